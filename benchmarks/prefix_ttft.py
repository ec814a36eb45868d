"""Time to first token of a prompt whose KV is recomputed, found in host memory, or read from
the SSD tier's persistent prefix cache (`hierarchical_offload`), and the break-even length.

For each prompt length, rounds alternate (median of `--repeats`, after a warm-up round):
- recompute: a fresh engine and cache, nothing cached: the whole prompt is prefilled;
- host_hit: the same prompt a second time in the same engine: its blocks are found in the
  pool's in-memory prefix cache (the newest 1,024 tokens on the device tier, the rest in the
  host tier), only the last token is computed;
- ssd_hit: a fresh engine and cache (as a new process has) over the store a previous run wrote
  through, with the store's file evicted from the page cache: the blocks are attached from
  disk and read by the prefetcher for the last token's attention.
Each time is one `Engine.generate` of one token, from submit to completion. Lengths are one
more than a multiple of the 64-token block, so a hit covers all but the last token (at 1,024
tokens a hit would leave the last, partial block's 64 tokens to compute). The break-even is
the prompt length below which an SSD hit is slower than recomputing (interpolated between the
measured lengths); `min_disk_hit_tokens` should be set to it on this kind of machine.

    python benchmarks/prefix_ttft.py [--lengths 65 129 257 513 1025 4097] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from benchmarks.kv_quant_speed import context_ids  # noqa: E402
from unikv.engine.assembly import build_kv  # noqa: E402
from unikv.engine.engine import Engine  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.sampling import SamplingParams  # noqa: E402
from unikv.settings.config import PoolConfig, TierConfig  # noqa: E402

ONE = SamplingParams(max_new_tokens=1, ignore_eos=True)


def strategy(model, store: Path, **options):
    tiers = (TierConfig("device", 2 << 30), TierConfig("host", 2 << 30),
             TierConfig("ssd", 4 << 30, path=str(store)))  # fmt: skip
    opts = {"device_window": 1024, "host_window": 1 << 20, "min_disk_hit_tokens": 0, **options}
    spec = model.kv_spec()
    return build_kv(spec, "hierarchical_offload", PoolConfig(tiers=tiers),
                              options=opts).strategy  # fmt: skip


async def ttft(engine: Engine, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    await engine.generate(prompt, ONE)
    return time.perf_counter() - t0


async def measure(model, tok, prompt: list[int], root: Path, rnd: int) -> dict[str, float]:
    out = {}
    # recompute, writing the prompt through to a store for ssd_hit (write-through runs on a
    # background thread after the token; it is excluded by waiting for it before ssd_hit)
    store = root / f"{len(prompt)}-{rnd}"
    kv = strategy(model, store)
    async with Engine(model, tok, kv=kv) as e:
        out["recompute"] = await ttft(e, prompt)
        out["host_hit"] = await ttft(e, prompt)
        hits = kv.stats().pool.prefix.hits
    kv.close()
    assert hits >= (len(prompt) - 1) // kv.pool.block_size, "host_hit did not hit"
    kv = strategy(model, store)
    kv.ssd.store.drop_page_cache()
    async with Engine(model, tok, kv=kv) as e:
        out["ssd_hit"] = await ttft(e, prompt)
    disk = kv.stats().placement["disk_prefix_hits"]
    kv.close()
    assert disk["blocks"] == (len(prompt) - 1) // kv.pool.block_size, disk
    shutil.rmtree(store, ignore_errors=True)
    return out


def break_even(rows: list[dict]) -> float | None:
    """Prompt length where ssd_hit stops being slower than recompute (linear interpolation);
    None when the disk hit wins (or loses) at every measured length."""
    pts = [(r["tokens"], r["ssd_hit_ms"] - r["recompute_ms"]) for r in rows]
    for (n0, d0), (n1, d1) in zip(pts, pts[1:], strict=False):
        if d0 > 0 >= d1:
            return n0 + (n1 - n0) * d0 / (d0 - d1)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[65, 129, 257, 513, 1025, 4097])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2", progress=False)
    root = Path(tempfile.mkdtemp(prefix="unikv-ttft-", dir=args.dir))
    rows = []
    try:
        for n in sorted(args.lengths):
            prompt = context_ids(tok, n)
            samples: dict[str, list[float]] = {}
            for rnd in range(args.repeats + 1):
                got = asyncio.run(measure(model, tok, prompt, root, rnd))
                if rnd:  # round 0 warms up
                    for k, v in got.items():
                        samples.setdefault(k, []).append(v)
            med = {k: statistics.median(v) * 1000 for k, v in samples.items()}
            rows.append({
                "tokens": n,
                "recompute_ms": med["recompute"],
                "host_hit_ms": med["host_hit"],
                "ssd_hit_ms": med["ssd_hit"],
                "ssd_speedup": med["recompute"] / med["ssd_hit"],
                "host_speedup": med["recompute"] / med["host_hit"],
            })  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(
        "prefix_ttft",
        rows,
        ["tokens", "recompute_ms", "host_hit_ms", "ssd_hit_ms", "ssd_speedup", "host_speedup"],
        {"break_even_tokens": break_even(rows), "repeats": args.repeats},
    )


if __name__ == "__main__":
    main()
