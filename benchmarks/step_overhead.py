"""What a decode step costs around its C call, two ways at a time in one process.

This VM's pace drifts by up to 20% from one minute to the next, so each comparison here runs
both ways in one process, round by round, and prints medians:

- `blocks`: a packed cache's steps that complete a block (every `block_size` tokens under the
  default strategy) in the one C call, the block packed after it (`PackedFormat.native_step`,
  `_complete_native`), against the same steps refused by the one call and run layer by layer
  (as before 2026-12-07). A decode of `--tokens` from a 64-token context, `--rounds` each;
  the completing steps' and the other steps' median milliseconds.
- `engine`: one request of `--tokens` through the engine with each `--intervals` stream
  interval (`Engine.create`'s `stream_interval_ms`; `unikv run` uses 20), and the benchmarks'
  bare loop: the median time between two steps' C calls (`gemv.decode_step`), the C call's
  own median, and the request's decode tokens/s.

    python benchmarks/step_overhead.py [--part blocks engine] [--strategy auto] [--rounds 6]
        [--tokens 200] [--intervals 0 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from benchmarks.decode_profile import cpu_name  # noqa: E402
from benchmarks.kv_quant_speed import build, context_ids, prefill  # noqa: E402
from benchmarks.run_speed import engine_rate, loop_rate  # noqa: E402
from unikv.engine import compute  # noqa: E402
from unikv.engine.engine import Engine  # noqa: E402
from unikv.engine.sampling import greedy_rows  # noqa: E402
from unikv.kernels import gemv  # noqa: E402
from unikv.kvstrategies import hybrid  # noqa: E402
from unikv.kvstrategies.kv import StepBatch  # noqa: E402


def blocks(a: argparse.Namespace, engine: Engine) -> list[dict]:
    """Completing steps in one call against layer by layer (see the module's docstring)."""
    model, tok = engine.model, engine.tokenizer
    kv = build(model, tok, engine.kv.name)
    if not isinstance(getattr(kv, "format", None), hybrid.PackedFormat):
        sys.exit(f"step_overhead: --part blocks needs a packed format, not {engine.kv.name}")
    real, block = hybrid.PackedFormat.native_step, kv.format.T

    def refused(self, step):  # the rule before: a step completing a block went layer by layer
        lens = step.batch.query_lens
        if any((p + n) // block != p // block for p, n in zip(step.past, lens, strict=True)):
            return None
        return real(self, step)

    ids = context_ids(tok, 64)
    times: dict[str, dict[str, list[float]]] = {}
    try:
        for r in range(a.rounds + 1):  # round 0 warms up
            for way in ("one call", "layer by layer")[:: 1 if r % 2 else -1]:
                hybrid.PackedFormat.native_step = real if way == "one call" else refused
                seq = 2 * r + (way == "one call")
                token = prefill(model, kv, ids, seq)
                with torch.inference_mode():
                    for pos in range(len(ids), len(ids) + a.tokens):
                        t0 = time.perf_counter()
                        logits = model.forward(torch.tensor([token]), torch.tensor([pos]), kv,
                                               StepBatch([seq], [1]))  # fmt: skip
                        token = greedy_rows(logits)[0]
                        part = "completing" if (pos + 1) % block == 0 else "other"
                        if r:
                            times.setdefault(way, {}).setdefault(part, []).append(
                                (time.perf_counter() - t0) * 1e3
                            )
                kv.free(seq)
    finally:
        hybrid.PackedFormat.native_step = real
        kv.close()
    med = statistics.median
    return [{"part": "blocks", "way": way, "completing ms": round(med(t["completing"]), 2),
             "other ms": round(med(t["other"]), 2), "steps": len(t["completing"])}
            for way, t in times.items()]  # fmt: skip


async def between_calls(a: argparse.Namespace, engine: Engine) -> list[dict]:
    """The engine's time between C calls per stream interval, and the bare loop's."""
    calls: list[tuple[float, float]] = []
    real = gemv.decode_step

    def timed(*args):
        t0 = time.perf_counter()
        got = real(*args)
        calls.append((t0, time.perf_counter()))
        return got

    gemv.decode_step = timed
    ways = [f"engine, {ms:g} ms" for ms in a.intervals] + ["loop"]
    seen: dict[str, list[tuple[float, float, float]]] = {w: [] for w in ways}
    try:
        for r in range(a.rounds + 1):
            for way, ms in zip(ways, [*a.intervals, None], strict=True):
                calls.clear()
                if ms is None:
                    rate = await compute.run(loop_rate, engine, engine.kv.name, a.tokens)
                else:
                    engine.stream_interval = ms / 1000.0
                    rate = await engine_rate(engine, a.tokens)
                gaps = [b[0] - e[1] for e, b in zip(calls, calls[1:], strict=False)]
                if r and gaps:
                    spans = [e - b for b, e in calls]
                    seen[way].append((statistics.median(gaps) * 1e6,
                                      statistics.median(spans) * 1e3, rate))  # fmt: skip
    finally:
        gemv.decode_step = real
    med = statistics.median
    return [{"part": "engine", "way": w, "between C calls us": round(med(x[0] for x in v)),
             "C call ms": round(med(x[1] for x in v), 3), "tok/s": round(med(x[2] for x in v), 1)}
            for w, v in seen.items() if v]  # fmt: skip


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--part", nargs="+", choices=("blocks", "engine"), default=["blocks", "engine"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--intervals", type=float, nargs="+", default=[0.0, 20.0])
    a = p.parse_args()
    if a.rounds < 1 or a.tokens < 2 or any(not 0 <= ms <= 1000 for ms in a.intervals):
        p.error("--rounds >= 1, --tokens >= 2, --intervals in [0, 1000]")
    engine = await Engine.create(a.model, strategy=a.strategy)
    rows: list[dict] = []
    try:
        if "blocks" in a.part:
            rows += await compute.run(blocks, a, engine)
        if "engine" in a.part:
            rows += await between_calls(a, engine)
    finally:
        await engine.close()
    columns = ["part", "way", "completing ms", "other ms", "steps", "between C calls us",
               "C call ms", "tok/s"]  # fmt: skip
    for row in rows:
        for c in columns:
            row.setdefault(c, "")
    report(f"a decode step's cost around its C call ({engine.kv.name})", rows, columns,
           {"cpu": cpu_name(), "rounds": a.rounds, "tokens": a.tokens})  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
