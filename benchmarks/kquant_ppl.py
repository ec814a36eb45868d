"""Int8 activations on K-quant weights: the DESIGN protocol's PPL on every development text, the
K-quant matmuls multiplied with int8 activations (`gemv_ki8`, the registry's first entry) against
the same weights with float32 activations (`gemv_k`), in one process.

The packaged SmolLM2's only matrices whose rows hold whole 256-element super-blocks are the
ffn_down projections (1,536 wide): each is quantized here to `--format` (Q4_K or Q6_K, by
`tests/tinygguf.quantize_k`, round to nearest), the rest of the model stays float32. The model is
loaded twice, each ffn_down pinned to one matmul entry; each text's first `--tokens` tokens go
through a `full` cache (prefill 256, chunks of 16, every token after the prefill scored), the two
alternating text by text. Int8 activations may be the default only within 0.1% of float32
activations on every text (engine/linear.py's EXACT_PACKED promise); run once per instruction
set, e.g.

    python benchmarks/kquant_ppl.py --format Q4_K
    UNIKV_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/kquant_ppl.py --format Q6_K

Prints a table and one JSON line (the CPU model, the kernels' paths, each text's PPLs and the
change).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_profile import cpu_name  # noqa: E402
from benchmarks.native_weights import ppl_by_text  # noqa: E402
from tests.tinygguf import quantize_k  # noqa: E402
from unikv.engine.linear import Linear, PackedWeight  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.quantized import FORMATS, QuantizedTensor  # noqa: E402
from unikv.kernels import gemv, operators  # noqa: E402

ENTRIES = {"int8": "gemv_i8", "float32": "gemv"}  # activations -> the matmul entry pinned


def with_k_quant_down(model, fmt: str, entry: str):
    """`model` with every ffn_down replaced by its `fmt` super-blocks, multiplied by `entry` alone
    (a breaker holding that one implementation)."""
    op = f"matmul.{fmt.lower()}"
    impl = next(i for i in operators.implementations(op, "cpu") if i.name == entry)
    for li, layer in enumerate(model.layers):
        w = layer[5].to_dense().numpy()
        blocks = torch.from_numpy(quantize_k(w, fmt).copy()).view(w.shape[0], -1, FORMATS[fmt])
        packed = PackedWeight(QuantizedTensor(fmt, blocks), torch.float32)
        model.layers[li] = (*layer[:5], Linear(packed, operators.Breaker(op, [impl]), fmt))
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", choices=("Q4_K", "Q6_K"), default="Q4_K")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    models = {}
    for label, entry in ENTRIES.items():
        m, tok = load_model("smollm2", progress=False, weights="float32")
        models[label] = with_k_quant_down(m, args.format, entry)
    rows = ppl_by_text(models, tok, args.tokens)  # int8 first: the change is int8 / float32
    worst = max(abs(r["change"]) for r in rows.values())
    where = f"{cpu_name()}; kernels {gemv.isa()} (int8: {gemv.i8_isa()})"
    print(f"{where}; ffn_down as {args.format}, int8 against float32 activations")
    for name, r in rows.items():
        print(f"  {name:16s} {r['int8']:.4f} / {r['float32']:.4f} ({r['change']:+.3%})")
    print(f"  worst |change| {worst:.3%} (tolerance 0.1%)")
    print(json.dumps({"cpu": where, "format": args.format, "texts": rows, "worst": worst,
                      "settings": vars(args)}))  # fmt: skip


if __name__ == "__main__":
    main()
