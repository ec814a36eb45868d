"""Q4_K and Q6_K weights multiplied as their super-blocks, with float32 activations (`gemv.c`'s
`gemv_k`) and with int8 ones (`gemv_ki8`, the registry's first entry), against the same weights
decoded to float32 at load (what `--weights native` did before: `gemv_f32` over 4.5 or
7.1 times the bytes), in one process.

The packaged SmolLM2's rows are 576 wide, not whole 256-element super-blocks (llama-quantize
falls back to Q5_0 / Q8_0 for them), so this times synthetic weights the size of a 1B-class
model's layers: `--matrices` matrices of [`--out`, `--in`] random super-blocks with sane scales
(about `--mib` MiB of K-quant bytes in all, more than the caches), multiplied one after the
other as a decode step would, at `--rows` activation rows; the median of `--repeats` passes after
one untimed pass. Prints tokens/s-equivalent (passes per second), the bytes each way reads per
pass, GB/s, and a 1 GiB stream on the same threads (`decode_profile.stream_gb_s`).

    python benchmarks/kquant_speed.py [--rows 1] [--threads 2] [--mib 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_profile import cpu_name, stream_gb_s  # noqa: E402
from tests.tinygguf import synthetic_blocks  # noqa: E402
from unikv.engine.quantized import FORMATS, QuantizedTensor, dequantize  # noqa: E402
from unikv.kernels import gemv  # noqa: E402


def random_weight(fmt: str, out: int, in_: int, rng) -> QuantizedTensor:
    raw = synthetic_blocks((out, in_), fmt, rng)
    return QuantizedTensor(fmt, torch.from_numpy(raw.copy()).view(out, -1, FORMATS[fmt]))


def passes_per_s(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1 / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=int, default=8192)
    p.add_argument("--in", dest="in_", type=int, default=2048)
    p.add_argument("--mib", type=int, default=256, help="K-quant bytes in all (per format)")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    if gemv.unavailable() is not None:
        raise SystemExit(f"gemv.c is unavailable here: {gemv.unavailable()}")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    x = torch.randn(args.rows, args.in_)
    rows = []
    for fmt in ("Q4_K", "Q6_K"):
        one = args.out * args.in_ // 256 * FORMATS[fmt]
        count = max(1, (args.mib << 20) // one)
        qs = [random_weight(fmt, args.out, args.in_, rng) for _ in range(count)]
        packed = passes_per_s(lambda qs=qs, f=fmt: [gemv.gemv_kquant(x, q.blocks, f) for q in qs],
                              args.repeats)  # fmt: skip
        i8 = passes_per_s(lambda qs=qs, f=fmt: [gemv.gemv_kquant_i8(x, q.blocks, f) for q in qs],
                          args.repeats)  # fmt: skip
        dense = [dequantize(q) for q in qs]
        del qs
        floats = passes_per_s(lambda d=dense: [gemv.gemv_float(x, w) for w in d], args.repeats)
        del dense
        kq_bytes, f_bytes = count * one, count * args.out * args.in_ * 4
        rows.append({"format": fmt, "matrices": count, "packed_pass_s": packed,
                     "float32_pass_s": floats, "ratio": packed / floats,
                     "i8_pass_s": i8, "i8_gb_s": kq_bytes * i8 / 1e9,
                     "packed_gb_s": kq_bytes * packed / 1e9,
                     "float32_gb_s": f_bytes * floats / 1e9,
                     "packed_mib": kq_bytes / 2**20, "float32_mib": f_bytes / 2**20})  # fmt: skip
    stream = stream_gb_s(args.threads)
    print(f"{cpu_name()}, kernels {gemv.isa()}; {args.rows} row(s), {args.threads} thread(s); "
          f"a {args.threads}-thread stream reads {stream:.1f} GB/s")  # fmt: skip
    for r in rows:
        print(f"  {r['format']}: {r['matrices']} x [{args.out}, {args.in_}]: packed "
              f"{r['packed_pass_s']:.1f} passes/s ({r['packed_mib']:.0f} MiB, "
              f"{r['packed_gb_s']:.1f} GB/s = {r['packed_gb_s'] / stream:.0%} of the stream); "
              f"decoded at load {r['float32_pass_s']:.1f} ({r['float32_mib']:.0f} MiB, "
              f"{r['float32_gb_s']:.1f} GB/s): {r['ratio']:.2f}x; int8 activations "
              f"{r['i8_pass_s']:.1f} passes/s ({r['i8_gb_s']:.1f} GB/s = "
              f"{r['i8_gb_s'] / stream:.0%} of the stream, "
              f"{r['i8_pass_s'] / r['packed_pass_s']:.2f}x float32 activations)")  # fmt: skip
    print(json.dumps({"cpu": cpu_name(), "isa": gemv.isa(), "stream_gb_s": stream,
                      "settings": vars(args), "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
