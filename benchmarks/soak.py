"""Soak `unikv serve`: a set time of good, bad, cancelled and disconnected requests beside a
canary, and a report of what the service did with them (issue 31; not part of `make test`).

    python benchmarks/soak.py [--minutes 30] [--window-s 300] [--workers 4]
                              [--device-capacity 64MiB] [--report FILE] [--report-dir DIR]

One `unikv serve` (the auto strategy, native weights, as shipped) on a free port, its device
tier `--device-capacity` (default 64 MiB: the tier's arena is mapped lazily and the cache cycles
through all its blocks, so its pages count in RSS as the cache fills, up to the capacity; a
small tier is filled in the first window, and what RSS does after that is the process's own;
`--device-capacity default` keeps the shipped 1 GiB); `--workers` clients loop until the
time is up, each request drawn at random (seeded):
- good (50%): a completion or chat request, greedy or sampled, streamed or not, 8-48 tokens;
- bad (20%): a hostile body from a fixed list (a text/plain POST, JSON nested 100,000 deep, a
  311-digit priority, a seed of 2**64, a lone surrogate, another model's name, mistyped fields, a
  temperature of 1e-300 — that one is valid and must answer 200);
- cancelled (10%): a stream the client closes after its first chunk;
- disconnected (10%): a non-streamed request whose client gives up after 0.3 s;
- canary (10%): a greedy request whose text must equal its solo run before the soak.

Reported: requests by outcome, canary mismatches (goal 0), 5xx (goal 0), per window the
latency p50 / p99 of the good requests and the server's RSS and open files (goal: flat; the
slopes are fitted over the windows), and the KV bytes the pool holds once the load has
stopped (goal 0). A table, one JSON line, and the JSON in `--report`. With `--report-dir`,
the server writes its own health report per window there (`unikv serve --report-dir`: an
HTML page and a JSON file each, with the advice it gave).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.decode_profile import cpu_name  # noqa: E402
from benchmarks.serve_load import Proc, free_port  # noqa: E402

CANARY = {"prompt": "The history of the printing press begins", "max_tokens": 24,
          "temperature": 0}  # fmt: skip
PROMPTS = [
    "Explain in two sentences why the KV cache makes decoding fast.",
    "Write a short poem about a lighthouse.",
    "List three uses of a paper clip.",
    "What is the capital of France?",
    "Summarise the rules of chess in one paragraph.",
]
JSON = {"Content-Type": "application/json"}
# (body bytes, headers, the status it must get)
BAD = [
    (b'{"prompt": "hi", "max_tokens": 4}', {"Content-Type": "text/plain"}, 415),
    (b"[" * 100_000, JSON, 400),
    (b'{"prompt": "hi", "priority": 1' + b"0" * 310 + b"}", JSON, 400),
    (b'{"prompt": "hi", "seed": 18446744073709551616}', JSON, 400),
    (b'{"prompt": "a\\ud800b", "max_tokens": 4}', JSON, 400),
    (b'{"prompt": "hi", "model": "gpt-4o"}', JSON, 404),
    (b'{"prompt": 12, "max_tokens": "many"}', JSON, 400),
    (b'{"messages": [{"role": "robot", "content": "x"}]}', JSON, 400),
    (b"{not json", JSON, 400),
    (b'{"prompt": "hi", "max_tokens": 4, "temperature": 1e-300}', JSON, 200),
]
KINDS = ["good"] * 5 + ["bad"] * 2 + ["cancelled", "disconnected", "canary"]


def proc_stats(pid: int) -> tuple[float, int]:
    """The server's resident memory (MiB) and open file descriptors."""
    rss = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def slope_per_hour(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (seconds), per hour (0 with fewer than 2 points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return (
        0.0
        if den == 0
        else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den * 3600
    )


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


class Soak:
    def __init__(self, url: str, solo: str, seed: int) -> None:
        self.url, self.solo, self.rng = url, solo, random.Random(seed)
        self.outcomes: dict[str, int] = {}
        self.latencies: list[float] = []  # good requests of the current window
        self.mismatches: list[str] = []
        self.five_xx: list[str] = []

    def count(self, what: str) -> None:
        self.outcomes[what] = self.outcomes.get(what, 0) + 1

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choice(KINDS)
        try:
            await getattr(self, kind)(client)
        except httpx.TransportError as e:  # the server's connection failed: counted
            self.count(f"transport_error ({type(e).__name__})")

    def _status(self, status: int, what: str) -> bool:
        if status >= 500:
            self.five_xx.append(f"{what}: {status}")
            self.count("5xx")
            return False
        return True

    async def good(self, client: httpx.AsyncClient) -> None:
        prompt = self.rng.choice(PROMPTS)
        chat = self.rng.random() < 0.5
        body = {
            "max_tokens": self.rng.randint(8, 48),
            "temperature": self.rng.choice([0, 0.8]),
            "seed": self.rng.randrange(1000),
        }
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        path = "/v1/chat/completions" if chat else "/v1/completions"
        t0 = time.perf_counter()
        if self.rng.random() < 0.5:
            async with client.stream("POST", self.url + path, json={**body, "stream": True}) as r:
                if not self._status(r.status_code, "good stream"):
                    return
                text = "".join([line async for line in r.aiter_lines()])
                if "server_error" in text:
                    self.five_xx.append("good stream: an error inside the stream")
                    self.count("5xx")
                    return
        else:
            r = await client.post(self.url + path, json=body)
            if not self._status(r.status_code, "good"):
                return
        self.latencies.append(time.perf_counter() - t0)
        self.count("good" if r.status_code == 200 else f"good answered {r.status_code}")

    async def bad(self, client: httpx.AsyncClient) -> None:
        raw, headers, want = self.rng.choice(BAD)
        r = await client.post(self.url + "/v1/completions", content=raw, headers=headers)
        if self._status(r.status_code, f"bad {raw[:40]!r}"):
            self.count("bad: refused as expected" if r.status_code == want
                       else f"bad: {r.status_code}, expected {want}")  # fmt: skip

    async def cancelled(self, client: httpx.AsyncClient) -> None:
        body = {"prompt": self.rng.choice(PROMPTS), "max_tokens": 64, "stream": True}
        async with client.stream("POST", self.url + "/v1/completions", json=body) as r:
            if self._status(r.status_code, "cancelled"):
                async for _ in r.aiter_lines():
                    break  # leaving the block closes the stream: the server cancels
        self.count("cancelled")

    async def disconnected(self, client: httpx.AsyncClient) -> None:
        body = {"prompt": self.rng.choice(PROMPTS), "max_tokens": 64}
        try:
            r = await client.post(self.url + "/v1/completions", json=body, timeout=0.3)
            self._status(r.status_code, "disconnected")
            self.count("disconnected: finished first")
        except httpx.TimeoutException:
            self.count("disconnected")

    async def canary(self, client: httpx.AsyncClient) -> None:
        r = await client.post(self.url + "/v1/completions", json=CANARY)
        if not self._status(r.status_code, "canary"):
            return
        got = r.json()["choices"][0]["text"]
        if got != self.solo:
            self.mismatches.append(got)
        self.count("canary")


async def drive(args: argparse.Namespace, server: Proc) -> dict:
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(server.url + "/v1/completions", json=CANARY)
        solo = r.json()["choices"][0]["text"]
        soak = Soak(server.url, solo, args.seed)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        windows = []
        rss0, fds0 = proc_stats(server.proc.pid)
        next_window = t0 + args.window_s

        async def worker() -> None:
            while time.monotonic() < end:
                await soak.one(client)

        tasks = [asyncio.create_task(worker()) for _ in range(args.workers)]
        while time.monotonic() < end:
            await asyncio.sleep(min(5.0, max(0.0, min(next_window, end) - time.monotonic())))
            if time.monotonic() >= next_window or time.monotonic() >= end:
                rss, fds = proc_stats(server.proc.pid)
                lat, soak.latencies = soak.latencies, []
                windows.append({"t_s": round(time.monotonic() - t0), "good": len(lat),
                                "p50_s": pct(lat, 50), "p99_s": pct(lat, 99),
                                "rss_mib": round(rss, 1), "open_files": fds})  # fmt: skip
                print(f"  window {len(windows)}: {windows[-1]}", flush=True)
                next_window += args.window_s
        await asyncio.gather(*tasks)
        # The load has stopped: the pool must be back at idle (abandoned streams reaped).
        idle_kv = None
        for _ in range(100):
            metrics = (await client.get(server.url + "/metrics")).text
            line = next(ln for ln in metrics.splitlines()
                        if ln.startswith("unikv_kv_stored_bytes "))  # fmt: skip
            idle_kv = float(line.split()[1])
            if idle_kv == 0:
                break
            await asyncio.sleep(0.1)
        health = (await client.get(server.url + "/health")).json()
    xs = [w["t_s"] for w in windows]
    return {
        "cpu": cpu_name(),
        "settings": vars(args),
        "outcomes": dict(sorted(soak.outcomes.items())),
        "requests": sum(soak.outcomes.values()),
        "canary": {
            "solo": solo,
            "mismatches": len(soak.mismatches),
            "examples": soak.mismatches[:3],
        },  # fmt: skip
        "five_xx": len(soak.five_xx),
        "five_xx_examples": soak.five_xx[:5],
        "windows": windows,
        "rss_start_mib": round(rss0, 1),
        "open_files_start": fds0,
        "rss_slope_mib_per_h": round(slope_per_hour(xs, [w["rss_mib"] for w in windows]), 1),
        "open_files_slope_per_h": round(slope_per_hour(xs, [w["open_files"] for w in windows]), 1),
        "kv_bytes_at_idle": idle_kv,
        "health_at_end": health.get("status"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--window-s", type=float, default=300.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device-capacity",
        default="64MiB",
        help="the device tier's capacity (\"default\": the shipped config's)",
    )
    p.add_argument("--report", default=None, help="also write the JSON report here")
    p.add_argument("--report-dir", default=None,
                   help="the server's own health reports (unikv serve --report-dir), one per "
                   "--window-s, HTML and JSON")  # fmt: skip
    args = p.parse_args()
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    if args.device_capacity != "default":
        env["UNIKV_TIERS__DEVICE__CAPACITY"] = args.device_capacity
    argv = [sys.executable, "-m", "unikv.cli", "serve", "--port", str(port),
            "--max-waiting", "256"]  # fmt: skip
    if args.report_dir:
        argv += ["--report-dir", args.report_dir, "--report-every", f"{args.window_s:g}s"]
    server = Proc("unikv-soak", argv, port, env)
    try:
        server.wait_ready()
        print(f"soak: {args.minutes:g} min, {args.workers} workers, {cpu_name()}", flush=True)
        out = asyncio.run(drive(args, server))
    finally:
        server.stop()
    print(f"requests: {out['requests']}  by outcome: {out['outcomes']}")
    print(f"canary mismatches: {out['canary']['mismatches']} (goal 0); 5xx: {out['five_xx']} "
          f"(goal 0)")  # fmt: skip
    print(f"RSS {out['rss_start_mib']} MiB at start, slope {out['rss_slope_mib_per_h']} MiB/h; "
          f"open files slope {out['open_files_slope_per_h']}/h")  # fmt: skip
    print(f"KV bytes at idle {out['kv_bytes_at_idle']:g} (goal 0); health at the end: "
          f"{out['health_at_end']}")  # fmt: skip
    for i, w in enumerate(out["windows"], 1):
        print(f"  window {i} (to {w['t_s']} s): {w['good']} good, p50 {w['p50_s']} s, "
              f"p99 {w['p99_s']} s, RSS {w['rss_mib']} MiB, {w['open_files']} files")  # fmt: skip
    line = json.dumps(out)
    print(line)
    if args.report:
        Path(args.report).write_text(line + "\n")


if __name__ == "__main__":
    main()
