"""Decode step time of `hierarchical_offload` with its host and SSD tiers in use, against the
same strategy with every block on the device, same model, same process, interleaved.

For each context length, five caches prefill the same text, then decode `--new-tokens` greedy
tokens per round, rounds alternating device, host, host_stage, ssd, ssd_cold after a warm-up
round; the step time is the median over rounds.

- device: windows larger than the context (every block on the device tier): the compute-only
  step, and the baseline;
- host: the newest 1,024 tokens on the device, all older ones in the host tier, attended in
  place (a CPU reads host memory directly);
- host_stage: the same, with `host_access = "stage"`: host blocks are copied to a staging
  buffer by the prefetcher before attention, as an accelerator must;
- ssd: the default windows (1,024 device / 2,048 host / the rest on SSD, LMDB in a temporary
  directory on this machine's disk), the store's pages left in the page cache;
- ssd_cold: the same, with the store's file evicted from the page cache before every step
  (after the fetches in flight finish; the eviction itself is not timed): every SSD block is
  read from the disk each step.

"I/O only" is the time to fetch the ssd_cold step's SSD blocks, every layer, from a cold cache
through the store with the prefetcher's thread count and nothing else running: the pure I/O
time for the bytes read. "raw" is the disk's own ceiling for the same number of reads of the
same size (O_DIRECT, 16 threads, benchmarks/store_bandwidth.py), for context.
Goals (issue 5), reported, never asserted: host <= 1.05 x device; ssd_cold <= 1.1 x
max(device, I/O only).

    python benchmarks/offload_speed.py [--contexts 4096 8192] [--new-tokens 16] [--repeats 5]
        [--threads 2] [--prefetch-depth N] [--io-threads N]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from benchmarks.kv_quant_speed import context_ids, decode, prefill  # noqa: E402
from benchmarks.store_bandwidth import raw_read  # noqa: E402
from engine.assembly import build_kv  # noqa: E402
from engine.loading import load_model  # noqa: E402
from memory.config import PoolConfig, TierConfig  # noqa: E402

NAME = "hierarchical_offload"
HUGE = 1 << 20
CASES = {  # name -> (options, evict the store's pages before each step)
    "device": ({"device_window": HUGE}, False),
    "host": ({"device_window": 1024, "host_window": HUGE}, False),
    "host_stage": ({"device_window": 1024, "host_window": HUGE, "host_access": "stage"}, False),
    "ssd": ({}, False),
    "ssd_cold": ({}, True),
}


def build(model, store_dir: Path, options: dict, depth: int | None, threads: int | None = None):
    tiers = (TierConfig("device", 4 << 30), TierConfig("host", 4 << 30),
             TierConfig("ssd", 8 << 30, path=str(store_dir)))  # fmt: skip
    opts = {**options, "persist_prefix": False}
    if depth is not None:
        opts["prefetch_depth"] = depth
    if threads is not None:
        opts["io_threads"] = threads
    spec = model.kv_spec()
    built = build_kv(spec, NAME, PoolConfig(tiers=tiers), options=opts)
    return built.strategy


def evict(kv) -> float:
    """Evict the store's pages before a step: wait (timed) for the fetches in flight, then
    evict (untimed: set-up of the measurement, not work a deployment does per step)."""
    kv.prefetcher.drain()
    t0 = time.perf_counter()
    kv.ssd.store.drop_page_cache()
    return time.perf_counter() - t0


def io_only(kv, seq: int, threads: int) -> tuple[float, int]:
    """(seconds, bytes) to read every SSD block of `seq`, all layers, cold, as the
    prefetcher's threads would, with nothing else running."""
    ids = [r.block_id for r in kv.pool.table(seq).refs if r.tier == "ssd"]
    kv.ssd.store.drop_page_cache()
    layers = range(kv.spec.num_layers)
    with ThreadPoolExecutor(threads) as ex:
        t0 = time.perf_counter()
        list(ex.map(lambda layer: kv.ssd.read_slice(ids, layer), layers))
        seconds = time.perf_counter() - t0
    return seconds, len(ids) * kv.ssd.slice_bytes * kv.spec.num_layers


def raw_mbps(kv) -> float:
    """The disk's O_DIRECT bandwidth for reads of one SSD value's size (16 threads)."""
    count = sum(r.tier == "ssd" for r in kv.pool.table(0).refs) * kv.spec.num_layers
    return raw_read(kv.ssd.store.path / "data.mdb", kv.ssd.slice_bytes, count, 16)[0]


def run_context(model, tok, n: int, args, root: Path) -> list[dict]:
    # Decoding must stay inside the model's context (8,192 for SmolLM2: "8K" is 8,096 + 96).
    n = min(n, model.cfg.context_length - (args.repeats + 1) * args.new_tokens)
    ids = context_ids(tok, n)
    caches, firsts = {}, {}
    for name, (options, _) in CASES.items():
        kv = build(model, root / f"{n}-{name}", options, args.prefetch_depth, args.io_threads)
        firsts[name] = prefill(model, kv, ids, seq=0)
        caches[name] = kv
    pos = {name: n for name in CASES}
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    io: list[float] = []
    io_bytes = 0
    for r in range(args.repeats + 1):  # round 0 warms up
        for name, (_, cold) in CASES.items():
            kv = caches[name]
            hook = (lambda kv=kv: evict(kv)) if cold else None
            sec = decode(model, kv, firsts[name], pos[name], args.new_tokens, 0, hook)
            pos[name] += args.new_tokens
            if r:
                samples[name].append(sec / args.new_tokens)
        if r:
            sec, io_bytes = io_only(caches["ssd_cold"], 0, caches["ssd_cold"].opts["io_threads"])
            io.append(sec)
    step = {name: statistics.median(s) for name, s in samples.items()}
    io_s = statistics.median(io)
    raw = statistics.median(raw_mbps(caches["ssd_cold"]) for _ in range(3))
    rows = []
    for name, kv in caches.items():
        stats = kv.stats()
        pf = stats["prefetch"]
        row = {
            "context": n,
            "case": name,
            "step_ms": step[name] * 1000,
            "vs_device": step[name] / step["device"],
            "tokens_dev/host/ssd": "/".join(
                str(stats["tokens_by_tier"][t]) for t in ("device", "host", "ssd")
            ),  # fmt: skip
            "hit_ratio": pf["hit_ratio"],
            "wait_ms_per_step": None,
        }
        if pf["layers_fetched"]:
            steps = pf["layers_fetched"] / kv.spec.num_layers
            row["wait_ms_per_step"] = pf["wait_s"] * 1000 / steps
        if name == "ssd_cold":
            bound = max(step["device"], io_s)
            row["io_only_ms"] = io_s * 1000
            row["io_MBps"] = io_bytes / io_s / 1e6
            row["raw_MBps"] = raw
            row["vs_bound"] = step[name] / bound
            row["vs_raw_bound"] = step[name] / max(step["device"], io_bytes / raw / 1e6)
        rows.append(row)
        kv.close()
    caches.clear()
    gc.collect()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps per round")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up)")
    p.add_argument("--prefetch-depth", type=int, default=None,
                   help="layers fetched ahead (default: the cpu profile's)")  # fmt: skip
    p.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    p.add_argument("--io-threads", type=int, default=None, help="SSD reader threads")
    p.add_argument("--threads", type=int, default=2, help="torch compute threads (default 2)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2", progress=False)
    root = Path(tempfile.mkdtemp(prefix="unikv-offload-", dir=args.dir))
    rows = []
    try:
        for n in args.contexts:
            rows += run_context(model, tok, n, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    goals = {}
    for n in dict.fromkeys(r["context"] for r in rows):
        by = {r["case"]: r for r in rows if r["context"] == n}
        goals[n] = {
            "host_vs_device": by["host"]["vs_device"],
            "host_goal_met": by["host"]["vs_device"] <= 1.05,
            "ssd_cold_vs_bound": by["ssd_cold"]["vs_bound"],
            "ssd_goal_met": by["ssd_cold"]["vs_bound"] <= 1.1,
        }
    report(
        "offload_speed",
        rows,
        [
            "context",
            "case",
            "step_ms",
            "vs_device",
            "tokens_dev/host/ssd",
            "hit_ratio",
            "wait_ms_per_step",
            "io_only_ms",
            "io_MBps",
            "raw_MBps",
            "vs_bound",
            "vs_raw_bound",
        ],
        {"goals": goals, "new_tokens": args.new_tokens, "repeats": args.repeats},
    )


if __name__ == "__main__":
    main()
