"""The first request's TTFT against the steady state: `unikv serve` with its start-up warm-up
and with `--no-warm-up`, in one run (issue 34: "warm before ready").

    python benchmarks/first_request.py [--rounds 2] [--steady 6] [--new 8] [--cold-cache]

Each round starts `unikv serve` as shipped (the auto strategy, native weights) on a free port
for each mode, waits until `/ready` answers 200 (nothing answers before the warm-up has run),
sends the first request at once, then `--steady` more one after another; every request has a
fresh prompt of about 150 tokens (a head of its own, so no prefix is shared) and streams
`--new` tokens. Reported per mode: the first request's TTFT, the median TTFT of the rest (the
steady state), their ratio (goal with the warm-up: <= 1.2x), and the start-up time to ready.
The modes alternate within a round, so both see the same machine state. `--cold-cache`: each
start as on a fresh machine (an empty kernel cache; as root, the page cache dropped).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.decode_profile import cpu_name  # noqa: E402
from benchmarks.serve_load import Proc, free_port, one  # noqa: E402

BODY = (
    "The operator reads the health view, the memory report and the advice, then changes one "
    "setting at a time and watches the next report before changing another. "
) * 6


def wait_ready(server: Proc, limit: float = 300) -> float:
    """Seconds until `/ready` answers 200."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if server.proc.poll() is not None:
            raise SystemExit(f"{server.name} exited; see {server.log_path}")
        try:
            if httpx.get(server.url + "/ready", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{server.name} not ready in {limit} s; see {server.log_path}")


async def requests(url: str, n: int, new: int, tag: str) -> list[float]:
    """TTFTs of `n` requests sent one after another, each with a fresh prompt."""
    out = []
    async with httpx.AsyncClient(timeout=300) as client:
        for i in range(n):
            r = await one(client, url, f"{tag} request {i}: {BODY}", new)
            out.append(r["ttft"])
    return out


def _drop_page_cache() -> None:
    """Drop the OS page cache (as root; elsewhere a no-op, said once)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        print(f"  (page cache not dropped: {e})", flush=True)


def measure(warm: bool, steady: int, new: int, tag: str, cold_cache: bool = False) -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "unikv.cli", "serve", "--port", str(port)]
    if not warm:
        argv.append("--no-warm-up")
    env = {**os.environ}
    if cold_cache:  # a fresh machine: no built kernels, and the model file out of the page cache
        env["UNIKV_KERNEL_DIR"] = tempfile.mkdtemp(prefix="unikv-kernels-")
        _drop_page_cache()
    server = Proc("unikv-first", argv, port, env)
    try:
        ready_s = wait_ready(server)
        ttfts = asyncio.run(requests(server.url, 1 + steady, new, tag))
    finally:
        server.stop()
    first, rest = ttfts[0], statistics.median(ttfts[1:])
    return {"warm_up": warm, "ready_s": round(ready_s, 2), "first_ttft_s": round(first, 4),
            "steady_ttft_s": round(rest, 4), "ratio": round(first / rest, 2)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steady", type=int, default=6, help="requests after the first (6)")
    p.add_argument("--new", type=int, default=8, help="tokens per request (8)")
    p.add_argument("--cold-cache", action="store_true",
                   help="each start as on a fresh machine: an empty kernel cache and (as root) the "
                   "page cache dropped, so the weights are read from disk")  # fmt: skip
    args = p.parse_args()
    print(f"first request vs steady state, {cpu_name()}", flush=True)
    rows = []
    for r in range(args.rounds):
        for warm in (True, False) if r % 2 == 0 else (False, True):
            tag = f"round {r} {'warm' if warm else 'cold'}"
            row = measure(warm, args.steady, args.new, tag, args.cold_cache)
            rows.append(row)
            print(f"  round {r}, warm-up {'on ' if warm else 'off'}: ready in {row['ready_s']} s, "
                  f"first TTFT {row['first_ttft_s']:.3f} s, steady {row['steady_ttft_s']:.3f} s, "
                  f"{row['ratio']:.2f}x", flush=True)  # fmt: skip
    for warm in (True, False):
        mine = [x["ratio"] for x in rows if x["warm_up"] == warm]
        print(f"warm-up {'on ' if warm else 'off'}: first/steady {statistics.median(mine):.2f}x "
              f"(median of {len(mine)}; worst {max(mine):.2f}x)")  # fmt: skip
    print(json.dumps({"cpu": cpu_name(), "rows": rows}))


if __name__ == "__main__":
    main()
