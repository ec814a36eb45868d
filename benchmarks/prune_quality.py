"""Token pruning: perplexity change and passkey accuracy against the kept ratio, for every
scorer (the learned head and the in-house baselines), same model, same process (issue 6).

Perplexity: DESIGN.md's protocol (GPL-3, first `--tokens` tokens, prefill 256, chunks of 16,
every later token scored) through the pruning strategy, against the `full` cache of the same
run. Passkey: `--samples` prompts of `--length` tokens (needle at 10/50/90% depth). Every
scorer runs at the same kept ratios; the achieved ratio is reported. With `--head FILE` (made
by `unikv tune --kv_optimization=learned_prune`) the head runs too; `--chart PNG` draws both
curves (needs matplotlib: `make bench`).

    python benchmarks/prune_quality.py [--ratios 0.5 0.59 0.75] [--samples 12] [--head F]
        [--scorers streaming surprisal:recent_share=0.5 ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kvstrategies  # noqa: E402
from benchmarks.common import report  # noqa: E402
from engine.evaluate import perplexity, read_text  # noqa: E402
from engine.model import load_model  # noqa: E402
from engine.passkey import passkey  # noqa: E402
from kvstrategies.prune import SCORERS, PruneStrategy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT.parent / "shared" / "texts" / "GPL-3.txt"


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for scorer in dict.fromkeys(r["scorer"] for r in rows):
        pts = sorted((r["kept"], r["ppl_change_%"], r["passkey"]) for r in rows
                     if r["scorer"] == scorer)  # fmt: skip
        style = "o-" if scorer.startswith("head") else ".--"
        a.plot([p[0] for p in pts], [p[1] for p in pts], style, label=scorer)
        b.plot([p[0] for p in pts], [p[2] for p in pts], style, label=scorer)
    a.set(xlabel="kept ratio", ylabel="PPL change vs full (%)", title="perplexity (GPL-3)")
    b.set(xlabel="kept ratio", ylabel="accuracy", title="passkey", ylim=(-0.05, 1.05))
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", default=str(TEXT))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.59, 0.75])
    p.add_argument("--length", type=int, default=1024, help="passkey prompt tokens")
    p.add_argument("--samples", type=int, default=12, help="passkey prompts per point")
    p.add_argument(
        "--scorers",
        nargs="+",
        default=[s for s in SCORERS if s != "head"],
        help="scorer names, each optionally NAME:key=value,... (strategy options)",
    )
    p.add_argument("--head", default=None, help="a pruning head file: run the head too")
    p.add_argument("--recency", type=float, default=None, help="the head's recency weight")
    p.add_argument(
        "--recent-share", type=float, default=0.0, help="budget share for the newest tokens"
    )
    p.add_argument("--chart", default=None, help="write a PNG chart here")
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2", progress=False)
    spec = kvstrategies.KVSpec.for_model(model)
    ids = tok.encode(read_text(args.text))[: args.tokens]
    full = kvstrategies.create("full", spec)
    base = perplexity(model, ids, full)
    base_pk = passkey(model, tok, full, args.length, args.samples)
    rows = [{"scorer": "full", "kept": 1.0, "ppl": base.ppl, "ppl_change_%": 0.0,
             "passkey": base_pk.accuracy}]  # fmt: skip
    scorers = list(args.scorers) + (["head"] if args.head else [])
    for spec_ in scorers:
        scorer, _, extra = spec_.partition(":")
        given = {k: float(v) for k, v in (kv.split("=") for kv in extra.split(",") if kv)}
        for ratio in args.ratios:
            opts = {"scorer": scorer, "kept_ratio": ratio, "recent_share": args.recent_share}
            opts |= given
            if scorer == "head":
                opts["head"] = args.head
                if args.recency is not None:
                    opts["recency"] = args.recency
            s = PruneStrategy.create(spec, options=opts)
            res = perplexity(model, ids, s)
            pk = passkey(model, tok, s, args.length, args.samples)
            rows.append({
                "scorer": spec_, "kept": round(res.kept_ratio, 3), "ppl": res.ppl,
                "ppl_change_%": (res.ppl / base.ppl - 1) * 100, "passkey": pk.accuracy,
                "passkey_kept": round(pk.kept_ratio, 3),
            })  # fmt: skip
            print(rows[-1], flush=True)
    if args.chart:
        chart(rows, args.chart)
    report(
        "prune_quality",
        rows,
        ["scorer", "kept", "ppl", "ppl_change_%", "passkey", "passkey_kept"],
        {"tokens": len(ids), "passkey_length": args.length, "samples": args.samples},
    )


if __name__ == "__main__":
    main()
