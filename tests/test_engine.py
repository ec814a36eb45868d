"""The async engine: streaming, continuous batching, cancellation, isolation, sampling, closing."""

import asyncio
import threading
import time

import pytest
import torch

from unikv.engine.engine import Engine
from unikv.engine.requests import Piece
from unikv.engine.sampling import SamplingParams
from unikv.engine.scheduler import RequestCounts
from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


async def until(cond) -> None:
    """Yield to the engine until `cond()` holds (events, not timed sleeps; the suite's timeout
    guards a hang)."""
    while not cond():
        await asyncio.sleep(0.005)


PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "Water boils at",
    "A list of the planets of the solar system: Mercury, Venus,",
    "def fibonacci(n):",
]


def greedy_reference(model, ids, n):
    """Plain greedy decoding of one sequence straight through the model (no scheduler)."""
    cfg = model.cfg
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    out, seq = [], list(ids)
    logits = model.forward(
        torch.tensor(seq), torch.arange(len(seq)), kv, StepBatch([0], [len(seq)])
    )
    for _ in range(n):
        tok = int(logits[-1].argmax())
        out.append(tok)
        logits = model.forward(
            torch.tensor([tok]), torch.tensor([len(seq)]), kv, StepBatch([0], [1])
        )
        seq.append(tok)
    return out


@pytest.fixture
async def engine(model, tokenizer):
    e = Engine(model, tokenizer, max_batch=8, max_step_tokens=64)
    yield e
    await e.close(cancel=True)


GREEDY_16 = SamplingParams(max_new_tokens=16, ignore_eos=True)


async def test_generate_equals_plain_greedy(engine, model, tokenizer):
    ids = tokenizer.encode(PROMPTS[1])
    c = await engine.generate(PROMPTS[1], GREEDY_16)
    assert c.token_ids == greedy_reference(model, ids, 16)
    assert c.finish_reason == "length" and c.prompt_tokens == len(ids)
    assert c.text == tokenizer.decode(c.token_ids)


async def test_concurrent_requests_equal_sequential(engine):
    """Continuous batching (joins mid-flight, chunked prefill) changes nothing in the output."""
    sequential = [await engine.generate(p, GREEDY_16) for p in PROMPTS]

    handles = []
    for p in PROMPTS:  # each joins once the one before it is decoding
        if handles:
            await until(lambda: handles[-1]._req.output_ids)
        handles.append(engine.submit(p, GREEDY_16))
    concurrent = await asyncio.gather(*(h.result() for h in handles))
    assert [c.token_ids for c in concurrent] == [c.token_ids for c in sequential]
    assert engine.kv.bytes_used() == 0  # everything was freed


async def test_prompt_longer_than_the_step_budget_is_prefilled_in_chunks(engine, model, tokenizer):
    ids = tokenizer.encode(" ".join(PROMPTS) * 6)[:300]  # the fixture's budget is 64 per step
    c = await engine.generate(ids, GREEDY_16)
    assert c.token_ids == greedy_reference(model, ids, 16)


class RecordingKV(ContiguousKVCache):
    """Records, per step, each sequence's (new tokens, more of its prompt follows)."""

    def begin_step(self, batch):
        self.steps = getattr(self, "steps", [])
        self.steps.append(list(zip(batch.query_lens, batch.more_prompt, strict=True)))
        super().begin_step(batch)


async def test_the_engine_marks_prompt_chunks_that_more_prompt_follows(model, tokenizer):
    """A query-aware cache waits for the prompt's end: every chunk but the prompt's last says
    more follows; the last chunk and the decode steps do not."""
    cfg = model.cfg
    kv = RecordingKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    engine = Engine(model, tokenizer, kv=kv, max_batch=8, max_step_tokens=64)
    try:
        ids = tokenizer.encode(" ".join(PROMPTS) * 6)[:300]
        await engine.generate(ids, SamplingParams(max_new_tokens=3, ignore_eos=True))
    finally:
        await engine.close(cancel=True)
    steps = [s[0] for s in kv.steps]
    chunks = -(-len(ids) // 64)
    assert len(ids) > 4 * 64 and sum(n for n, _ in steps[:chunks]) == len(ids)
    assert [more for _, more in steps[:chunks]] == [True] * (chunks - 1) + [False]
    assert steps[chunks:] == [(1, False), (1, False)]


async def test_stream_pieces_add_up_to_completion(engine):
    handle = engine.submit(PROMPTS[3], SamplingParams(max_new_tokens=24))
    pieces = [p async for p in handle]
    assert len(pieces) > 3
    assert "".join(pieces) == handle.completion.text


async def test_cancel_frees_memory_at_once_and_spares_others(engine, model, tokenizer):
    other = asyncio.create_task(engine.generate(PROMPTS[0], GREEDY_16))
    handle = engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=500, ignore_eos=True))
    got = 0
    async for _ in handle:
        got += 1
        if got == 5:
            break  # leaving the loop cancels the request
    await until(lambda: handle._req.finish_reason is not None)
    rid = handle._req.rid
    assert handle._req.finish_reason == "cancelled"
    assert engine.kv.stored_tokens(rid) == 0
    done = await other
    assert done.token_ids == greedy_reference(model, tokenizer.encode(PROMPTS[0]), 16)


async def test_turns_back_to_back_deliver_each_turns_tokens_as_it_ends(engine, monkeypatch):
    """While requests run the compute thread takes turns back to back (engine.BURST_S); each
    turn's pieces go to the event loop as that turn ends, not when the burst does."""
    from unikv.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "BURST_S", 60.0)  # one burst for the whole request
    sizes, real = [], Engine._deliver
    monkeypatch.setattr(Engine, "_deliver", staticmethod(lambda out: (sizes.append(len(out)),
                                                                      real(out))))  # fmt: skip
    handle = engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=12, ignore_eos=True))
    pieces = [p async for p in handle.pieces()]
    assert len(handle.completion.token_ids) == 12
    assert "".join(p.text for p in pieces) == handle.completion.text
    # one delivery per turn: the prompt's turn, then a piece (or none, a split character held
    # back) per token; the last turn's piece and the completion in the final flush
    assert len(sizes) >= 10 and max(sizes) <= 2, sizes


async def test_a_stream_interval_holds_pieces_back_but_not_the_first_or_the_end(
    model, tokenizer, monkeypatch
):
    """With a stream interval the pieces of the turns in between wait for it (here longer than
    the request), but a request's first piece goes out as its turn ends (time to first token)
    and its end at once; the text and tokens are those of a stream without one."""
    from unikv.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "BURST_S", 60.0)  # one burst for the whole request
    sizes, real = [], Engine._deliver
    monkeypatch.setattr(Engine, "_deliver", staticmethod(lambda out: (sizes.append(len(out)),
                                                                      real(out))))  # fmt: skip
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    got = {}
    for interval in (0.0, 1000.0):  # none, then 1 s
        e = Engine(model, tokenizer, max_batch=8, max_step_tokens=64, stream_interval_ms=interval)
        try:
            sizes.clear()
            e._delivered_at = time.perf_counter()  # as if a delivery had just gone out
            handle = e.submit(PROMPTS[1], params)
            pieces = [p.text async for p in handle.pieces()]
            got[interval] = (pieces, handle.completion, [n for n in sizes if n])
        finally:
            await e.close(cancel=True)
    (every, done, each), (held, done_held, batched) = got.values()
    assert done_held.token_ids == done.token_ids and "".join(held) == done_held.text == done.text
    assert held == every  # the same pieces, in the same order: only their delivery differs
    assert len(each) >= 10  # without an interval: a delivery per turn
    # with one: the first piece alone, then the rest with the request's end (a machine slow
    # enough to take a second over the request delivers once more in between)
    assert batched[0] == 1 and sum(batched) == len(every) + 1 and len(batched) <= 3, batched


async def test_the_outbox_is_due_by_the_interval_a_first_piece_or_an_end(engine):
    """`Engine._due`'s rules, without a clock race: an interval that has not passed holds
    pieces of a request already streaming, not a request's first piece or its end."""
    engine.stream_interval = 1.0
    old, new = engine.submit(PROMPTS[0], GREEDY_16)._req, engine.submit(PROMPTS[1], GREEDY_16)._req
    await engine.close(cancel=True)  # the rules alone, on requests that no longer run
    old.streamed, new.streamed = True, False  # (their cancellations went out: set again)
    cases = [([(old, ("text", Piece("a")))], False), ([(new, ("text", Piece("b")))], True),
             ([(old, ("text", Piece("c"))), (old, ("done", None))], True)]  # fmt: skip
    for outbox, due in cases:
        engine._outbox, engine._delivered_at = outbox, time.perf_counter()
        assert engine._due() is due, outbox
    assert new.streamed  # marked as it went
    engine._outbox, engine._delivered_at = cases[0][0], time.perf_counter() - 1.5
    assert engine._due()  # the interval has passed
    engine.stream_interval = 0.0
    engine._outbox, engine._delivered_at = cases[0][0], time.perf_counter()
    assert engine._due()  # no interval: every turn


def test_a_stream_interval_out_of_range_is_refused(model, tokenizer):
    for bad in (-1.0, float("nan"), 5000.0):
        with pytest.raises(ValueError, match="stream_interval_ms"):
            Engine(model, tokenizer, stream_interval_ms=bad)


async def test_cancelling_the_awaiting_task_cancels_the_request(engine):
    task = asyncio.create_task(
        engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=400, ignore_eos=True))
    )
    await until(lambda: engine.kv.bytes_used() > 0)  # running
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The KV is freed at the next turn (the report other threads read is published when the
    # request ends, so it may lag the pool by that turn: wait on the pool itself).
    await until(lambda: engine.kv.bytes_used() == 0)
    await until(lambda: engine.memory_report().requests.running == 0)


async def test_the_scheduler_settings_and_counts_reach_the_engine(engine):
    assert engine.max_batch == engine.scheduler.config.max_batch == 8
    assert engine.scheduler.config.max_step_tokens == 64
    c = await engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=2, ignore_eos=True))
    report = engine.memory_report()
    assert report.kv_bytes_peak > 0
    # no step target here: the budget alone
    assert report.requests == RequestCounts(0, 0, 0, 0, step_tokens=64, max_batch=8)
    assert len(c.token_ids) == 2


class FlakyKV(ContiguousKVCache):
    """Fails every step that contains a poisoned sequence, like a bad device write would."""

    poisoned: set[int] = set()

    def append(self, layer, k, v):
        if self.poisoned & set(self._batch.seq_ids):
            raise RuntimeError("injected storage fault")
        super().append(layer, k, v)


async def test_error_in_one_request_does_not_disturb_others(model, tokenizer):
    cfg = model.cfg
    kv = FlakyKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    engine = Engine(model, tokenizer, kv=kv, max_batch=8)
    try:
        good = [engine.submit(p, GREEDY_16) for p in PROMPTS[:2]]
        bad = engine.submit(PROMPTS[2], GREEDY_16)
        kv.poisoned = {bad._req.rid}
        results = await asyncio.gather(*(h.result() for h in good))
        with pytest.raises(RuntimeError, match="injected"):
            await bad.result()
        for p, r in zip(PROMPTS[:2], results, strict=True):
            assert r.token_ids == greedy_reference(model, tokenizer.encode(p), 16)
        assert kv.bytes_used() == 0
    finally:
        await engine.close(cancel=True)


async def test_bad_requests_fail_alone(engine):
    good = asyncio.create_task(engine.generate(PROMPTS[0], GREEDY_16))
    with pytest.raises(ValueError, match="context"):
        await engine.generate("word " * 9000)
    with pytest.raises(ValueError, match="empty"):
        await engine.generate("   ")
    with pytest.raises(ValueError, match="token ids"):
        await engine.generate([1, 2, 10**9])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    assert (await good).finish_reason == "length"


async def test_seeded_sampling_is_reproducible(engine):
    p = SamplingParams(
        max_new_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=7, ignore_eos=True
    )
    a = await engine.generate(PROMPTS[1], p)
    b = await engine.generate(PROMPTS[1], p)
    c = await engine.generate(PROMPTS[1], SamplingParams(**{**_fields(p), "seed": 8}))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def _fields(p):
    return {f: getattr(p, f) for f in p.__slots__}


async def test_stop_string_and_stop_token(engine):
    free = await engine.generate(PROMPTS[3], SamplingParams(max_new_tokens=24, ignore_eos=True))
    stop = free.text[10:14]
    assert stop.strip()
    stopped = await engine.generate(PROMPTS[3], SamplingParams(max_new_tokens=24, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    streamed = "".join(
        [p async for p in engine.stream(PROMPTS[3], SamplingParams(max_new_tokens=24, stop=stop))]
    )
    assert streamed == stopped.text  # held-back text never leaks a partial stop string
    tok = free.token_ids[5]
    by_id = await engine.generate(
        PROMPTS[3], SamplingParams(max_new_tokens=24, stop_token_ids=(tok,))
    )
    first = free.token_ids.index(tok)
    # the stop token ends the ids (vLLM counts it), never the text
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: first + 1]
    assert by_id.text == engine.tokenizer.decode(free.token_ids[:first])


async def test_chat_template_and_eos(engine):
    c = await engine.generate(
        "What is the capital of France?", SamplingParams(max_new_tokens=40), chat=True
    )
    assert "Paris" in c.text
    assert c.finish_reason == "stop"  # the model ends its answer with <|im_end|>
    assert c.token_ids[-1] == engine.tokenizer.eos_id and "<|im_end|>" not in c.text


async def test_after_step_hook_sees_every_step_and_check_running_says_when_it_stopped(
    model, tokenizer
):
    """The public hooks a server uses instead of the engine's internals: `after_step` (the
    replicas' simulated hot chip) and `check_running` (Ray Serve's health check)."""
    engine = Engine(model, tokenizer)
    seen: list[float] = []

    async def hook(seconds: float) -> None:
        seen.append(seconds)

    engine.after_step = hook
    await engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=3))
    assert len(seen) >= 3 and all(s > 0 for s in seen)  # the prompt's step, then each token
    engine.check_running()
    await engine.close()
    with pytest.raises(RuntimeError, match="loop stopped: the engine was closed"):
        engine.check_running()


async def test_close_finishes_running_requests(model, tokenizer):
    engine = Engine(model, tokenizer)
    handle = engine.submit(PROMPTS[0], GREEDY_16)
    task = asyncio.create_task(handle.result())
    await until(lambda: handle._req.output_ids)  # running when the engine closes
    await engine.close()
    assert (await task).finish_reason == "length"
    with pytest.raises(RuntimeError, match="closed"):
        await engine.generate(PROMPTS[0])


async def test_close_with_cancel(model, tokenizer):
    engine = Engine(model, tokenizer)
    handle = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=2000, ignore_eos=True))
    await until(lambda: handle._req.output_ids)
    await asyncio.wait_for(engine.close(cancel=True), timeout=30)
    assert (await handle.result()).finish_reason == "cancelled"
    assert engine.kv.bytes_used() == 0


async def test_create_loads_the_packaged_model():
    engine = await Engine.create("smollm2")
    try:
        c = await engine.generate("Hello", SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(c.token_ids) == 3
    finally:
        await engine.close()


class CountingKV(ContiguousKVCache):
    """Counts the tokens appended per sequence (layer 0): what the cache holds, to compare
    with what each request has computed."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.appended: dict[int, int] = {}

    def append(self, layer, k, v):
        if layer == 0:
            for sid, n in zip(self._batch.seq_ids, self._batch.query_lens, strict=True):
                self.appended[sid] = self.appended.get(sid, 0) + n
        super().append(layer, k, v)


async def test_a_failing_sample_fails_its_request_alone_and_appends_nothing_twice(
    model, tokenizer, monkeypatch
):
    """Issue 31: a request whose sampling raises after the step committed its KV used to make
    the engine re-run the whole batch one by one on top of the committed KV (every co-batched
    sequence's cache grew by the step twice). Now sampling fails per request: the others'
    tokens equal their solo runs and every cache holds exactly its request's tokens."""
    import unikv.engine.stepping as eng  # where the step samples

    real = eng.sample

    def sample(logits, params, gen, *rest):
        if params.seed == 666:
            raise RuntimeError("probability tensor contains inf or nan")
        return real(logits, params, gen, *rest)

    monkeypatch.setattr(eng, "sample", sample)
    cfg = model.cfg
    kv = CountingKV(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    engine = Engine(model, tokenizer, kv=kv, max_batch=8)
    try:
        good = [engine.submit(p, GREEDY_16) for p in PROMPTS[:2]]
        bad = engine.submit(PROMPTS[2], SamplingParams(max_new_tokens=8, temperature=1.0, seed=666))
        with pytest.raises(RuntimeError, match="inf or nan"):
            await bad.result()
        results = await asyncio.gather(*(h.result() for h in good))
        for p, h, r in zip(PROMPTS[:2], good, results, strict=True):
            ids = tokenizer.encode(p)
            assert r.token_ids == greedy_reference(model, ids, 16)
            # the prompt and every generated token but the last went through the cache once
            assert kv.appended[h._req.rid] == len(ids) + 15
        assert kv.bytes_used() == 0
    finally:
        await engine.close(cancel=True)


async def test_hostile_sampling_values_are_normalised_or_refused(engine):
    """A temperature of 1e-300 is greedy (vLLM's epsilon), not an overflow; a seed or a
    priority out of range is refused where it enters, naming the range."""
    tiny = SamplingParams(max_new_tokens=8, temperature=1e-300, ignore_eos=True)
    assert tiny.greedy
    greedy = await engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert (await engine.generate(PROMPTS[0], tiny)).token_ids == greedy.token_ids
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63 - 1\]"):
        SamplingParams(seed=2**64)
    for bad in (10**310, -(10**15), 1001, True):
        with pytest.raises(ValueError, match=r"priority must be an integer in \[-1000, 1000\]"):
            engine.submit(PROMPTS[0], GREEDY_16, priority=bad)


async def test_only_the_compute_thread_touches_the_pool(model, tokenizer):
    """Issue 31: cancellations and snapshots used to reach the pool from the event loop while
    the compute thread stepped (a swapped-out request's blocks freed mid-allocation, the OOM
    predictor sampled inside `end_step`). Now the event loop queues them and reads the report
    the last turn published; the pool's owner check (on in the tests) catches a violation."""
    from unikv.engine import compute

    engine = Engine(model, tokenizer, max_batch=8)
    pool = engine.kv.pool
    seen: set[int] = set()
    snapshot = pool.snapshot

    def spy():
        seen.add(threading.get_ident())
        return snapshot()

    pool.snapshot = spy
    try:
        long = engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=200, ignore_eos=True))
        other = engine.submit(PROMPTS[0], GREEDY_16)
        await until(lambda: len(long._req.output_ids) >= 3)
        for _ in range(20):  # what /health and /metrics do, while steps run
            assert engine.memory_report().requests.running >= 1
            await asyncio.sleep(0.001)
        long.cancel()
        await until(lambda: long._req.finish_reason is not None)
        assert (await other.result()).finish_reason == "length"
        assert seen == {compute.thread_id()}  # the report's pool snapshot: compute thread only
        assert pool.owner == compute.thread_id()
        with pytest.raises(RuntimeError, match="only its owner"):
            pool.free(long._req.rid)  # a mutation from the event loop's thread
    finally:
        await engine.close(cancel=True)
    assert pool.owner is None  # the loop has ended: the pool is the caller's again


async def test_the_engine_gives_the_heap_back_once_it_is_idle(engine, monkeypatch):
    """Issue 31's soak: glibc kept what PyTorch freed (one trim gave back 95 MiB of 100 MiB
    grown). The engine trims the C heap on the compute thread once it has been idle for
    IDLE_TRIM_S after running steps: never between a request and one that follows at once,
    and not again while it stays idle."""
    from unikv.engine import compute
    from unikv.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "IDLE_TRIM_S", 0.2)
    done: list[int] = []
    calls: list[tuple[int, bool, int]] = []
    monkeypatch.setattr(
        compute,
        "trim_heap",
        lambda: calls.append((threading.get_ident(), engine._idle(), len(done))),
    )
    for prompt in PROMPTS[:3]:  # one after another, each submitted as the last one ends
        done.append(len((await engine.generate(prompt, GREEDY_16)).token_ids))
    assert done == [16, 16, 16]
    await until(lambda: calls)
    assert calls == [(compute.thread_id(), True, 3)]  # once, after the last, idle
    await asyncio.sleep(0.5)
    assert len(calls) == 1  # idle with nothing run since: not again
    await engine.generate(PROMPTS[3], GREEDY_16)
    await until(lambda: len(calls) == 2)


def test_trim_heap_returns_memory_to_the_os():
    """On glibc `trim_heap` calls `malloc_trim`: freed heap memory leaves the process's RSS."""
    from unikv.engine import compute

    if compute._malloc_trim is None:
        pytest.skip("this C library has no malloc_trim")

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    # Many small blocks (below glibc's mmap threshold) freed, then one survivor on top keeps
    # the heap from shrinking at its end: only a trim gives the middle back.
    blocks = [bytearray(b"\x01") * (64 << 10) for _ in range(2000)]  # 125 MiB, touched
    keep = bytearray(b"\x01") * (64 << 10)
    del blocks
    before = rss()
    assert compute.trim_heap() is True
    assert before - rss() > 64 << 20
    del keep


async def test_prompt_logprobs_match_one_forward_pass_and_skip_the_cache(engine, model, tokenizer):
    """Issue 33 (what lm-evaluation-harness's log-likelihood tasks need): `max_new_tokens` 0
    computes the prompt only, and `prompt_logprobs` gives every prompt token's log-probability
    under the model, as one forward pass over the whole prompt gives them, though the engine
    prefills it in chunks of 64 and the prefix cache already holds it."""
    ids = tokenizer.encode(" ".join(PROMPTS) * 3)[:150]
    await engine.generate(ids, SamplingParams(max_new_tokens=1))  # now in the prefix cache
    done = await engine.generate(ids, SamplingParams(max_new_tokens=0, prompt_logprobs=2))
    assert done.token_ids == [] and done.finish_reason == "length" and done.cached_tokens == 0
    lps = done.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    cfg = model.cfg
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    batch = StepBatch([0], [len(ids)])
    n = len(ids)
    logits = model.forward(torch.tensor(ids), torch.arange(n), kv, batch, torch.arange(n - 1))
    ref = torch.log_softmax(logits.float(), dim=-1)
    got = torch.tensor([x.logprob for x in lps[1:]])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert [x.token_id for x in lps[1:]] == ids[1:]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    assert all(x.top[0][0] == int(ref[i].argmax()) for i, x in enumerate(lps[1:]))


async def test_pieces_carry_the_logprobs_of_their_tokens_and_add_up_to_the_completion(engine):
    """Streaming with log-probabilities: each piece brings those of the tokens generated since
    the last, the first also the prompt's, and together they are the completion's, also when a
    stop string cuts the text (its tokens are still counted, as the whole answer counts them)."""
    whole = await engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, logprobs=1))
    stop = whole.text[len(whole.text) // 2 :][:3]  # a stop string in the middle of the answer
    params = SamplingParams(max_new_tokens=12, logprobs=1, prompt_logprobs=0, stop=(stop,))
    h = engine.submit(PROMPTS[0], params)
    pieces = [p async for p in h.pieces()]
    done = h.completion
    assert "".join(p.text for p in pieces) == done.text and stop not in done.text
    assert [x for p in pieces for x in p.logprobs] == done.logprobs
    assert pieces[0].prompt_logprobs == done.prompt_logprobs
    assert all(p.prompt_logprobs is None for p in pieces[1:])
    assert len(pieces) > 1 and sum(1 for p in pieces if p.logprobs) > 1


async def test_logprobs_min_tokens_min_p_and_repetition_penalty(engine):
    greedy = await engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=8, logprobs=3))
    assert len(greedy.logprobs) == 8
    for tok, lp in zip(greedy.token_ids, greedy.logprobs, strict=True):
        assert lp.token_id == tok and lp.top[0] == (tok, lp.logprob) and len(lp.top) == 3
    # min-p 1.0 keeps only the most likely token: sampling equals greedy
    sampled = await engine.generate(
        PROMPTS[0], SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, min_p=1.0)
    )
    assert sampled.token_ids == greedy.token_ids
    # a stop token is held back until min_tokens are out
    first = greedy.token_ids[0]
    stop_first = SamplingParams(max_new_tokens=8, stop_token_ids=(first,))
    stopped = await engine.generate(PROMPTS[0], stop_first)
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert stopped.text == "" and stopped.completion_tokens == 1
    held = await engine.generate(
        PROMPTS[0], SamplingParams(max_new_tokens=4, stop_token_ids=(first,), min_tokens=2)
    )
    assert held.token_ids[0] != first and len(held.token_ids) >= 2
    # a strong repetition penalty: no token of the prompt or the answer comes twice
    pen = await engine.generate(
        PROMPTS[3], SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=50.0)
    )
    assert len(set(pen.token_ids)) == 16


async def test_the_warm_up_runs_the_whole_path_and_shares_nothing(model, tokenizer, tmp_path):
    """issue 34: one request before serving; it publishes and persists nothing, and the step
    target forgets the speed it measured on those cold steps."""
    from unikv import kvstrategies
    from unikv.engine.assembly import store_tiers
    from unikv.engine.warmup import PROMPT_TOKENS, warm_up
    from unikv.kvstrategies.calibration import WARMUP_TEXT
    from unikv.settings.config import PoolConfig, TierConfig

    tiers = (TierConfig("device", 64 << 20), TierConfig("ssd", 64 << 20, str(tmp_path)))
    cfg, spec = PoolConfig(tiers=tiers), model.kv_spec()
    opts = kvstrategies.get("full").check_options({})
    stores = store_tiers("full", spec, cfg, opts)
    kv = kvstrategies.create("full", spec, cfg, opts, stores=stores)
    async with Engine(model, tokenizer, kv=kv, step_target_ms=100.0) as e:
        assert await warm_up(e) > 0
        report = e.memory_report()
        assert report.kv_bytes_peak > 0 and report.kv_bytes_used == 0  # it ran, and freed
        assert report.prefix.queries == 0 and report.prefix.cached_blocks == 0
        assert e.scheduler.step_tokens == e.scheduler.config.max_step_tokens
        writer = kv.pool.persistence.writer
        writer.wait_writes()
        assert writer.blocks_written == 0  # nothing written through to the SSD
        # The warm-up's own prompt, asked by a user, is computed, not found.
        ids = tokenizer.encode(WARMUP_TEXT.read_text(encoding="utf-8"))[:PROMPT_TOKENS]
        c = await e.generate(ids, SamplingParams(max_new_tokens=1))
        assert c.cached_tokens == 0
        writer.wait_writes()
        assert writer.blocks_written > 0  # the user's prompt is, as always
    kv.close()
