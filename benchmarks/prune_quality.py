"""Token pruning: perplexity change and passkey accuracy against the kept ratio, for every
scorer (the learned head and the in-house baselines), same model, same process (issue 6).

Perplexity: the protocol of docs/protocol.md (GPL-3, first `--tokens` tokens, prefill 256, chunks
of 16, every later token scored) through the pruning strategy, against the `full` cache of the same
run. Also kvpress's protocol (the one `kvpress_compare.py` runs its presses on): six windows of the
text at offsets 0, 1152, ..., each 1,024 tokens prefilled in one step (pruned once, at its end),
then the next 128 tokens fed in one step and scored. Passkey: `--samples` prompts of `--length`
tokens (needle at 10/50/90% depth; seed 1: seed 0's prompts were used when the head's defaults were
chosen). Every scorer runs at the same kept ratios; the achieved ratio is reported. Baselines run
in their published form (no recent share) unless given one. `head` uses the shipped head file
unless `--head FILE` (made by `unikv tune --kv_optimization=learned_prune`); `--chart PNG` draws
the curves (needs matplotlib: `make bench`).

    python benchmarks/prune_quality.py [--ratios 0.5 0.59 0.75] [--samples 12] [--head F]
        [--scorers streaming surprisal:recent_share=0.5 ...]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import named_options, report  # noqa: E402
from unikv import kvstrategies  # noqa: E402
from unikv.engine.evaluate import perplexity, read_text  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.passkey import passkey  # noqa: E402
from unikv.kvstrategies.kv import StepBatch  # noqa: E402
from unikv.kvstrategies.prune import SCORERS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "benchmarks" / "texts" / "GPL-3.txt"
COLUMNS = ["scorer", "kept", "ppl", "ppl_change_%", "passkey", "passkey_kept",
           "kvpress_change_%", "kvpress_kept"]  # fmt: skip


def chart(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.6))
    for scorer in dict.fromkeys(r["scorer"] for r in rows):
        pts = sorted((r["kept"], r["ppl_change_%"], r["passkey"]) for r in rows
                     if r["scorer"] == scorer)  # fmt: skip
        style = "o-" if scorer.startswith("head") else ".--"
        a.plot([p[0] for p in pts], [p[1] for p in pts], style, label=scorer)
        b.plot([p[0] for p in pts], [p[2] for p in pts], style, label=scorer)
    a.set(xlabel="kept ratio", ylabel="PPL change vs full (%)", title="perplexity (GPL-3)")
    b.set(xlabel="kept ratio", ylabel="accuracy", title="passkey", ylim=(-0.05, 1.05))
    # One legend for both panels, below them: inside an axes it covered the curves.
    handles, labels = a.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), frameon=False)
    rows_of_legend = -(-len(labels) // 4)
    fig.tight_layout(rect=(0, 0.06 * rows_of_legend, 1, 1))
    fig.savefig(path, dpi=120)


def kvpress_protocol(model, ids: list[int], kv, windows: int = 6) -> tuple[float, float]:
    """(PPL, kept ratio after the prefill) through `kv` on kvpress's protocol."""
    nll, kept = [], []
    for w in range(windows):
        window = torch.tensor(ids[w * 1152 : (w + 1) * 1152])
        if len(window) < 1152:
            raise ValueError(f"the text has {len(ids)} tokens; {windows} windows need more")
        ctx, tgt = window[:1024], window[1024:]
        last = model.forward(ctx, torch.arange(1024), kv, StepBatch([w], [1024]),
                             torch.tensor([1023]))  # fmt: skip
        kept.append(kv.stored_tokens(w) / 1024)
        rest = model.forward(tgt, torch.arange(1024, 1152), kv, StepBatch([w], [128]),
                             torch.arange(127))  # fmt: skip
        logp = torch.log_softmax(torch.cat([last, rest]).float(), dim=-1)
        nll.append(-logp.gather(1, tgt[:, None]).mean().item())
        kv.free(w)
    return math.exp(sum(nll) / windows), sum(kept) / windows


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
        default=list(SCORERS),
        help="scorer names, each optionally NAME:key=value,... (strategy options)",
    )
    p.add_argument("--head", default=None, help="the head file (default: the shipped one)")
    p.add_argument("--seed", type=int, default=1, help="passkey seed (0 was used for tuning)")
    p.add_argument("--chart", default=None, help="write a PNG chart here")
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2", progress=False)
    spec = model.kv_spec()
    all_ids = tok.encode(read_text(args.text))
    ids = all_ids[: args.tokens]
    full = kvstrategies.create("full", spec)
    base = perplexity(model, ids, full)
    base_pk = passkey(model, tok, full, args.length, args.samples, args.seed)
    base_kvp, _ = kvpress_protocol(model, all_ids, full)
    rows = [{"scorer": "full", "kept": 1.0, "ppl": base.ppl, "ppl_change_%": 0.0,
             "passkey": base_pk.accuracy, "kvpress_ppl": base_kvp}]  # fmt: skip
    for spec_ in args.scorers:
        scorer, given = named_options(spec_)
        for ratio in args.ratios:
            opts = {"scorer": scorer, "kept_ratio": ratio}
            if scorer != "head":  # baselines in their published form unless given
                opts["recent_share"] = 0.0
            opts |= given
            if scorer == "head":
                opts.setdefault("head", args.head)
            s = kvstrategies.create("learned_prune", spec, options=opts)
            res = perplexity(model, ids, s)
            pk = passkey(model, tok, s, args.length, args.samples, args.seed)
            kvp, kvp_kept = kvpress_protocol(model, all_ids, s)
            rows.append({
                "scorer": spec_, "kept": round(res.kept_ratio, 3), "ppl": res.ppl,
                "ppl_change_%": (res.ppl / base.ppl - 1) * 100, "passkey": pk.accuracy,
                "passkey_kept": round(pk.kept_ratio, 3), "kvpress_ppl": kvp,
                "kvpress_change_%": (kvp / base_kvp - 1) * 100, "kvpress_kept": round(kvp_kept, 3),
            })  # fmt: skip
            print(rows[-1], flush=True)
    if args.chart:
        chart(rows, args.chart)
    report(
        "prune_quality",
        rows,
        COLUMNS,
        {"tokens": len(ids), "passkey_length": args.length, "samples": args.samples},
    )


if __name__ == "__main__":
    main()
