"""Decode step time of the pruning head against a zero-cost scorer, same run (issue 6).

Two pruning caches at the same kept ratio prefill the same text, then decode rounds alternate
between them after a warm-up round (which goes first alternates too): one ranks tokens with
the shipped head (its MLP over every layer's K/V of the tokens not yet scored, when an eviction
is due, and the surprisal term, which needs every step's log-probabilities), the other with
`streaming` (a position: no work at all). The median step-time ratio is the head's
overhead; the goal (issue 6) is at most 2%.

    python benchmarks/prune_overhead.py [--context 1024] [--new-tokens 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from benchmarks.kv_quant_speed import context_ids, decode, prefill  # noqa: E402
from unikv import kvstrategies  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kept", type=float, default=0.5)
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2", progress=False)
    spec = model.kv_spec()
    ids = context_ids(tok, args.context)
    cases = {}
    for name in ("streaming", "head"):
        kv = kvstrategies.create(
            "learned_prune", spec, options={"scorer": name, "kept_ratio": args.kept}
        )
        cases[name] = [kv, prefill(model, kv, ids, seq=0), args.context]
    samples: dict[str, list[float]] = {n: [] for n in cases}
    for r in range(args.repeats + 1):  # round 0 warms up; the order alternates by round
        for name, case in sorted(cases.items(), reverse=bool(r % 2)):
            kv, first, pos = case
            sec = decode(model, kv, first, pos, args.new_tokens, 0)
            case[2] += args.new_tokens
            if r:
                samples[name].append(sec / args.new_tokens)
    step = {n: statistics.median(s) for n, s in samples.items()}
    rows = [
        {"scorer": n, "step_ms": step[n] * 1000, "vs_streaming": step[n] / step["streaming"],
         "kept": round(cases[n][0].stats().selection["kept_ratio"], 3)}
        for n in cases
    ]  # fmt: skip
    report("prune_overhead", rows, ["scorer", "step_ms", "vs_streaming", "kept"],
           {"context": args.context, "goal_overhead": 0.02,
            "overhead": step["head"] / step["streaming"] - 1})  # fmt: skip


if __name__ == "__main__":
    main()
