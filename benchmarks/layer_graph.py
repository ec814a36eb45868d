"""A Llama layer's dense part three ways: torch ops (eager), `torch.compile` of the same ops, and
gemv.c's two layer calls (`engine/fused.py`), per decode step, in one process.

The dense part is everything of a layer but the KV seam: before attention, norm + QKV
projection + RoPE (`layer.qkv`); after it, output projection + residual + norm + SwiGLU MLP +
residual (`layer.out`). Each way runs both halves of every layer in turn (so the weights
stream from memory as in a decode step, not from cache), `--rows` activation rows, and the
step time is the median of `--repeats` passes over all layers after `--warmup` passes. The
compiled way is inductor's CPU backend over the ops path with the matmuls as custom ops
calling the same gemv.c entry points (a graph cannot see into a ctypes call otherwise), static
shapes, `cpp_wrapper` on; its compile time is printed. Outputs of the three ways are compared.

    python benchmarks/layer_graph.py [--weights native|float32] [--rows 1] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_profile import cpu_name  # noqa: E402
from unikv.engine import fused  # noqa: E402
from unikv.engine.linear import i8_weight  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.kernels import gemv  # noqa: E402

CPP_WRAPPER = "--python-wrapper" not in sys.argv


@torch.library.custom_op("unikv_bench::gemv_float", mutates_args=())
def _gemv_float(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return gemv.gemv_float(x, w)


@_gemv_float.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[0]))


@torch.library.custom_op("unikv_bench::gemv_i8", mutates_args=())
def _gemv_i8(
    x: torch.Tensor, blocks: torch.Tensor, head: torch.Tensor, qtype: str, rows16: bool
) -> torch.Tensor:
    return gemv.gemv_packed_i8(x, blocks, head, qtype, rows16=rows16)


@_gemv_i8.register_fake
def _(x, blocks, head, qtype, rows16):
    return x.new_empty((x.shape[0], blocks.shape[0]))


def _matmul(lin):
    """The layer's matmul as a function of x only, through the custom op its kernel needs."""
    w = lin.weight
    if lin.fmt == "float":
        return lambda x: _gemv_float(x, w.weight)
    blocks, head, rows16 = i8_weight(w)
    return lambda x: _gemv_i8(x, blocks, head, w.qtype, rows16)


def compiled_layers(m):
    """Per layer (qkv(x, pos), out(x, attn)) compiled by inductor; shared code, per-layer
    weights as closures (one graph per layer)."""
    cfg = m.cfg
    hq, hkv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    cos, ss = m.rope.cos, m.rope._sin_signed
    out = []
    for attn_norm, wqkv, wo, ffn_norm, wgu, wdown in m.layers:
        mq, mo, mgu, md = (_matmul(lin) for lin in (wqkv, wo, wgu, wdown))

        def qkv(x, pos, attn_norm=attn_norm, mq=mq):
            n = x.shape[0]
            t = mq(F.rms_norm(x, (x.shape[-1],), attn_norm, eps)).view(n, hq + 2 * hkv, d)
            qk, v = t.split([hq + hkv, hkv], dim=1)
            r = qk * cos[pos].unsqueeze(1) + qk.roll(d // 2, -1) * ss[pos].unsqueeze(1)
            q, k = r.split([hq, hkv], dim=1)
            return q.contiguous(), k.contiguous(), v.contiguous()

        def post(x, attn, ffn_norm=ffn_norm, mo=mo, mgu=mgu, md=md):
            x = x + mo(attn.reshape(x.shape[0], -1))
            gate, up = mgu(F.rms_norm(x, (x.shape[-1],), ffn_norm, eps)).chunk(2, dim=-1)
            return x + md(F.silu(gate) * up)

        opts = {"cpp_wrapper": CPP_WRAPPER}
        out.append((torch.compile(qkv, dynamic=False, fullgraph=True, options=opts),
                    torch.compile(post, dynamic=False, fullgraph=True, options=opts)))  # fmt: skip
    return out


def run_all(m, ways, x, pos, attn) -> list:
    """Both halves of every layer (the same input each time: what is timed is the weights)."""
    outs = []
    for li in range(m.cfg.num_layers):
        qkv, post = ways(li)
        outs.append((qkv(x, pos), post(x, attn)))
    return outs


def timed(m, ways, x, pos, attn, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run_all(m, ways, x, pos, attn)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_all(m, ways, x, pos, attn)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="native", choices=("native", "float32"))
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--python-wrapper", action="store_true",
                   help="inductor's Python wrapper instead of cpp_wrapper")  # fmt: skip
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    m, _ = load_model(args.model, progress=False, weights=args.weights)
    cfg = m.cfg
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, cfg.hidden_size, generator=g)
    pos = torch.arange(100, 100 + args.rows)
    attn = torch.randn(args.rows, cfg.num_heads, cfg.head_dim, generator=g)
    ways = {
        "ops": lambda li: (lambda a, b: fused.qkv_ops(m, li, a, b),
                           lambda a, b: fused.out_ops(m, li, a, b)),
        "native": lambda li: (lambda a, b: fused.qkv_native(m, li, a, b),
                              lambda a, b: fused.out_native(m, li, a, b)),
    }  # fmt: skip
    with torch.inference_mode():
        t0 = time.perf_counter()
        graphs = compiled_layers(m)
        run_all(m, lambda li: graphs[li], x, pos, attn)  # compiles every layer's two graphs
        compile_s = time.perf_counter() - t0
        ways["compiled"] = lambda li: graphs[li]
        results = {name: run_all(m, way, x, pos, attn) for name, way in ways.items()}
        ms = {}
        for _ in range(2):  # interleaved, twice; the faster of the two per way
            for name, way in ways.items():
                t = timed(m, way, x, pos, attn, args.warmup, args.repeats) * 1e3
                ms[name] = min(ms.get(name, t), t)
    ref = results["ops"]

    def err(outs) -> float:
        worst = 0.0
        for (qkv, o), (rqkv, ro) in zip(outs, ref, strict=True):
            for a, b in zip((*qkv, o), (*rqkv, ro), strict=True):
                worst = max(worst, ((a - b).norm() / b.norm()).item())
        return worst

    print(f"{cpu_name()}; {args.weights} weights, {args.rows} row(s), {args.threads} thread(s); "
          f"the dense part of all {cfg.num_layers} layers per step")  # fmt: skip
    print(f"  {'way':9s} {'ms/step':>8s} {'x ops':>6s} {'max rel. diff vs ops':>21s}")
    for name, t in ms.items():
        print(f"  {name:9s} {t:8.2f} {ms['ops'] / t:6.2f} {err(results[name]):21.1e}")
    print(f"  compile time (inductor, {2 * cfg.num_layers} graphs): {compile_s:.1f} s")
    print(json.dumps({"cpu": cpu_name(), "settings": vars(args), "ms_per_step": ms,
                      "compile_s": compile_s}))  # fmt: skip


if __name__ == "__main__":
    main()
