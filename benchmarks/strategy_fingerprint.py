"""Exact fingerprints of every KV strategy's perplexity run, to show a refactor changed nothing.

For each development text (every .txt/.md in benchmarks/texts but README.md) and each strategy
(the presets, every valid FORMAT+PLACEMENT+SELECTION with its defaults, and a few option
variants that exercise the tiers and the scorers), runs the perplexity protocol (`--tokens`
tokens, a `--prefill` prefill, chunks of `--chunk`) on the packaged SmolLM2 and records the
summed NLL as a float's hex (bit-exact), the bytes stored and the tokens kept. With
`--compare FILE` it prints every difference against a saved run and exits 1 if there is any.

    python benchmarks/strategy_fingerprint.py --out before.json        # on the old tree
    python benchmarks/strategy_fingerprint.py --compare before.json    # on the new one
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

TEXTS = Path(__file__).resolve().parent / "texts"
# Variants beyond the defaults: windows small enough that tiered runs use host and SSD,
# and the pruning scorers that observe attention.
VARIANTS = {
    "hierarchical_offload/small": (
        "hierarchical_offload",
        {"device_window": 128, "host_window": 128},
    ),
    "hybrid+tiered+all/small": ("hybrid+tiered+all", {"device_window": 128, "host_window": 128}),
    "learned_prune/snapkv": ("learned_prune", {"scorer": "snapkv"}),
    "learned_prune/h2o": ("learned_prune", {"scorer": "h2o"}),
    "hybrid+resident+pruned/knorm": ("hybrid+resident+pruned", {"scorer": "knorm"}),
}


def methods() -> dict[str, tuple[str, dict]]:
    """Name -> (strategy, options) for every run."""
    from unikv import kvstrategies
    from unikv.kvstrategies import composed

    out = {name: (name, {}) for name in kvstrategies.available()}
    for axes in composed.combinations():
        name = composed.name_of(axes)
        out[name] = (name, {})
    return out | VARIANTS


def run(args: argparse.Namespace) -> dict:
    import torch

    from unikv import kvstrategies
    from unikv.engine.assembly import assemble_for
    from unikv.engine.evaluate import perplexity, read_text
    from unikv.engine.loading import load_model
    from unikv.settings.config import PoolConfig, TierConfig

    torch.manual_seed(0)
    model, tok = load_model("smollm2", "float32", "cpu", False, "float32")
    texts = sorted(p for p in TEXTS.iterdir() if p.suffix in (".txt", ".md")
                   and p.name != "README.md")  # fmt: skip
    results: dict = {}
    todo = methods()
    if args.only:
        todo = {k: v for k, v in todo.items() if k in args.only}
    for name, (strategy, options) in todo.items():
        results[name] = {}
        for path in texts:
            ids = tok.encode(read_text(str(path)))[: args.tokens]
            with tempfile.TemporaryDirectory() as tmp:
                mb = 1 << 20
                tiers = (TierConfig("device", 256 * mb), TierConfig("host", 256 * mb))
                if not kvstrategies.get(strategy).evicts:  # a pruned cache refuses a store tier
                    tiers += (TierConfig("ssd", 512 * mb, path=tmp),)
                cfg = PoolConfig(tiers=tiers)
                t0 = time.perf_counter()
                with assemble_for(model, tok, strategy, cfg, None, options) as parts:
                    r = perplexity(model, ids, parts.kv.strategy, args.prefill, args.chunk)
            results[name][path.stem] = {
                "nll": float.hex(r.nll),
                "kv_bytes": r.kv_bytes,
                "kept_ratio": r.kept_ratio,
            }
            print(f"{name:34} {path.stem:16} ppl {math.exp(r.nll):8.4f}  "
                  f"{time.perf_counter() - t0:5.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    return results


def compare(new: dict, old: dict) -> list[str]:
    """Every (method, text) whose record differs, in words."""
    diffs = []
    for name, texts in new.items():
        for text, rec in texts.items():
            before = old.get(name, {}).get(text)
            if before is None:
                diffs.append(f"{name} {text}: not in the saved run")
            elif before != rec:
                diffs.append(f"{name} {text}: {before} -> {rec}")
    return diffs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=768)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--only", nargs="*", help="run only these method names")
    p.add_argument("--out", type=Path, help="save the fingerprints here (JSON)")
    p.add_argument("--compare", type=Path, help="a saved run to compare against")
    args = p.parse_args(argv)
    results = run(args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    if args.compare:
        diffs = compare(results, json.loads(args.compare.read_text()))
        print("\n".join(diffs) or "bit-identical: every method on every text")
        sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
