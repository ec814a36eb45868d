"""Q4_K and Q6_K weights multiplied as their super-blocks, with float32 activations (`gemv.c`'s
`gemv_k`) and with int8 ones (`gemv_ki8`, the registry's first entry; where that path reads a
format interleaved by 16 rows, as the entry then holds it, that way too), against the same weights
decoded to float32 at load (what `--weights native` did before: `gemv_f32` over 4.5 or
7.1 times the bytes), in one process.

The packaged SmolLM2's rows are 576 wide, not whole 256-element super-blocks (llama-quantize
falls back to Q5_0 / Q8_0 for them), so this times synthetic weights the size of a 1B-class
model's layers: `--matrices` matrices of [`--out`, `--in`] random super-blocks with sane scales
(about `--mib` MiB of K-quant bytes in all, more than the caches), multiplied one after the
other as a decode step would, at `--rows` activation rows; the median of `--repeats` passes after
one untimed pass, the ways taking turns in each round. Every weight lies in huge pages, as the
engine's do (`memory.hugepages`; since 2026-12-06). Prints tokens/s-equivalent (passes per
second), the bytes each way reads per pass, GB/s, and a 1 GiB stream on the same threads
(`decode_profile.stream_gb_s`, the faster of one in 4 KiB pages and one in huge pages) before,
between and after the formats; the shares are of their median.

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

from benchmarks.decode_profile import cpu_name, stream_buffers, stream_gb_s  # noqa: E402
from tests.tinygguf import synthetic_blocks  # noqa: E402
from unikv.engine.quantized import FORMATS, QuantizedTensor, dequantize  # noqa: E402
from unikv.kernels import gemv  # noqa: E402
from unikv.memory import hugepages  # noqa: E402


def random_weight(fmt: str, out: int, in_: int, rng) -> QuantizedTensor:
    """Random `fmt` super-blocks, held in huge pages as the engine holds its weights."""
    raw = torch.from_numpy(synthetic_blocks((out, in_), fmt, rng).copy())
    return QuantizedTensor(fmt, hugepages.place(raw.view(out, -1, FORMATS[fmt])))


def stream_now(bufs: dict) -> float:
    """The faster of a sum over 4 KiB pages and one over huge pages (`decode_profile`)."""
    return max(stream_gb_s(b) for b in bufs.values())


def passes_per_s(fns: dict, repeats: int) -> dict:
    """Passes per second of each way (the median of `repeats`), the ways taking turns in each
    round after one untimed pass each, so a drift in this machine's pace reaches them alike."""
    for fn in fns.values():
        fn()
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1 / statistics.median(t) for name, t in times.items()}


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
    bufs = stream_buffers()
    streams = [stream_now(bufs)]
    rows = []
    for fmt in ("Q4_K", "Q6_K"):
        one = args.out * args.in_ // 256 * FORMATS[fmt]
        count = max(1, (args.mib << 20) // one)
        qs = [random_weight(fmt, args.out, args.in_, rng) for _ in range(count)]
        # the two int8 ways first, side by side in memory and in each round: with the interleaved
        # copy made after the 1.8 GB of float32 weights and timed after them, the same kernel
        # read 25-28 GB/s where it reads 32-38 made beside the GGUF blocks (AMD EPYC, Zen 4)
        ways = {"i8": lambda qs=qs, f=fmt: [gemv.gemv_kquant_i8(x, q.blocks, f) for q in qs]}
        if gemv.can_interleave(fmt, args.out):  # the int8 entry's form for Q4_K
            r16 = [hugepages.place(gemv.interleave(q.blocks, fmt)) for q in qs]
            ways["i8_rows16"] = lambda r16=r16, f=fmt: [
                gemv.gemv_kquant_i8(x, b, f, rows16=True) for b in r16
            ]
        dense = [hugepages.place(dequantize(q)) for q in qs]
        ways["packed"] = lambda qs=qs, f=fmt: [gemv.gemv_kquant(x, q.blocks, f) for q in qs]
        ways["float32"] = lambda d=dense: [gemv.gemv_float(x, w) for w in d]
        rate = passes_per_s(ways, args.repeats)
        del qs, dense, ways
        streams.append(stream_now(bufs))  # after each format
        i16 = rate.get("i8_rows16")
        kq_bytes, f_bytes = count * one, count * args.out * args.in_ * 4
        rows.append({"format": fmt, "matrices": count, "packed_pass_s": rate["packed"],
                     "float32_pass_s": rate["float32"], "ratio": rate["packed"] / rate["float32"],
                     "i8_pass_s": rate["i8"], "i8_gb_s": kq_bytes * rate["i8"] / 1e9,
                     "i8_rows16_pass_s": i16,
                     "i8_rows16_gb_s": kq_bytes * i16 / 1e9 if i16 else None,
                     "packed_gb_s": kq_bytes * rate["packed"] / 1e9,
                     "float32_gb_s": f_bytes * rate["float32"] / 1e9,
                     "packed_mib": kq_bytes / 2**20, "float32_mib": f_bytes / 2**20})  # fmt: skip
    # the shares below against the median of the three streams (this VM's stream has read
    # 25-55 GB/s within an hour: one odd reading is not the yardstick)
    stream = statistics.median(streams)
    print(f"{cpu_name()}, kernels {gemv.isa()}; {args.rows} row(s), {args.threads} thread(s); "
          f"a {args.threads}-thread stream reads "
          f"{', '.join(f'{v:.1f}' for v in streams)} GB/s (before, between, after; the "
          f"shares against their median, {stream:.1f})")  # fmt: skip
    for r in rows:
        print(f"  {r['format']}: {r['matrices']} x [{args.out}, {args.in_}]: packed "
              f"{r['packed_pass_s']:.1f} passes/s ({r['packed_mib']:.0f} MiB, "
              f"{r['packed_gb_s']:.1f} GB/s = {r['packed_gb_s'] / stream:.0%} of the stream); "
              f"decoded at load {r['float32_pass_s']:.1f} ({r['float32_mib']:.0f} MiB, "
              f"{r['float32_gb_s']:.1f} GB/s): {r['ratio']:.2f}x; int8 activations "
              f"{r['i8_pass_s']:.1f} passes/s ({r['i8_gb_s']:.1f} GB/s = "
              f"{r['i8_gb_s'] / stream:.0%} of the stream, "
              f"{r['i8_pass_s'] / r['packed_pass_s']:.2f}x float32 activations)")  # fmt: skip
        if r["i8_rows16_pass_s"]:
            print(f"    int8 activations, rows interleaved by 16: {r['i8_rows16_pass_s']:.1f} "
                  f"passes/s ({r['i8_rows16_gb_s']:.1f} GB/s = "
                  f"{r['i8_rows16_gb_s'] / stream:.0%} of the stream, "
                  f"{r['i8_rows16_pass_s'] / r['i8_pass_s']:.2f}x the GGUF order)")  # fmt: skip
    print(json.dumps({"cpu": cpu_name(), "isa": gemv.isa(), "stream_gb_s": streams,
                      "settings": vars(args), "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
