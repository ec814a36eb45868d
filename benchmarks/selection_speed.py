"""Decode speed of several strategies at one context, interleaved in one process.

Picks between selections (`all`, `pruned`, `sparse`) over the same format: each strategy's
cache is filled with the same `--context` tokens of English text (prompt chunks of 512), then
`--rounds` rounds of `--steps` greedy decode steps go to each cache in turn (a warm-up round
first), so the machine's drift falls on every strategy alike. Prints per strategy the median
milliseconds per step, each round's, the KV bytes stored, the sparse summaries' bytes and the
share of blocks a step read (sparse), and the ratio to the first strategy. With
`--device-window N` the pool has a host tier beside the device tier, and every tiered strategy
keeps its newest N tokens on the device and every older one on the host (the medium class's
placement; the device's share of the KV is printed too).

    python benchmarks/selection_speed.py [--context 8090] [--strategies hybrid+resident+all
        hybrid+resident+pruned hybrid+resident+sparse] [--weights native]
        [--device-window 1024 --strategies dense+tiered+all dense+tiered+sparse]
        [--strategies dense+resident+sparse dense+resident+sparse:block_score=lse]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import named_options, report  # noqa: E402
from benchmarks.decode_profile import cpu_name  # noqa: E402
from benchmarks.kv_quant_speed import build, context_ids, decode, device_kv_bytes, prefill  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.kernels import native  # noqa: E402
from unikv.settings.config import PoolConfig, TierConfig  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="native", help="native (the default) or float32")
    p.add_argument("--context", type=int, default=8090, help="tokens before the first step")
    p.add_argument("--steps", type=int, default=24, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--strategies", nargs="+",
                   default=["hybrid+resident+all", "hybrid+resident+pruned",
                            "hybrid+resident+sparse"],
                   help="strategy names, each optionally NAME:key=value,... (options over its "
                        "defaults)")  # fmt: skip
    p.add_argument("--device-window", type=int,
                   help="tiered strategies: the newest N tokens on the device tier, every "
                        "older one on a host tier (default: no host tier)")  # fmt: skip
    a = p.parse_args()
    model, tok = load_model(a.model, progress=False, weights=a.weights)[:2]
    room, need = model.cfg.context_length - a.context, a.steps * (a.rounds + 1)
    if room < need:
        p.error(f"--context {a.context} leaves {room} positions of the model's "
                f"{model.cfg.context_length}: fewer than the {need} steps")  # fmt: skip
    ids = context_ids(tok, a.context)
    config, tiered = None, {}
    if a.device_window:  # no SSD tier: the host tier holds everything older than the window
        config = PoolConfig(tiers=(TierConfig("device", 2**30), TierConfig("host", 2**31)))
        tiered = {"device_window": a.device_window, "host_window": a.context + need}
    caches, prefill_s = {}, {}
    for s in a.strategies:
        name, given = named_options(s)
        opts = (tiered if "tiered" in name.split("+") else {}) | given
        kv = build(model, tok, name, config, opts or None)
        t0 = time.perf_counter()
        caches[s] = (kv, prefill(model, kv, ids, 0))
        prefill_s[s] = time.perf_counter() - t0
        print(f"{s}: {a.context} tokens in {prefill_s[s]:.0f} s", file=sys.stderr, flush=True)
    at = dict.fromkeys(a.strategies, a.context)
    ms: dict[str, list[float]] = {s: [] for s in a.strategies}
    for r in range(a.rounds + 1):  # round 0 warms every cache up
        for s, (kv, first) in caches.items():
            t = decode(model, kv, first, at[s], a.steps, 0)
            at[s] += a.steps
            if r:
                ms[s].append(1000 * t / a.steps)
    rows = []
    base = statistics.median(ms[a.strategies[0]])
    for s, (kv, _) in caches.items():
        stats = kv.selection.stats() if hasattr(kv, "selection") else {}
        step = statistics.median(ms[s])
        rows.append({
            "strategy": s, "ms/step": round(step, 2),
            "rounds": " ".join(f"{x:.1f}" for x in ms[s]),
            "KV MiB": round(kv.bytes_used() / 2**20, 1),
            "device KV MiB": round(device_kv_bytes(kv) / 2**20, 1),
            "summaries MiB": round(stats["summary_bytes"] / 2**20, 1)
            if "summary_bytes" in stats else None,
            "blocks read": round(stats["blocks_read_share"], 3)
            if "blocks_read_share" in stats else None,
            f"vs {a.strategies[0]}": round(base / step, 2),
        })  # fmt: skip
        kv.close()
    extra = {"cpu": cpu_name(), "kernels": native.isa(),
             "torch_capability": torch.backends.cpu.get_cpu_capability(),
             "context": a.context, "steps": a.steps, "rounds": a.rounds,
             "weights": a.weights, "device_window": a.device_window}  # fmt: skip
    report("decode ms per step, strategies interleaved", rows, list(rows[0]), extra)


if __name__ == "__main__":
    main()
