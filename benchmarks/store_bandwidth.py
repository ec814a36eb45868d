"""Cold random-read bandwidth of the LMDB block store against the raw disk, same file, same run.

Writes a store of 737,280-byte blocks (one SmolLM2 fp32 KV block of 16 tokens: 30 layers x 2 x
3 KV heads x 64 dims x 16 tokens x 4 bytes) and of 64 KiB blocks into a temporary directory,
then, for each thread count, in interleaved rounds (median of the repeats):
- raw: O_DIRECT `preadv` of block-sized, 4 KiB-aligned random ranges of the store's own
  data.mdb into page-aligned (mmap) buffers, one fd shared by the threads: the disk's ceiling;
- store: `get` of a random sample of the blocks (a quarter of them, so readahead that fetches
  neighbours is charged for it instead of turning into later cache hits), the threads sharing
  one store, with the page cache dropped before each run (see `drop_cache`), under three
  settings: readahead off + location-hint prefetch (the default; once with `get`, once with
  `get_many` of 8 keys per call, once with `read_into` of 8 keys per call: one `preadv` per
  value straight into the caller's buffer, what the SSD tier uses), readahead on without hints
  (LMDB's own default), readahead off without hints.
Reports MB/s of payload, the store's fraction of raw at the same thread count, and the read
amplification (bytes the device read, from /proc/diskstats, per payload byte).

    python benchmarks/store_bandwidth.py [--blocks 1024] [--small 8192] [--threads 1,4,16]

Disk use: about 1.2 GiB written, deleted at the end. Measures only; the goal (store >= 80% of
raw) is reported, never asserted.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from unikv.storage.lmdb_store import LmdbBlockStore  # noqa: E402

BIG = 737_280
SMALL = 64 * 1024
GOAL = 0.80
CONFIGS = {  # name -> (LmdbBlockStore options, keys per get_many call; 1 = plain `get`)
    "hints": ({"readahead": False, "prefetch": True}, 1),
    "hints_b8": ({"readahead": False, "prefetch": True}, 8),
    "into_b8": ({"readahead": False, "prefetch": True}, -8),  # read_into, 8 keys per call
    "ra_on": ({"readahead": True, "prefetch": False}, 1),
    "ra_off": ({"readahead": False, "prefetch": False}, 1),
}


def drop_cache(data_file: Path) -> str:
    """Empty the page cache (the store must be closed: mapped pages are never dropped)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return "drop_caches"
    except OSError:
        fd = os.open(data_file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return "fadvise_dontneed"


def device_reads(path: Path) -> int | None:
    """Bytes read so far by the block device holding `path` (None if not found)."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if int(p[0]) == major and int(p[1]) == minor:
                return int(p[5]) * 512
    return None


def run_threads(work, shares: list[list]) -> float:
    """Seconds for `work(share)` on every share at once, one thread each."""
    with ThreadPoolExecutor(len(shares)) as ex:
        t0 = time.perf_counter()
        list(ex.map(work, shares))
        return time.perf_counter() - t0


def raw_read(data_file: Path, size: int, count: int, threads: int) -> tuple[float, float]:
    """(MB/s, amplification) of O_DIRECT reads of `count` random `size`-byte ranges."""
    file_size = os.path.getsize(data_file)
    offsets = [random.randrange((file_size - size) // 4096) * 4096 for _ in range(count)]
    drop_cache(data_file)
    fd = os.open(data_file, os.O_RDONLY | os.O_DIRECT)

    def work(share: list[int]) -> None:
        buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT requires
        for off in share:
            if os.preadv(fd, [buf], off) != size:
                raise RuntimeError(f"short O_DIRECT read at {off}")

    try:
        before = device_reads(data_file)
        dt = run_threads(work, [offsets[i::threads] for i in range(threads)])
        after = device_reads(data_file)
    finally:
        os.close(fd)
    amp = (after - before) / (count * size) if before is not None else float("nan")
    return count * size / dt / 1e6, amp


def store_read(
    path: Path, keys: list[bytes], size: int, threads: int, opts: dict, batch: int
) -> tuple[float, float]:
    """(MB/s, amplification) of cold reads of `keys` from the store opened with `opts`."""
    drop_cache(path / "data.mdb")
    with LmdbBlockStore(path, **opts) as store:

        def work(share: list[bytes]) -> None:
            bufs = [[bytearray(size)] for _ in range(abs(batch))]
            for i in range(0, len(share), abs(batch)):
                chunk = share[i : i + abs(batch)]
                if batch < 0:  # read_into: straight into buffers allocated once per thread
                    ok = store.read_into(chunk, bufs[: len(chunk)])
                else:
                    got = [store.get(chunk[0])] if batch == 1 else store.get_many(chunk)
                    ok = [v is not None and len(v) == size for v in got]
                if not all(ok):
                    raise RuntimeError(f"a block of {[k.hex() for k in chunk]} did not read back")

        before = device_reads(path)
        dt = run_threads(work, [keys[i::threads] for i in range(threads)])
        after = device_reads(path)
    amp = (after - before) / (len(keys) * size) if before is not None else float("nan")
    return len(keys) * size / dt / 1e6, amp


def write_store(path: Path, n_big: int, n_small: int) -> dict:
    """Fill the store with random blocks; its write bandwidth (informative, puts only)."""
    rng = random.Random(0)
    out = {}
    with LmdbBlockStore(path, map_size=2 << 30) as store:
        for prefix, size, n in ((b"B", BIG, n_big), (b"S", SMALL, n_small)):
            batch = max(1, (8 << 20) // size)  # ~8 MB per transaction
            seconds = 0.0
            for start in range(0, n, batch):
                items = [
                    (prefix + i.to_bytes(8, "big"), rng.randbytes(size))
                    for i in range(start, min(n, start + batch))
                ]
                t0 = time.perf_counter()
                store.put_many(items)
                seconds += time.perf_counter() - t0
            out[f"write_MBps_{size}"] = n * size / seconds / 1e6 if n else None
        out["store_file_bytes"] = store.stats()["file_bytes"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1024, help="737,280-byte blocks to write")
    ap.add_argument("--small", type=int, default=8192, help="64 KiB blocks to write")
    ap.add_argument("--threads", default="1,4,16", help="reader thread counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp", help="where the temporary store goes")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    random.seed(1)
    root = Path(tempfile.mkdtemp(prefix="unikv-bw-", dir=args.dir))
    path = root / "store"
    try:
        extra = write_store(path, args.blocks, args.small)
        method = drop_cache(path / "data.mdb")
        samples: dict[tuple, list[tuple[float, float]]] = {}
        for _ in range(args.repeats):
            for size, prefix, n in ((BIG, b"B", args.blocks), (SMALL, b"S", args.small)):
                for t in threads:
                    count = max(t, n // 4)
                    samples.setdefault((size, t, "raw"), []).append(
                        raw_read(path / "data.mdb", size, count, t)
                    )
                    for name, (opts, batch) in CONFIGS.items():
                        keys = [
                            prefix + i.to_bytes(8, "big") for i in random.sample(range(n), count)
                        ]
                        samples.setdefault((size, t, name), []).append(
                            store_read(path, keys, size, t, opts, batch)
                        )
        rows = []
        for size in (BIG, SMALL):
            for t in threads:
                med = {
                    name: (
                        statistics.median(s[0] for s in samples[(size, t, name)]),
                        statistics.median(s[1] for s in samples[(size, t, name)]),
                    )
                    for name in ("raw", *CONFIGS)
                }
                rows.append(
                    {
                        "block_bytes": size,
                        "threads": t,
                        "raw_MBps": med["raw"][0],
                        **{f"{name}_MBps": med[name][0] for name in CONFIGS},
                        "hints/raw": med["hints"][0] / med["raw"][0],
                        "hints_b8/raw": med["hints_b8"][0] / med["raw"][0],
                        "ra_on/raw": med["ra_on"][0] / med["raw"][0],
                        "ra_off/raw": med["ra_off"][0] / med["raw"][0],
                        **{f"{name}_amp": med[name][1] for name in CONFIGS},
                    }
                )
        best = {
            size: max(r["hints_MBps"] for r in rows if r["block_bytes"] == size)
            / max(r["raw_MBps"] for r in rows if r["block_bytes"] == size)
            for size in (BIG, SMALL)
        }
        columns = ["block_bytes", "threads", "raw_MBps", *(f"{n}_MBps" for n in CONFIGS)]
        columns += [
            "hints/raw",
            "hints_b8/raw",
            "ra_on/raw",
            "ra_off/raw",
            *(f"{n}_amp" for n in CONFIGS),
        ]
        report(
            "store_bandwidth",
            rows,
            columns,
            {
                "cold_cache_method": method,
                "goal_store_over_raw": GOAL,
                "best_hints_over_best_raw": {str(k): v for k, v in best.items()},
                "repeats": args.repeats,
                "sample_fraction": 0.25,
                **extra,
            },
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
