"""MoE router top-k: how often blockwise routing chooses other experts than exact, and the time.

For each router shape, block size and sequence length: the fraction of tokens whose set of
selected experts differs between `route(..., "blockwise", block)` and `route(..., "exact")`
(over `--sequences` sequences of that length), and the time of one `route` call on one sequence
of that length for each mode (same process, interleaved exact, blockwise, exact, ... after a
warm-up; median of `--repeats`). Rows with the default winners per block
(`engine.routing.default_winners`) and with one winner fewer show how close the default is to
the edge. The field figure to beat is 0.79% of tokens routed differently at 4K tokens.

With `--model DIR --text FILE`, the logits are the checkpoint's own: its routers' inputs over
the text, run through the engine (one sequence per window of the text, every MoE layer a router
of its own). That is the realistic distribution when the checkpoint is trained. There are no
trained DeepSeek weights here (no model hub), so the default is synthetic logits imitating what
a router sees:

- a router weight of E random unit-scale directions in a 64-dimensional hidden space (experts are
  exchangeable at initialisation, so in a trained router the index of an expert inside its group
  carries no meaning: a block of consecutive experts is a random subset as far as the token is
  concerned; only the groups of V3 are structure, and `route` reproduces them);
- hidden states that are correlated from token to token: an AR(1) process (rho = 0.9, so
  neighbouring tokens share most of their experts) plus a per-sequence topic vector (30% of the
  variance), so a sequence keeps coming back to the same experts;
- per-expert popularity: a bias on each expert's logit, N(0, 0.5) for V3, N(0, 0.3) for V2-Lite;
- V3-like (DeepSeek-V3/R1 router shape): 256 experts in 8 groups, 4 groups kept, k = 8,
  sigmoid scoring, noaux_tc, normalized weights, scaling 2.5; logits offset -1 and scaled 1.5,
  so most sigmoid scores are 0.1-0.5. The score-correction bias is learned the way V3 learns it:
  its auxiliary-loss-free rule b_e -= 0.002 * sign(load_e - mean load), 300 steps over 4K
  calibration tokens (other seeds), which balances the expert loads as training does;
- V2-Lite-like: 64 experts, k = 6, softmax scoring, greedy, no groups, no bias.

Timings are of PyTorch ops on this machine: the blockwise top-k is two `torch.topk` calls and
a gather, so they say what it costs in this code base, not what a fused on-chip kernel saves.

    python benchmarks/routing.py [--lengths 512 1024 4096] [--sequences 32] [--blocks 16 32]
                                 [--repeats 20] [--model DIR --text FILE] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import environment, interleaved, report  # noqa: E402
from unikv.engine.config import MoEConfig  # noqa: E402
from unikv.engine.routing import default_winners, route  # noqa: E402
from unikv.settings.profiles import DEFAULT_TOPK_BLOCK  # noqa: E402

FIELD_DIFF_PCT_4K = 0.79  # field figure to beat: % of tokens routed differently at 4K tokens
LATENT = 64
RHO = 0.9
TOPIC = 0.3


@dataclass(frozen=True)
class Router:
    """A synthetic router: its MoE shape and how its logits are drawn."""

    name: str
    moe: MoEConfig
    popularity: float  # std of the per-expert logit bias
    offset: float
    scale: float
    balance: bool  # learn a V3 score-correction bias


ROUTERS = (
    Router(
        "v3",
        MoEConfig(
            num_experts=256,
            num_shared=1,
            top_k=8,
            intermediate_size=2048,
            first_dense=3,
            scoring="sigmoid",
            topk_method="noaux_tc",
            num_groups=8,
            topk_groups=4,
            norm_topk=True,
            routed_scaling=2.5,
        ),
        popularity=0.5,
        offset=-1.0,
        scale=1.5,
        balance=True,
    ),
    Router(
        "v2-lite",
        MoEConfig(
            num_experts=64,
            num_shared=2,
            top_k=6,
            intermediate_size=1408,
            first_dense=1,
            scoring="softmax",
            topk_method="greedy",
        ),
        popularity=0.3,
        offset=0.0,
        scale=1.5,
        balance=False,
    ),
)


class Synthetic:
    """Router logits [tokens, E] of one synthetic router (see the module docstring)."""

    def __init__(self, router: Router, seed: int = 0) -> None:
        self.router = router
        g = torch.Generator().manual_seed(seed)
        e = router.moe.num_experts
        self.weight = torch.randn(e, LATENT, generator=g) / math.sqrt(LATENT)  # [E, D]
        self.popularity = torch.randn(e, generator=g) * router.popularity  # [E]
        self.bias: torch.Tensor | None = None
        self.load_cv: tuple[float | None, float | None] = (None, None)
        if router.balance:
            self.bias, self.load_cv = self._balance()

    def logits(self, tokens: int, seed: int) -> torch.Tensor:
        """One sequence of `tokens` router logits, [tokens, E]."""
        g = torch.Generator().manual_seed(seed)
        eps = torch.randn(tokens, LATENT, generator=g)
        h = torch.empty_like(eps)  # AR(1): unit variance, correlation RHO to the previous token
        h[0] = eps[0]
        c = math.sqrt(1 - RHO * RHO)
        for t in range(1, tokens):
            h[t] = RHO * h[t - 1] + c * eps[t]
        topic = torch.randn(LATENT, generator=g)
        h = math.sqrt(TOPIC) * topic + math.sqrt(1 - TOPIC) * h  # [T, D]
        r = self.router
        return r.offset + r.scale * (h @ self.weight.T) + self.popularity  # [T, E]

    def _balance(self, steps: int = 300, gamma: float = 0.002) -> tuple[torch.Tensor, tuple]:
        """V3's auxiliary-loss-free bias update on calibration tokens; (bias, load CV before,
        after)."""
        moe = self.router.moe
        calib = torch.cat([self.logits(1024, 10_000 + i) for i in range(4)])
        bias = torch.zeros(moe.num_experts)

        def load_cv(b: torch.Tensor | None) -> float:
            idx = route(calib, moe, b)[1]
            load = torch.bincount(idx.reshape(-1), minlength=moe.num_experts).float()
            return (load.std() / load.mean()).item()

        before = load_cv(None)
        for _ in range(steps):
            idx = route(calib, moe, bias)[1]
            load = torch.bincount(idx.reshape(-1), minlength=moe.num_experts).float()
            bias -= gamma * torch.sign(load - load.mean())
        return bias, (before, load_cv(bias))


def same_set(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, whether two [N, k] index tensors hold the same set."""
    return (a.sort(dim=1).values == b.sort(dim=1).values).all(dim=1)


def neighbour_overlap(idx: torch.Tensor) -> float:
    """Mean fraction of a token's experts that the previous token also chose."""
    k = idx.shape[1]
    hits = (idx[1:, :, None] == idx[:-1, None, :]).any(dim=2).sum(dim=1)
    return (hits.float() / k).mean().item()


def candidates(moe: MoEConfig) -> int:
    if moe.topk_method == "greedy":
        return moe.num_experts
    return moe.topk_groups * (moe.num_experts // moe.num_groups)


def synthetic_sources(args: argparse.Namespace):
    """(name, MoE config, correction bias, sequences(length) -> logits list, info) per router."""
    for router in ROUTERS:
        synth = Synthetic(router)
        info = {"load_cv_unbiased": synth.load_cv[0], "load_cv_biased": synth.load_cv[1]}

        def seqs(length: int, synth=synth) -> list[torch.Tensor]:
            # independent sequences: the seeds differ between lengths
            return [synth.logits(length, length * 1000 + s) for s in range(args.sequences)]

        yield router.name, router.moe, synth.bias, seqs, info


def model_sources(args: argparse.Namespace):
    """The same per MoE layer of a checkpoint: its router logits over windows of the text."""
    from unikv.engine.loading import load_model
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    model, tok = load_model(args.model, progress=True)
    if model.cfg.moe is None:
        raise SystemExit(f"{args.model}: not an MoE model")
    ids = tok.encode(Path(args.text).read_text(encoding="utf-8"))
    captured: dict[tuple[int, int], list[torch.Tensor]] = {}  # (layer, length) -> sequences
    biases: dict[int, torch.Tensor | None] = {}
    cfg, spec_dim = model.cfg, model.cfg.mla.kv_lora_rank
    for length in args.lengths:
        if length > cfg.context_length or len(ids) < length:
            raise SystemExit(f"--lengths {length}: the model's context or the text is shorter")
        starts = range(0, len(ids) - length + 1, max(1, (len(ids) - length) // args.sequences))
        for i, start in enumerate(list(starts)[: args.sequences]):

            def record(li, logits, bias, length=length):
                captured.setdefault((li, length), []).append(logits)
                biases[li] = bias

            model.on_route = record
            kv = ContiguousKVCache(cfg.num_layers, 1, cfg.head_dim, model.dtype,
                                   scale=cfg.mla.softmax_scale, value_dim=spec_dim)  # fmt: skip
            toks = torch.tensor(ids[start : start + length])
            last = torch.tensor([length - 1])
            model.forward(toks, torch.arange(length), kv, StepBatch([i], [length]), last)
    model.on_route = None
    for li in sorted(biases):

        def seqs(length: int, li=li) -> list[torch.Tensor]:
            return captured[li, length]

        yield f"layer{li}", cfg.moe, biases[li], seqs, {"model": args.model}


def measure(args: argparse.Namespace) -> tuple[list[dict], dict]:
    rows: list[dict] = []
    extra: dict = {"field_diff_pct_4k": FIELD_DIFF_PCT_4K, "routers": {}}
    sources = model_sources(args) if args.model else synthetic_sources(args)
    for name, moe, bias, sequences, info in sources:
        for length in args.lengths:
            seqs = sequences(length)
            x = torch.cat(seqs)  # [sequences * length, E]
            exact = route(x, moe, bias)[1]
            if length == max(args.lengths):
                first = route(seqs[0], moe, bias)[1]
                info["neighbour_overlap"] = round(neighbour_overlap(first), 3)
            for block in args.blocks:
                best = default_winners(moe.top_k, block, candidates(moe))
                for winners in sorted({best, max(1, best - 1)}, reverse=True):
                    if winners < moe.top_k and winners * candidates(moe) < moe.top_k * block:
                        continue  # too few winners to be valid (see route)
                    blockwise = route(x, moe, bias, "blockwise", block, winners=winners)[1]
                    per_seq = (~same_set(exact, blockwise)).view(len(seqs), length)
                    differ = int(per_seq.sum())
                    worst = per_seq.float().mean(dim=1).max().item()
                    one = seqs[0]

                    def run_exact(one=one, moe=moe, bias=bias):
                        return route(one, moe, bias)

                    def run_blockwise(one=one, moe=moe, bias=bias, b=block, w=winners):
                        return route(one, moe, bias, "blockwise", b, winners=w)

                    times = interleaved(
                        {"exact": run_exact, "blockwise": run_blockwise}, args.repeats, warmup=2
                    )
                    rows.append(
                        {
                            "router": name,
                            "tokens": length,
                            "block": block,
                            "winners": winners,
                            "default": "yes" if winners == best else "",
                            "second_pass": -(-moe.num_experts // block) * winners,
                            "differ_pct": round(100 * differ / x.shape[0], 4),
                            "differ": f"{differ}/{x.shape[0]}",
                            "worst_seq_pct": round(100 * worst, 3),
                            "exact_ms": round(times["exact"] * 1e3, 3),
                            "blockwise_ms": round(times["blockwise"] * 1e3, 3),
                            "ratio": round(times["blockwise"] / times["exact"], 2),
                        }
                    )
        extra["routers"][name] = info
    return rows, extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096])
    ap.add_argument("--sequences", type=int, default=32, help="sequences per length (accuracy)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[DEFAULT_TOPK_BLOCK, 32])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--model", help="a DeepSeek checkpoint directory: its own router logits")
    ap.add_argument("--text", help="with --model: the text to route (UTF-8 file)")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args()
    if bool(args.model) != bool(args.text):
        ap.error("--model and --text go together")
    rows, extra = measure(args)
    if args.json:
        print(json.dumps({"benchmark": "routing", "rows": rows, **extra, "env": environment()}))
        return
    cols = [
        "router",
        "tokens",
        "block",
        "winners",
        "default",
        "second_pass",
        "differ_pct",
        "differ",
        "worst_seq_pct",
        "exact_ms",
        "blockwise_ms",
        "ratio",
    ]
    report("routing", rows, cols, extra)
    at_4k = [r for r in rows if r["tokens"] == 4096 and r["default"]]
    for r in at_4k:
        verdict = "beats" if r["differ_pct"] < FIELD_DIFF_PCT_4K else "does not beat"
        print(
            f"{r['router']} block {r['block']} (default winners {r['winners']}) at 4K: "
            f"{r['differ_pct']:.3f}% of tokens routed differently; {verdict} the field figure "
            f"{FIELD_DIFF_PCT_4K}%"
        )


if __name__ == "__main__":
    main()
