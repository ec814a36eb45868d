"""Decode speed of the engine against `transformers.generate` on the same model, same process.

Two scenarios, each interleaved (engine, reference, engine, ...) after warm-up, median of repeats:
- batch 1: one prompt, N new tokens (greedy, end-of-sequence ignored so lengths match);
- 8 requests of different prompt lengths: the engine serves them concurrently (continuous
  batching); the reference serves them one after another with `generate`.
Reports generated tokens per second and the ratio engine / reference.

    python benchmarks/decode_speed.py [--new-tokens 64] [--repeats 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import interleaved, report  # noqa: E402
from unikv.engine import compute  # noqa: E402
from unikv.engine.engine import Engine  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.sampling import SamplingParams  # noqa: E402

PROSE = (
    "The history of the town is long and full of small surprises. Its first houses were built by "
    "the river, where the mill still stands, and its people traded grain, wool and stories. "
)


def prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Prompts of the given token lengths cut from repeated prose."""
    ids = tokenizer.encode(PROSE * 40)
    return [ids[i * 7 : i * 7 + n] for i, n in enumerate(lengths)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from unikv.engine.gguf_loader import resolve_model_path
    from unikv.kernels.dtypes import DTYPES

    dtype = DTYPES[args.dtype]
    # All torch work on the one compute thread (see engine/compute.py), the reference's too.
    model, tok = compute.run_sync(load_model, args.model, args.dtype, "cpu", False)
    path = resolve_model_path(args.model)
    hf = compute.run_sync(
        lambda: AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        ).eval()
    )
    n_new = args.new_tokens
    params = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    one = prompts(tok, [64])[0]
    eight = prompts(tok, [16, 40, 64, 100, 160, 256, 384, 512])

    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(_make_engine(model, tok))

    def engine_one():
        c = loop.run_until_complete(engine.generate(one, params))
        assert len(c.token_ids) == n_new

    def engine_eight():
        cs = loop.run_until_complete(_gather(engine, eight, params))
        assert all(len(c.token_ids) == n_new for c in cs)

    def hf_generate(ids):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                pad_token_id=tok.eos_id,
            )
        assert out.shape[1] == len(ids) + n_new

    def hf_one():
        compute.run_sync(hf_generate, one)

    def hf_eight():
        for ids in eight:
            compute.run_sync(hf_generate, ids)

    t1 = interleaved({"engine": engine_one, "transformers": hf_one}, args.repeats)
    t8 = interleaved({"engine": engine_eight, "transformers": hf_eight}, max(2, args.repeats // 2))
    loop.run_until_complete(engine.close())
    rows = []
    for name, t, n in (("batch 1", t1, n_new), ("8 requests", t8, 8 * n_new)):
        rows.append(
            {
                "scenario": name,
                "engine_tok_s": n / t["engine"],
                "transformers_tok_s": n / t["transformers"],
                "ratio": t["transformers"] / t["engine"],
            }
        )
    report(
        "decode_speed",
        rows,
        ["scenario", "engine_tok_s", "transformers_tok_s", "ratio"],
        {"dtype": args.dtype, "new_tokens": n_new, "prompt_lengths_8": [len(p) for p in eight]},
    )


async def _make_engine(model, tok) -> Engine:
    # Prefix sharing off: the reference recomputes every prompt, so the engine does too.
    return Engine(model, tok, max_batch=8, max_step_tokens=512, prefix_sharing=False)


async def _gather(engine, prompts_, params):
    return await asyncio.gather(*(engine.generate(p, params) for p in prompts_))


if __name__ == "__main__":
    main()
