"""The same engine on a CUDA device: skipped where there is none (every CI machine here)."""

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


async def test_cuda_engine_matches_cpu_greedy(loaded, model, tokenizer):
    from unikv.engine.engine import Engine
    from unikv.engine.model import LlamaModel
    from unikv.engine.sampling import SamplingParams

    cfg, tensors, _ = loaded
    gpu = LlamaModel(cfg, tensors, device="cuda")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "Water boils at"]
    async with Engine(gpu, tokenizer) as e:
        on_gpu = [(await e.generate(p, params)).token_ids for p in prompts]
        assert e.kv.pool.arena("kv").device.type == "cuda"
    async with Engine(model, tokenizer) as e:
        on_cpu = [(await e.generate(p, params)).token_ids for p in prompts]
    agree = sum(
        a == b for x, y in zip(on_gpu, on_cpu, strict=True) for a, b in zip(x, y, strict=True)
    )
    assert agree >= 0.9 * 32  # float32 on both; kernels differ, near-ties may flip late


# ---- the tiny random model: CUDA paths without the packaged 98 MB model (a lent GPU machine
# receives the repository only) ----

TINY_STRATEGIES = ["full", "hierarchical_offload", "hybrid_fp16_int4", "learned_prune",
                   "sparse_attention", "int8+resident+all", "hybrid+tiered+all",
                   "fp16+tiered+sparse", "hybrid+resident+pruned"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(cpu model, cuda model, tokenizer) of a tiny random Llama GGUF file (tests/tinygguf.py)."""
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.model import LlamaModel
    from unikv.engine.tokenizer import GGUFTokenizer

    from . import tinygguf

    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    tinygguf.write(path, "F32")
    cfg, tensors, reader = load_gguf(path, progress=False)
    return (LlamaModel(cfg, tensors), LlamaModel(cfg, tensors, device="cuda"),
            GGUFTokenizer(reader, str(path)))  # fmt: skip


@pytest.mark.parametrize("name", TINY_STRATEGIES)
def test_every_strategy_scores_on_cuda_as_on_the_cpu(tiny, name, tmp_path):
    """The perplexity protocol (prefill, then 16-token chunks) through each strategy with its
    KV on the GPU: the same PPL as on the CPU (float32 both; a packed format's codes may
    round differently by a last bit), the same bytes stored, the KV held on the device."""
    from unikv.engine.assembly import build_kv
    from unikv.engine.evaluate import perplexity

    cpu, gpu, _ = tiny
    ids = torch.randint(0, cpu.cfg.vocab_size, (128,), generator=torch.Generator().manual_seed(3))
    from unikv.settings.config import PoolConfig, TierConfig

    results = []
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        config = None  # the defaults; tiered: a host tier and an SSD store of its own
        if "tiered" in name or name == "hierarchical_offload":
            tiers = (TierConfig("device", 1 << 26), TierConfig("host", 1 << 26),
                     TierConfig("ssd", 1 << 28, path=str(tmp_path / device)))  # fmt: skip
            config = PoolConfig(block_size=16, tiers=tiers)
        kv = build_kv(model.kv_spec(), name, config, device=device).strategy
        res = perplexity(model, ids.tolist(), kv, prefill=48, chunk=16)
        assert kv.pool.arena("kv").device.type == device
        results.append(res)
    a, b = results
    lossless = name in ("full", "hierarchical_offload", "fp16+tiered+sparse")
    assert abs(b.ppl / a.ppl - 1) < (1e-4 if lossless else 1e-2), (a.ppl, b.ppl)
    assert b.kv_bytes == a.kv_bytes and abs(b.kept_ratio - a.kept_ratio) <= 0.05


async def test_the_engine_generates_on_cuda_as_on_the_cpu(tiny):
    from unikv.engine.engine import Engine
    from unikv.engine.sampling import SamplingParams

    cpu, gpu, tok = tiny
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = [[5, 17, 200, 3, 44, 9, 120], list(range(30, 90))]
    out = []
    for model in (gpu, cpu):
        async with Engine(model, tok) as e:
            out.append([(await e.generate(p, params)).token_ids for p in prompts])
            assert e.kv.pool.arena("kv").device.type == model.device.type
    agree = sum(a == b for x, y in zip(*out, strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= 0.8 * 32, out  # float32 on both; a near-tie of random weights may flip


# ---- CUDA graphs (engine.graphs): the step's regions captured per batch bucket ----


def _tiny_gpu(tmp_path_factory, graphs_on: bool):
    """The tiny model on the GPU, a model of its own (its graphs and breakers its own)."""
    from unikv.engine import graphs
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.model import LlamaModel

    from . import tinygguf

    path = tmp_path_factory.mktemp("tiny_gpu") / "tiny.gguf"
    tinygguf.write(path, "F32")
    cfg, tensors, _ = load_gguf(path, progress=False)
    with pytest.MonkeyPatch.context() as mp:
        if not graphs_on:  # the entry's availability is decided when the breaker is made
            mp.setenv(graphs.OFF_ENV, "0")
        return LlamaModel(cfg, tensors, device="cuda")


@pytest.fixture(scope="module")
def eager_gpu(tmp_path_factory):
    return _tiny_gpu(tmp_path_factory, graphs_on=False)


def _scores(model, name: str):
    from unikv.engine.assembly import build_kv
    from unikv.engine.evaluate import perplexity

    ids = torch.randint(0, model.cfg.vocab_size, (110,), generator=torch.Generator().manual_seed(5))
    kv = build_kv(model.kv_spec(), name, device="cuda").strategy
    out: list[torch.Tensor] = []
    res = perplexity(model, ids.tolist(), kv, prefill=45, chunk=13, logits_out=out)
    return res, torch.cat(out)


@pytest.mark.parametrize("name", ["full", "hybrid_fp16_int4", "hybrid+resident+pruned"])
def test_cuda_graphs_score_as_the_eager_step(tiny, eager_gpu, name):
    """Prefill 45 rows, chunks of 13 (buckets 48 and 16, with padding rows): the same logits
    and PPL as the eager step on the same GPU, the same bytes stored; every bucket used holds
    a graph per region (layers + 1)."""
    gpu = tiny[1]
    assert gpu._stack.active.name == "graphs" and eager_gpu._stack.active.name == "python"
    (a, la), (b, lb) = _scores(eager_gpu, name), _scores(gpu, name)
    assert b.kv_bytes == a.kv_bytes and abs(b.ppl / a.ppl - 1) < 1e-5
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)
    assert {16, 48} <= set(gpu._step_graphs)
    assert all(len(g.graphs) == gpu.cfg.num_layers + 1 for g in gpu._step_graphs.values())
    assert gpu._stack.report()["fallbacks"] == 0


async def test_cuda_graphs_batch_requests_as_the_eager_step(tiny, eager_gpu):
    """Three requests at once (decode steps of 3 rows: bucket 4), greedy: the tokens of the
    eager step on the same GPU."""
    import asyncio

    from unikv.engine.engine import Engine
    from unikv.engine.sampling import SamplingParams

    _, gpu, tok = tiny
    prompts = [[5, 17, 200, 3, 44, 9, 120], list(range(30, 90)), [7, 7, 8]]
    out = []
    for model in (eager_gpu, gpu):
        async with Engine(model, tok) as e:
            params = SamplingParams(max_new_tokens=16, ignore_eos=True)
            done = await asyncio.gather(*(e.generate(p, params) for p in prompts))
            out.append([r.token_ids for r in done])
    agree = sum(a == b for x, y in zip(*out, strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= 0.95 * 48, out  # the same ops; a product's last bits may flip a near-tie
    assert 4 in gpu._step_graphs and gpu._stack.report()["fallbacks"] == 0


def test_a_capture_that_fails_falls_back_to_the_eager_step(tmp_path_factory, eager_gpu,
                                                          monkeypatch):  # fmt: skip
    """The breaker serves the step eagerly (the capture fails before the strategy is touched,
    so the call runs again whole) and the kernels report says so."""
    from unikv.engine import graphs

    gpu = _tiny_gpu(tmp_path_factory, graphs_on=True)

    def refuse(self, *args):
        raise RuntimeError("capture refused (test)")

    monkeypatch.setattr(graphs.StepGraphs, "_capture", refuse)
    (a, la), (b, lb) = _scores(eager_gpu, "full"), _scores(gpu, "full")
    torch.testing.assert_close(lb, la, rtol=0, atol=0)
    assert b.ppl == a.ppl
    report = gpu._stack.report()
    assert report["active"] == "python" and report["fallbacks"] == 1
    assert "graphs" in report["switched_off"]


async def test_warm_up_captures_every_bucket(tmp_path_factory):
    """`unikv serve`'s warm-up captures the graphs of every batch bucket, so no request pays
    for a capture; the model's steps then run through them."""
    from unikv.engine import graphs
    from unikv.engine.engine import Engine
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.tokenizer import GGUFTokenizer
    from unikv.engine.warmup import warm_up

    from . import tinygguf

    path = tmp_path_factory.mktemp("tiny_warm") / "tiny.gguf"
    tinygguf.write(path, "F32")
    _, _, reader = load_gguf(path, progress=False)
    gpu = _tiny_gpu(tmp_path_factory, graphs_on=True)
    async with Engine(gpu, GGUFTokenizer(reader, str(path))) as e:
        await warm_up(e, prompt_tokens=20, new_tokens=2)
        assert set(gpu._step_graphs) == set(graphs.BUCKETS)
        assert graphs.capture_buckets(gpu) == 0  # nothing left to capture


def test_a_region_that_fails_inside_its_capture_leaves_the_stream_as_it_was(
    tmp_path_factory, eager_gpu, monkeypatch
):
    """A region whose op raises while its graph is captured (not in the eager warm-up before):
    the step is served eagerly, the same numbers, the caller's stream is the default stream
    again, and a later bucket still captures and replays."""
    from unikv.engine import fused, graphs

    gpu = _tiny_gpu(tmp_path_factory, graphs_on=True)
    real = fused.out_ops

    def fails_in_capture(*args):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("an op refused inside the capture (test)")
        return real(*args)

    monkeypatch.setattr(graphs, "out_ops", fails_in_capture)
    (a, la), (b, lb) = _scores(eager_gpu, "full"), _scores(gpu, "full")
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.testing.assert_close(lb, la, rtol=0, atol=0)
    assert b.ppl == a.ppl
    assert gpu._stack.report()["active"] == "python" and "_step_graphs" not in gpu.__dict__


def test_a_switched_breaker_recaptures_every_bucket_together(tmp_path_factory, eager_gpu):
    """A breaker the regions use switching (rmsnorm's fused entry switched off) makes every
    bucket's graphs stale; they are dropped together (they share a stream, whose cuBLAS
    workspace goes with any of its graphs) and the next steps capture anew, with the numbers
    of the eager step."""
    from unikv.engine import graphs

    gpu = _tiny_gpu(tmp_path_factory, graphs_on=True)
    _scores(gpu, "full")
    assert graphs.capture_buckets(gpu) == len(graphs.BUCKETS) - 2  # all but 16 and 48
    before = dict(gpu._step_graphs)
    assert gpu.operators["rmsnorm"]._switch_off(0, "test")
    (a, la), (b, lb) = _scores(eager_gpu, "full"), _scores(gpu, "full")
    assert set(gpu._step_graphs) == {16, 48}  # the others were dropped with them
    assert all(gpu._step_graphs[r] is not before[r] for r in (16, 48))
    assert gpu._step_graphs[16].serving["rmsnorm"] == "torch"
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)
    assert abs(b.ppl / a.ppl - 1) < 1e-5
