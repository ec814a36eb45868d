"""A prompt chunk's attention two ways, in one process: a whole prefill with each, alternating.

`attention_one` (kvstrategies/kv.py) attends a prompt chunk of T > 1 queries on a CPU in float32
as two parts merged by their log-sum-exp: the stored tokens without a mask, the chunk's own
tokens causally (`_prompt_chunk`). The baseline is the single call it replaced, kept here: every
query over all S tokens with a `[G*T, S]` boolean causal mask. Each round prefills the same
prompt as a new sequence of `--strategy` (512-token chunks, as the engine's step budget does)
once with each, alternating; the medians and their ratio are printed, with each way's first
greedy token (they must agree).

    python benchmarks/prefill_attention.py [--tokens 4096] [--rounds 2] [--weights float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from benchmarks.decode_profile import cpu_name  # noqa: E402
from benchmarks.kv_quant_speed import build, context_ids, prefill  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.kvstrategies import kv as kvmod  # noqa: E402


def masked(q, k, v, num_past: int, scale: float) -> torch.Tensor:
    """The baseline: one flash call over every stored and new token, with a causal mask."""
    t, hq, d = q.shape
    hkv, s, _ = k.shape
    dv, g = v.shape[-1], hq // hkv
    qg = q.view(t, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * t, d)
    allowed = torch.arange(s).unsqueeze(0) <= (num_past + torch.arange(t)).unsqueeze(1)
    if kvmod.values_in_keys(k, v):
        v = k
    out = kvmod.sdpa(qg, k.unsqueeze(0), v.unsqueeze(0), attn_mask=allowed.repeat(g, 1),
                     scale=scale)[..., :dv]  # fmt: skip
    return out.view(hkv, g, t, dv).permute(2, 0, 1, 3).reshape(t, hq, dv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--strategy", default="full")
    p.add_argument("--weights", default="float32")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2", progress=False, weights=args.weights)
    ids = context_ids(tok, args.tokens)
    ways = {"one masked call": masked, "stored + own, merged": kvmod._prompt_chunk}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    first: dict[str, int] = {}
    try:
        for _ in range(args.rounds):
            for name, fn in ways.items():
                kvmod._prompt_chunk = fn
                kv = build(model, tok, args.strategy)
                t0 = time.perf_counter()
                first[name] = prefill(model, kv, ids, 0)
                seconds[name].append(time.perf_counter() - t0)
                kv.close()
                print(f"{name}: {seconds[name][-1]:.1f} s", flush=True)
    finally:
        kvmod._prompt_chunk = ways["stored + own, merged"]
    rows = [{"way": name, "seconds": statistics.median(s), "first_token": first[name]}
            for name, s in seconds.items()]  # fmt: skip
    base = rows[0]["seconds"]
    for r in rows:
        r["speedup"] = base / r["seconds"]
    report("prefill_attention", rows, ["way", "seconds", "speedup", "first_token"],
           {"tokens": args.tokens, "rounds": args.rounds, "strategy": args.strategy,
            "weights": args.weights, "cpu": cpu_name()})  # fmt: skip


if __name__ == "__main__":
    main()
