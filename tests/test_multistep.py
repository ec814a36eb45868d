"""Multi-step decoding: several greedy decode steps in one native call (gemv.c's decode_steps,
`LlamaModel.decode`, the engine's `decode_steps`) against the same steps one call each.

Every run must give the same tokens, the same logits bit for bit and leave the cache in the
same state (the packed format's side buffers and packed blocks, the sparse selection's
summaries, the pool's counts) as its steps one by one, under every instruction set this CPU
runs; a run the cache or gemv.c cannot take changes nothing; through the engine, completions,
stop strings, stop tokens, lengths and prefix sharing are those of one step a turn.
"""

import pytest
import torch

from unikv.engine.model import LlamaModel
from unikv.kernels import gemv

pytestmark = pytest.mark.skipif(gemv.unavailable() is not None, reason=str(gemv.unavailable()))

# Blocks of 16 tokens; a sparse selection that starts choosing once a sequence stores 33 tokens
# (a budget of 24 tokens: one sink block, the newest token's block and nothing between), every
# layer choosing: its runs must stop where its first choice would be made.
SPARSE = {"budget_tokens": 24, "sink_tokens": 1, "recent_window": 1, "dense_layers": 0}
# A pruned selection that evicts while the sequences decode (half the tokens seen kept, 2
# sinks, 8 recent); on the tiny model it ranks by surprisal (the shipped head is SmolLM2's).
PRUNED = {"kept_ratio": 0.5, "sink_tokens": 2, "recent_window": 8}


def test_argmax_rows_picks_as_torch_argmax(isa):
    """gemv.c's argmax (the token a run feeds its next step): torch.argmax's pick over random
    rows with ties, infinities and NaNs (the first NaN; else the first of the largest)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (400, 97), generator=g).float()  # many ties
    x[::7, 5] = float("inf")
    x[::11, 60] = float("nan")
    x[::13, 30] = float("nan")
    x[3] = float("-inf")
    x[4] = float("nan")
    assert torch.equal(gemv.argmax_rows(x), x.argmax(1))
    y = torch.randn(50, 49152, generator=g)
    assert torch.equal(gemv.argmax_rows(y), y.argmax(1))


def _rows(n: int, t: float, k: int = 0, p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    return torch.tensor([[t, k, p, min_p]] * n, dtype=torch.float64)


@pytest.mark.parametrize(
    "t,k,p,min_p",
    [(1.0, 0, 1.0, 0.0), (2.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 50, 1.0, 0.0),
     (1.0, 0, 0.9, 0.0), (0.8, 40, 0.95, 0.0), (1.0, 0, 1.0, 0.05), (5.0, 0, 0.999, 0.0),
     (1.0, 3000, 0.5, 0.01)],
)  # fmt: skip
def test_the_c_draw_keeps_and_draws_what_the_torch_path_does(t, k, p, min_p, isa):
    """gemv.c's sample_row (a run's draw, and `sampling.draw`'s on a CPU) against
    `sampling.torch_draw` with the same uniform numbers, under every ISA: temperature alone,
    top-k (ties kept), top-p (a narrow nucleus, and a flat one of thousands of tokens: no
    sort), both, min-p, all three. The same token for all but a few of 1,500 draws (u within
    float rounding of a boundary); never a token either path drops (-inf, top-k's, top-p's,
    min-p's); the draws follow the kept weights. Vocabularies of 1,000 and SmolLM2's 49,152."""
    from unikv.engine.sampling import SamplingParams, candidates, categorical

    params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=min_p)
    g = torch.Generator().manual_seed(int(t * 10) + k + int(p * 100))
    agree = total = 0
    for n, scale in ((1000, 3.0), (49152, 4.0), (49152, 1.0)):
        x = torch.randn(n, generator=g) * scale
        x[torch.randperm(n, generator=g)[: n // 3]] = float("-inf")
        us = torch.rand(500, generator=g, dtype=torch.float64)
        got = gemv.sample_rows(x.expand(500, n), _rows(500, t, k, p, min_p), us).tolist()
        probs, ids = candidates(x, params)  # (sampling.torch_draw's, once for every u)
        ids = torch.arange(n) if ids is None else ids
        want = [int(ids[categorical(probs, None, float(u))]) for u in us]
        kept = set(ids[probs > 0].tolist())  # what the torch path can draw
        assert len(set(got) - kept) <= 1, set(got) - kept  # (a boundary token at most)
        assert all(torch.isfinite(x[i]) for i in got)
        agree += sum(a == b for a, b in zip(got, want, strict=True))
        total += 500
    assert agree >= total - 5, (agree, total)


def test_rows_drawn_together_are_the_rows_drawn_one_by_one(isa):
    """sample_rows shares several rows among the OpenMP threads: each row's token is the one
    it gets alone (its own logits and number), greedy rows and sampled ones mixed."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 5000, generator=g) * 3
    spec = torch.tensor([[0.0, 0, 1.0, 0.0], [0.8, 0, 0.95, 0.0], [1.0, 40, 1.0, 0.0],
                         [0.7, 50, 0.9, 0.02]] * 16, dtype=torch.float64)  # fmt: skip
    us = torch.rand(64, generator=g, dtype=torch.float64)
    together = gemv.sample_rows(x, spec, us)
    alone = torch.cat([gemv.sample_rows(x[r : r + 1], spec[r : r + 1], us[r : r + 1])
                       for r in range(64)])  # fmt: skip
    assert torch.equal(together, alone)
    assert torch.equal(together[::4], x[::4].argmax(1))  # (the greedy rows)


def test_the_c_draw_at_its_edges(isa):
    """gemv.c's draw: the argmax at temperature 0; a token far below the top at a low
    temperature never; the last token of weight where u times the total rounds up to it; top-k
    keeps every logit tied with the k-th; a temperature past float32's range draws every
    finite logit; -1 for NaN or only -inf logits; the draws follow the weights."""
    x = torch.tensor([[0.0, 50.0, float("-inf"), 49.0, -30.0, float("-inf")]])
    top = torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)
    assert gemv.sample_rows(x, _rows(1, 0.0), torch.tensor([0.3])).item() == 1
    assert gemv.sample_rows(x, _rows(1, 0.1), torch.tensor([0.999])).item() == 1
    assert gemv.sample_rows(x, _rows(1, 50.0), top).item() == 4  # the last of weight
    ties = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0, 2.0]])
    us = torch.rand(300, dtype=torch.float64)
    assert set(gemv.sample_rows(ties.expand(300, 6), _rows(300, 1e6, 2), us).tolist()) == {
        1, 2, 3, 5}  # fmt: skip
    huge = gemv.sample_rows(
        x.expand(200, 6), _rows(200, 1e39), torch.rand(200, dtype=torch.float64)
    )
    assert set(huge.tolist()) == {0, 1, 3, 4}  # a temperature past float32's: all but -inf
    for bad in ([0.0, float("nan")], [float("-inf"), float("-inf")]):
        assert gemv.sample_rows(torch.tensor([bad]), _rows(1, 1.0), top).item() == -1
    # a top_p too small for float32 (0): the most likely token alone, as the torch path keeps it
    wide = torch.randn(1, 1000) * 3
    us = torch.rand(50, dtype=torch.float64)
    tiny = gemv.sample_rows(wide.expand(50, 1000), _rows(50, 1.0, 0, 1e-300), us)
    assert set(tiny.tolist()) == {int(wide.argmax())}
    w = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    n = 20000
    got = gemv.sample_rows(w.expand(n, 4), _rows(n, 1.0), torch.rand(n, dtype=torch.float64))
    counts = torch.bincount(got, minlength=4)
    want = torch.softmax(w[0].double(), -1) * n
    assert ((counts - want).abs() < 4 * want.sqrt() + 1).all(), (counts, want)


def _tiny():
    from tests.test_operators import _tiny_llama

    return _tiny_llama("Q4_1", context=160, packed_embedding=True)


def _cache(m, strategy: str, options=None, host: bool = False, block_size: int = 16):
    from unikv import kvstrategies
    from unikv.settings.config import PoolConfig, TierConfig

    tiers = (TierConfig("device", 32 << 20),) + ((TierConfig("host", 1 << 20),) if host else ())
    cfg = PoolConfig(block_size=block_size, tiers=tiers)
    return kvstrategies.create(strategy, m.kv_spec(), cfg, options)


def _decode(m, kv, prompts: dict[int, int], new: int, steps: int):
    """Prefill `prompts` ({sequence: prompt tokens}, random tokens), then `new` greedy tokens
    of each, in runs of up to `steps` (`LlamaModel.decode`, as long as `kv.sequential` allows;
    1: a step a call): (tokens [new, S], logits [new, S, V], the run lengths)."""
    from unikv.kvstrategies.kv import StepBatch

    g = torch.Generator().manual_seed(0)
    seqs = list(prompts)
    last, pos = [], []
    with torch.inference_mode():
        for sid, n in prompts.items():
            toks = torch.randint(0, m.cfg.vocab_size, (n,), generator=g)
            logits = m.forward(toks, torch.arange(n), kv, StepBatch([sid], [n]))
            last.append(int(logits[-1].argmax()))
            pos.append(n)
    tokens, logits, runs = [], [], []
    while len(tokens) < new:
        k = min(steps, new - len(tokens), *(kv.sequential(sid, steps) for sid in seqs))
        got = m.decode(last, pos, kv, seqs, k) if k > 1 else None
        if got is None:
            with torch.inference_mode():
                out = m.forward(torch.tensor(last), torch.tensor(pos), kv,
                                StepBatch(seqs, [1] * len(seqs)))  # fmt: skip
            got, k = (out.argmax(1)[None], out[None]), 1
        tokens += got[0].unbind(0)
        logits += got[1].unbind(0)
        last, pos = got[0][-1].tolist(), [p + k for p in pos]
        runs.append(k)
    return torch.stack(tokens), torch.stack(logits), runs


def _same_state(a, b, seqs) -> None:
    """Two caches holding the same tokens hold the same bytes: pool counts, the packed
    format's side buffers and packed blocks, the sparse selection's summaries."""
    for sid in seqs:
        n = a.pool.num_tokens(sid)
        assert n == b.pool.num_tokens(sid)
        fa, fb = a.format, b.format
        if hasattr(fa, "_dense"):  # a packed format: side buffers and packed blocks
            assert torch.equal(fa._dense[sid], fb._dense[sid])
            ids_a = fa.pool.table(sid).block_ids()[: n // fa.T]
            ids_b = fb.pool.table(sid).block_ids()[: n // fb.T]
            assert torch.equal(fa._arena[:, ids_a], fb._arena[:, ids_b])
        if not hasattr(fa, "_dense"):  # a dense format: the sequence's slots
            slots = fa.pool.slot_ids(sid, 0, n)
            for x, y in zip(fa._layers, fb._layers, strict=True):
                assert torch.equal(x[:, :, slots], y[:, :, fb.pool.slot_ids(sid, 0, n)])
        if hasattr(a.selection, "_scores"):  # a pruned selection: its scores and positions
            assert torch.equal(a.selection._scores[sid], b.selection._scores[sid])
            assert torch.equal(a.selection._pos[sid], b.selection._pos[sid])
        if hasattr(a.selection, "summaries"):
            with torch.inference_mode():
                assert torch.equal(a.selection.summaries(sid), b.selection.summaries(sid))


@pytest.mark.parametrize(
    "strategy,options",
    [("hybrid_fp16_int4", None), ("int8+resident+all", None),
     ("hybrid+resident+sparse", SPARSE), ("full", None), ("dense+resident+sparse", SPARSE),
     ("hybrid+resident+pruned", PRUNED), ("learned_prune", PRUNED)],
)  # fmt: skip
def test_a_run_equals_its_steps_one_by_one(strategy, options, isa):
    """Two sequences (prompts of 20 and 9 tokens) decode 40 tokens each in runs of up to 6,
    against a step a call: the same tokens and logits bit for bit, and the same cache bytes.
    Runs end where a block is completed (its last row completes it; the block is packed after
    the run from the rows the run wrote, as its steps would have) and, for the sparse
    selection, where its first choice would be made (from then on: a step a call)."""
    m = _tiny()
    prompts = {0: 20, 1: 9}
    a, b = _cache(m, strategy, options), _cache(m, strategy, options)
    try:
        tok_a, log_a, runs = _decode(m, a, prompts, 40, 6)
        tok_b, log_b, ones = _decode(m, b, prompts, 40, 1)
        assert set(ones) == {1} and max(runs) == 6
        assert torch.equal(tok_a, tok_b) and torch.equal(log_a, log_b)
        _same_state(a, b, prompts)
        # each run ends at a block's end (16 tokens) or earlier: 20 + 9 = 29 stored tokens
        # in the batch's first sequence's blocks after the first run of 6, and so on
        ends = [20 + sum(runs[: i + 1]) for i in range(len(runs))]
        starts = [20 + sum(runs[:i]) for i in range(len(runs))]
        pruned = strategy.endswith("pruned") or strategy == "learned_prune"
        for s, k in zip(starts, runs, strict=True):  # (pruned: blocks of stored, not seen)
            assert (s % 16) + k <= 16 or k == 1 or pruned, (s, k)
        if pruned:
            assert a.selection.evicted == b.selection.evicted > 40  # (and evicted while decoding)
            assert a.pool.num_tokens(0) < 60
        if strategy == "hybrid+resident+sparse":
            # the second sequence stores 33 tokens after 24 new ones: every step from then
            # on chooses, one a call
            assert runs[-16:] == [1] * 16 and a.selection.counts["sparse_reads"] > 0
        assert ends[-1] == 60
    finally:
        a.close()
        b.close()


def test_a_run_across_a_key_group_equals_its_steps():
    """Blocks of 48 tokens and the sparse selection's 4-bit keys in groups of 32 (choosing
    nothing: a budget of 400 tokens): runs cross a key group's end (20 + 8 + 8 = 36), where the
    group's keys are quantized at the run's end instead of kept (`_add_keys`); the summaries
    come out the same bytes as its steps', and so do tokens, logits and side buffers."""
    m = _tiny()
    opts = {"budget_tokens": 400, "sink_tokens": 1, "recent_window": 1, "dense_layers": 0,
            "key_group": 32}  # fmt: skip
    a, b = (_cache(m, "hybrid+resident+sparse", opts, block_size=48) for _ in range(2))
    try:
        tok_a, log_a, runs = _decode(m, a, {0: 20, 1: 9}, 60, 8)
        tok_b, log_b, _ = _decode(m, b, {0: 20, 1: 9}, 60, 1)
        assert runs[:3] == [8, 8, 8]  # (the second crosses 32)
        assert torch.equal(tok_a, tok_b) and torch.equal(log_a, log_b)
        _same_state(a, b, [0, 1])
    finally:
        a.close()
        b.close()


def test_a_refused_run_changes_nothing(monkeypatch):
    """gemv.c refusing a run's last sub-step (after the others ran: their rows written)
    ends the run: `decode` returns None, the step is rolled back (nothing committed, the
    selection's summaries untouched), and stepping on one token a call gives what it would
    have without the refusal."""
    m = _tiny()
    real = gemv.decode_steps

    def refuse_last(layers, kv, step, tokens, positions, steps, temps=None, draws=None):
        fewer = None if draws is None else draws[:-1]
        return real(layers, kv, step, tokens, positions, steps - 1, temps, fewer)

    a, b = _cache(m, "hybrid+resident+sparse", SPARSE), _cache(m, "hybrid+resident+sparse", SPARSE)
    try:
        monkeypatch.setattr(gemv, "decode_steps", refuse_last)
        tok_a, log_a, runs = _decode(m, a, {0: 7}, 12, 5)
        monkeypatch.setattr(gemv, "decode_steps", real)
        tok_b, log_b, _ = _decode(m, b, {0: 7}, 12, 1)
        assert runs == [1] * 12  # every run refused, then stepped
        assert torch.equal(tok_a, tok_b) and torch.equal(log_a, log_b)
        _same_state(a, b, [0])
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    "strategy,options",
    [("dense+tiered+all", {"device_window": 8, "host_window": 1 << 10}),
     ("hybrid+tiered+all", {"device_window": 8, "host_window": 1 << 10}),
     ("hybrid+resident+pruned", {"scorer": "knorm"})],
)  # fmt: skip
def test_a_cache_that_cannot_run_steps_in_sequence_says_so(strategy, options):
    """A placement that moves blocks and a selection with work at every layer (a pruned cache's
    knorm scorer) run no sequential step: they say 1, and `decode` refuses a run of 2 (nothing
    changed: the sequence still stores its prompt alone)."""
    from unikv.kvstrategies.kv import StepBatch

    m = _tiny()
    kv = _cache(m, strategy, options, host=options is not None)
    try:
        with torch.inference_mode():
            m.forward(torch.arange(10), torch.arange(10), kv, StepBatch([0], [10]))
        assert kv.sequential(0, 8) == 1
        assert m.decode([3], [10], kv, [0], 2) is None
        assert kv.pool.num_tokens(0) == 10
    finally:
        kv.close()


def test_float32_weights_run_in_sequence_too(model):
    """SmolLM2 on float32 weights: gemv.c reads its float32 embedding table's rows itself
    (`gemv.F32_ROWS`), so its decode runs too, with the tokens, logits and cache bytes of its
    steps one call each."""
    from unikv import kvstrategies
    from unikv.settings.config import PoolConfig, TierConfig

    cfg = PoolConfig(block_size=64, tiers=(TierConfig("device", 64 << 20),))
    a, b = (kvstrategies.create("hybrid_fp16_int4", model.kv_spec(), cfg) for _ in range(2))
    try:
        assert model.decodes(1)
        tok_a, log_a, runs = _decode(model, a, {0: 50}, 24, 8)
        tok_b, log_b, _ = _decode(model, b, {0: 50}, 24, 1)
        assert runs == [8, 6, 8, 2]  # (the first block completes at 64 tokens)
        assert torch.equal(tok_a, tok_b) and torch.equal(log_a, log_b)
        _same_state(a, b, [0])
    finally:
        a.close()
        b.close()


# ---- through the engine ----------------------------------------------------------------------

REAL_DECODE = LlamaModel.decode  # (the tests below spy on it)
LONG = " ".join(f"Item {i}: a line of the inventory." for i in range(12))  # > 64 tokens
PROMPTS = [
    "The history of the printing press",
    "Write a haiku about rain.",
    "List three prime numbers:",
]


async def _completions(native_model, tokenizer, steps: int, calls: list, requests, monkeypatch,
                       strategy: str = "hybrid+resident+sparse"):  # fmt: skip
    from unikv.engine.assembly import assemble_for
    from unikv.engine.engine import Engine

    def spy(self, *a):
        got = REAL_DECODE(self, *a)
        calls.append(None if got is None else got[0].shape[0])
        if got is not None and len(a) > 5 and a[5] is not None:  # temps: a run that drew
            calls.append(("sampled", got[0].shape[0]))
        return got

    monkeypatch.setattr(type(native_model), "decode", spy)
    parts = assemble_for(native_model, tokenizer, strategy=strategy)
    e = Engine(native_model, tokenizer, kv=parts.kv.strategy, max_batch=4, decode_steps=steps)
    try:
        out = []
        for batch in requests:  # the requests of a batch run together
            handles = [e.submit(p, params) for p, params in batch]
            out += [await h.result() for h in handles]
        return out
    finally:
        await e.close()
        parts.close()


@pytest.mark.parametrize("strategy", ["hybrid+resident+sparse", "hybrid+resident+pruned"])
async def test_the_engine_s_runs_give_one_step_a_turn_s_completions(
    native_model, tokenizer, strategy, monkeypatch
):
    """`decode_steps=8` against 1, SmolLM2 on its native weights under the CPU defaults (an
    AVX-512 machine's, and the pruned cache of a low-bandwidth AVX2 one: its shipped head and
    surprisal, its evictions while decoding):
    the same text, tokens and finish reasons for requests alone and three at once, a length
    that is no multiple of 8, a stop string and a stop token met inside a run (the tokens after
    them dropped), EOS, seeded sampled requests (which run too, their uniform numbers taken
    from their generators ahead: at a temperature alone, beside a greedy one, and with top-p;
    hostile values, a temperature of 1e30 or 1e-4, top_k 10**30, top_p 1e-300, min_p 1, beside
    a greedy canary whose text must not change);
    a prompt asked again after a run stopped early hits the prefix its prompt left."""
    from unikv.engine.sampling import SamplingParams

    free = SamplingParams(max_new_tokens=37, ignore_eos=True)
    ref: list = []
    base = await _completions(native_model, tokenizer, 1, ref, [[(PROMPTS[0], free)]],
                              monkeypatch, strategy)  # fmt: skip
    text = base[0].text
    stop = text[40:44]
    assert stop.strip()
    tok = base[0].token_ids[21]
    requests = [
        [(PROMPTS[0], free)],
        [(p, SamplingParams(max_new_tokens=29, ignore_eos=True)) for p in PROMPTS],
        [(PROMPTS[0], SamplingParams(max_new_tokens=37, stop=(stop,)))],
        [(PROMPTS[0], SamplingParams(max_new_tokens=37, stop_token_ids=(tok,)))],
        [("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
          SamplingParams(max_new_tokens=60))],
        [(PROMPTS[1], SamplingParams(max_new_tokens=20, temperature=0.8, seed=5))],
        [(LONG, SamplingParams(max_new_tokens=37, stop_token_ids=(tok,)))],
        [(LONG, SamplingParams(max_new_tokens=37, stop_token_ids=(tok,)))],
        [(PROMPTS[0], SamplingParams(max_new_tokens=29, ignore_eos=True)),
         (PROMPTS[2], SamplingParams(max_new_tokens=29, ignore_eos=True, temperature=1.2,
                                     seed=9))],
        [(PROMPTS[1], SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=5))],
        [(PROMPTS[0], free),  # a greedy canary beside hostile sampling values
         (PROMPTS[1], SamplingParams(max_new_tokens=20, temperature=1e30, top_k=10**30,
                                     top_p=1e-300, seed=3)),
         (PROMPTS[2], SamplingParams(max_new_tokens=20, temperature=1e-4, min_p=1.0, seed=4))],
    ]  # fmt: skip
    one_calls: list = []
    one = await _completions(native_model, tokenizer, 1, one_calls, requests, monkeypatch,
                             strategy)  # fmt: skip
    run_calls: list = []
    runs = await _completions(native_model, tokenizer, 8, run_calls, requests, monkeypatch,
                              strategy)  # fmt: skip
    assert one_calls == []  # (decode_steps=1 never asks)
    assert any(isinstance(n, int) and n >= 6 for n in run_calls), run_calls
    assert any(isinstance(n, tuple) and n[1] >= 6 for n in run_calls), run_calls  # drawn
    for a, b in zip(one, runs, strict=True):
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        assert a.prompt_tokens == b.prompt_tokens and a.cached_tokens == b.cached_tokens
    # (the three requests of the second batch are runs[1:4])
    assert runs[0].text == text and all(c.finish_reason == "length" for c in runs[:4])
    assert runs[4].finish_reason == "stop" and runs[4].text == text[: text.index(stop)]
    assert runs[5].finish_reason == "stop" and runs[5].token_ids[-1] == tok
    assert runs[6].finish_reason == "stop" and "Paris" in runs[6].text
    # a long prompt asked again after its run stopped early hits its first block (a pruned
    # cache shares no prefix: a compacted block no longer holds the tokens its position says)
    assert runs[9].token_ids == runs[8].token_ids
    assert runs[9].cached_tokens >= 64 or strategy.endswith("pruned")
    assert runs[11].token_ids != runs[3].token_ids  # (drawn at 1.2: not the greedy text)
    assert runs[13].text == text  # the canary's tokens, unchanged beside hostile values
    assert all(len(c.token_ids) >= 1 and c.finish_reason in ("length", "stop") for c in runs[13:])


def test_decode_steps_out_of_range_are_refused(model, tokenizer):
    from unikv.cli.args import MAX_DECODE_STEPS as CLI_MAX
    from unikv.engine.engine import MAX_DECODE_STEPS, Engine, check_decode_steps
    from unikv.serving.replicas import ReplicaSpec

    assert CLI_MAX == MAX_DECODE_STEPS
    for bad in (0, -1, MAX_DECODE_STEPS + 1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="decode_steps"):
            check_decode_steps(bad)
        with pytest.raises(ValueError, match="decode_steps"):
            ReplicaSpec(decode_steps=bad)
    with pytest.raises(ValueError, match="decode_steps"):
        Engine(model, tokenizer, decode_steps=0)
    check_decode_steps(MAX_DECODE_STEPS)
