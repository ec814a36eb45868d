"""Decode speed through `make run`'s path against the decode benchmarks' loop, same process.

`make run` (`unikv run`) serves its prompt through the engine (`Engine.create`: scheduler,
sampling, streaming, the compute thread) with the strategy the chip picks (`auto`); the decode
benchmarks (`vs_llamacpp.py`, `decode_profile.py`) time a bare loop of `model.forward` calls.
Issue 34 asks that the first be the second: no hidden cost per step in the default strategy.
For each `--strategies` (default: auto, then the benchmarks' `full`, and the auto strategy's
format without its selection), both ways run N greedy tokens after the same chat prompt
(end-of-sequence ignored), interleaved round by round, both on the engine's compute thread
(torch work on a second thread slows both: `unikv.engine.compute`); decode tokens/s counts the
tokens after the first from the first on (what `unikv run` prints as "tokens/s decoding").
The engine runs at each `--decode-steps` (default: `unikv run`'s 8, then 1: one step a turn),
the loop one step a call: with several steps a native call the engine may pass the loop.

    python benchmarks/run_speed.py [--strategies auto full hybrid+resident+all]
        [--new-tokens 256] [--rounds 3] [--decode-steps 8 1]
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
from benchmarks.kv_quant_speed import build, decode, prefill  # noqa: E402
from unikv.cli.main import RUN_DECODE_STEPS, RUN_STREAM_INTERVAL_MS  # noqa: E402
from unikv.engine import compute  # noqa: E402
from unikv.engine.engine import Engine  # noqa: E402
from unikv.engine.requests import prompt_ids  # noqa: E402
from unikv.engine.sampling import SamplingParams  # noqa: E402
from unikv.kernels import native  # noqa: E402

PROMPT = "Explain in two sentences why the KV cache makes LLM decoding fast."  # make run's


async def engine_rate(engine: Engine, n: int) -> float:
    """Decode tokens/s of one request through the engine, as `unikv run` measures it."""
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0)
    handle, first = engine.submit(PROMPT, params, chat=True), None
    async for _ in handle:
        first = first or time.perf_counter()
    return (n - 1) / (time.perf_counter() - first)


def loop_rate(engine: Engine, strategy: str, n: int) -> float:
    """Decode tokens/s of the benchmarks' loop over a new cache of `strategy` (as resolved)."""
    model, tok = engine.model, engine.tokenizer
    kv = build(model, tok, strategy)
    try:
        ids = prompt_ids(tok, model.cfg.vocab_size, PROMPT, chat=True)
        first = prefill(model, kv, ids, 0)
        return n / decode(model, kv, first, len(ids), n, 0)
    finally:
        kv.close()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--strategies", nargs="+", default=["auto", "full", "hybrid+resident+all"])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stream-interval-ms", type=float, default=RUN_STREAM_INTERVAL_MS,
                   help="the engine's (default: unikv run's, %(default)s)")  # fmt: skip
    p.add_argument("--decode-steps", type=int, nargs="+", default=[RUN_DECODE_STEPS, 1],
                   help="an engine for each (default: unikv run's, %(default)s, and one step "
                        "a turn)")  # fmt: skip
    a = p.parse_args()
    engines = {(s, k): await Engine.create(a.model, strategy=s, decode_steps=k,
                                           stream_interval_ms=a.stream_interval_ms)
               for s in a.strategies for k in a.decode_steps}  # fmt: skip
    resolved = {s: e.kv.name for (s, _), e in engines.items()}
    rates: dict[tuple[str, object], list[float]] = {}
    try:
        for r in range(a.rounds + 1):  # round 0 warms every path up
            for s in a.strategies:
                # The loop on the engine's compute thread too: torch work on a second thread
                # slows both (unikv.engine.compute's note on libgomp).
                e = engines[s, a.decode_steps[0]]
                got = [("loop", await compute.run(loop_rate, e, resolved[s], a.new_tokens))]
                got += [(k, await engine_rate(engines[s, k], a.new_tokens))
                        for k in a.decode_steps]  # fmt: skip
                for way, rate in got:
                    if r:
                        rates.setdefault((s, way), []).append(rate)
    finally:
        for e in engines.values():
            await e.close()
    rows = []
    for s in a.strategies:
        loop = statistics.median(rates[s, "loop"])
        for k in a.decode_steps:
            eng = statistics.median(rates[s, k])
            rows.append({"strategy": s, "as": resolved[s], "decode steps": k,
                         "engine tok/s": round(eng, 1), "loop tok/s": round(loop, 1),
                         "engine / loop": round(eng / loop, 3)})  # fmt: skip
    extra = {"cpu": cpu_name(), "kernels": native.isa(),
             "torch_capability": torch.backends.cpu.get_cpu_capability(),
             "new_tokens": a.new_tokens, "rounds": a.rounds}  # fmt: skip
    report("decode through make run's path (the engine) and the benchmarks' loop (one step a "
           "call)", rows, ["strategy", "as", "decode steps", "engine tok/s", "loop tok/s",
                           "engine / loop"], extra)  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
