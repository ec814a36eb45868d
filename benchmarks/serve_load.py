"""`unikv serve` against llama.cpp's `llama-server`, through the OpenAI API, in one run.

    python benchmarks/serve_load.py [--concurrency 1 8 32] [--new-tokens 64] [--text FILE]
        [--weights native|float32] [--grpc] [--skip-llamacpp]

Both servers run the same weights from the same file: with `--weights native` (the default,
unikv's own default) the packaged SmolLM2 GGUF (Q4_1 layers, a Q8_0 head) for both, unikv
multiplying its blocks; with `--weights float32` that file converted to F32 with
`llama-quantize` for both (llama.cpp found or built by `benchmarks/llamacpp.py`). Each server
gets 2 threads and is started once; the measurements alternate between them, the other server
paused (SIGSTOP) meanwhile so that its idle threads cannot take the cores. N concurrent
streaming clients send prompts cut from the text at mixed lengths (32 to 256 tokens),
`ignore_eos`, `max_tokens` fixed, so every request generates the same number of tokens.

Reported per server and concurrency: output tokens/s, TTFT p50/p99, inter-token p99. Then:
- **Urgent request**: TTFT of a `priority: -10` request sent 10 times from the moment 16
  normal streams start (while their prompts prefill, then while they decode; median and
  worst), against its TTFT on the idle server (unikv only: llama-server has no priorities;
  its figure under the same load is shown for comparison).
- **Batching window**: a bursty arrival trace (bursts of 8 requests, 1.5 s apart) through
  unikv with the admission window at 0 and at the chip profile's (cpu: 40 ms).

With `--grpc` the unikv server also serves gRPC, and each concurrency runs over HTTP and then
over gRPC (`Generate`, the same fields) against the same server: rows `unikv-grpc`.

Prints a human table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import environment  # noqa: E402
from benchmarks.llamacpp import converted, find_or_build  # noqa: E402
from unikv.engine.gguf_loader import resolve_model_path  # noqa: E402

TEXT = Path(__file__).with_name("texts") / "GPL-3.txt"
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(text: str, n: int, seed: int = 0) -> list[str]:
    """`n` prompts cut from the text, 24 to 190 words (about 32 to 256 tokens)."""
    words = text.split()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(24, 190)
        start = rng.randrange(0, len(words) - length)
        out.append(" ".join(words[start : start + length]))
    return out


class Proc:
    """A server process on a free port, stopped on exit."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict) -> None:
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        self.log = os.fdopen(fd, "wb")  # kept open for the process's lifetime
        self.log_path = path
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )

    def wait_ready(self, limit: float = 300) -> None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise SystemExit(f"{self.name} did not start in {limit} s; see {self.log_path}")

    @contextlib.contextmanager
    def paused(self):
        """This server stopped (SIGSTOP) while another is measured, continued after: an idle
        server's threads (llama.cpp's polling thread pool, a late request's cleanup) must not
        take the cores of the one measured."""
        self.proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def one(client: httpx.AsyncClient, url: str, prompt: str, new: int, priority=None) -> dict:
    """Stream one completion; return its TTFT, inter-token gaps and token count. A kept-alive
    connection the server closed as the request went out (both servers close one idle for 5 s:
    the client then reads "Server disconnected without sending a response", or a reset, before
    any response) is tried once more on a new one; a response broken off is an error."""
    answered: list = []
    try:
        return await _one(client, url, prompt, new, priority, answered)
    except (httpx.RemoteProtocolError, httpx.ReadError):
        if answered:  # broken off after the response began: an error
            raise
        return await _one(client, url, prompt, new, priority, [])


async def _one(client: httpx.AsyncClient, url: str, prompt: str, new: int, priority,
               answered: list) -> dict:  # fmt: skip
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": new,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    if priority is not None:
        body["priority"] = priority
    t0 = time.perf_counter()
    first, last, gaps, pieces = None, None, [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        answered.append(r.status_code)
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
            pieces += 1
    return {"ttft": first - t0, "gaps": gaps, "tokens": new, "end": last - t0}


async def load(url: str, ps: list[str], concurrency: int, new: int) -> dict:
    """`concurrency` clients, each sending its share of `ps` one after another."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return await _drive(lambda prompt: one(client, url, prompt, new), ps, concurrency)


async def one_grpc(stub, prompt: str, new: int) -> dict:
    """`one` over gRPC: stream one `Generate` call (the same fields)."""
    from unikv.serving import unikv_pb2 as pb

    req = pb.GenerateRequest(prompt=prompt, max_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    first, last, gaps = None, None, []
    async for r in stub.Generate(req, timeout=600):
        if not r.text:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            gaps.append(now - last)
        last = now
    return {"ttft": first - t0, "gaps": gaps, "tokens": new, "end": last - t0}


async def load_grpc(address: str, ps: list[str], concurrency: int, new: int) -> dict:
    """`load` over gRPC, one channel (HTTP/2 multiplexes the clients' streams)."""
    import grpc

    from unikv.serving import unikv_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return await _drive(lambda prompt: one_grpc(stub, prompt, new), ps, concurrency)


async def _drive(send, ps: list[str], concurrency: int) -> dict:
    """`concurrency` workers sending `ps` through `send`; throughput and latencies."""
    queue = list(ps)
    results: list[dict] = []

    async def worker() -> None:
        while queue:
            results.append(await send(queue.pop()))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ttfts = sorted(r["ttft"] for r in results)
    gaps = sorted(g for r in results for g in r["gaps"])
    return {
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50": _pct(ttfts, 50),
        "ttft_p99": _pct(ttfts, 99),
        "itl_p99": _pct(gaps, 99),
        "requests": len(results),
    }


async def urgent(url: str, ps: list[str], new: int, normal: int = 16, samples: int = 10) -> dict:
    """TTFT of an urgent request alone (median of 3), and sent `samples` times, 0.25 s after the
    previous one ended, from the moment `normal` streams start: while their prompts are
    prefilled (the longest steps) and while they decode (median and worst)."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        idle = statistics.median(
            [(await one(c, url, ps[0], 8, priority=-10))["ttft"] for _ in range(3)]
        )
        background = [asyncio.create_task(one(c, url, p, new * 2)) for p in ps[1 : normal + 1]]
        loaded = []
        for _ in range(samples):
            await asyncio.sleep(0.25)
            loaded.append((await one(c, url, ps[0], 8, priority=-10))["ttft"])
        await asyncio.gather(*background)
    return {
        "idle_ttft": idle,
        "loaded_ttft": statistics.median(loaded),
        "loaded_worst": max(loaded),
        "ratio": statistics.median(loaded) / idle,
        "ratio_worst": max(loaded) / idle,
    }


async def bursty(url: str, ps: list[str], new: int, bursts: int = 4, size: int = 8) -> dict:
    """Bursts of `size` requests, `1.5 s` apart: mean TTFT and output tokens/s."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        t0 = time.perf_counter()
        tasks = []
        for b in range(bursts):
            tasks += [
                asyncio.create_task(one(c, url, ps[(b * size + i) % len(ps)], new))
                for i in range(size)
            ]
            await asyncio.sleep(1.5)
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return {
        "ttft_mean": statistics.mean(r["ttft"] for r in results),
        "ttft_p99": _pct(sorted(r["ttft"] for r in results), 99),
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
    }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[i]


def unikv_server(
    batch: int,
    window_ms: float | None,
    grpc_port: int | None = None,
    weights: str = "native",
    decode_steps: int = 1,
) -> Proc:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "2", "UNIKV_SCHEDULER__BATCH_SIZE": str(batch)}
    if window_ms is not None:
        env["UNIKV_SCHEDULER__BATCHING_WINDOW_MS"] = str(window_ms)
    argv = [
        sys.executable,
        "-m",
        "unikv.cli",
        "serve",
        "--port",
        str(port),
        "--strategy",
        "full",
        "--max-waiting",
        "256",
        "--weights",
        weights,
        "--decode-steps",
        str(decode_steps),
    ]
    if weights == "float32":  # the F32 file llama-server reads: the same bytes, not a decoding
        argv += ["--model", str(converted(resolve_model_path("smollm2"), "F32", find_or_build()))]
    if grpc_port is not None:
        argv += ["--grpc-port", str(grpc_port)]
    return Proc(f"unikv-w{window_ms}", argv, port, env)


def llama_server(
    bin_dir: Path, gguf: Path, slots: int, ctx_per_slot: int, extra: tuple[str, ...] = ()
) -> Proc:
    port = free_port()
    argv = [
        str(bin_dir / "llama-server"),
        "-m",
        str(gguf),
        "--port",
        str(port),
        "-t",
        "2",
        "-np",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        "--no-webui",
        "-fa",
        "on",
        *extra,
    ]
    return Proc("llama-server", argv, port, dict(os.environ))


def start_llama_server(bin_dir: Path, gguf: Path, slots: int, extra: dict) -> Proc:
    """llama-server, ready; started again with `--no-repack` if it dies at start (0.3.36
    segfaults here repacking the Q4_1 file's weights for AVX-512 while llama-bench runs them;
    `extra["llama_server_flags"]` records what it ran with)."""
    for flags in ((), ("--no-repack",)):
        s = llama_server(bin_dir, gguf, slots, 512, flags)
        try:
            s.wait_ready()
        except SystemExit as e:
            s.stop()
            print(f"{e}; trying again with --no-repack", file=sys.stderr)
            continue
        extra["llama_server_flags"] = " ".join(flags) or "(defaults)"
        return s
    raise SystemExit("llama-server does not start, with or without --no-repack")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--concurrency",
        type=int,
        nargs="*",
        default=[1, 8, 32],
        help="client counts for the throughput rows (none: skip them)",
    )
    ap.add_argument("--skip-window", action="store_true", help="no batching-window part")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--skip-llamacpp", action="store_true", help="unikv's figures only")
    ap.add_argument("--weights", choices=("native", "float32"), default="native",
                    help="the shipped GGUF for both servers, or its F32 conversion")  # fmt: skip
    ap.add_argument("--decode-steps", type=int, default=1,
                    help="unikv serve's --decode-steps (default: its own, 1)")  # fmt: skip
    ap.add_argument(
        "--grpc",
        action="store_true",
        help="also the same load over gRPC, to the same unikv server (rows unikv-grpc)",
    )
    args = ap.parse_args()
    text = Path(args.text).read_text(encoding="utf-8")
    top = max(args.concurrency or [32])
    grpc_port = free_port() if args.grpc else None
    rows, extra = [], {}
    servers = {}
    if not args.skip_llamacpp:  # first: it may need a second start (start_llama_server)
        bin_dir = find_or_build()
        shipped = resolve_model_path("smollm2")
        gguf = converted(shipped, "F32", bin_dir) if args.weights == "float32" else shipped
        servers["llama-server"] = start_llama_server(bin_dir, gguf, top, extra)
    servers = {"unikv": unikv_server(top, None, grpc_port, args.weights, args.decode_steps),
               **servers}  # fmt: skip
    try:
        for s in servers.values():
            s.wait_ready()
        loop = asyncio.new_event_loop()
        for s in servers.values():  # warm-up
            loop.run_until_complete(load(s.url, prompts(text, 4, seed=99), 2, 8))
        for i, c in enumerate(args.concurrency):
            n = max(4, c * args.requests_per_client)
            # Cold prompts for every run: a seed of their own per position (a concurrency
            # given twice must not hit the prefix cache with its first run's prompts).
            cut = prompts(text, n, seed=c + 1000 * i)
            ps = [f"Run A. {x}" for x in cut]
            runs = [(name, load, s.url, ps) for name, s in servers.items()]
            if grpc_port is not None:
                # The same server as the HTTP run, the same prompts behind a head of the same
                # length (no prefix hits on the other's), in alternating order.
                grpc_run = ("unikv-grpc", load_grpc, f"127.0.0.1:{grpc_port}",
                            [f"Run B. {x}" for x in cut])  # fmt: skip
                runs.insert(i % 2, grpc_run)  # after the HTTP run, then before it
            for name, run, where, cut in runs:
                server = servers["unikv" if name == "unikv-grpc" else name]
                cpu0 = (_cpu_s(server.proc.pid), time.process_time())
                with _others_paused(servers, server):
                    r = loop.run_until_complete(run(where, cut, c, args.new_tokens))
                # CPU seconds per output token: the server's and this client's (one machine:
                # a protocol whose client costs more leaves the server less of the cores).
                toks = r["requests"] * args.new_tokens
                r["server_cpu_ms_per_token"] = 1000 * (_cpu_s(server.proc.pid) - cpu0[0]) / toks
                r["client_cpu_ms_per_token"] = 1000 * (time.process_time() - cpu0[1]) / toks
                rows.append({"server": name, "concurrency": c, **r})
                print(f"  {name} c={c}: {r['tokens_per_s']:.1f} tok/s", file=sys.stderr)
        ps = prompts(text, 20, seed=5)
        for name, s in servers.items():
            try:
                with _others_paused(servers, s):
                    got = loop.run_until_complete(urgent(s.url, ps, args.new_tokens))
                extra[f"urgent_{name}"] = got
            except httpx.HTTPError as e:  # recorded, not fatal: the throughput rows stand
                extra[f"urgent_{name}"] = f"failed: {type(e).__name__}: {e}"
        servers.pop("unikv").stop()
        for window in () if args.skip_window else (0.0, None):  # None: the profile's
            s = unikv_server(top, window, weights=args.weights)
            try:
                s.wait_ready()
                loop.run_until_complete(load(s.url, prompts(text, 4, seed=99), 2, 8))
                key = "window_0ms" if window == 0.0 else "window_profile"
                extra[key] = loop.run_until_complete(bursty(s.url, ps, args.new_tokens))
            finally:
                s.stop()
    finally:
        for s in servers.values():
            s.stop()
    _print(rows, extra)


@contextlib.contextmanager
def _others_paused(servers: dict, measured):
    """Every server but `measured` paused for the block."""
    with contextlib.ExitStack() as stack:
        for other in servers.values():
            if other is not measured:
                stack.enter_context(other.paused())
        yield


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` and its threads have used (0 unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _print(rows: list[dict], extra: dict) -> None:
    print(f"{'server':13} {'conc':>4} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p99':>8} "
          f"{'CPU ms/tok server / client':>27}")  # fmt: skip
    for r in rows:
        print(
            f"{r['server']:13} {r['concurrency']:>4} {r['tokens_per_s']:>7.1f} "
            f"{r['ttft_p50'] * 1000:>7.0f}ms {r['ttft_p99'] * 1000:>7.0f}ms "
            f"{r['itl_p99'] * 1000:>6.0f}ms {r['server_cpu_ms_per_token']:>14.1f} / "
            f"{r['client_cpu_ms_per_token']:.1f}"
        )
    by = {(r["server"], r["concurrency"]): r for r in rows}
    for (srv, c), r in by.items():
        peer = by.get(("llama-server", c))
        if srv == "unikv" and peer:
            print(f"unikv / llama-server at {c}: {r['tokens_per_s'] / peer['tokens_per_s']:.2f}x")
        if srv == "unikv-grpc" and ("unikv", c) in by:
            http = by[("unikv", c)]
            print(f"unikv gRPC / HTTP at {c}: {r['tokens_per_s'] / http['tokens_per_s']:.2f}x "
                  f"tokens/s, TTFT p50 {r['ttft_p50'] / http['ttft_p50']:.2f}x")  # fmt: skip
    for k, v in extra.items():
        print(k, {a: round(b, 4) for a, b in v.items()} if isinstance(v, dict) else v)
    print(json.dumps({"benchmark": "serve_load", "rows": rows, **extra, "env": environment()}))


if __name__ == "__main__":
    main()
