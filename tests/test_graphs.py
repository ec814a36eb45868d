"""engine.graphs: a step's layers as regions around the KV seam, captured as CUDA graphs.

The capture needs a GPU (tests/test_cuda.py runs it there). Here the same regions run eagerly
on the same static buffers (`StepGraphs(capture=False)`): the bucketing, the padding rows, the
chain of regions and the strategy's `append` and `attend` between them, against the eager
layer loop of the same torch ops."""

import asyncio

import pytest
import torch

from unikv.engine import fused, graphs
from unikv.kernels.operators import Breaker, BreakerSettings, FnImplementation, NotMine, choose


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(a tiny random float32 Llama on the CPU, its tokenizer): tests/tinygguf.py."""
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.model import LlamaModel
    from unikv.engine.tokenizer import GGUFTokenizer

    from . import tinygguf

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    tinygguf.write(path, "F32")
    cfg, tensors, reader = load_gguf(path, progress=False)
    return LlamaModel(cfg, tensors), GGUFTokenizer(reader, str(path))


@pytest.fixture
def eager(tiny, monkeypatch):
    """The tiny model stepping through the layer loop of torch ops (the reference)."""
    model = tiny[0]
    monkeypatch.setattr(model, "_qkv", fused.qkv_ops)
    monkeypatch.setattr(model, "_out", fused.out_ops)
    monkeypatch.setattr(model, "_stack", fused.layers_python)
    return model


def _through_regions(model, monkeypatch) -> dict:
    """Make `model` step through StepGraphs run eagerly; returns the buckets made, by rows."""
    made: dict[int, graphs.StepGraphs] = {}

    def stack(m, x, positions, kv):
        rows = graphs.bucket(x.shape[0])
        assert rows is not None, "the tests keep to the buckets"
        if rows not in made:
            made[rows] = graphs.StepGraphs(m, rows, capture=False)
        return made[rows].run(x, positions, kv)

    monkeypatch.setattr(model, "_stack", stack)
    return made


def test_bucket_is_the_smallest_that_holds_the_rows():
    assert [graphs.bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 25, 33, 49, 64)] == [
        1, 2, 4, 8, 8, 16, 24, 32, 48, 64, 64]  # fmt: skip
    assert graphs.bucket(0) is None and graphs.bucket(65) is None


@pytest.mark.parametrize("name", ["full", "hybrid_fp16_int4", "hybrid+resident+pruned"])
def test_regions_score_as_the_eager_layers(tiny, eager, monkeypatch, name):
    """The perplexity protocol with a prefill of 45 rows and chunks of 13 (buckets 48 and 16,
    each with padding rows): the logits of every scored token and the bytes stored equal the
    eager loop's (up to the last bits a product of more rows may round differently)."""
    from unikv.engine.assembly import build_kv
    from unikv.engine.evaluate import perplexity

    model = eager
    ids = torch.randint(0, model.cfg.vocab_size, (110,), generator=torch.Generator().manual_seed(5))
    results, logits = [], []
    for regions in (False, True):
        made = _through_regions(model, monkeypatch) if regions else None
        kv = build_kv(model.kv_spec(), name).strategy
        out: list[torch.Tensor] = []
        results.append(perplexity(model, ids.tolist(), kv, prefill=45, chunk=13, logits_out=out))
        logits.append(torch.cat(out))
    assert sorted(made) == [16, 48]
    a, b = results
    assert b.kv_bytes == a.kv_bytes and b.kept_ratio == a.kept_ratio
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    assert abs(b.ppl / a.ppl - 1) < 1e-6


async def test_engine_batches_through_padded_buckets(tiny, eager, monkeypatch):
    """Three requests at once (decode steps of 3 rows: bucket 4, a padding row; then fewer as
    they finish): the same tokens as the eager loop, and the KV seam saw only real rows."""
    from unikv.engine.engine import Engine
    from unikv.engine.sampling import SamplingParams

    model, tok = eager, tiny[1]
    prompts = [[5, 17, 200, 3, 44, 9, 120], list(range(30, 90)), [7, 7, 8]]
    lengths = (12, 20, 16)

    async def run():
        async with Engine(model, tok) as e:
            done = await asyncio.gather(*(
                e.generate(p, SamplingParams(max_new_tokens=m, ignore_eos=True))
                for p, m in zip(prompts, lengths, strict=True)))  # fmt: skip
            return [r.token_ids for r in done]

    want = await run()
    made = _through_regions(model, monkeypatch)
    got = await run()
    assert got == want
    assert 4 in made  # the three decoding together
    assert all(len(t) == m for t, m in zip(got, lengths, strict=True))


def test_padding_rows_never_reach_the_kv_seam(eager):
    """One step of 3 rows in bucket 4: every layer appends and attends 3 rows, and the output
    is 3 rows; the padding row's input (here NaN) changes nothing the real rows get."""
    model = eager
    cfg = model.cfg
    g = graphs.StepGraphs(model, 4, capture=False)
    g.x.fill_(float("nan"))

    class Seam:
        def __init__(self):
            self.seen = []

        def append(self, layer, k, v):
            self.seen.append(("append", layer, k.shape[0], v.shape[0]))

        def attend(self, layer, q):
            self.seen.append(("attend", layer, q.shape[0]))
            return q.new_ones(q.shape[0], cfg.num_heads, cfg.head_dim)

    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    seam = Seam()
    out = g.run(x, torch.tensor([4, 9, 2]), seam)
    assert out.shape == (3, cfg.hidden_size) and torch.isfinite(out).all()
    assert seam.seen == [e for li in range(cfg.num_layers)
                         for e in (("append", li, 3, 3), ("attend", li, 3))]  # fmt: skip
    # the same rows alone in bucket 4 with a finite padding row: the same output
    g.x.zero_()
    again = g.run(x, torch.tensor([4, 9, 2]), Seam())
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_steps_past_the_largest_bucket_run_eagerly(eager, monkeypatch):
    from unikv.engine.assembly import build_kv
    from unikv.kvstrategies.kv import StepBatch

    model = eager

    def never(*args):
        raise AssertionError("a step past the largest bucket was captured")

    monkeypatch.setattr(graphs, "_graphs", never)
    n = graphs.BUCKETS[-1] + 1
    x = torch.randn(n, model.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(n)
    outs = []
    for fn in (graphs.layers_graphs, fused.layers_python):
        kv = build_kv(model.kv_spec(), "full").strategy
        kv.begin_step(StepBatch([0], [n]))
        outs.append(fn(model, x, pos, kv))
        kv.abort_step()
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_the_entry_is_for_cuda_llama_models(tiny, monkeypatch):
    model = tiny[0]
    entry = [i for i in choose("model.layers", "cpu", model)[0] if i.name == "graphs"]
    assert entry == []  # on the CPU: the native call and the python loop only
    available = graphs._available
    assert available(torch.device("cpu"), model) == "CUDA only"
    monkeypatch.setenv(graphs.OFF_ENV, "0")
    assert available(torch.device("cuda"), model) == f"turned off ({graphs.OFF_ENV}=0)"
    monkeypatch.setenv(graphs.OFF_ENV, "yes")
    with pytest.raises(ValueError, match="UNIKV_CUDA_GRAPHS='yes': expected 0"):
        available(torch.device("cuda"), model)
    monkeypatch.delenv(graphs.OFF_ENV)
    if not torch.cuda.is_available():
        assert available(torch.device("cuda"), model) == "no CUDA device"
    else:
        assert available(torch.device("cuda"), model) is None
        assert available(torch.device("cuda"), object()) == "Llama layers only"


def test_breaker_times_nothing_while_a_graph_is_captured(monkeypatch):
    """A CUDA breaker's timed call synchronizes and reads the clock; inside a capture (where a
    synchronize is an error) it serves the call untimed, and a failure still falls back."""
    reads, syncs = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))

    def clock():
        reads.append(1)
        return float(len(reads))

    def broken(x):
        raise RuntimeError("no kernel")

    impls = [FnImplementation("op", "a", lambda x: x + 1, ("cuda",)),
             FnImplementation("op", "b", lambda x: x + 2, ("cuda",))]  # fmt: skip
    b = Breaker("op", impls, BreakerSettings(every=1), clock=clock, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert b(1) == 2 and reads == [] and syncs == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert b(1) == 2 and len(syncs) == 2 and len(reads) == 2
    # a failure inside a capture: the next implementation serves the call
    impls = [FnImplementation("op", "a", broken, ("cuda",)),
             FnImplementation("op", "b", lambda x: x + 2, ("cuda",))]  # fmt: skip
    b = Breaker("op", impls, BreakerSettings(every=1), clock=clock, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert b(1) == 3 and b.active.name == "b"


def test_warm_up_captures_nothing_where_the_step_is_not_graphs(tiny):
    """On the CPU the native call serves `model.layers`: the warm-up's capture does nothing
    (tests/test_cuda.py checks it captures every bucket on a GPU)."""
    model = tiny[0]
    assert model._stack.active.name != "graphs"
    assert graphs.capture_buckets(model) == 0 and "_step_graphs" not in model.__dict__


def test_a_cache_failure_is_the_calls_not_the_graphs(eager):
    """The strategy's `append` or `attend` raising inside a step is the call's failure: it
    reaches the caller as it is (`NotMine` through the breaker), nothing switched and nothing
    run again (an eager re-run would append the layers before it twice)."""
    model = eager
    cfg = model.cfg
    g = graphs.StepGraphs(model, 2, capture=False)

    class Refusing:
        appended = 0

        def append(self, layer, k, v):
            self.appended += 1

        def attend(self, layer, q):
            if layer == 1:
                raise MemoryError("no room for the step")
            return q.new_zeros(q.shape[0], cfg.num_heads, cfg.head_dim)

    seam = Refusing()
    x = torch.zeros(2, cfg.hidden_size)
    with pytest.raises(NotMine) as got:
        g.run(x, torch.tensor([0, 1]), seam)
    assert isinstance(got.value.error, MemoryError)
    calls = []

    def eager_again(*args):
        calls.append(args)
        return "eager"

    impls = [FnImplementation("model.layers", "graphs", lambda *a: g.run(*a), ("*",)),
             FnImplementation("model.layers", "python", eager_again, ("*",))]  # fmt: skip
    b = Breaker("model.layers", impls, BreakerSettings(every=1))
    seam = Refusing()
    with pytest.raises(MemoryError, match="no room"):
        b(x, torch.tensor([0, 1]), seam)
    assert calls == [] and seam.appended == 2  # layers 0 and 1, once each
    assert b.active.name == "graphs" and b.report()["fallbacks"] == 0


def test_regions_are_stale_once_a_breaker_they_use_switches(tmp_path):
    """A switch of a breaker the regions run (here rmsnorm's) makes them stale (`current`):
    they hold the kernels chosen when they were made. A switch anywhere else does not."""
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.model import LlamaModel
    from unikv.kernels.operators import OperatorSet

    from . import tinygguf

    path = tmp_path / "tiny.gguf"
    tinygguf.write(path, "F32")
    cfg, tensors, _ = load_gguf(path, progress=False)
    model = LlamaModel(cfg, tensors)  # its own breakers: switched here, not the shared model's
    g = graphs.StepGraphs(model, 1, capture=False)
    assert "rmsnorm" in g.serving and "model.layers" not in g.serving
    other = OperatorSet("cpu")["rmsnorm"]  # another owner's breaker switching
    assert other._switch_off(0, "test")
    assert g.current()
    rms = model.operators["rmsnorm"]
    assert rms._switch_off(0, "test")
    assert not g.current()


class _FakeGraph:
    """A CUDA graph's semantics without a GPU: "captured" once (its outputs kept, their storage
    what every replay writes), each replay runs the region again and writes into those same
    tensors; RoPE's positions are gathered anew by each, as a captured gather re-runs."""

    def __init__(self, g: graphs.StepGraphs, r: int) -> None:
        self.g, self.r = g, r
        g.model.rope._last = None
        self.outs = g._region(r)
        g.model.rope._last = None

    def replay(self) -> None:
        self.g.model.rope._last = None
        for static, new in zip(self.outs, self.g._region(self.r), strict=True):
            static.copy_(new)
        self.g.model.rope._last = None


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


def test_captured_regions_replay_into_their_static_outputs(eager, monkeypatch):
    """`_capture` and the replay path of `run` (graph mode: no region's outputs replaced, each
    replay writing into the tensors captured) with the graphs' semantics simulated on the CPU:
    the same rows out and the same calls at the seam as the eager mode, step after step, with
    new positions each step and a padding row."""
    import contextlib

    model = eager
    cfg = model.cfg
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    recorded = []

    def record(self, r, pool, stream):
        assert (pool, type(stream)) == ("pool", _FakeStream)
        graph = _FakeGraph(self, r)
        self.outs.append(graph.outs)
        recorded.append(r)
        return graph

    monkeypatch.setattr(graphs.StepGraphs, "_record", record)
    captured = graphs.StepGraphs(model, 4, capture=True, pool="pool", stream=_FakeStream())
    assert recorded == list(range(cfg.num_layers + 1)) and len(captured.graphs) == len(recorded)
    statics = [tuple(map(id, o)) for o in captured.outs]
    plain = graphs.StepGraphs(model, 4, capture=False)

    class Seam:  # attention of a fixed function of q: both modes see the same
        def append(self, layer, k, v):
            pass

        def attend(self, layer, q):
            return torch.tanh(q * (layer + 1))

    g = torch.Generator().manual_seed(4)
    for step in range(4):
        n = 3 if step % 2 else 4
        x = torch.randn(n, cfg.hidden_size, generator=g)
        pos = torch.randint(0, cfg.context_length, (n,), generator=g)
        got, want = captured.run(x, pos, Seam()), plain.run(x, pos, Seam())
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert [tuple(map(id, o)) for o in captured.outs] == statics  # never replaced


def test_a_capture_that_fails_falls_back_before_the_cache_is_touched(eager, monkeypatch):
    """`layers_graphs` captures before its first `append`: a capture that raises leaves the
    begun step untouched, so the breaker's re-run through `python` stores each layer once and
    gives the eager rows (the GPU test does the same with a real capture)."""
    from unikv.engine.assembly import build_kv
    from unikv.kvstrategies.kv import StepBatch

    model = eager

    def refuse(*args):
        raise RuntimeError("capture refused (test)")

    monkeypatch.setattr(graphs, "_graphs", refuse)
    impls = [FnImplementation("model.layers", "graphs", graphs.layers_graphs, ("*",)),
             FnImplementation("model.layers", "python", fused.layers_python, ("*",))]  # fmt: skip
    breaker = Breaker("model.layers", impls, BreakerSettings(every=1))
    x = torch.randn(3, model.cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    pos = torch.arange(3)
    outs, appended = [], []
    for fn in (breaker, fused.layers_python):
        kv = build_kv(model.kv_spec(), "full").strategy
        calls = []
        real = kv.append
        monkeypatch.setattr(kv, "append", lambda li, k, v, real=real, calls=calls: (
            calls.append(li), real(li, k, v))[1])  # fmt: skip
        kv.begin_step(StepBatch([0], [3]))
        outs.append(fn(model, x, pos, kv))
        kv.end_step()
        appended.append(calls)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert appended[0] == appended[1] == list(range(model.cfg.num_layers))
    assert breaker.active.name == "python" and breaker.report()["fallbacks"] == 1
