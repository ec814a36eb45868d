"""Decode speed and memory of compressed KV strategies against `full`, same model, same process.

For each context length every strategy prefills the same text once (chunks of 512 tokens, as
the engine's step budget does); then rounds of `--new-tokens` greedy decode steps alternate
full, strategy, full, ... each round continuing its sequence (the context grows by a few
hundred tokens over all rounds); round 0 is the warm-up, tokens/s is the median of the rest.
Also reports KV bytes after the prefill (against what an fp16 cache of the same tokens needs)
and, with `--rss`, the peak RSS growth of an 8K prefill measured in a fresh child process.

    python benchmarks/kv_quant_speed.py [--contexts 2048 8192] [--new-tokens 32] [--repeats 3]
    python benchmarks/kv_quant_speed.py --strategies hybrid+resident+pruned int8+tiered+all
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from unikv.engine.assembly import build_kv  # noqa: E402
from unikv.engine.evaluate import read_text  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.sampling import greedy_rows  # noqa: E402
from unikv.kvstrategies.kv import StepBatch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "benchmarks" / "texts" / "GPL-3.txt"
FALLBACK = ROOT / "kvstrategies" / "data" / "warmup.txt"


def context_ids(tok, n: int) -> list[int]:
    """n tokens of English text (the GPL-3 text repeated, or the bundled warm-up text)."""
    text = read_text(str(TEXT if TEXT.exists() else FALLBACK))
    ids = tok.encode(text)
    return (ids * (n // len(ids) + 1))[:n]


def build(model, tok, name: str, config=None, options: dict | None = None):
    spec = model.kv_spec()
    return build_kv(spec, name, config, options=options, model=model, tokenizer=tok).strategy


def device_kv_bytes(kv) -> int:
    """KV bytes the device tier holds (blocks in use times their size)."""
    pool = kv.pool
    return pool.allocators["device"].num_used * pool.layout.page_bytes


def prefill(model, kv, ids: list[int], seq: int, chunk: int = 512) -> int:
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        toks = torch.tensor(part)
        pos = torch.arange(start, start + len(part))
        logits = model.forward(
            toks, pos, kv, StepBatch([seq], [len(part)]), torch.tensor([len(part) - 1])
        )
    return greedy_rows(logits)[0]  # as the engine picks a greedy token


def decode(model, kv, first: int, start: int, n: int, seq: int, before_step=None,
           per_call: int = 1) -> float:  # fmt: skip
    """Seconds for n greedy decode steps. `before_step()` runs before each; the seconds it
    returns (e.g. spent evicting a page cache: set-up, not work of the step) are not counted.
    `per_call` > 1: up to that many steps in one native call (`LlamaModel.decode`, multi-step
    decoding, as `unikv run`'s engine runs them) where the cache allows, else one."""
    token = first
    excluded = 0.0
    i = 0
    t0 = time.perf_counter()
    with torch.inference_mode():  # once for the loop, as the engine's turn, not each step
        while i < n:
            if before_step is not None:
                excluded += before_step()
            k = min(per_call, n - i)
            k = kv.sequential(seq, k) if k > 1 else 1
            got = model.decode([token], [start + i], kv, [seq], k) if k > 1 else None
            if got is not None:
                token, i = int(got[0][-1, 0]), i + k
                continue
            logits = model.forward(
                torch.tensor([token]), torch.tensor([start + i]), kv, StepBatch([seq], [1])
            )
            token, i = greedy_rows(logits)[0], i + 1
    return time.perf_counter() - t0 - excluded


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def rss_child(name: str, n: int) -> None:
    """In a fresh process: peak RSS growth while prefilling n tokens with strategy `name`
    (RSS sampled every millisecond by a thread; the model load's own peak is excluded)."""
    torch.set_num_threads(2)
    model, tok = load_model("smollm2", progress=False)
    kv = build(model, tok, name)
    ids = context_ids(tok, min(n, model.cfg.context_length))
    gc.collect()
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    prefill(model, kv, ids, 0)
    done.set()
    sampler.join()
    print(json.dumps({"strategy": name, "tokens": len(ids), "rss_growth": peak[0] - base,
                      "kv_bytes": kv.bytes_used()}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--strategies",
        nargs="+",
        default=["hybrid_fp16_int4"],
        help="strategy names or format+placement+selection (each against full)",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--rss", action="store_true", help="also measure peak RSS of an 8K prefill")
    ap.add_argument("--rss-child", nargs=2, metavar=("STRATEGY", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        rss_child(args.rss_child[0], int(args.rss_child[1]))
        return
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2", progress=False)
    cfg = model.cfg
    fp16_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    names = list(dict.fromkeys(["full", *args.strategies]))
    rows = []
    for n in args.contexts:
        # room to decode every round inside the context
        n = min(n, cfg.context_length - args.new_tokens * (args.repeats + 1))
        ids = context_ids(tok, n)
        kvs = {name: build(model, tok, name) for name in names}
        first, kv_bytes = {}, {}
        for seq, name in enumerate(names):
            first[name] = prefill(model, kvs[name], ids, seq)
            kv_bytes[name] = kvs[name].bytes_used()
        samples = {name: [] for name in names}
        at = n
        for rnd in range(args.repeats + 1):  # round 0 is the warm-up
            for seq, name in enumerate(names):
                secs = decode(model, kvs[name], first[name], at, args.new_tokens, seq)
                if rnd:
                    samples[name].append(args.new_tokens / secs)
            at += args.new_tokens  # each round appends to its sequence (from the same token)
        tps = {name: statistics.median(s) for name, s in samples.items()}
        for name in names:
            rows.append({
                "context": n,
                "strategy": name,
                "tok_s": tps[name],
                "vs_full": tps[name] / tps["full"],
                "kv_MiB": kv_bytes[name] / 2**20,
                "fp16_over_kv": n * fp16_bytes_per_token / kv_bytes[name],
            })  # fmt: skip
            print(rows[-1], flush=True)
        for seq, name in enumerate(names):
            kvs[name].free(seq)
        del kvs
    extra = {"threads": args.threads}
    if args.rss:
        n = 8192
        for name in ("hybrid_fp16_int4", "full"):
            out = subprocess.run(
                [sys.executable, __file__, "--rss-child", name, str(n)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            extra[f"rss_{name}"] = json.loads(out.stdout.strip().splitlines()[-1])
        extra["fp16_cache_bytes_8k"] = n * fp16_bytes_per_token
    cols = ["context", "strategy", "tok_s", "vs_full", "kv_MiB", "fp16_over_kv"]
    report("kv_quant_speed", rows, cols, extra)


if __name__ == "__main__":
    main()
