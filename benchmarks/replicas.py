"""unikv's replica router against Ray Serve's default (power of two choices), same run.

Three replicas of the real model (one compute thread each, `full` KV) on a local Ray Serve take
the same open-loop workload under each router: Poisson arrivals, every prompt one of a few
shared prefixes (system prompts) plus its own question. A third of the way in, replica 0's
scripted sensor goes above the chip's throttle limit and, while hot, each of its engine steps
takes 30% longer (`ReplicaSpec.simulate_throttle`: the throttling the field deployment
measured); two thirds in, it cools down. Reported per router: p50/p99 latency and throughput
over the episode, requests lost (goal 0), the prefix-cache hit rate over all replicas (goal: at
least 2x the default router's), and where requests went while replica 0 was hot.

Then the Ray overhead: one replica through Ray against the same engine in this process, on the
same sequential requests (median latency ratio).

    python benchmarks/replicas.py [--rate 1.2] [--seconds 60] [--prefixes 24]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from unikv.engine.sampling import SamplingParams  # noqa: E402
from unikv.serving.replicas import Replicas, ReplicaSpec  # noqa: E402

LIMIT_C = 85.0  # the cpu profile's thermal_throttle_c
TOPICS = ["a lighthouse keeper", "a tea merchant", "a chess club", "a mountain railway",
          "a bakery at dawn", "a lost violin", "a river ferry", "a night market"]  # fmt: skip


def write_reading(sensors: Path, rank: int, celsius: float) -> None:
    """Replace a replica's scripted reading atomically (a reader never sees half a file)."""
    tmp = sensors / f".{rank}.tmp"
    tmp.write_text(str(celsius))
    os.replace(tmp, sensors / str(rank))


def prompts(tok, n_prefixes: int, n: int, seed: int) -> list[list[int]]:
    """`n` prompts, each a shared system prompt (~250 tokens) plus its own question."""
    rng = random.Random(seed)
    heads = []
    for k in range(n_prefixes):
        topic = TOPICS[k % len(TOPICS)]
        text = (f"System prompt {k}. You are a careful assistant who writes about {topic}. "
                + " ".join(f"Rule {i}: answer briefly about {topic}, plainly and kindly."
                           for i in range(18)))  # fmt: skip
        heads.append(tok.encode(text))
    return [heads[rng.randrange(n_prefixes)] + tok.encode(f" Question {i}: what happens next?")
            for i in range(n)]  # fmt: skip


async def episode(client, sensors: Path, ps: list[list[int]], rate: float, seconds: float,
                  seed: int) -> dict:  # fmt: skip
    """Open-loop arrivals for `seconds`; replica 0 hot in the middle third."""
    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    lat: list[float] = []
    lost = 0
    where_hot: dict[str, int] = {}
    hot = [False]

    async def one(ids: list[int]) -> None:
        nonlocal lost
        t0 = time.perf_counter()
        h = client.submit(ids, params)
        try:
            await h.result()
        except Exception:
            lost += 1
            return
        lat.append(time.perf_counter() - t0)
        if hot[0]:
            where_hot[h.replica] = where_hot.get(h.replica, 0) + 1

    before = client.memory_report()
    t_start = time.perf_counter()
    tasks, i, t = [], 0, 0.0
    while t < seconds:
        now = time.perf_counter() - t_start
        phase_hot = seconds / 3 <= now < 2 * seconds / 3
        if phase_hot != hot[0]:
            write_reading(sensors, 0, LIMIT_C + 2 if phase_hot else LIMIT_C - 25)
            hot[0] = phase_hot
        if now >= t:
            tasks.append(asyncio.ensure_future(one(ps[i % len(ps)])))
            i += 1
            t += rng.expovariate(rate)
        await asyncio.sleep(min(0.01, max(0.0, t - now)))
    write_reading(sensors, 0, LIMIT_C - 25)
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t_start
    after = client.memory_report()
    q = after.prefix.queries - before.prefix.queries
    hits = after.prefix.hits - before.prefix.hits
    lat.sort()
    return {
        "requests": i,
        "completed": len(lat),
        "lost": lost,
        "p50_s": statistics.median(lat),
        "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "throughput_rps": len(lat) / wall,
        "prefix_hit_rate": hits / q if q else 0.0,
        "while_hot": where_hot,
        "decisions": after["router"]["decisions"],
    }


def run_router(router: str, spec: ReplicaSpec, sensors: Path, args, ps) -> dict:
    for rank in range(3):
        write_reading(sensors, rank, 40)
    reps = Replicas(spec, 3, router=router)
    client = reps.start()
    try:
        reps.wait_reports()
        # Warm-up: every replica answers once (its first step pays for lazy set-up).
        warm = SamplingParams(max_new_tokens=2)

        async def warmup():
            await asyncio.gather(*(client.submit(p, warm).result() for p in ps[-6:]))

        asyncio.run(warmup())
        return asyncio.run(episode(client, sensors, ps, args.rate, args.seconds, args.seed))
    finally:
        reps.stop()


def ray_overhead(spec: ReplicaSpec, ps, n: int) -> dict:
    """Median latency of sequential requests: one replica through Ray vs the engine here."""
    import torch

    from unikv.engine.engine import Engine

    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    reqs = [p[-40:] for p in ps[:n]]  # short prompts: the fixed costs show

    async def direct() -> list[float]:
        torch.set_num_threads(spec.threads)
        out = []
        async with await Engine.create(spec.model, config=spec.config) as e:
            await e.generate(reqs[0], params)
            for r in reqs:
                t0 = time.perf_counter()
                await e.generate(r, params)
                out.append(time.perf_counter() - t0)
        return out

    async def via_ray(client) -> list[float]:
        await client.submit(reqs[0], params).result()
        out = []
        for r in reqs:
            t0 = time.perf_counter()
            await client.submit(r, params).result()
            out.append(time.perf_counter() - t0)
        return out

    here = statistics.median(asyncio.run(direct()))
    reps = Replicas(spec, 1)
    client = reps.start()
    try:
        ray = statistics.median(asyncio.run(via_ray(client)))
    finally:
        reps.stop()
    return {"direct_s": here, "ray_s": ray, "ratio": ray / here, "ms_added": (ray - here) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=1.2, help="arrivals per second")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument(
        "--prefixes",
        type=int,
        default=24,
        help="shared prefixes; their KV is twice what one replica's pool caches",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overhead-requests", type=int, default=12)
    args = p.parse_args()
    from unikv.engine.loading import load_tokenizer

    tok = load_tokenizer("smollm2")
    d = Path(tempfile.mkdtemp(prefix="unikv-replicas-"))
    sensors = d / "sensors"
    sensors.mkdir()
    cfg = d / "unikv.toml"
    # 128 MiB of `full` KV: ~2,900 tokens, a third of the 24 prefixes (~6,000 tokens) plus
    # the running requests. Affinity can keep each prefix on one replica; spreading them makes
    # every replica cycle through all of them.
    cfg.write_text('strategy = "full"\n[tiers.device]\ncapacity = "128MiB"\n'
                   "[thermal]\ninterval_s = 0.25\n")  # fmt: skip
    spec = ReplicaSpec(config=str(cfg), sensor=f"scripted:{sensors}", stats_period_s=0.25,
                       simulate_throttle=0.3)  # fmt: skip
    ps = prompts(tok, args.prefixes, 4096, args.seed)
    rows = []
    for router in ("power_of_two", "unikv"):
        r = run_router(router, spec, sensors, args, ps)
        rows.append({"router": router, **r})
        print(router, json.dumps(r), flush=True)
    base, ours = rows
    ratios = {
        "p99_ratio": ours["p99_s"] / base["p99_s"],
        "throughput_ratio": ours["throughput_rps"] / base["throughput_rps"],
        "hit_rate_ratio": (
            ours["prefix_hit_rate"] / base["prefix_hit_rate"] if base["prefix_hit_rate"] else None
        ),  # fmt: skip
    }
    overhead = ray_overhead(ReplicaSpec(config=str(cfg), sensor="none"), ps,
                            args.overhead_requests)  # fmt: skip
    report("replicas", rows,
           ["router", "requests", "completed", "lost", "p50_s", "p99_s", "throughput_rps",
            "prefix_hit_rate"],
           {"unikv_vs_power_of_two": ratios, "ray_overhead_one_replica": overhead,
            "rate": args.rate, "seconds": args.seconds, "prefixes": args.prefixes})  # fmt: skip
    print("unikv vs power of two:", ratios)
    print("Ray overhead, one replica:", overhead)


if __name__ == "__main__":
    main()
