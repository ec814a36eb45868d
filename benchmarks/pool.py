"""The unified memory pool's figures (issue 3), each against a baseline in the same process.

1. allocate+free latency: `TierAllocator` 1-block ops (see pool_alloc.py; baseline list.pop/
   append) and the pool-level `reserve` of one block + `free` of the sequence.
2. internal waste on 1,000 seeded requests of realistic lengths (see pool_alloc.py).
3. engine decode speed with paged `full` KV in pool blocks vs the contiguous per-sequence cache
   it replaced: batch 1 (512-token prompt) and 8 concurrent requests (prompts 64-1024 tokens),
   64 new tokens each, interleaved after warm-up, median of repeats.
4. time to first token of a request whose 1,024-token prompt is already in the prefix cache vs
   the same engine computing a fresh 1,024-token prompt (interleaved, median).

    python benchmarks/pool.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import interleaved, report  # noqa: E402
from benchmarks.pool_alloc import latency, waste  # noqa: E402
from unikv.engine import compute  # noqa: E402
from unikv.engine.assembly import assemble_for  # noqa: E402
from unikv.engine.engine import Engine  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.sampling import SamplingParams  # noqa: E402
from unikv.kvstrategies.kv import ContiguousKVCache  # noqa: E402

TEXT = Path(__file__).resolve().parent / "texts" / "GPL-3.txt"


def _full_kv(model):
    """The `full` strategy over the default pool, as the engine builds it by default."""
    return assemble_for(model, strategy="full").kv.strategy


def pool_latency(iters: int = 20000) -> dict:
    """p50/p99 of UnifiedMemoryPool.reserve(seq, one block) + free(seq), in µs."""
    import torch

    from unikv.memory.layout import BLOCKS, ArenaSpec, BlockLayout
    from unikv.memory.pool import UnifiedMemoryPool
    from unikv.settings.config import PoolConfig, TierConfig

    layout = BlockLayout(16, (ArenaSpec("kv", torch.float32, (BLOCKS, 16)),))
    pool = UnifiedMemoryPool(
        PoolConfig(tiers=(TierConfig("device", 4096 * layout.page_bytes),)), layout
    )
    for i in range(2048):  # half full, as in pool_alloc
        pool.reserve(("resident", i), 16)
    samples = []
    for i in range(iters + 2000):
        t0 = time.perf_counter_ns()
        pool.reserve(i, 16)
        pool.free(i)
        if i >= 2000:
            samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return {
        "pool_reserve_free_p50_us": samples[len(samples) // 2] / 1e3,
        "pool_reserve_free_p99_us": samples[int(len(samples) * 0.99)] / 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    lat = latency(200_000, 16)
    lat |= pool_latency()
    w = waste(16)

    model, tok = compute.run_sync(load_model, "smollm2", "float32", "cpu", False)
    cfg = model.cfg
    text = TEXT.read_text() if TEXT.exists() else ("The quick brown fox jumps over the dog. " * 900)
    ids = tok.encode(text)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    one = ids[:512]
    eight = [
        ids[i * 50 : i * 50 + n] for i, n in enumerate([64, 96, 128, 200, 300, 450, 700, 1024])
    ]

    loop = asyncio.new_event_loop()
    contiguous = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    paged_kv = compute.run_sync(_full_kv, model)
    # Prefix sharing is off for the speed comparison: both engines compute every token.
    engines = {
        "paged": loop.run_until_complete(_engine(model, tok, paged_kv, prefix_sharing=False)),
        "contiguous": loop.run_until_complete(_engine(model, tok, contiguous)),
    }

    def run(name, prompts):
        def go():
            e = engines[name]
            outs = loop.run_until_complete(_all(e, prompts, params))
            assert all(len(o.token_ids) == 64 for o in outs)

        return go

    t1 = interleaved({n: run(n, [one]) for n in engines}, args.repeats)
    t8 = interleaved({n: run(n, eight) for n in engines}, max(2, args.repeats // 2))

    # Time to first token: prefix hit vs computing the prompt.
    ttft_engine = loop.run_until_complete(_engine(model, tok, compute.run_sync(_full_kv, model)))
    first = SamplingParams(max_new_tokens=1, ignore_eos=True)
    cold, warm = [], []
    for r in range(args.repeats + 1):
        prompt = ids[2000 + r * 40 : 2000 + r * 40 + 1024] if len(ids) > 3300 else ids[:1024]
        prompt = [tok.bos_id or 1, *prompt[1:]] if r % 2 else prompt  # a fresh prefix each round
        t0 = time.perf_counter()
        loop.run_until_complete(ttft_engine.generate(prompt, first))
        t_cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        loop.run_until_complete(ttft_engine.generate(prompt, first))
        t_warm = time.perf_counter() - t0
        if r:  # the first round warms up
            cold.append(t_cold)
            warm.append(t_warm)
    for e in [*engines.values(), ttft_engine]:
        loop.run_until_complete(e.close())

    ttft_cold, ttft_warm = statistics.median(cold), statistics.median(warm)

    def row(figure, value, baseline, goal):
        return {"figure": figure, "value": value, "baseline": baseline, "goal": goal}

    rows = [
        row("TierAllocator alloc p99 (µs)", lat["alloc_p99_us"], lat["base_alloc_p99_us"], "<= 5"),
        row("TierAllocator free p99 (µs)", lat["free_p99_us"], lat["base_free_p99_us"], "<= 5"),
        row("pool reserve+free p99 (µs)", lat["pool_reserve_free_p99_us"], None, "<= 5"),
        row("internal waste at request end", w["waste_final"], None, "<= 0.04"),
        row(
            "decode batch 1, paged / contiguous speed",
            t1["contiguous"] / t1["paged"],
            f"contiguous {64 / t1['contiguous']:.1f} tok/s",
            ">= 0.95",
        ),
        row(
            "decode 8 requests, paged / contiguous speed",
            t8["contiguous"] / t8["paged"],
            f"contiguous {512 / t8['contiguous']:.1f} tok/s",
            ">= 0.95",
        ),
        row(
            "TTFT 1,024-token prompt, fresh / prefix hit",
            ttft_cold / ttft_warm,
            f"fresh {ttft_cold * 1000:.0f} ms",
            ">= 5",
        ),
    ]
    report(
        "pool",
        rows,
        ["figure", "value", "baseline", "goal"],
        {"allocator": lat, "waste": w, "ttft_hit_ms": ttft_warm * 1000},
    )


async def _all(engine, prompts, params):
    return await asyncio.gather(*(engine.generate(p, params) for p in prompts))


async def _engine(model, tok, kv, prefix_sharing: bool = True) -> Engine:
    return Engine(
        model, tok, kv=kv, max_batch=8, max_step_tokens=512, prefix_sharing=prefix_sharing
    )


if __name__ == "__main__":
    main()
