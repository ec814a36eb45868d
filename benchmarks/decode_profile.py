"""Where a batch-1 decode step's time goes: matmul, attention (KV append + attend), norm, rope,
the rest of the tensor ops, sampling, and Python (the step's wall time that no op accounts for).

Runs `--steps` greedy decode steps of the real model after a `--context`-token prefill, under
`torch.profiler` (CPU activities, with Python stacks), and charges every operator's self time
to the part of the step its innermost unikv frame belongs to: `kvstrategies/` is attention (KV
append and attend), `engine/linear.py`'s matmuls and norm, the model's RoPE table, sampling
(the argmax), and the rest of the tensor ops (residual adds, SiLU, splits, views). The matmul
C kernel (`unikv/kernels/gemv.c`, called through ctypes) is no torch op: its time is the self
time of the Python functions in `unikv/kernels/gemv.py` that call it (and the attention kernel's,
`unikv/kernels/sparse.c`, of those in `unikv/kernels/sparse.py`). The profiler costs
microseconds per op, so the step's wall time is also measured without it; "python" is that wall
time minus the ops' share of the profiled run, scaled to the unprofiled one.

    python benchmarks/decode_profile.py [--context 64] [--steps 32] [--rounds 5] [--strategy full]
        [--weights float32|native] [--threads 2] [--layer native|ops] [--step native|layers]
        [--isas avx512,avx2 [--repeats 2]] [--inside]

`--step layers` runs a decode step layer by layer (gemv.c's two layer calls each, the strategy's
`append` and `attend` between them) instead of one gemv.c call for every layer (`model.layers`,
where the strategy describes its step as plain arenas: `full`): the baseline of that call.
`--layer ops` runs a Llama layer's dense part as torch ops (each matmul, norm and RoPE through
its registry entry) instead of gemv.c's two layer calls (`engine/fused.py`): the baseline of
what those calls save.

`--inside` splits the one C call of the timed steps (gemv.c's run_step, built with
STEP_PROFILE: a clock read around each part, about 1% of the step) per thread: making each
product's activations, multiplying, waiting at a barrier, the fork and join of each layer's
parallel region, and on the calling thread RoPE, a sparse choice and the attention (the KV
writes and the strategy's kernel); "the rest" is the norms, residual adds and SiLU, and a
thread's idle time between the regions. It also prints the bytes each kind of matrix read over
its multiplying time: how near the products alone come to the stream.

Each run reports the matmuls' effective bandwidth (the bytes of every weight a step reads,
over the matmul time), the whole step's (those bytes times tokens/s) against a stream over a
1 GiB buffer in the same run (issue 34's goal: 85% of it), and the CPU model and instruction
sets. `--isas` runs the profile once per instruction set in a child process (`UNIKV_ISA` for the
C kernels and `ATEN_CPU_CAPABILITY` for PyTorch's own, both read at start-up), once more for the
first with `--layer ops` and with `--step layers`, plus the PyTorch-only
baseline (`UNIKV_NO_KERNEL=1`: MKL's or oneDNN's float32 products, whatever the vendor
dispatch does), interleaved `--repeats` times, one process at a time, and prints the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kv_quant_speed import build, context_ids, decode, prefill  # noqa: E402
from unikv.engine import fused  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.model import step_weight_bytes  # noqa: E402
from unikv.kernels import gemv  # noqa: E402
from unikv.kernels import native as ckernels  # noqa: E402
from unikv.kernels.operators import summary  # noqa: E402
from unikv.memory import hugepages  # noqa: E402

# (path fragment, function name or None for any) -> part; the first match, innermost frame first
RULES = [
    ("kvstrategies/", None, "attention"),
    ("engine/linear.py", "rms_norm", "norm"),
    ("engine/linear.py", "_fused_rms_norm", "norm"),
    ("engine/linear.py", None, "matmul"),
    ("engine/model.py", "apply", "rope"),
    ("benchmarks/kv_quant_speed.py", "decode", "sampling"),
    ("engine/model.py", None, "other ops"),
]
# The Python frames that call the matmul C kernel (unikv/kernels/gemv.c).
C_KERNEL = "unikv/kernels/gemv.py("
# ... and the attention C kernel (unikv/kernels/sparse.c: a decode step's whole-cache attention)
ATTENTION_KERNEL = "unikv/kernels/sparse.py("
LAYER_CALLS = (": layer_qkv", ": layer_out")  # ... and gemv.c's whole-layer calls (engine/fused.py)
# ... and its every-layer call (the KV writes and sparse.c's attention inside it)
STEP_CALL = ": decode_layers"
# ... and its whole-step call (model.step: the embedding, every layer and the output layer)
WHOLE_CALL = ": decode_step"
# The parts whose calls read the weights (the whole-step call's time includes its attention: at
# a short context a few percent of it)
WEIGHT_PARTS = ("matmul", "layer (gemv.c)", "layers + attention (gemv.c)",
                "step: layers + attention + output (gemv.c)")  # fmt: skip


def part_of(event) -> str:
    """The part of the step an op belongs to, by the innermost Python frame a rule knows (the
    profiler records Python calls as events: an op's ancestors are its stack)."""
    e = event.cpu_parent
    while e is not None:
        for path, fn, part in RULES:
            if path in e.name and (fn is None or e.name.endswith(": " + fn)):
                return part
        e = e.cpu_parent
    return "other ops"


def is_python(event) -> bool:
    return ".py(" in event.name or event.name.startswith("<built-in")


def cpu_name() -> str:
    """The CPU's model name and the instruction sets it offers ("AMD EPYC (avx512, avx2)")."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        "unknown CPU")  # fmt: skip
    except OSError:
        name = "unknown CPU"
    flags = set(ckernels.cpu_flags().split())
    isas = [i for i, need in ckernels.ISA_NEEDS.items() if need and flags >= set(need)]
    return f"{name} ({', '.join(isas) or 'baseline'})"


def stream_buffers(gib: int = 1) -> dict[str, torch.Tensor]:
    """Two float32 buffers of `gib` GiB (larger than any cache), faulted in: "4k" in the
    allocator's 4 KiB pages, "huge" in huge pages as the weights are (`memory.hugepages`;
    where they are off, the same 4 KiB pages)."""
    bufs = {"4k": torch.ones(gib << 28)}
    bufs["huge"] = hugepages.place(bufs["4k"])
    return bufs


def stream_gb_s(buf: torch.Tensor, repeats: int = 3) -> float:
    """Memory read bandwidth in GB/s: the fastest of `repeats` sums over `buf` (one of
    `stream_buffers`) on torch's threads, after one pass."""
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def compare(args: argparse.Namespace) -> None:
    """One child run per instruction set and the PyTorch-only baseline, interleaved."""
    isas = args.isas.split(",")
    configs = {isa: ({"UNIKV_ISA": isa, "ATEN_CPU_CAPABILITY": "avx2" if isa != "avx512" else
                      "avx512"}, []) for isa in isas}  # fmt: skip
    # the same kernels with a layer's dense part as torch ops (what the native layer call saves)
    configs[f"{isas[0]}, ops"] = (configs[isas[0]][0], ["--layer", "ops"])
    # ... and with the two layer calls, layer by layer (what the one-call step saves)
    configs[f"{isas[0]}, layer by layer"] = (configs[isas[0]][0], ["--step", "layers"])
    configs["pytorch"] = ({"UNIKV_NO_KERNEL": "1"}, [])
    child = [sys.executable, __file__, "--model", args.model, "--weights", args.weights,
             "--context", str(args.context), "--steps", str(args.steps), "--strategy",
             args.strategy, "--threads", str(args.threads)]  # fmt: skip
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    for _ in range(args.repeats):
        for name, (env, extra) in configs.items():
            proc = subprocess.run([*child, *extra], env={**os.environ, **env},
                                  capture_output=True, text=True, check=True)  # fmt: skip
            runs[name].append(json.loads(proc.stdout.splitlines()[-1]))
    table = {}
    for name, rs in runs.items():
        table[name] = {
            "tok_s": statistics.median(r["tok_s"] for r in rs),
            "matmul_ms": statistics.median(
                sum(r["ms_by_part"].get(k, 0.0) for k in WEIGHT_PARTS) for r in rs
            ),
            "matmul_gb_s": statistics.median(r["matmul_gb_s"] for r in rs),
            "stream_gb_s": statistics.median(r["stream_gb_s"] for r in rs),
            "bandwidth_share": statistics.median(r["bandwidth_share"] for r in rs),
            "kernels": rs[-1]["kernels"],
        }
    base = table["pytorch"]["tok_s"]
    print(f"{cpu_name()}; {args.weights} weights, {args.strategy}, {args.threads} thread(s), "
          f"median of {args.repeats}")  # fmt: skip
    print(f"  {'run':22s} {'tok/s':>7s} {'x base':>7s} {'matmul ms':>10s} {'GB/s':>6s} "
          f"{'stream GB/s':>12s} {'step/stream':>12s}")  # fmt: skip
    for name, r in table.items():
        share = r["bandwidth_share"]
        print(f"  {name:22s} {r['tok_s']:7.1f} {r['tok_s'] / base:7.2f} {r['matmul_ms']:10.2f} "
              f"{r['matmul_gb_s']:6.1f} {r['stream_gb_s']:12.1f} {share:12.0%}")  # fmt: skip
    print(json.dumps({"cpu": cpu_name(), "settings": vars(args), "runs": table}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="float32")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of --steps steps, each followed by a stream")  # fmt: skip
    p.add_argument("--strategy", default="full")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isas", default=None, help="e.g. avx512,avx2: one child run each")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layer", choices=("native", "ops"), default="native",
                   help="a layer's dense part as two gemv.c calls, or as torch ops")  # fmt: skip
    p.add_argument("--step", choices=("native", "layers"), default="native",
                   help="a decode step's layers in one gemv.c call (where the strategy allows: "
                        "full), or layer by layer")  # fmt: skip
    p.add_argument("--decode-steps", type=int, default=8,
                   help="each round also times the same steps run up to this many per native "
                        "call (multi-step decoding, `unikv run`'s engine; 1: not)")  # fmt: skip
    p.add_argument("--inside", action="store_true",
                   help="build gemv.c with STEP_PROFILE and split the timed steps' one C call "
                        "into its parts per thread (multiplying, per matrix; barriers; RoPE; "
                        "attention)")  # fmt: skip
    args = p.parse_args()
    if args.inside and (args.isas or args.step == "layers" or args.layer == "ops"):
        p.error("--inside splits the one-call step: not with --isas, --step layers or --layer ops")
    if args.inside:  # before the model loads the kernel
        gemv.DEFINES = ("-DSTEP_PROFILE",)
    if args.isas:
        compare(args)
        return
    torch.set_num_threads(args.threads)
    m, tok = load_model(args.model, progress=False, weights=args.weights)
    if args.layer == "ops":  # the baseline: a layer's dense part as torch ops (engine/fused.py)
        m._qkv, m._out = (lambda *a: fused.qkv_ops(*a)), (lambda *a: fused.out_ops(*a))
    if args.step == "layers" or args.layer == "ops":  # the baseline of the one-call step
        m._stack = fused.layers_python
    kv = build(m, tok, args.strategy)
    ids = context_ids(tok, args.context)
    first = prefill(m, kv, ids, 0)
    pos = len(ids)
    decode(m, kv, first, pos, 8, 0)  # warm-up: calibrations, breakers' budgets
    pos += 8
    # The step against the same moment's memory bandwidth (issue 34's yardstick): this VM's
    # stream moved by 1.5x within a minute, so each round times `--steps` steps and then a
    # sum over a 1 GiB buffer in 4 KiB pages and one in huge pages (on the AMD EPYC VM 1.2x
    # the first, where they are on; the weights lie in them); the step is held to the faster.
    # Each round decodes a sequence of its own from the same context (so the KV cache each
    # step also reads is the same size in every round), and frees it.
    bufs = stream_buffers()
    rounds, inside, layers_inside, runs = [], [], 0, []
    for r in range(1, args.rounds + 1):
        tok0 = prefill(m, kv, ids, r)
        decode(m, kv, tok0, len(ids), 2, r)  # the caches back after the stream
        gemv.step_profile(reset=True)
        before = gemv.inside_layers()
        t = decode(m, kv, tok0, len(ids) + 2, args.steps, r) / args.steps
        layers_inside += gemv.inside_layers() - before
        inside.append(gemv.step_profile(reset=True))
        kv.free(r)
        if args.decode_steps > 1:  # the same steps, several per call, on a sequence of its own
            seq = args.rounds + r
            tok0 = prefill(m, kv, ids, seq)
            decode(m, kv, tok0, len(ids), 2, seq)
            n = len(ids) + 2
            runs.append(decode(m, kv, tok0, n, args.steps, seq, per_call=args.decode_steps)
                        / args.steps)  # fmt: skip
            kv.free(seq)
            gemv.step_profile(reset=True)  # (--inside splits the one-step calls only)
        rounds.append((t, {k: stream_gb_s(buf) for k, buf in bufs.items()}))
    del bufs
    wall = statistics.median(t for t, _ in rounds)
    streams = {k: statistics.median(s[k] for _, s in rounds) for k in ("4k", "huge")}
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        t0 = time.perf_counter()
        decode(m, kv, first, pos, args.steps, 0)
        prof_wall = (time.perf_counter() - t0) / args.steps
    kv.close()
    kernels = summary(m.operators.report())  # which entry served each op (a breaker may switch)
    spent: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    for e in prof.events():
        t = e.self_cpu_time_total / 1e6
        if t > 0 and C_KERNEL in e.name:  # a C kernel called by ctypes is no torch op: its time
            # is its Python caller's self time
            part = "layer (gemv.c)" if e.name.endswith(LAYER_CALLS) else "matmul"
            part = "layers + attention (gemv.c)" if e.name.endswith(STEP_CALL) else part
            part = (
                "step: layers + attention + output (gemv.c)"
                if e.name.endswith(WHOLE_CALL)
                else part
            )
            spent[part] += t
            ops[f"gemv.c {part} (ctypes)"] += t
            continue
        if t > 0 and ATTENTION_KERNEL in e.name:
            spent["attention"] += t
            ops["sparse.c attention (ctypes)"] += t
            continue
        if t <= 0 or e.name.startswith("ProfilerStep") or is_python(e):
            continue
        spent[part_of(e)] += t
        ops[e.name] += t
    steps = args.steps
    op_total = sum(spent.values()) / steps
    scale = wall / prof_wall
    rows = {k: v / steps * scale * 1e3 for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    python_ms = max(0.0, wall - op_total * scale) * 1e3
    weight_bytes = step_weight_bytes(m)  # (an untied embedding table: a row a token)
    matmul_ms = sum(rows.get(k, 0.0) for k in WEIGHT_PARTS) or float("nan")
    m_pages = m.huge_pages  # where the weights lie
    m_layers = m.cfg.num_layers
    del m, kv, prof
    stream = statistics.median(max(s.values()) for _, s in rounds)
    weight_gb = weight_bytes / 1e9
    out = {
        "cpu": cpu_name(),
        "isa": ckernels.isa() if os.environ.get("UNIKV_NO_KERNEL") != "1" else "none",
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        # the weights over the time of the calls that read them (gemv.c's layer calls also
        # run the norms and RoPE: a few microseconds)
        "matmul_gb_s": weight_bytes / (matmul_ms / 1e3) / 1e9,
        "weight_bytes": weight_bytes,
        # decode tokens/s x weight bytes read per token, against the stream (goal >= 0.85)
        "step_gb_s": weight_bytes / wall / 1e9,
        "stream_gb_s": stream,
        "stream_4k_gb_s": streams["4k"],
        "stream_huge_gb_s": streams["huge"],
        "huge_pages": m_pages,
        # the median over rounds of each round's step against its own faster stream
        "bandwidth_share": statistics.median(weight_gb / t / max(s.values()) for t, s in rounds),
        "rounds": [{"ms_per_step": t * 1e3, "stream_gb_s": s} for t, s in rounds],
        # the same with up to --decode-steps steps per native call (multi-step decoding)
        "runs_ms_per_step": [t * 1e3 for t in runs],
        "runs_bandwidth_share": statistics.median(
            weight_gb / t / max(s.values()) for t, (_, s) in zip(runs, rounds, strict=True)
        )
        if runs
        else None,  # fmt: skip
        "wall_ms_per_step": wall * 1e3,
        "tok_s": 1 / wall,
        "profiled_wall_ms": prof_wall * 1e3,
        "ms_by_part": rows,
        "python_and_untracked_ms": python_ms,
        "top_ops_ms": {
            k: v / steps * scale * 1e3 for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:12]
        },  # fmt: skip
        "kernels": kernels,
        "settings": vars(args),
    }
    print(f"{out['cpu']}, kernels {out['isa']}, torch {out['torch_capability']}")
    print(f"{out['wall_ms_per_step']:.2f} ms per step ({out['tok_s']:.1f} tok/s); matmuls (and "
          f"the layer calls) read the weights at {out['matmul_gb_s']:.1f} GB/s")  # fmt: skip
    print(f"tokens/s x {weight_bytes / 2**20:.0f} MiB of weights = {out['step_gb_s']:.1f} GB/s; "
          f"a {args.threads}-thread stream reads {streams['4k']:.1f} GB/s in 4 KiB pages, "
          f"{streams['huge']:.1f} in huge pages: {out['bandwidth_share']:.0%} of the faster "
          f"(goal 85%; medians of {args.rounds} rounds, each step against its round's stream); "
          f"{m_pages}")  # fmt: skip
    if runs:
        run_ms = statistics.median(runs) * 1e3
        print(f"up to {args.decode_steps} steps per native call (multi-step decoding): "
              f"{run_ms:.2f} ms per step ({1e3 / run_ms:.1f} tok/s), "
              f"{out['runs_bandwidth_share']:.0%} of the faster stream; one step a call ÷ "
              f"runs: {wall * 1e3 / run_ms:.3f}")  # fmt: skip
    for k, v in rows.items():
        print(f"  {k:12s} {v:7.2f} ms  {v / (wall * 1e3):6.1%}")
    print(f"  {'python':12s} {python_ms:7.2f} ms  {python_ms / (wall * 1e3):6.1%}  (wall - ops)")
    print(f"  kernels: {kernels}")
    if args.inside:
        out["inside"] = print_inside(inside, args.steps * args.rounds)
        out["inside"]["layers_attending_inside"] = layers_inside
        print(f"  attention inside the layers' regions (the other threads reading ahead): "
              f"{layers_inside} of {m_layers * args.steps * args.rounds} layer steps")  # fmt: skip
    print(json.dumps(out))


def print_inside(rounds: list[dict | None], steps: int) -> dict:
    """The rounds' `gemv.step_profile` summed and printed: each part's share of the C call per
    thread, and each kind of matrix's bytes over its multiplying time. Returned for the JSON."""
    if any(r is None for r in rounds):
        sys.exit("decode_profile: --inside: the kernel counted nothing (not the profiling "
                 "build, or the step did not take the one-call path)")  # fmt: skip
    nthreads = min(len(r["threads"]) for r in rounds)
    threads = [{k: sum(r["threads"][t][k] for r in rounds) for k in gemv.PROFILE_PARTS}
               for t in range(nthreads)]  # fmt: skip
    call = threads[0]["call"]
    matrices = {k: [sum(r["matrices"][k][j] for r in rounds) for j in (0, 1)]
                for k in gemv.PROFILE_MATRICES}  # fmt: skip
    print(f"inside the step's C call (gemv.c built with STEP_PROFILE; {steps} steps): "
          f"{call / steps * 1e3:.2f} ms per call")  # fmt: skip
    print("  " + " " * 22 + "".join(f"thread {t:<3d}" for t in range(nthreads)))
    for part in gemv.PROFILE_PARTS[:-1]:
        shares = [th[part] / call for th in threads]
        if any(shares):
            print(f"  {part:22s}" + "".join(f"{x:9.1%} " for x in shares))
    idle = [1 - sum(th[p] for p in gemv.PROFILE_PARTS[:-1]) / call for th in threads]
    print(f"  {'the rest (norms; idle)':22s}" + "".join(f"{x:9.1%} " for x in idle))
    rates = {k: b / (s / nthreads) / 1e9 for k, (s, b) in matrices.items() if s > 0}
    print("  weights read while multiplying (all threads' bytes over their mean time): "
          + ", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items()))  # fmt: skip
    return {"ms_per_call": call / steps * 1e3,
            "shares": [{k: v / call for k, v in th.items()} for th in threads],
            "matrix_gb_s": rates}  # fmt: skip


if __name__ == "__main__":
    main()
