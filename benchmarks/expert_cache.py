"""Expert cache: hit rate and decode slowdown of routed experts held partly off the device tier
(`memory.experts.ExpertCache`), against every expert resident, same process, interleaved.

Workload: a decode-like loop (one sequence, one token per step) over a synthetic DeepSeek-shaped
MoE stack: `--layers` MoE layers (default 4), hidden 1024, expert intermediate 512, 64 routed
experts, top-6, 2 shared experts, float32. Each layer computes RMSNorm, the router's logits, the
two shared experts and the six routed SwiGLU experts the routing trace names (weighted by the
softmax of their router logits), and adds the result to the residual: the slowdown is measured
against real expert compute. Attention is left out, so the ratios are upper bounds for a whole
model.

Routing is synthetic and fixed in advance (one trace, every case runs the same tokens), because
a router with random weights chooses experts almost uniformly: over random hidden states every
expert gets about k/E of the tokens, and a cache holding a fraction f of the experts would hit
about f of the time, which says nothing about a served model. Trained routers are skewed:
left alone they concentrate tokens on favourite experts (the reason MoE training adds balancing
losses, or V3's balancing bias, which even out the load over large training batches, not within
one request's tokens), and consecutive tokens often reuse experts (the Mixtral report's routing
analysis finds repeated assignments well above chance). The trace models both, with two knobs,
assumptions rather than measurements of a DeepSeek checkpoint (none is here):

- popularity: in each layer the experts, in a random order of their own, have Zipf weights
  1 / rank^s (`--zipf` s, default 1.0: the top quarter of the experts takes ~71% of one draw's
  probability; six distinct draws per token flatten that);
- locality: each of the previous token's experts is kept with probability `--locality` (default
  0.3); the remaining slots are drawn by popularity without replacement.

The JSON records the trace's measured skew (routing share of each layer's top 25% of experts)
and locality (mean overlap of consecutive tokens' expert sets).

Cases (capacities as fractions of the 256 routed experts; device = `expert_cache`, host =
`expert_host` of the rest, the remainder in the SSD tier: LMDB in a temporary directory):

- resident: expert_cache 1.0, the baseline (`get` is a dictionary lookup);
- c25_host / c50_host: 25% / 50% on the device tier (LRU), every other expert on host;
- c25_ssd / c50_ssd: the same with `--host-fraction` (default 0.5) of the rest on host, the
  others on SSD; the store's pages stay in the page cache (a warm SSD tier);
- c25_ssd_cold: c25_ssd with the store's file evicted from the page cache before every token
  (the eviction is not timed): SSD promotions read the disk.

On this CPU machine the "device" tier is host memory too: a promotion from host is a memcpy at
CPU memory bandwidth, where an accelerator would copy over its host link (and overlap it with
compute, which this loop does not try).

Protocol: `--warmup` tokens (untimed: they fill the LRU and teach the counts; the cache
rebalances every `--rebalance-every` observations, one per layer and token), then `--repeats`
rounds of `--tokens` tokens, each round running every case in turn on the same tokens; ms per
token is the median over rounds, the counters cover the timed rounds only.

With `--model DIR --text FILE` the workload is a DeepSeek checkpoint itself, through the
engine: for each case the model is loaded, its experts placed by a config's [moe] table
(`engine.assembly.build_kv`, `full` strategy), the text's first `--prompt` tokens prefilled, then
`--warmup` untimed and `--tokens` timed greedy decode steps; routing is the checkpoint's own
(realistic when it is trained; a random checkpoint's greedy decode tends to repeat itself,
which flatters the hit rate). Cases run one after another (each needs its own placement), not
interleaved.

    flock /tmp/unikv-cpu.lock .venv/bin/python benchmarks/expert_cache.py [--tokens 24]
        [--repeats 5] [--warmup 48] [--zipf 1.0] [--locality 0.3] [--host-fraction 0.5]
        [--threads 2] [--dir DIR] [--model DIR --text FILE --prompt 128]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from unikv.memory.experts import ExpertCache  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K, SHARED = 1024, 512, 64, 6, 2


def make_weights(layers: int, seed: int = 0):
    """Routed experts (layer, e) -> (gate_up [2I, H], down [H, I]), shared experts, routers."""
    g = torch.Generator().manual_seed(seed)

    def expert():
        return (
            torch.randn(2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5,
            torch.randn(HIDDEN, INTER, generator=g) / INTER**0.5,
        )

    routed = {(layer, e): expert() for layer in range(layers) for e in range(EXPERTS)}
    shared = [[expert() for _ in range(SHARED)] for _ in range(layers)]
    routers = [torch.randn(EXPERTS, HIDDEN, generator=g) / HIDDEN**0.5 for _ in range(layers)]
    return routed, shared, routers


def make_trace(tokens: int, layers: int, zipf: float, locality: float, seed: int = 1):
    """Routing trace [tokens, layers, top_k] of expert ids (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, EXPERTS + 1, dtype=torch.float64)
    # popularity[layer]: Zipf weights over a random order of that layer's experts
    popularity = [(ranks**-zipf)[torch.randperm(EXPERTS, generator=g)] for _ in range(layers)]
    trace = torch.empty(tokens, layers, TOP_K, dtype=torch.long)
    prev: list[list[int]] = [[] for _ in range(layers)]
    for t in range(tokens):
        for layer in range(layers):
            keep = torch.rand(len(prev[layer]), generator=g) < locality
            chosen = [e for e, k in zip(prev[layer], keep.tolist(), strict=True) if k]
            if len(chosen) < TOP_K:
                p = popularity[layer].clone()
                p[chosen] = 0.0
                fresh = torch.multinomial(p, TOP_K - len(chosen), replacement=False, generator=g)
                chosen += fresh.tolist()
            trace[t, layer] = torch.tensor(chosen)
            prev[layer] = chosen
    return trace


def trace_profile(trace: torch.Tensor) -> dict:
    """Measured skew and locality of a trace."""
    tokens, layers, k = trace.shape
    top = EXPERTS // 4
    shares, overlaps = [], []
    for layer in range(layers):
        counts = torch.bincount(trace[:, layer].reshape(-1), minlength=EXPERTS).double()
        shares.append(float(counts.sort(descending=True).values[:top].sum() / counts.sum()))
        for t in range(1, tokens):
            a, b = set(trace[t - 1, layer].tolist()), set(trace[t, layer].tolist())
            overlaps.append(len(a & b) / k)
    return {
        "top25pct_share": statistics.mean(shares),
        "consecutive_overlap": statistics.mean(overlaps),
        "uniform_overlap": k / EXPERTS,
    }


def swiglu(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = (h @ gate_up.T).chunk(2, dim=-1)  # [1, 2I] -> 2 x [1, I]
    return (F.silu(gate) * up) @ down.T  # [1, H]


class Decoder:
    """The MoE stack over one expert cache, continuing one sequence token by token."""

    def __init__(self, cache: ExpertCache, shared, routers, cold: bool = False) -> None:
        self.cache, self.shared, self.routers, self.cold = cache, shared, routers, cold
        self.x = torch.ones(1, HIDDEN)  # [1, H]: the residual stream of the one sequence

    def step(self, experts: torch.Tensor) -> None:
        """One token through every layer; `experts`: [layers, top_k] from the trace."""
        x = self.x
        for layer, idx in enumerate(experts):
            h = F.rms_norm(x, (HIDDEN,))
            logits = h @ self.routers[layer].T  # [1, E]
            gates = torch.softmax(logits[0, idx], dim=-1)  # [top_k]
            out = sum(swiglu(h, *w) for w in self.shared[layer])
            ws = self.cache.get_many(layer, idx.tolist())
            for gate, w in zip(gates, ws, strict=True):
                out = out + gate * swiglu(h, *w)
            self.cache.observe(layer, idx[None])  # [1 token, top_k]
            x = x + out
        self.x = F.rms_norm(x, (HIDDEN,))

    def run(self, trace: torch.Tensor) -> float:
        """Decode the trace's tokens; the seconds spent, page-cache evictions excluded."""
        spent = 0.0
        for experts in trace:
            if self.cold:
                self.cache.store.drop_page_cache()
            t0 = time.perf_counter()
            self.step(experts)
            spent += time.perf_counter() - t0
        return spent


def counters(cache: ExpertCache) -> dict:
    s = cache.stats()
    return {
        "hits": s["hits"],
        "misses": s["misses"],
        "host": s["promotions"]["host"],
        "ssd": s["promotions"]["ssd"],
        # every copy between tiers, SSD writes included (a move to SSD writes only once)
        "bytes": sum(s["bytes_moved"].values()),
        "ssd_read": s["bytes_moved"].get("ssd->device", 0) + s["bytes_moved"].get("ssd->host", 0),
        "ssd_written": s["ssd_bytes_written"],
    }


def model_rows(args: argparse.Namespace, cases: dict, root: Path) -> list[dict]:
    """The cases on a real checkpoint through the engine (see the module docstring)."""
    from unikv.engine.assembly import build_kv
    from unikv.engine.loading import load_model
    from unikv.kvstrategies.kv import StepBatch
    from unikv.settings.config import MoEOptions, PoolConfig, TierConfig

    rows, base = [], None
    for name, (fc, fh, _cold) in cases.items():
        if name.endswith("_cold"):
            continue  # page-cache eviction needs the synthetic loop's store handle
        model, tok = load_model(args.model, progress=False)
        if model.cfg.moe is None:
            raise SystemExit(f"{args.model}: not an MoE model")
        ids = tok.encode(Path(args.text).read_text(encoding="utf-8"))[: args.prompt]
        tiers = (TierConfig("device", 1 << 30), TierConfig("ssd", 1 << 34, path=str(root / name)))
        cfg = PoolConfig(tiers=tiers, strategy="full",
                         moe=MoEOptions(topk="exact", expert_cache=fc, expert_host=fh))  # fmt: skip
        built = build_kv(model.kv_spec(), config=cfg, model=model)
        kv, n = built.strategy, len(ids)
        last = torch.tensor([n - 1])
        logits = model.forward(torch.tensor(ids), torch.arange(n), kv, StepBatch([0], [n]), last)
        spent = 0.0
        for step in range(args.warmup + args.tokens):
            if step == args.warmup:
                model.experts.reset_stats()
                spent = 0.0
            token = logits[-1].argmax().view(1)
            t0 = time.perf_counter()
            logits = model.forward(token, torch.tensor([n]), kv, StepBatch([0], [1]))
            spent += time.perf_counter() - t0
            n += 1
        st = model.experts.stats()
        ms = spent / args.tokens
        base = base or ms
        rows.append(
            {
                "case": name,
                "dev/host/ssd": "/".join(str(v) for v in st["residents"].values()),
                "ms_per_token": ms * 1e3,
                "vs_resident": ms / base,
                "hit_rate": st["hit_rate"],
                "host_promo_per_tok": st["promotions"]["host"] / args.tokens,
                "ssd_promo_per_tok": st["promotions"]["ssd"] / args.tokens,
            }
        )
        kv.close()
        model.experts.close()
    return rows


def synthetic_rows(decoders: dict, before: dict, times: dict, timed_tokens: int) -> list[dict]:
    """One row per case: time per token against the resident case, hit rate and traffic."""
    base = statistics.median(times["resident"])
    rows = []
    for name, d in decoders.items():
        after, b = counters(d.cache), before[name]
        diff = {k: after[k] - b[k] for k in after}
        st = d.cache.stats()
        ms = statistics.median(times[name])
        rows.append(
            {
                "case": name,
                "dev/host/ssd": "/".join(str(v) for v in st["residents"].values()),
                "ms_per_token": ms * 1e3,
                "vs_resident": ms / base,
                "hit_rate": diff["hits"] / max(1, diff["hits"] + diff["misses"]),
                "host_promo_per_tok": diff["host"] / timed_tokens,
                "ssd_promo_per_tok": diff["ssd"] / timed_tokens,
                "MB_moved_per_tok": diff["bytes"] / timed_tokens / 1e6,
                "ssd_MB_read_per_tok": diff["ssd_read"] / timed_tokens / 1e6,
                "ssd_MB_written_per_tok": diff["ssd_written"] / timed_tokens / 1e6,
                "rebalances": st["rebalances"],
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4, help="MoE layers")
    p.add_argument("--tokens", type=int, default=24, help="tokens per timed round")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds")
    p.add_argument("--warmup", type=int, default=48, help="untimed tokens first")
    p.add_argument("--zipf", type=float, default=1.0, help="popularity exponent s")
    p.add_argument("--locality", type=float, default=0.3, help="P(keep a previous expert)")
    p.add_argument("--host-fraction", type=float, default=0.5, help="expert_host of *_ssd")
    p.add_argument("--rebalance-every", type=int, default=64, help="observations per rebalance")
    p.add_argument("--threads", type=int, default=2, help="torch compute threads")
    p.add_argument("--dir", default=None, help="where the SSD tiers go (default: a temp dir)")
    p.add_argument("--model", help="a DeepSeek MoE checkpoint directory, run through the engine")
    p.add_argument("--text", help="with --model: the prompt text (UTF-8 file)")
    p.add_argument("--prompt", type=int, default=128, help="with --model: prompt tokens")
    args = p.parse_args()
    if bool(args.model) != bool(args.text):
        p.error("--model and --text go together")
    torch.set_num_threads(args.threads)

    hf = args.host_fraction
    cases = {  # name -> (expert_cache, expert_host, cold SSD)
        "resident": (1.0, 1.0, False),
        "c25_host": (0.25, 1.0, False),
        "c25_ssd": (0.25, hf, False),
        "c25_ssd_cold": (0.25, hf, True),
        "c50_host": (0.5, 1.0, False),
        "c50_ssd": (0.5, hf, False),
    }
    root = Path(tempfile.mkdtemp(prefix="unikv-experts-", dir=args.dir))
    if args.model:
        try:
            rows = model_rows(args, cases, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        columns = ["case", "dev/host/ssd", "ms_per_token", "vs_resident", "hit_rate",
                   "host_promo_per_tok", "ssd_promo_per_tok"]  # fmt: skip
        report("expert_cache", rows, columns, {"model": args.model, "tokens": args.tokens})
        return
    routed, shared, routers = make_weights(args.layers)
    trace = make_trace(args.warmup + args.tokens * args.repeats, args.layers, args.zipf,
                       args.locality)  # fmt: skip
    decoders: dict[str, Decoder] = {}
    try:
        for name, (fc, fh, cold) in cases.items():
            cache = ExpertCache.from_fractions(
                routed, expert_cache=fc, expert_host=fh, ssd_path=root,
                rebalance_every=args.rebalance_every,
            )  # fmt: skip
            decoders[name] = Decoder(cache, shared, routers, cold and cache.store is not None)
        for d in decoders.values():
            d.run(trace[: args.warmup])
        before = {name: counters(d.cache) for name, d in decoders.items()}
        times: dict[str, list[float]] = {name: [] for name in decoders}
        for r in range(args.repeats):
            chunk = trace[args.warmup + r * args.tokens : args.warmup + (r + 1) * args.tokens]
            for name, d in decoders.items():
                times[name].append(d.run(chunk) / len(chunk))
        rows = synthetic_rows(decoders, before, times, args.tokens * args.repeats)
    finally:
        for d in decoders.values():
            d.cache.close()
        decoders.clear()
        gc.collect()
        shutil.rmtree(root, ignore_errors=True)
    expert_mb = sum(t.numel() * t.element_size() for t in routed[(0, 0)]) / 1e6
    report(
        "expert_cache",
        rows,
        [
            "case",
            "dev/host/ssd",
            "ms_per_token",
            "vs_resident",
            "hit_rate",
            "host_promo_per_tok",
            "ssd_promo_per_tok",
            "MB_moved_per_tok",
            "ssd_MB_read_per_tok",
        ],
        {
            "shape": {
                "layers": args.layers,
                "hidden": HIDDEN,
                "intermediate": INTER,
                "routed": EXPERTS,
                "top_k": TOP_K,
                "shared": SHARED,
                "expert_MB": expert_mb,
            },
            "routing": {"zipf": args.zipf, "locality": args.locality, **trace_profile(trace)},
            "warmup": args.warmup,
            "tokens": args.tokens,
            "repeats": args.repeats,
            "rebalance_every": args.rebalance_every,
        },
    )


if __name__ == "__main__":
    main()
