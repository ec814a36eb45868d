"""Perplexity of each KV strategy on every development text, against `full` on the same text.

The DESIGN protocol (`unikv eval ppl`: `--tokens` tokens of each text, a `--prefill`-token
prefill, then chunks of `--chunk`), one model load, the strategies built through the engine's
assembly as `unikv eval ppl --strategy S` builds them (calibration and pruning head as shipped).
Reported per strategy: the PPL change on each text, the mean and the worst (defaults are
chosen by the worst, never the best), and bits per element (bytes stored ÷ all tokens seen).

    python benchmarks/quality_texts.py [--strategies full hybrid_fp16_int4 ...] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from engine.assembly import assemble_for  # noqa: E402
from engine.evaluate import perplexity, read_text  # noqa: E402
from engine.loading import load_model  # noqa: E402

TEXTS = Path(__file__).resolve().parent / "texts"
DEFAULT = ["full", "hybrid_fp16_int4", "learned_prune", "hybrid+resident+pruned",
           "int8+resident+all"]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", nargs="+", default=DEFAULT)
    p.add_argument("--texts", nargs="+", default=None, help="files (default: benchmarks/texts)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--prefill", type=int, default=256)
    p.add_argument("--chunk", type=int, default=16)
    args = p.parse_args()
    torch.set_num_threads(2)
    texts = [Path(t) for t in args.texts] if args.texts else sorted(
        t for t in TEXTS.iterdir() if t.suffix in (".txt", ".md") and t.name != "README.md"
    )  # fmt: skip
    model, tok = load_model("smollm2", progress=False)
    names = ["full", *[s for s in args.strategies if s != "full"]]
    ppl: dict[str, dict[str, float]] = {s: {} for s in names}
    bits: dict[str, list[float]] = {s: [] for s in names}
    for text in texts:
        ids = tok.encode(read_text(str(text)))[: args.tokens]
        for s in names:
            with assemble_for(model, tok, s, None, None, progress=False) as parts:
                r = perplexity(model, ids, parts.kv.strategy, args.prefill, args.chunk)
            ppl[s][text.stem] = r.ppl
            bits[s].append(r.bits_per_element)
            print(json.dumps({"text": text.stem, "strategy": s, "ppl": r.ppl,
                              "bits": r.bits_per_element}), flush=True)  # fmt: skip
    rows = []
    for s in names:
        change = {t: ppl[s][t] / ppl["full"][t] - 1 for t in ppl[s]}
        row = {"strategy": s, "bits": statistics.mean(bits[s])}
        row |= {t: f"{100 * c:+.2f}%" for t, c in change.items()}
        row["mean"] = f"{100 * statistics.mean(change.values()):+.2f}%"
        row["worst"] = f"{100 * max(change.values()):+.2f}%"
        rows.append(row)
    cols = ["strategy", "bits", *[t.stem for t in texts], "mean", "worst"]
    report("quality_texts", rows, cols, {"ppl": ppl, "tokens": args.tokens})


if __name__ == "__main__":
    main()
