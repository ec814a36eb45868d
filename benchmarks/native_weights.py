"""`--weights native` against float32: the DESIGN protocol's PPL on every development text, on
the instruction set this process's kernels were built for.

The packaged GGUF (Q4_1 layers, a Q8_0 head) is loaded twice in this process, kept packed
(`native`: the kernels `engine.linear` chooses here) and decoded to float32 (the reference);
each text's first `--tokens` tokens go through a `full` cache (prefill 256, chunks of 16, every
token after the prefill scored), native and float32 alternating text by text. The default
(native) must stay within 0.1% of float32 on every text, on every machine: run it once per
instruction set, e.g.

    python benchmarks/native_weights.py
    UNIKV_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/native_weights.py

Prints a table and one JSON line (the CPU model, the kernels' instruction set, torch's
dispatch, each text's two PPLs and their change).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_profile import cpu_name  # noqa: E402
from unikv.engine.evaluate import perplexity  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.model import weight_formats  # noqa: E402
from unikv.kernels import gemv  # noqa: E402
from unikv.kvstrategies.kv import ContiguousKVCache  # noqa: E402

TEXTS = Path(__file__).resolve().parent / "texts"
NAMES = ["GPL-2", "GPL-3", "node-events", "python-compound", "vim-usr_03"]


def kernels_used(model) -> dict[str, str]:
    """GGUF weight type -> the kernels that multiply it packed (the memory report's words)."""
    return {f: "; ".join(w.how) for f, w in weight_formats(model).items()}


def ppl_by_text(models: dict, tok, tokens: int) -> dict[str, dict[str, float]]:
    """Each development text's first `tokens` tokens through a `full` cache, the models (label
    -> model, two of them) alternating text by text: text -> {label: PPL, "change": the first's
    PPL over the second's, less 1}."""
    (a, _), (b, _) = models.items()
    rows = {}
    for name in NAMES:
        path = next(TEXTS.glob(name + ".*"))
        ids = tok.encode(path.read_text())[:tokens]
        got = {}
        for label, m in models.items():
            c = m.cfg
            kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim, m.dtype)
            got[label] = perplexity(m, ids, kv).ppl
        got["change"] = got[a] / got[b] - 1
        rows[name] = got
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ref, tok = load_model("smollm2", progress=False, weights="float32")
    native, _ = load_model("smollm2", progress=False, weights="native")
    how = kernels_used(native)
    rows = ppl_by_text({"native": native, "float32": ref}, tok, args.tokens)
    worst = max(abs(r["change"]) for r in rows.values())
    where = f"{cpu_name()}; kernels {gemv.isa()} (int8: {gemv.i8_isa()}), torch " + str(
        torch.backends.cpu.get_cpu_capability()
    )
    print(where)
    print(f"weights: {how}")
    for name, r in rows.items():
        print(f"  {name:16s} {r['native']:.4f} / {r['float32']:.4f} ({r['change']:+.3%})")
    print(f"  worst |change| {worst:.3%} (tolerance 0.1%)")
    print(json.dumps({"cpu": where, "weights": how, "texts": rows, "worst": worst,
                      "settings": vars(args)}))  # fmt: skip


if __name__ == "__main__":
    main()
