"""A Llama layer's dense part in two native calls (engine/fused.py, unikv/kernels/gemv.c's layer_qkv
and layer_out) against the same computation as torch ops: q, k, v and the layer's output per
call, under every instruction set this CPU runs, with float32 and packed weights; the whole
model's decode logits and PPL; and the fallbacks (rows a kernel does not take, a matmul entry
that is not gemv.c's, a native call that raises)."""

import math

import pytest
import torch

from unikv.engine import fused
from unikv.kernels import gemv

pytestmark = pytest.mark.skipif(gemv.unavailable() is not None, reason=str(gemv.unavailable()))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _check_layers(m, rows: int, tol: float) -> None:
    cfg = m.cfg
    for li in (0, cfg.num_layers // 2, cfg.num_layers - 1):
        x = torch.randn(rows, cfg.hidden_size)
        pos = torch.randint(0, 2000, (rows,))
        got, ref = fused.qkv_native(m, li, x, pos), fused.qkv_ops(m, li, x, pos)
        for a, b in zip(got, ref, strict=True):
            assert a.shape == b.shape and _rel(a, b) < tol, (li, _rel(a, b))
        attn = torch.randn(rows, cfg.num_heads, cfg.head_dim)
        got, ref = fused.out_native(m, li, x, attn), fused.out_ops(m, li, x, attn)
        assert _rel(got, ref) < tol, (li, _rel(got, ref))


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_float32_layer_equals_its_ops_under_every_isa(model, isa, rows):
    assert gemv.unavailable() is None
    _check_layers(model, rows, 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 3, 12])
def test_packed_layer_equals_its_ops_under_every_isa(native_model, isa, rows):
    """Q8_0 and Q4_1 blocks; 12 rows: the int8 kernel takes any number, the float one 4. The
    int8 kernel rounds its input to codes, so a last-bit difference of the norm can move one
    code by one (measured 3e-6 of the layer's output)."""
    assert gemv.unavailable() is None
    _check_layers(native_model, rows, 2e-5)


def test_a_layer_description_follows_the_build_and_the_weights_forms(native_model, monkeypatch):
    """A layer's native description points into its weights in the layout the loaded build
    reads (interleaved by 16 rows on the VNNI path, GGUF order in the portable build). Another
    build (as the `isa` fixture loads) or a weight given another form rebuilds it, and it holds
    the tensors it points into. (Kept across builds, a description of one layout was read by
    another: a worker that ran the ISA tests crashed in the next decode.)"""
    from unikv.engine import linear

    def lins(d):
        return [getattr(d.layer, f) for f in ("qkv", "wo", "gu", "down")]

    def check(d):  # every pointer into a kept tensor, in the layout `i8_weight` gives now
        kept = {t.data_ptr() for t in d.keep if t.numel()}
        layers = native_model.layers[0]
        for lin, w in zip(lins(d), (layers[j].weight for j in (1, 2, 4, 5)), strict=True):
            assert lin.w in kept and (lin.h is None or lin.h in kept)
            if lin.kind == gemv.KIND_PACKED_I8:
                assert bool(lin.fmt & gemv.ROWS16) == linear.i8_weight(w)[2]

    first = fused._described(native_model, 0)
    assert fused._described(native_model, 0) is first  # kept while nothing moved
    check(first)
    monkeypatch.setenv("UNIKV_ISA", "portable")
    monkeypatch.setattr(gemv, "_state", {})  # another build, loaded on first use
    portable = fused._described(native_model, 0)
    assert portable is not first and gemv.isa() == "portable"
    check(portable)
    assert not any(lin.fmt & gemv.ROWS16 for lin in lins(portable))
    monkeypatch.undo()
    back = fused._described(native_model, 0)
    assert back is not portable
    check(back)
    linear._built()  # a weight gained or changed a form
    assert fused._described(native_model, 0) is not back


def test_rows_a_kernel_does_not_take_go_the_ops_way(model, monkeypatch):
    """Float32 weights: gemv takes at most MAX_ROWS rows, so 5 rows are the ops path's exactly
    (a prompt chunk); a position past the RoPE table fails as the ops path fails."""
    calls = []
    monkeypatch.setattr(gemv, "layer_qkv", lambda *a: calls.append(a) or None)
    cfg = model.cfg
    x, pos = torch.randn(gemv.MAX_ROWS + 1, cfg.hidden_size), torch.arange(gemv.MAX_ROWS + 1)
    for a, b in zip(fused.qkv_native(model, 0, x, pos), fused.qkv_ops(model, 0, x, pos),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)
    assert not calls
    monkeypatch.undo()
    with pytest.raises(IndexError):
        fused.qkv_native(model, 0, x[:1], torch.tensor([cfg.context_length]))


def test_a_matmul_entry_other_than_gemv_makes_the_layer_take_the_ops_way(model_path):
    """After a fallback of one matmul (here: the output projection switched to bmm) the layer's
    description is rebuilt and the layer runs as ops, with that matmul's chosen entry; the
    whole step's description (kept between steps) is dropped too, and comes back with gemv."""
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.model import LlamaModel

    cfg, tensors, _ = load_gguf(model_path, progress=False)
    m = LlamaModel(cfg, tensors)
    x = torch.randn(1, cfg.hidden_size)
    assert fused._usable(m, 3, x) is not None
    stack = fused._all_usable(m, x)
    assert stack is not None and fused._all_usable(m, x) is stack  # kept between steps
    wo = m.layers[3][2]
    wo.op._use([s.impl.name for s in wo.op._states].index("split_bmm"))
    assert fused._usable(m, 3, x) is None
    assert fused._all_usable(m, x) is None
    wo.op._use(0)
    assert fused._all_usable(m, x) is not None
    wo.op._use([s.impl.name for s in wo.op._states].index("split_bmm"))
    attn = torch.randn(1, cfg.num_heads, cfg.head_dim)
    assert torch.equal(fused.out_native(m, 3, x, attn), fused.out_ops(m, 3, x, attn))


def test_a_native_call_that_raises_falls_back_and_is_reported(model_path, monkeypatch):
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.model import LlamaModel
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    cfg, tensors, _ = load_gguf(model_path, progress=False)
    m = LlamaModel(cfg, tensors)
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, m.dtype)
    first = m.forward(torch.tensor([1, 2]), torch.arange(2), kv, StepBatch([0], [2]))

    def broken(*a):
        raise RuntimeError("injected")

    monkeypatch.setattr(gemv, "layer_out", broken)
    got = m.forward(torch.tensor([3]), torch.tensor([2]), kv, StepBatch([0], [1]))
    assert first.shape[-1] == got.shape[-1] and torch.isfinite(got).all()
    report = m.operators.report()["layer.out"]
    assert report["active"] == "ops" and report["fallbacks"] == 1
    assert "injected" in report["switched_off"]["native"]
    assert report["candidates"] == ["native", "ops"]


def test_a_bad_position_raises_without_switching_the_native_layer_off(model):
    """A position past the RoPE table makes both ways of the layer raise: the call is at
    fault, so the error reaches the caller and the native layer keeps serving later calls."""
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    c = model.cfg

    def step(pos: int):
        kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
        return model.forward(torch.tensor([5]), torch.tensor([pos]), kv, StepBatch([0], [1]))

    with pytest.raises(IndexError):
        step(c.context_length + 10)
    report = model.operators.report()
    assert report["layer.qkv"]["active"] == "native", report["layer.qkv"]
    assert "switched_off" not in report["layer.qkv"]
    assert torch.isfinite(step(3)).all()
    assert model.operators.report()["layer.qkv"]["active"] == "native"


def _decode(m, ids, ops: bool):
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    c = m.cfg
    saved = m._qkv, m._out
    if ops:
        m._qkv, m._out = (lambda *a: fused.qkv_ops(*a)), (lambda *a: fused.out_ops(*a))
    try:
        kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim, m.dtype)
        return torch.cat([m.forward(torch.tensor([t]), torch.tensor([i]), kv, StepBatch([0], [1]))
                          for i, t in enumerate(ids)])  # fmt: skip
    finally:
        m._qkv, m._out = saved


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["float32", "native"])
def test_decode_through_the_native_layer_keeps_the_ppl(
    weights, model, native_model, tokenizer, english_text
):
    """One token per step (every layer native) against the ops path: the same greedy tokens, the
    PPL within 0.01%, the logits within float32 summation order (float32 weights) or within the
    int8 kernel's rounding of its input (native weights: a code moved by one in some layer
    carries through the rest; measured 1.8e-4, docs/kernels.md's tolerance is 1e-3)."""
    m = model if weights == "float32" else native_model
    ids = tokenizer.encode(english_text)[:40]
    ref, got = _decode(m, ids, ops=True), _decode(m, ids, ops=False)
    assert m.operators.report()["layer.qkv"]["active"] == "native"
    assert _rel(got, ref) < (1e-5 if weights == "float32" else 1e-3)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    target = torch.tensor(ids[1:])[:, None]
    lp_ref, lp = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    change = math.exp(-lp[:-1].gather(1, target).mean() + lp_ref[:-1].gather(1, target).mean()) - 1
    assert abs(change) < 1e-4, f"PPL changed by {change:.5%}"


# ---- every layer of a decode step in one call (fused.layers_native, gemv.c's decode_layers) ----

# Two prompts written a chunk at a time in turn (their blocks interleave in the arena), then
# decode steps of 1 to 4 rows per sequence, one of 5 (a chunk: layer by layer) and one of one.
SCHEDULE = [{0: 20}, {1: 9}, {0: 17}, {1: 30}, {0: 1, 1: 1}, {0: 2, 1: 1}, {0: 4, 1: 3},
            {0: 1, 1: 4}, {0: 5, 1: 1}, {1: 1}]  # fmt: skip


def _serve(m, strategy: str, stack, schedule=SCHEDULE, options=None, block_size=16,
           kept: list | None = None, tiers=None) -> torch.Tensor:  # fmt: skip
    """Every step of `schedule` ({sequence: new tokens}) through `m.forward` over a new
    `strategy` cache (on `tiers`, by default a device tier alone), with `stack` as the model's
    `model.layers`: all the steps' logits (the cache closed, or appended to `kept`)."""
    from unikv import kvstrategies
    from unikv.engine.assembly import store_tiers
    from unikv.kvstrategies.kv import StepBatch
    from unikv.settings.config import PoolConfig, TierConfig

    tiers = tiers or (TierConfig("device", 32 << 20),)
    cfg = PoolConfig(block_size=block_size, tiers=tiers)
    stores = store_tiers(strategy, m.kv_spec(), cfg, options)  # an SSD tier's LMDB store
    kv = kvstrategies.create(strategy, m.kv_spec(), cfg, options, stores=stores)
    g, done, out, saved = torch.Generator().manual_seed(0), {}, [], m._stack
    m._stack = stack
    try:
        for step in schedule:
            seqs, lens = list(step), list(step.values())
            for sid, n in step.items():
                assert kv.reserve(sid, n)
            pos = torch.cat([torch.arange(done.get(s, 0), done.get(s, 0) + n)
                             for s, n in step.items()])  # fmt: skip
            toks = torch.randint(0, m.cfg.vocab_size, (sum(lens),), generator=g)
            out.append(m.forward(toks, pos, kv, StepBatch(seqs, lens)))
            done.update({s: done.get(s, 0) + n for s, n in step.items()})
    finally:
        m._stack = saved
        kv.close() if kept is None else kept.append(kv)
    return torch.cat(out)


def _spy(monkeypatch) -> list[int]:
    """The rows of every step gemv.c's decode_layers served (not refused) from now on."""
    served, real = [], gemv.decode_layers

    def spy(layers, kv, x, positions):
        got = real(layers, kv, x, positions)
        if got is not None:
            served.append(x.shape[0])
        return got

    monkeypatch.setattr(gemv, "decode_layers", spy)
    return served


@pytest.mark.parametrize("qtype", [None, "Q8_0", "Q4_1", "Q4_K"])
def test_a_decode_step_in_one_call_equals_the_step_layer_by_layer(qtype, isa, monkeypatch):
    """Same logits as `layers_python` (the same kernels: gemv.c's layer calls and sparse.c's
    attention, called from C), for decode steps of 1-4 rows a sequence, two sequences whose
    blocks interleave; float32 weights (at most gemv.MAX_ROWS rows in all) and packed ones
    (any number). Prompt chunks and steps of more rows go layer by layer."""
    from tests.test_operators import _tiny_llama

    m = _tiny_llama(qtype)
    served = _spy(monkeypatch)
    got = _serve(m, "full", fused.layers_native)
    want = _serve(m, "full", fused.layers_python)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert _rel(got, want) < 1e-6, _rel(got, want)
    if qtype is None:
        assert served == [2, 3, 1]  # (1, 1), (2, 1) and (1,): 7 and 5 rows exceed gemv's 4
    else:
        assert served == [2, 3, 7, 5, 1]
    assert m.operators.report()["model.layers"]["active"] == "native"


@pytest.mark.parametrize("qtype", [None, "Q8_0", "Q4_1", "Q4_K"])
def test_a_whole_decode_step_in_one_call_gives_the_model_s_logits(qtype, isa, monkeypatch):
    """model.step's native entry (gemv.c's decode_step: the embedding lookup, from the packed
    table or a float32 one's rows, every layer, the final norm and the output layer in one
    call) gives
    step_python's logits (the embedding, `model.layers`, the norm and the output layer's own
    entries) for the decode steps it serves; the rest go the model's way. Float32 output
    layers take at most gemv.MAX_ROWS rows. A packed output layer rounds its input to int8 per
    block, and the paths reach it through different code (the final norm and the product in
    gemv.c's last region, or the model's norm and the output layer's entry): a last-bit
    difference there can put one code on the other side of a rounding, and that row then
    differs by about 1e-5 (seen on the AVX2 build at Q8_0: 2 rows of 100 at 6e-6 and 9e-6,
    96 equal to the bit, 2 within 2e-7)."""
    from tests.test_operators import _tiny_llama

    m = _tiny_llama(qtype, packed_embedding=qtype is not None)
    served, real = [], gemv.decode_step

    def spy(layers, kv, step, x, tokens, positions, rows):
        got = real(layers, kv, step, x, tokens, positions, rows)
        if got is not None:
            served.append((tokens.shape[0], x is None))
        return got

    monkeypatch.setattr(gemv, "decode_step", spy)
    got = _serve(m, "full", m._stack)
    assert m.operators.report()["model.step"]["active"] == "native"
    monkeypatch.setattr(m, "_step", fused.step_python)
    want = _serve(m, "full", m._stack)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert _rel(got, want) < (1e-6 if qtype is None else 1e-5), _rel(got, want)
    packed = qtype is not None  # (every one reads its embedding rows in gemv.c: x is None)
    assert served == [(n, True) for n in ([2, 3, 7, 5, 1] if packed else [2, 3, 1])]


@pytest.mark.parametrize("qtype", [None, "Q4_1"])
@pytest.mark.parametrize("strategy", ["full", "hybrid+resident+sparse"])
def test_a_short_attention_runs_inside_the_region_with_the_same_bits(qtype, strategy,
                                                                     monkeypatch):  # fmt: skip
    """On 2 threads, a step whose every sequence attends fewer keys than gemv.c's INSIDE_KEYS
    runs its attention on thread 0 inside the layer's parallel region while thread 1 reads its
    next chunks ahead (touch_ahead); the logits are those of one thread (every attention
    between the regions) to the bit. So does a packed cache's own layer work (hybrid's, under
    the default strategy's sparse selection, which chooses nothing this short). A sequence
    past INSIDE_KEYS (2 KV heads x 512 tokens) takes its steps the other way."""
    from tests.test_operators import _tiny_llama
    from unikv.kvstrategies import hybrid
    from unikv.kvstrategies.quant import plan_from_scores

    def calibrated(spec, opts):  # a channel order of random scores, other for the values
        g = torch.Generator().manual_seed(3)
        shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        return plan_from_scores(torch.rand(shape, generator=g), torch.rand(shape, generator=g))

    monkeypatch.setattr(hybrid, "channel_plan", calibrated)
    m = _tiny_llama(qtype, context=640)
    short = [{0: 5, 1: 3}, {0: 1, 1: 1}, {0: 1}]
    long = [{0: 520}, {0: 1}, {0: 1}]
    threads, runs, inside, served = torch.get_num_threads(), {}, {}, {}
    calls, real = [], gemv.decode_layers

    def counted(*args):  # the one-call steps gemv.c served
        got = real(*args)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(gemv, "decode_layers", counted)
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for name, schedule in (("short", short), ("long", long)):
                before, calls[:] = gemv.inside_layers(), []
                runs[name, n] = _serve(m, strategy, fused.layers_native, schedule)
                inside[name, n] = gemv.inside_layers() - before
                served[name, n] = sum(calls)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs["short", 1], runs["short", 2])
    # past INSIDE_KEYS the attention itself splits over 2 threads: the same numbers, summed in
    # another order
    assert _rel(runs["long", 2], runs["long", 1]) < 1e-5
    # every layer of every one-call step of the short schedule: its two decode steps, and
    # the first (5 and 3 rows) where the cache and the weights take so many rows in one call
    assert served["short", 2] >= 2 and served["long", 2] >= 2
    every = served["short", 2] * m.cfg.num_layers
    assert inside == {("short", 1): 0, ("long", 1): 0, ("short", 2): every, ("long", 2): 0}


@pytest.mark.parametrize("qtype", [None, "Q4_1"])
def test_the_profiling_build_gives_the_same_bits_and_splits_the_call(qtype, monkeypatch):
    """gemv.c built with STEP_PROFILE (benchmarks/decode_profile.py --inside) gives the same
    logits to the bit as the kernel it profiles, and counts what its decode steps did: the
    whole call, and its products' time and bytes per kind of matrix (the two-layer model's
    QKV product reads twice the output projection's bytes, gate|up twice down's); the plain
    build counts nothing."""
    from tests.test_operators import _tiny_llama

    m = _tiny_llama(qtype)
    monkeypatch.setattr(gemv, "_state", {})
    assert gemv.step_profile() is None
    want = _serve(m, "full", m._stack)
    monkeypatch.setattr(gemv, "DEFINES", ("-DSTEP_PROFILE",))
    monkeypatch.setattr(gemv, "_state", {})
    gemv.step_profile(reset=True)
    got = _serve(m, "full", m._stack)
    assert torch.equal(got, want)
    counted = gemv.step_profile(reset=True)
    first = counted["threads"][0]
    assert first["call"] > 0 and 0 < first["multiply"] < first["call"]
    assert 0 < first["attention"] < first["call"] and first["make"] > 0
    b = {k: nbytes for k, (seconds, nbytes) in counted["matrices"].items()}
    assert all(seconds > 0 for seconds, _ in counted["matrices"].values())
    assert b["qkv"] == pytest.approx(2 * b["out"]) and b["gate|up"] == pytest.approx(2 * b["down"])
    again = gemv.step_profile()  # reset: nothing counted since
    assert again["threads"] == [] and set(again["matrices"].values()) == {(0.0, 0.0)}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K"])
def test_a_one_call_step_gives_the_same_bits_on_any_number_of_threads(qtype, isa, monkeypatch):
    """decode_layers shares each product's rows among a team of threads (gemv.c's
    team_product: a range each, the rest taken from its end by a thread done with its own) and
    takes an int8 product's x rows 16 at a time: decode steps of 10 sequences (40 rows: three
    such chunks; then 18 and 1) give the same logits to the bit on 1, 2 and 3 threads (more
    threads than this machine's cores), and the layer-by-layer path's; so does a build whose
    threads take every range from its end first, 16 rows a claim (STEAL_FIRST)."""
    from tests.test_operators import _tiny_llama

    m = _tiny_llama(qtype)
    schedule = [{s: 6 + s for s in range(10)}, {s: 4 for s in range(10)},
                {s: 2 for s in range(9)}, {3: 1}]  # fmt: skip
    served, runs, threads = _spy(monkeypatch), [], torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(_serve(m, "full", fused.layers_native, schedule))
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(gemv, "DEFINES", ("-DSTEAL_FIRST=1", "-DCLAIM_BYTES=1"))
    monkeypatch.setattr(gemv, "_state", {})
    try:
        for n in (2, 3):
            torch.set_num_threads(n)
            runs.append(_serve(m, "full", fused.layers_native, schedule))
    finally:
        torch.set_num_threads(threads)
    want = _serve(m, "full", fused.layers_python, schedule)
    assert served == [40, 18, 1] * 5
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    assert torch.isfinite(want).all() and _rel(runs[1], want) < 1e-6, _rel(runs[1], want)


@pytest.mark.parametrize(
    ("strategy", "scorer"),
    [("fp16+resident+all", None), ("hybrid+tiered+all", None),
     ("hybrid+resident+pruned", "knorm"), ("hybrid+resident+pruned", "h2o")],
)  # fmt: skip
def test_a_cache_with_work_at_every_layer_is_stepped_layer_by_layer(strategy, scorer,
                                                                    monkeypatch):  # fmt: skip
    """float16 K/V, a packed format over a tiered placement and a packed format under a
    selection with work at every layer of every step (knorm scores each new key, h2o each
    step's attention) describe no native step: the step goes layer by layer."""
    from tests.test_operators import _tiny_llama

    m = _tiny_llama()
    served = _spy(monkeypatch)
    opts = None if scorer is None else {"scorer": scorer}
    assert torch.isfinite(_serve(m, strategy, fused.layers_native, SCHEDULE[:6], opts)).all()
    assert served == []


@pytest.mark.parametrize("scorer", ["head", "streaming"])
def test_a_pruned_cache_steps_in_one_call_where_its_selection_has_no_layer_work(
    scorer, monkeypatch
):
    """The pruned selection's default scorer (the head: here the surprisal, as the tiny model
    has no head) and streaming do nothing per layer in a decode step; such a step runs in one
    call with the layer-by-layer path's logits, and evictions between steps (small budgets:
    every sequence is compacted) leave both caches alike. A prompt's end (observed by the
    query-aware scorer at every layer) goes layer by layer."""
    from tests.test_operators import _tiny_llama

    m = _tiny_llama()
    opts = {"scorer": scorer, "sink_tokens": 2, "recent_window": 4}
    served, kept = _spy(monkeypatch), []
    got = _serve(m, "hybrid+resident+pruned", fused.layers_native, SCHEDULE, opts, kept=kept)
    want = _serve(m, "hybrid+resident+pruned", fused.layers_python, SCHEDULE, opts, kept=kept)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-6, _rel(got, want)
    assert 1 in served and 2 in served  # the decode steps of one and of two sequences
    a, b = (kv.selection for kv in kept)
    assert a.evicted == b.evicted > 0
    for sid in (0, 1):
        assert torch.equal(a._pos[sid], b._pos[sid])  # the same tokens kept
        assert torch.equal(kept[0].format._dense[sid], kept[1].format._dense[sid])
    for kv in kept:
        kv.close()


def test_a_refused_step_runs_layer_by_layer_and_a_bad_position_raises(monkeypatch):
    """gemv.c refusing the step (here: injected) leaves the step to the layer-by-layer path,
    with the same logits; a position past the RoPE table makes both ways raise, and the
    native step keeps serving later steps (the call was at fault)."""
    from tests.test_operators import _decode_step, _tiny_llama

    m = _tiny_llama()
    want = _serve(m, "full", fused.layers_python)
    monkeypatch.setattr(gemv, "decode_layers", lambda *a: None)
    assert torch.equal(_serve(m, "full", fused.layers_native), want)
    monkeypatch.undo()
    served = _spy(monkeypatch)
    m, x, positions, kv = _decode_step(m)
    with pytest.raises(IndexError):
        m._stack(m, x, positions + m.cfg.context_length, kv)
    report = m.operators.report()["model.layers"]
    assert report["active"] == "native" and "switched_off" not in report
    assert torch.isfinite(m._stack(m, x, positions, kv)).all() and served == [3]


@pytest.mark.parametrize("strategy", ["hybrid_fp16_int4", "int8+resident+all"])
@pytest.mark.parametrize("qtype", [None, "Q4_1"])
def test_a_packed_cache_steps_in_one_call_through_its_own_layer_code(strategy, qtype, isa,
                                                                     monkeypatch):  # fmt: skip
    """A packed format describes its step as its own C code per layer (`NativeHook`:
    hybrid_attend.c's hybrid_layer, the per-layer path's kernel with the same arguments): the
    same logits as the step layer by layer, the same fp16 side buffers (sinks and tail) and
    the same packed blocks after every step. A step that completes a block with a sequence's
    last row keeps the step's keys and values, and the block is quantized after it (in Python,
    as layer by layer); one that completes a block before a sequence's last row goes layer by
    layer, and so do float32 weights' steps of more than 4 rows."""
    from tests.test_operators import _tiny_llama
    from unikv.kvstrategies import hybrid
    from unikv.kvstrategies.quant import plan_from_scores

    def calibrated(spec, opts):  # a channel order of random scores, other for the values
        g = torch.Generator().manual_seed(2)
        shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        return plan_from_scores(torch.rand(shape, generator=g), torch.rand(shape, generator=g))

    monkeypatch.setattr(hybrid, "channel_plan", calibrated)
    m = _tiny_llama(qtype)
    served, kept = _spy(monkeypatch), []
    got = _serve(m, strategy, fused.layers_native, kept=kept)
    assert len(served) > 0
    want = _serve(m, strategy, fused.layers_python, kept=kept)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-6, _rel(got, want)
    # (0, 20) (1, 9) (0, 17) (1, 30) complete blocks of 16 but (1, 9); then the decode steps
    # 37+1 39+1, 38+2 40+1, 40+4 41+3, 44+1 44+4 (completes with its last row), 45+5 48+1
    # (completes a block at its fourth row), 48+1.
    assert served == ([2, 3, 1] if qtype is None else [9, 2, 3, 7, 5, 1])
    a, b = (kv.format for kv in kept)
    for sid in (0, 1):
        assert torch.equal(a._dense[sid], b._dense[sid])
        ids = torch.tensor(a.pool.table(sid).block_ids()[:3])
        assert ids.tolist() == b.pool.table(sid).block_ids()[:3]
        assert torch.equal(a._arena[:, ids], b._arena[:, ids])
    for kv in kept:
        kv.close()


@pytest.mark.parametrize("strategy", ["full", "hybrid_fp16_int4"])
@pytest.mark.parametrize("weights", ["float32", "native"])
def test_the_real_model_decodes_in_one_call_per_step(weights, strategy, model, native_model,
                                                     monkeypatch):  # fmt: skip
    """SmolLM2 (a packed cache with its shipped calibration): a 12-token prompt, then 12 steps
    of one token each, every one served by decode_layers (a packed cache's the step that
    completes its first block too, and its prompt, on native weights, which take any number of
    rows), with the layer-by-layer path's logits."""
    from unikv.kvstrategies.calibration import shipped_path

    m = model if weights == "float32" else native_model
    schedule = [{0: 12}] + [{0: 1}] * 12
    served = _spy(monkeypatch)
    opts = None if strategy == "full" else {"calibration": shipped_path(m.cfg.identity)}
    got = _serve(m, strategy, fused.layers_native, schedule, opts)
    want = _serve(m, strategy, fused.layers_python, schedule, opts)
    packed = strategy != "full"
    assert served == [12] * (packed and weights == "native") + [1] * 12
    assert _rel(got, want) < 1e-6


# A sparse selection small enough to choose on the tiny model: blocks of 4 tokens, a budget of
# 12 tokens, one sink and one recent token, every layer choosing.
SPARSE = {"budget_tokens": 12, "sink_tokens": 1, "recent_window": 1, "dense_layers": 0}


@pytest.mark.parametrize("strategy", ["hierarchical_offload", "dense+tiered+sparse"])
def test_a_tiered_cache_reads_its_host_blocks_in_place_inside_the_one_call_step(
    strategy, isa, monkeypatch, tmp_path
):
    """Tiered over device and host tiers, the host blocks are read in place: the one-call step
    reads them where they lie (`NativeStep.places`, `where`), the same logits and (sparse)
    blocks read as layer by layer. With an SSD tier the step stages blocks per layer and goes
    layer by layer."""
    from tests.test_operators import _tiny_llama
    from unikv.memory.tiers import TierKind
    from unikv.settings.config import TierConfig

    m = _tiny_llama()
    host = (TierConfig("device", 1 << 20), TierConfig("host", 1 << 20))
    opts = {"device_window": 8, "host_window": 1 << 10, "min_disk_hit_tokens": 0}
    if strategy.endswith("sparse"):
        opts |= SPARSE
    served = _spy(monkeypatch)
    got, want = [], []
    a = _serve(m, strategy, fused.layers_native, SCHEDULE, opts, 4, got, host)
    b = _serve(m, strategy, fused.layers_python, SCHEDULE, opts, 4, want, host)
    assert served == [2, 3, 1], served  # as resident: chunks and 7 or 5 rows go layer by layer
    assert _rel(a, b) < 1e-6, _rel(a, b)
    for kv in (got[0], want[0]):
        assert kv.pool.tokens_by_tier()[TierKind.HOST] > 0  # the host blocks were read
    if strategy.endswith("sparse"):
        native, ref = got[0].selection, want[0].selection
        assert native.counts == ref.counts and native.counts["sparse_reads"] > 0
        for layer in range(m.cfg.num_layers):
            for x, y in zip(native.last_read[layer], ref.last_read[layer], strict=True):
                assert (x is None and y is None) or torch.equal(x, y), layer
    got[0].close(), want[0].close()
    served.clear()
    ssd = (*host, TierConfig("ssd", 1 << 24, path=str(tmp_path / "ssd")))
    opts |= {"host_window": 4}
    c = _serve(m, strategy, fused.layers_native, SCHEDULE, opts, 4, tiers=ssd)
    assert served == [] and _rel(c, b) < 1e-5, _rel(c, b)


@pytest.mark.parametrize("qtype", [None, "Q4_1"])
def test_a_sparse_selection_chooses_inside_the_one_call_step(qtype, isa, monkeypatch):
    """`dense+resident+sparse` describes its choice (`native_choice`): the one-call step
    chooses and attends as the step layer by layer does, the same logits, the same blocks
    read at every layer, the same counts and stability, and the summaries of the keys it
    wrote (later steps choose from them); a layer before `dense_layers` reads everything; from
    4-bit keys (the default, summary = keys: the step passes their width, d / 2, and `temp`
    for the log-sum-exp), from centres (their largest), with their ranges, and as one-token
    centres ranked by log-sum-exp."""
    from tests.test_operators import _tiny_llama

    m = _tiny_llama(qtype)
    centres = {**SPARSE, "summary": "centres", "block_score": "max"}  # before the keys' default
    for opts in (SPARSE, centres, {**centres, "dense_layers": 1, "range_weight": 0.5},
                 {**centres, "summary_tokens": 1, "block_score": "lse"}):  # fmt: skip
        served = _spy(monkeypatch)
        got, want = [], []
        a = _serve(m, "dense+resident+sparse", fused.layers_native, SCHEDULE, opts, 4, got)
        b = _serve(m, "dense+resident+sparse", fused.layers_python, SCHEDULE, opts, 4, want)
        assert _rel(a, b) < 1e-6, _rel(a, b)
        native, ref = got[0].selection, want[0].selection
        assert served and native.counts == ref.counts and native.counts["sparse_reads"] > 0
        for layer in range(m.cfg.num_layers):
            for x, y in zip(native.last_read[layer], ref.last_read[layer], strict=True):
                assert (x is None and y is None) or torch.equal(x, y), layer
        for sid in (0, 1):
            assert torch.equal(native.summaries(sid), ref.summaries(sid))
        got[0].close(), want[0].close()


def test_a_packed_decode_loop_keeps_its_step_structure_with_the_same_numbers(monkeypatch):
    """A packed cache's decode loop builds its one-call step's C structure once between two
    completed blocks (the same sequences, rows and packed blocks), then changes only the side
    buffer's counts and slots: the logits, side buffers and packed blocks of the step layer by
    layer, through a block completed (in one call too; the structure built again after it)
    and a sequence that ends."""
    from tests.test_operators import _tiny_llama
    from unikv.kvstrategies import hybrid
    from unikv.kvstrategies.quant import plan_from_scores

    def calibrated(spec, opts):
        g = torch.Generator().manual_seed(3)
        shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        return plan_from_scores(torch.rand(shape, generator=g), torch.rand(shape, generator=g))

    monkeypatch.setattr(hybrid, "channel_plan", calibrated)
    contexts, real = [], hybrid.PackedFormat.native_step

    def counted(self, step):  # the C structure each one-call step is given (kept alive here)
        hook = real(self, step)
        if hook is not None:
            contexts.append(hook.keep[0])
        return hook

    monkeypatch.setattr(hybrid.PackedFormat, "native_step", counted)
    m = _tiny_llama(context=128)
    # 14 and 9 tokens, then 8 steps of a token each (sequence 0 completes its first 16-token
    # block at the second, sequence 1 at the seventh), then sequence 1 alone
    schedule = [{0: 14}, {1: 9}] + [{0: 1, 1: 1}] * 8 + [{1: 1}] * 3
    served = _spy(monkeypatch)
    a = _serve(m, "hybrid+resident+all", fused.layers_native, schedule, kept=(got := []))
    b = _serve(m, "hybrid+resident+all", fused.layers_python, schedule, kept=(want := []))
    assert torch.isfinite(a).all() and _rel(a, b) < 1e-6, _rel(a, b)
    # built for: the two prompts, the first decode step, the steps after each completed block,
    # sequence 1 alone; every other step reused the one before's
    built = sum(1 for i, c in enumerate(contexts) if i == 0 or c is not contexts[i - 1])
    # every decode step in one call, the two that complete a block too (the prompts, 14 and
    # 9 rows of a float32 model, go layer by layer)
    assert served == [2] * 8 + [1] * 3 and built == 6 and len(contexts) == 13, (served, contexts)
    for sid in (0, 1):
        assert torch.equal(got[0].format._dense[sid], want[0].format._dense[sid])
        packed = got[0].pool.num_tokens(sid) // 16  # its packed blocks (the rest: unwritten)
        ids = torch.tensor(got[0].pool.table(sid).block_ids()[:packed])
        assert packed and ids.tolist() == want[0].pool.table(sid).block_ids()[:packed]
        assert torch.equal(got[0].format._arena[:, ids], want[0].format._arena[:, ids])
    got[0].close(), want[0].close()


@pytest.mark.parametrize("strategy", ["hybrid+resident+sparse", "int8+resident+sparse"])
def test_a_packed_cache_chooses_inside_the_one_call_step(strategy, isa, monkeypatch):
    """A packed format's own layer code takes the selection's choice too: per KV head it reads
    the packed blocks among the chosen (in place, where the step layer by layer gathers their
    records) and keeps the step's keys for the summaries. The same logits, blocks read at
    every layer, counts, summaries, side buffers and packed blocks as layer by layer, through a
    step that completes a block (quantized after it, from the keys and values it kept)."""
    from tests.test_operators import _tiny_llama
    from unikv.kvstrategies import hybrid
    from unikv.kvstrategies.quant import plan_from_scores

    def calibrated(spec, opts):  # a channel order of random scores, other for the values
        g = torch.Generator().manual_seed(3)
        shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        return plan_from_scores(torch.rand(shape, generator=g), torch.rand(shape, generator=g))

    monkeypatch.setattr(hybrid, "channel_plan", calibrated)
    m = _tiny_llama(context=128)
    # 90 and 70 tokens: 5 and 4 packed blocks of 16, each step reading the sink block, one
    # chosen of the 3 or 4 between, and the window; then decode steps of 1 to 3 tokens.
    schedule = [{0: 50}, {0: 40}, {1: 60}, {1: 10}, {0: 1, 1: 1}, {0: 2, 1: 1}, {0: 1, 1: 3},
                {0: 1}, {0: 1, 1: 1}]  # fmt: skip
    opts = {**SPARSE, "budget_tokens": 48}
    served, got, want = _spy(monkeypatch), [], []
    a = _serve(m, strategy, fused.layers_native, schedule, opts, kept=got)
    b = _serve(m, strategy, fused.layers_python, schedule, opts, kept=want)
    assert torch.isfinite(a).all() and _rel(a, b) < 1e-6, _rel(a, b)
    assert served == [2, 3, 4, 1, 2], served  # 95 + 1 completes seq 0's block: one call too
    native, ref = got[0].selection, want[0].selection
    assert native.counts == ref.counts and native.counts["sparse_reads"] > 0
    for layer in range(m.cfg.num_layers):
        for x, y in zip(native.last_read[layer], ref.last_read[layer], strict=True):
            assert (x is None and y is None) or torch.equal(x, y), layer
    for sid in (0, 1):
        assert torch.equal(native.summaries(sid), ref.summaries(sid))
        assert torch.equal(got[0].format._dense[sid], want[0].format._dense[sid])
        packed = got[0].pool.num_tokens(sid) // 16  # the last block may be the side buffer's
        ids = torch.tensor(got[0].pool.table(sid).block_ids()[:packed])
        assert ids.tolist() == want[0].pool.table(sid).block_ids()[:packed]
        assert torch.equal(got[0].format._arena[:, ids], want[0].format._arena[:, ids])
    got[0].close(), want[0].close()


@pytest.mark.parametrize(("qtype", "other"), [("Q4_K", "Q6_K"), ("Q4_1", "Q8_0"), ("Q4_1", None)])
def test_a_layer_of_parts_in_two_formats_stays_packed_and_steps_in_one_call(
    qtype, other, monkeypatch
):
    """Layer 0's attn_v and ffn_up in another format than the rest (Q4_K_M's attn_v in Q6_K):
    its QKV and gate|up are kept as parts (`StackedLinear`), each packed where a kernel reads
    its format (None: a float32 tensor, as the loader gives Q4_K_S's Q5_K attn_v); they
    multiply as their parts' products side by side, and the one-call decode step chains them
    (gemv.c's lin_t.next) to the same logits as the layer-by-layer path, to the bit on 1, 2
    and 3 threads."""
    from tests.test_operators import _tiny_llama
    from unikv.engine.linear import Linear, StackedLinear, layer_parts
    from unikv.engine.model import weight_formats

    m = _tiny_llama(qtype, formats={"blk.0.attn_v": other, "blk.0.ffn_up": other})
    torch.manual_seed(0)
    qkv, gu = m.layers[0][1], m.layers[0][4]
    held = "float" if other is None else other
    assert isinstance(qkv, StackedLinear) and [p.fmt for p in qkv.parts] == [qtype, held]
    assert isinstance(gu, StackedLinear) and [p.fmt for p in gu.parts] == [qtype, held]
    assert isinstance(m.layers[1][1], Linear) and m.layers[1][1].fmt == qtype
    layers = [p for layer in m.layers for lin in (layer[1], layer[2], layer[4], layer[5])
              for p in layer_parts(lin)]  # fmt: skip
    assert {p.fmt for p in layers} == {qtype, held}
    if held != "float":  # (the float entry holds the tied output layer too)
        assert weight_formats(m)[held].bytes == sum(p.weight.nbytes for p in layers
                                                    if p.fmt == held)  # fmt: skip
    x = torch.randn(3, m.cfg.hidden_size)
    dense = qkv.to_dense()
    assert dense.shape == (qkv.out_features, qkv.in_features)
    assert _rel(qkv(x), x @ dense.T) < 2e-2  # the parts' columns in order (int8 activations)
    index = torch.tensor([0, qkv.out_features - 1, qkv.parts[0].out_features])
    assert torch.equal(qkv.rows(index), dense[index])
    layer = fused._described(m, 0).layer  # the per-layer calls take the chain too
    pos = torch.tensor([0, 5, 9])
    got = gemv.layer_qkv(layer, x, pos)
    assert got is not None and all(_rel(a, b) < 1e-5 for a, b in
                                   zip(got, fused.qkv_ops(m, 0, x, pos), strict=True))  # fmt: skip
    attn = torch.randn(3, m.cfg.num_heads * m.cfg.head_dim)
    got = gemv.layer_out(layer, x, attn)
    assert got is not None and _rel(got, fused.out_ops(m, 0, x, attn)) < 1e-5
    served, runs, threads = _spy(monkeypatch), [], torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(_serve(m, "full", fused.layers_native))
    finally:
        torch.set_num_threads(threads)
    want = _serve(m, "full", fused.layers_python)
    assert served and len(served) % 3 == 0  # every thread count's steps took the one call
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    assert torch.isfinite(want).all() and _rel(runs[0], want) < 1e-6, _rel(runs[0], want)
