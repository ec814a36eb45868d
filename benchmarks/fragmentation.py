"""Does a long-running engine stay as fast as a fresh one? Rounds of the same load on one
engine: throughput per round, and how many runs of consecutive slots each running sequence's
KV is in (every run past the first few costs attention a copy or a call on every step).

    python benchmarks/fragmentation.py [--rounds 5] [--concurrency 32] [--requests 64]

One `Engine` (`full`, native weights, batch `--concurrency`), `--rounds` rounds of
`--requests` cold prompts (24 to 190 words of the serve_load text, a new seed per round) with
64 new tokens each, sent by `--concurrency` workers; per round: output tokens/s and the mean
and largest number of runs per sequence over the round's steps (counted where the dense format
plans a step). Baseline: round 0, on the fresh pool, in the same process.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.decode_profile import cpu_name  # noqa: E402
from benchmarks.serve_load import TEXT, prompts  # noqa: E402
from unikv.engine.engine import Engine  # noqa: E402
from unikv.engine.sampling import SamplingParams  # noqa: E402
from unikv.kvstrategies import full  # noqa: E402

RUNS: list[int] = []


def _count_runs() -> None:
    """Count each planned sequence's runs (instrumentation of this process only)."""
    prepare = full.DenseFormat.prepare

    def counted(self, step):
        prepare(self, step)
        if step.groups is None:
            RUNS.extend(len(r) for r in self._runs)

    full.DenseFormat.prepare = counted


async def main(args: argparse.Namespace) -> None:
    text = Path(TEXT).read_text(encoding="utf-8")
    e = await Engine.create("smollm2", strategy="full", max_batch=args.concurrency)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    print(f"fragmentation: {cpu_name()}, {args.concurrency} workers, {args.requests} requests "
          f"per round", flush=True)  # fmt: skip
    base = None
    for rnd in range(args.rounds):
        queue = prompts(text, args.requests, seed=900 + rnd)

        async def worker(queue: list[str] = queue) -> None:
            while queue:
                await e.generate(queue.pop(), params)

        RUNS.clear()
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        tok_s = args.requests * 64 / (time.perf_counter() - t0)
        base = base or tok_s
        print(
            f"  round {rnd}: {tok_s:6.1f} tok/s ({tok_s / base:.2f}x round 0), runs per "
            f"sequence mean {statistics.mean(RUNS):.1f}, max {max(RUNS)}",
            flush=True,
        )
    await e.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    _count_runs()
    asyncio.run(main(p.parse_args()))
