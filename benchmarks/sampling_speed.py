"""Sampled decoding through the engine: the sampler before 2026-12-07 against today's, same process.

OpenAI's API samples at temperature 1 unless the client says otherwise, and a sampled request
decodes one step a turn (the engine's multi-step runs are greedy), so whatever the sampler costs
is added to every token such a request gets. Until 2026-12-07 `engine.sampling.sample` drew with
`torch.multinomial` (an exponential variate per vocabulary entry: about 1 ms over SmolLM2's
49,152 tokens on a 2-core AMD EPYC) and found a top-p nucleus by sorting every logit (3.4 ms),
and every sampled request decoded one step a turn. Now a draw takes one uniform number over
the cumulative weights, by gemv.c's `sample_row` on a CPU (`draw`: top-k and top-p by radix
selects on the weights, no sort), and sampled requests run several steps in one native call as
greedy ones do. The baseline is the
former sampler (`OLD` below) with no sampled request in a multi-step call.

For each case (greedy; temperature 0.8; with top_p 0.95; with top_k 50 and top_p 0.95) and
each `--clients` count, both samplers decode `--new-tokens` tokens of `unikv run`'s prompt per
request through the engine (`auto`, `unikv run`'s decode steps; that many requests at once, each
its own seed), alternating round by round; output tokens/s counts the tokens after each
request's first. Then each sampler alone over the logits of `--steps` real decode steps (the model's
greedy continuation of the same prompt), per call.

    python benchmarks/sampling_speed.py [--new-tokens 256] [--rounds 3] [--steps 64]
        [--clients 1 8]

`--a FOLDER` instead times two builds of gemv.c's draw in one process, over the same logits:
FOLDER's `gemv.c` (a copy taken before an edit) against the package's, each sampled case's
`sample_rows` per row, one row a call and all `--steps` rows in one call, the builds
alternating for `--rounds` rounds (the medians, the ratio before / now, and whether both drew
the same tokens).

    cp unikv/kernels/gemv.c /tmp/before/   # then edit the package's
    python benchmarks/sampling_speed.py --a /tmp/before --rounds 7
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
from benchmarks.kernel_ab import load_build  # noqa: E402
from benchmarks.kv_quant_speed import build  # noqa: E402
from benchmarks.run_speed import PROMPT  # noqa: E402
from unikv.cli.main import RUN_DECODE_STEPS  # noqa: E402
from unikv.engine import compute, stepping  # noqa: E402
from unikv.engine.engine import Engine  # noqa: E402
from unikv.engine.requests import prompt_ids  # noqa: E402
from unikv.engine.sampling import SamplingParams, greedy_token, penalized, sample  # noqa: E402
from unikv.engine.sampling import spec as spec_row  # noqa: E402
from unikv.kernels import gemv  # noqa: E402
from unikv.kvstrategies.kv import StepBatch  # noqa: E402

CASES = {
    "greedy": {"temperature": 0.0},
    "T 0.8": {"temperature": 0.8},
    "T 0.8, top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "T 0.8, top_k 50, top_p 0.95": {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
}


def OLD(logits, params, gen, seen=(), banned=()):  # noqa: N802 (the baseline, by name)
    """`engine.sampling.sample` as it was before 2026-12-07 (torch.multinomial, a full sort)."""
    x = penalized(logits, params, seen, banned)  # (unchanged since)
    if params.greedy:
        return greedy_token(x)
    x = x.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=gen))


SEQUENTIAL = Engine._sequential


def _greedy_runs_only(self, work) -> int:
    """The baseline's `Engine._sequential`: no sampled request in a multi-step call."""
    return 1 if any(not w.req.params.greedy for w in work) else SEQUENTIAL(self, work)


async def engine_rate(engine: Engine, n: int, case: dict, clients: int) -> float:
    """Output tokens/s of `clients` requests at once (each its own seed), from the first
    token of any to the last of all, the tokens after each request's first counted."""
    firsts: list[float] = []

    async def one(seed: int) -> None:
        params = SamplingParams(max_new_tokens=n, ignore_eos=True, seed=seed, **case)
        handle, first = engine.submit(PROMPT, params, chat=True), None
        async for _ in handle:
            if first is None:
                first = time.perf_counter()
                firsts.append(first)

    await asyncio.gather(*(one(i) for i in range(clients)))
    return clients * (n - 1) / (time.perf_counter() - min(firsts))


def step_logits(engine: Engine, steps: int) -> list[torch.Tensor]:
    """The last-position logits of the prompt and of `steps` greedy decode steps after it."""
    model, tok = engine.model, engine.tokenizer
    kv = build(model, tok, engine.kv.name)
    rows = []
    try:
        ids = prompt_ids(tok, model.cfg.vocab_size, PROMPT, chat=True)
        with torch.inference_mode():
            n = len(ids)
            logits = model.forward(torch.tensor(ids), torch.arange(n), kv,
                                   StepBatch([0], [n]), torch.tensor([n - 1]))  # fmt: skip
            for i in range(steps):
                rows.append(logits[-1].clone())
                token = greedy_token(logits[-1])
                logits = model.forward(torch.tensor([token]), torch.tensor([len(ids) + i]), kv,
                                       StepBatch([0], [1]))  # fmt: skip
    finally:
        kv.close()
    return rows


def per_call_us(fn, rows: list[torch.Tensor], case: dict) -> float:
    params = SamplingParams(seed=0, **case)
    gen = params.make_generator()
    fn(rows[0], params, gen)  # warm
    t0 = time.perf_counter()
    for x in rows:
        fn(x, params, gen)
    return (time.perf_counter() - t0) / len(rows) * 1e6


def draw_ab(folder: Path, rows: list[torch.Tensor], rounds: int) -> list[dict]:
    """Per sampled case, gemv.c's sample_rows per row under the build in `folder` ("before")
    and the package's ("now"), alternating `rounds` times over the same logits and numbers:
    one row a call (`sampling.draw`, a step a turn) and every row in one call (a multi-step
    run's sequences)."""
    builds = {"before": load_build(folder)[0], "now": load_build(Path(gemv.__file__).parent)[0]}
    x = torch.stack(rows)
    draws = torch.rand(len(rows), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = []
    try:
        for name, case in CASES.items():
            if not case.get("temperature"):
                continue  # (greedy: the argmax, no draw)
            spec = torch.tensor([spec_row(SamplingParams(**case))] * len(rows), dtype=torch.float64)
            row = {"case": name}
            for label, size in (("1 row", 1), (f"{len(rows)} rows", len(rows))):
                times: dict[str, list[float]] = {w: [] for w in builds}
                tokens: dict[str, list[torch.Tensor]] = {}
                for _ in range(rounds + 1):  # the first round warms both up, uncounted
                    for which, state in builds.items():
                        gemv._state = state
                        t0 = time.perf_counter()
                        tokens[which] = [gemv.sample_rows(x[i : i + size], spec[i : i + size],
                                                          draws[i : i + size])
                                         for i in range(0, len(rows), size)]  # fmt: skip
                        times[which].append((time.perf_counter() - t0) / len(rows) * 1e6)
                before, now = (statistics.median(times[w][1:]) for w in builds)
                same = bool(torch.equal(torch.cat(tokens["before"]), torch.cat(tokens["now"])))
                row |= {f"{label}: us before": round(before, 1), f"{label}: us now": round(now, 1),
                        f"{label}: before / now": round(before / now, 3),
                        f"{label}: same tokens": same}  # fmt: skip
            out.append(row)
    finally:
        gemv._state = builds["now"]
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=64, help="decode steps whose logits are sampled")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8],
                   help="requests at once (a batch of that many)")  # fmt: skip
    p.add_argument("--a", type=Path, metavar="FOLDER",
                   help="time the draw of FOLDER's gemv.c against the package's instead "
                        "(no engine rows)")  # fmt: skip
    a = p.parse_args()
    for name, least in (("new_tokens", 2), ("rounds", 1), ("steps", 1)):
        if getattr(a, name) < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(a, name)}")
    if min(a.clients) < 1:
        p.error(f"--clients must be at least 1, got {min(a.clients)}")
    if a.a is not None and not (a.a / "gemv.c").is_file():
        p.error(f"--a {a.a}: no gemv.c there")
    engine = await Engine.create(a.model, strategy="auto", decode_steps=RUN_DECODE_STEPS)
    if a.a is not None:
        try:
            rows_x = await compute.run(step_logits, engine, a.steps)
            rows = await compute.run(draw_ab, a.a, rows_x, a.rounds)
        finally:
            await engine.close()
        report("gemv.c's draw: two builds, us a row", rows, list(rows[0]),
               {"cpu": cpu_name(), "isa": gemv.isa(), "a": str(a.a), "steps": a.steps,
                "rounds": a.rounds})  # fmt: skip
        return
    samplers = {"before": OLD, "now": sample}
    rates: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(a.rounds + 1):  # round 0 warms every path up
            for name, case in CASES.items():
                for c in a.clients:
                    for which, fn in samplers.items():
                        stepping.sample = fn  # what the engine's steps call
                        # before: no sampled request ran in a multi-step call
                        Engine._sequential = SEQUENTIAL if which == "now" else _greedy_runs_only
                        rate = await engine_rate(engine, a.new_tokens, case, c)
                        if r:
                            rates.setdefault((name, c, which), []).append(rate)
        rows_x = await compute.run(step_logits, engine, a.steps)
        calls = {(name, which): await compute.run(per_call_us, fn, rows_x, case)
                 for name, case in CASES.items() for which, fn in samplers.items()}  # fmt: skip
    finally:
        stepping.sample, Engine._sequential = sample, SEQUENTIAL
        await engine.close()
    rows = []
    for name in CASES:
        for c in a.clients:
            before, now = (statistics.median(rates[name, c, w]) for w in samplers)
            rows.append({"case": name, "clients": c, "before tok/s": round(before, 1),
                         "now tok/s": round(now, 1), "now / before": round(now / before, 3),
                         "sampler us before": round(calls[name, "before"], 1),
                         "sampler us now": round(calls[name, "now"], 1)})  # fmt: skip
    report("sampled decode through the engine: the former sampler and today's", rows,
           ["case", "clients", "before tok/s", "now tok/s", "now / before",
            "sampler us before", "sampler us now"],
           {"cpu": cpu_name(), "strategy": engine.kv.name, "decode_steps": RUN_DECODE_STEPS,
            "new_tokens": a.new_tokens, "rounds": a.rounds, "steps": a.steps})  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
