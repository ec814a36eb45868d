"""The remote tier's figures (issue 18), all measured in one run against a local redis-server.

1. TTFT in "process B" for a prompt "process A" computed: recompute (fresh engine, nothing
   cached) vs remote hit through Redis on loopback vs the file store, for each `--lengths`.
   B is a fresh strategy, pool and empty SSD directory in this process (what a new process
   has; the model stays loaded so weights loading is not timed); A wrote the prompt through and
   waited for its remote writes. Goal: remote hit >= 5x faster than recompute at 4K.
2. Store throughput for block-sized values: `RedisBlockStore.put_many` / `get_many` with
   batches of `--pipeline` values vs `redis-benchmark -t set,get -d SIZE -P PIPELINE` on the same
   server, same value size and depth, in the same run. Goal >= 70% of it.
3. Write-through cost on decode: ms per decoded token after a prompt, with the remote tier vs
   the same config without it (interleaved rounds, median). Goal <= 1.05x.

    python benchmarks/remote_tier.py [--lengths 1025 4097] [--repeats 3] [--pipeline 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from benchmarks.kv_quant_speed import context_ids  # noqa: E402
from unikv.engine.assembly import create_kv  # noqa: E402
from unikv.engine.engine import Engine  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.sampling import SamplingParams  # noqa: E402
from unikv.settings.config import PoolConfig, TierConfig  # noqa: E402
from unikv.storage import open_url  # noqa: E402

PASSWORD = "unikv-bench"
ONE = SamplingParams(max_new_tokens=1, ignore_eos=True)


class Server:
    """A redis-server on a free loopback port in a temporary directory (stopped on exit)."""

    def __init__(self, root: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(root),
             "--requirepass", PASSWORD, "--save", "", "--appendonly", "no",
             "--maxmemory", "8gb", "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while self.cli("PING").strip() != "PONG":
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        self.url = f"redis://:{PASSWORD}@127.0.0.1:{self.port}/0"

    def cli(self, *args: str) -> str:
        env = {**os.environ, "REDISCLI_AUTH": PASSWORD}
        return subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True,
                              text=True, env=env).stdout  # fmt: skip

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def strategy(model, ssd: Path, url: str | None):
    tiers = [TierConfig("device", 2 << 30), TierConfig("host", 2 << 30),
             TierConfig("ssd", 4 << 30, path=str(ssd))]  # fmt: skip
    if url is not None:
        tiers.append(TierConfig("remote", 8 << 30, path=url))
    opts = {"device_window": 1024, "host_window": 1 << 20, "min_disk_hit_tokens": 0}
    return create_kv("hierarchical_offload", model.kv_spec(), PoolConfig(tiers=tuple(tiers)), opts)


async def ttft(model, tok, kv, prompt: list[int]) -> float:
    async with Engine(model, tok, kv=kv) as e:
        t0 = time.perf_counter()
        await e.generate(prompt, ONE)
        return time.perf_counter() - t0


def ttft_round(model, tok, prompt, root: Path, urls: dict[str, str], rnd: int) -> dict:
    """One round: A computes and shares through each URL, then B's TTFT per case."""
    out = {}
    for case, url in urls.items():
        a = strategy(model, root / f"a-{case}-{len(prompt)}-{rnd}", url)
        asyncio.run(ttft(model, tok, a, prompt))  # (a remote hit itself after round 0)
        a.remote_writer.wait_writes()
        wrote = (a.remote_writer.blocks_written, a.remote_writer.blocks_dropped,
                 a.remote.breaker.reason, dict(a.remote.counts))  # fmt: skip
        a.close()
        b = strategy(model, root / f"b-{case}-{len(prompt)}-{rnd}", url)
        out[case] = asyncio.run(ttft(model, tok, b, prompt))
        hits = b.stats().placement["disk_prefix_hits"].get("remote_blocks", 0)
        b.close()
        assert hits == (len(prompt) - 1) // b.pool.block_size, (case, rnd, len(prompt), hits, wrote)
    fresh = strategy(model, root / f"r-{len(prompt)}-{rnd}", None)
    out["recompute"] = asyncio.run(ttft(model, tok, fresh, prompt))
    fresh.close()
    return out


def store_throughput(server: Server, size: int, pipeline: int, n: int, repeats: int) -> dict:
    """MB/s of put_many/get_many in batches of `pipeline` vs redis-benchmark SET/GET: both over
    the same `n` keys, after one untimed pass each (so both overwrite values that exist and
    read from warm connections); the median of `repeats` timed passes."""
    value = os.urandom(size)
    keys = [i.to_bytes(8, "little") * 4 for i in range(n)]
    env = {**os.environ, "REDISCLI_AUTH": PASSWORD}
    # -r n: random keys over n names, as ours are n distinct keys (without it every SET
    # overwrites one key and every GET reads that one cache-hot value).
    cmd = ["redis-benchmark", "-p", str(server.port), "-a", PASSWORD, "-t", "set,get",
           "-d", str(size), "-P", str(pipeline), "-n", str(n), "-r", str(n), "-c", "1",
           "--csv"]  # fmt: skip
    ours: dict[str, list[float]] = {"put": [], "get": []}
    peer: dict[str, list[float]] = {"SET": [], "GET": []}
    mb = size * n / 1e6
    with open_url(server.url, namespace="bench") as s:
        for rnd in range(repeats + 1):
            t0 = time.perf_counter()
            for i in range(0, n, pipeline):
                s.put_many([(k, value) for k in keys[i : i + pipeline]])
            put_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(0, n, pipeline):
                s.get_many(keys[i : i + pipeline])
            get_s = time.perf_counter() - t0
            csv = subprocess.run(cmd, capture_output=True, text=True, env=env).stdout
            if not rnd:
                continue  # the untimed pass
            ours["put"].append(mb / put_s)
            ours["get"].append(mb / get_s)
            for line in csv.splitlines()[1:]:
                cells = [c.strip('"') for c in line.split(",")]
                peer[cells[0]].append(float(cells[1]) * size / 1e6)
        s.clear()
    put, get = statistics.median(ours["put"]), statistics.median(ours["get"])
    peer_put, peer_get = statistics.median(peer["SET"]), statistics.median(peer["GET"])
    return {
        "value_bytes": size,
        "pipeline": pipeline,
        "put_MBps": put,
        "get_MBps": get,
        "redis_benchmark_set_MBps": peer_put,
        "redis_benchmark_get_MBps": peer_get,
        "put_ratio": put / peer_put,
        "get_ratio": get / peer_get,
    }


def decode_cost(model, tok, root: Path, url: str, repeats: int, new_tokens: int) -> dict:
    """ms per decoded token with and without the remote tier, interleaved rounds."""
    prompt = context_ids(tok, 513)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)

    async def per_token(kv) -> float:
        async with Engine(model, tok, kv=kv) as e:
            await e.generate(prompt, ONE)  # the prompt: written through, then decode
            t0 = time.perf_counter()
            await e.generate(prompt + [prompt[-1]], params)
            return (time.perf_counter() - t0) / new_tokens

    samples: dict[str, list[float]] = {"no_remote": [], "remote": []}
    for rnd in range(repeats + 1):
        for case, u in (("no_remote", None), ("remote", url)):
            kv = strategy(model, root / f"d-{case}-{rnd}", u)
            t = asyncio.run(per_token(kv))
            kv.close()
            if rnd:
                samples[case].append(t)
    med = {k: statistics.median(v) * 1000 for k, v in samples.items()}
    return {"no_remote_ms_per_token": med["no_remote"], "remote_ms_per_token": med["remote"],
            "ratio": med["remote"] / med["no_remote"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1025, 4097])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pipeline", type=int, default=16)
    p.add_argument("--values", type=int, default=4000, help="values per throughput run")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dir", default=None, help="where stores go (default: a temp dir)")
    p.add_argument(
        "--parts",
        nargs="+",
        default=["ttft", "throughput", "decode"],
        choices=["ttft", "throughput", "decode"],
        help="which figures to measure",
    )
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2", progress=False)
    root = Path(tempfile.mkdtemp(prefix="unikv-remote-", dir=args.dir))
    server = Server(root / "redis")
    try:
        urls = {"redis_hit": server.url, "file_hit": f"file://{root}/shared"}
        rows = []
        for n in sorted(args.lengths) if "ttft" in args.parts else ():
            prompt = context_ids(tok, n)
            samples: dict[str, list[float]] = {}
            for rnd in range(args.repeats + 1):
                got = ttft_round(model, tok, prompt, root, urls, rnd)
                if rnd:  # round 0 warms up
                    for k, v in got.items():
                        samples.setdefault(k, []).append(v)
            med = {k: statistics.median(v) * 1000 for k, v in samples.items()}
            rows.append({"tokens": n, "recompute_ms": med["recompute"],
                         "redis_hit_ms": med["redis_hit"], "file_hit_ms": med["file_hit"],
                         "redis_speedup": med["recompute"] / med["redis_hit"],
                         "file_speedup": med["recompute"] / med["file_hit"]})  # fmt: skip
        # One value per (block, layer): the size the tier stores for this model.
        probe = strategy(model, root / "probe", None)
        size = probe.ssd.slice_bytes
        probe.close()
        throughput = decode = None
        if "throughput" in args.parts:
            throughput = store_throughput(server, size, args.pipeline, args.values, args.repeats)
        if "decode" in args.parts:
            decode = decode_cost(model, tok, root, server.url, args.repeats, args.new_tokens)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    report(
        "remote_tier",
        rows,
        ["tokens", "recompute_ms", "redis_hit_ms", "file_hit_ms", "redis_speedup", "file_speedup"],
        {"store_throughput": throughput, "decode_write_through": decode, "repeats": args.repeats},
    )
    print("store throughput:", throughput)
    print("decode write-through:", decode)


if __name__ == "__main__":
    main()
