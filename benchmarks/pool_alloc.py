"""Allocator microbenchmark: 1-block allocate/free latency and internal waste.

Latency: `TierAllocator.allocate(1)` then `free` of that block, each timed alone with
`time.perf_counter_ns`, after a warm-up, on a 4,096-block tier that is half full. The baseline
(same process, interleaved in rounds) is the least an allocator can do in Python: `list.pop` /
`list.append` on a free list. The cyclic GC is paused while timing (as `timeit` does) so
collections of unrelated garbage do not land in the percentiles; `timer_ns` is the cost of an
empty timed region, included in every figure.

Waste: 1,000 requests (seeded) run through `BlockTable` + `TierAllocator` one at a time:
prefill allocates the prompt's blocks, decode appends one token at a time and allocates a
block when the last one is full. Prompt lengths are lognormal with median 600 tokens
(sigma 0.75, clipped to 8..8192), output lengths lognormal with median 200 (sigma 0.8,
clipped to 1..4096). Waste = allocated but unfilled token slots / allocated slots, at each
request's end ("final") and averaged over every decode step ("during decode").

Prints one JSON line, then a table. Measures only; targets are reported, never asserted.
Run (with the project installed, as `make` does): python benchmarks/pool_alloc.py [--iters N]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import random
import time

from unikv.memory.allocator import BlockTable, TierAllocator

TARGET_P99_US = 5.0
TARGET_WASTE = 0.04


def percentile(sorted_ns: list[int], q: float) -> float:
    """The q-quantile (nearest rank) of sorted nanosecond samples, in microseconds."""
    idx = min(len(sorted_ns) - 1, max(0, math.ceil(q * len(sorted_ns)) - 1))
    return sorted_ns[idx] / 1e3


def time_unikv(alloc: TierAllocator, n: int, out_a: list[int], out_f: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        ids = alloc.allocate(1, "bench")
        t1 = clock()
        alloc.free(ids)
        t2 = clock()
        out_a.append(t1 - t0)
        out_f.append(t2 - t1)


def time_baseline(free_list: list[int], n: int, out_a: list[int], out_f: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        b = free_list.pop()
        t1 = clock()
        free_list.append(b)
        t2 = clock()
        out_a.append(t1 - t0)
        out_f.append(t2 - t1)


def timer_overhead(n: int) -> float:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        t0 = clock()
        t1 = clock()
        samples.append(t1 - t0)
    samples.sort()
    return percentile(samples, 0.5) * 1e3


def latency(iters: int, block_size: int, rounds: int = 10) -> dict:
    alloc = TierAllocator("device", 4096, block_size)
    alloc.allocate(2048, "resident")  # half full: the queue is not trivially short
    free_list = list(range(2048))
    ua: list[int] = []
    uf: list[int] = []
    ba: list[int] = []
    bf: list[int] = []
    time_unikv(alloc, 20_000, [], [])  # warm-up
    time_baseline(free_list, 20_000, [], [])
    per_round = max(1, iters // rounds)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):  # interleaved so drift hits both alike
            time_unikv(alloc, per_round, ua, uf)
            time_baseline(free_list, per_round, ba, bf)
        overhead = timer_overhead(100_000)
    finally:
        if gc_was_enabled:
            gc.enable()
    result = {"timer_ns": overhead}
    for name, samples in (("alloc", ua), ("free", uf), ("base_alloc", ba), ("base_free", bf)):
        samples.sort()
        result[f"{name}_p50_us"] = round(percentile(samples, 0.50), 3)
        result[f"{name}_p99_us"] = round(percentile(samples, 0.99), 3)
    result["samples"] = len(ua)
    return result


def request_lengths(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = int(min(8192, max(8, rng.lognormvariate(math.log(600), 0.75))))
        output = int(min(4096, max(1, rng.lognormvariate(math.log(200), 0.8))))
        out.append((prompt, output))
    return out


def waste(block_size: int, n: int = 1000, seed: int = 0) -> dict:
    reqs = request_lengths(n, seed)
    alloc = TierAllocator("device", math.ceil((8192 + 4096) / block_size) + 1, block_size)
    final_free = final_cap = step_free = step_cap = 0
    for i, (prompt, output) in enumerate(reqs):
        table = BlockTable(i, block_size)
        ids = alloc.allocate(table.slots_needed(prompt), i)
        assert ids is not None
        table.append_blocks("device", ids)
        table.append_tokens(prompt)
        for _ in range(output):
            need = table.slots_needed(1)
            if need:
                more = alloc.allocate(need, i)
                assert more is not None
                table.append_blocks("device", more)
            table.append_tokens(1)
            step_free += table.num_free_slots
            step_cap += table.capacity
        final_free += table.num_free_slots
        final_cap += table.capacity
        alloc.free(table.block_ids())
    prompts = sorted(p for p, _ in reqs)
    outputs = sorted(o for _, o in reqs)
    return {
        "requests": n,
        "seed": seed,
        "prompt_median": prompts[n // 2],
        "output_median": outputs[n // 2],
        "waste_final": round(final_free / final_cap, 5),
        "waste_during_decode": round(step_free / step_cap, 5),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200_000, help="timed allocate+free pairs")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    lat = latency(args.iters, args.block_size)
    w = waste(args.block_size)
    record = {
        "benchmark": "pool_alloc",
        "python": platform.python_version(),
        "block_size": args.block_size,
        **lat,
        **w,
        "target_p99_us": TARGET_P99_US,
        "target_waste": TARGET_WASTE,
        "meets_targets": max(lat["alloc_p99_us"], lat["free_p99_us"]) <= TARGET_P99_US
        and w["waste_final"] <= TARGET_WASTE,
    }
    print(json.dumps(record))
    print()
    print(f"{'1-block op':<12}{'p50 µs':>10}{'p99 µs':>10}{'baseline p50':>14}{'p99':>8}")
    for op in ("alloc", "free"):
        print(
            f"{op:<12}{lat[f'{op}_p50_us']:>10.3f}{lat[f'{op}_p99_us']:>10.3f}"
            f"{lat[f'base_{op}_p50_us']:>14.3f}{lat[f'base_{op}_p99_us']:>8.3f}"
        )
    print(f"(baseline: list.pop/append; timer overhead {lat['timer_ns']:.0f} ns per sample,")
    print(f" included; {lat['samples']} samples each; target p99 <= {TARGET_P99_US} µs)")
    print()
    print(
        f"internal waste, block size {args.block_size}, {w['requests']} requests "
        f"(median prompt {w['prompt_median']}, median output {w['output_median']}):"
    )
    print(f"  at request end   {w['waste_final']:.2%}   (target <= {TARGET_WASTE:.0%})")
    print(f"  during decode    {w['waste_during_decode']:.2%}")


if __name__ == "__main__":
    main()
