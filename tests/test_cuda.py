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
