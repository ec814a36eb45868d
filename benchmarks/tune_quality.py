"""Quantization-aware tuning for `hybrid_fp16_int4`: does the gap to the full cache shrink?

The protocol of docs/protocol.md on held-out text (default GPL-3, which the tuning never sees; it
tunes on GPL-2): the first 2048 tokens, prefill 256, then chunks of 16. For the base model and for
the model tuned by `unikv tune --kv_optimization=hybrid_fp16_int4` (for the tightest setting,
`TIGHT`), in the same process: PPL with the `full` cache, and with `hybrid_fp16_int4` at the tight
setting and the looser ones; the gap (hybrid over full) before and after, and how much of it is
left. The tuning runs in this process first (or `--tuned DIR` reuses a finished run).

    python benchmarks/tune_quality.py [--steps 70] [--out /tmp/unikv-tuned] [--tuned DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from benchmarks.kv_quant_quality import label  # noqa: E402
from unikv.engine.assembly import build_kv  # noqa: E402
from unikv.engine.evaluate import perplexity, read_text  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.tune import TuneSettings, tune_hybrid  # noqa: E402
from unikv.settings.config import PoolConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ROOT / "benchmarks" / "texts"
# Tightest first: 2.84 bits (keys 16 int4 + 48 int2, values 12 int4 + 52 int2, fp8 headers),
# then the <= 3.2-bit setting of the README and the default (4.39 bits).
TIGHT = {"scales": "fp8", "fp16_share": 0.0, "low_share": 0.75, "v_low_share": 0.8125}
SETTINGS = [
    TIGHT,
    {"scales": "fp8", "fp16_share": 0.0, "low_share": 0.5625, "v_low_share": 0.6875},
    {},
]


def ppl(model, tok, ids, name, options=None) -> float:
    spec = model.kv_spec()
    kv = build_kv(spec, name, PoolConfig(), options=options, model=model,
                  tokenizer=tok).strategy  # fmt: skip
    return perplexity(model, ids, kv).ppl


def measure(model_arg: str, text: str, tokens: int) -> dict:
    model, tok = load_model(model_arg, progress=False)
    ids = tok.encode(text)[:tokens]
    out = {"full": ppl(model, tok, ids, "full")}
    for i, opts in enumerate(SETTINGS):
        out[i] = ppl(model, tok, ids, "hybrid_fp16_int4", opts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-text", nargs="+", default=[str(TEXTS / "GPL-2.txt")])
    ap.add_argument("--held-out", default=str(TEXTS / "GPL-3.txt"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=TuneSettings.steps)
    ap.add_argument("--lr", type=float, default=TuneSettings.lr)
    ap.add_argument("--lambda", dest="lam", type=float, default=TuneSettings.lam)
    ap.add_argument("--anchor", type=float, default=TuneSettings.anchor)
    ap.add_argument("--out", default="/tmp/unikv-tuned", help="where the tuned model goes")
    ap.add_argument("--tuned", default=None, help="a finished tuning directory: skip the tuning")
    args = ap.parse_args()
    held_out = read_text(args.held_out)

    tune_seconds = None
    if args.tuned is None:
        text = "\n\n".join(read_text(p) for p in args.train_text)
        shutil.rmtree(args.out, ignore_errors=True)
        settings = TuneSettings(steps=args.steps, lr=args.lr, lam=args.lam, anchor=args.anchor)
        t0 = time.perf_counter()
        tune_hybrid("smollm2", text, args.out, settings, TIGHT)
        tune_seconds = time.perf_counter() - t0
    tuned = args.tuned or args.out
    before = measure("smollm2", held_out, args.tokens)
    after = measure(tuned, held_out, args.tokens)

    rows = [{"cache": "full", "ppl_before": before["full"], "ppl_after": after["full"],
             "change_%": 100 * (after["full"] / before["full"] - 1)}]  # fmt: skip
    for i, opts in enumerate(SETTINGS):
        gb = 100 * (before[i] / before["full"] - 1)
        ga = 100 * (after[i] / after["full"] - 1)
        rows.append({"cache": label(opts), "ppl_before": before[i], "ppl_after": after[i],
                     "gap_before_%": gb, "gap_after_%": ga,
                     "gap_left": ga / gb if gb > 0 else None})  # fmt: skip
    report("tune_quality", rows,
           ["cache", "ppl_before", "ppl_after", "change_%", "gap_before_%", "gap_after_%",
            "gap_left"],
           {"tune_seconds": tune_seconds, "tuned": str(tuned), "steps": args.steps,
            "train_text": args.train_text, "held_out": args.held_out})  # fmt: skip


if __name__ == "__main__":
    main()
