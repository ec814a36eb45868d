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
