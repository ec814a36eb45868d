"""unikv's engine against llama.cpp on the same GGUF files, both columns from one run.

llama.cpp is found or built by `benchmarks/llamacpp.py` (from the `llama-cpp-python` source
package on PyPI; about 15 minutes on 2 cores the first time), and the packaged SmolLM2 file is
requantized with its `llama-quantize` to F32 and Q8_0 (cached beside the build). Each case runs
`llama-bench` (`--threads` threads, default 2, as many as unikv's torch threads; its own timing
of the generation or prompt phase) and the same work through unikv's model (`model.forward`
with the KV strategy, greedy argmax per token: the engine's decode loop without the
scheduler), interleaved: llama.cpp, unikv, llama.cpp, ...; the median of `--repeats` rounds.

| case | llama.cpp | unikv |
|---|---|---|
| decode, batch 1, weights F32 / Q8_0 / Q4_1 | `-p 0 -n N` | `--weights float32` / `native` |
| prefill, 512 tokens, weights F32 / Q8_0 / Q4_1 | `-p 512 -n 0` | one 512-token chunk |
| decode at C tokens of context, F32 | `-d C -fa on -ctk/-ctv f16, q4_0` | `full`, `hybrid` |

    python benchmarks/vs_llamacpp.py [--contexts 2048 8000] [--new-tokens 32] [--repeats 3]

`--shape llama-1b` runs the weights cases on a Llama 3.2 1B-shaped model of random weights
instead (`benchmarks/random_gguf.py`: SmolLM2's vocabulary, written in F16 and requantized by
the same `llama-quantize`), where a layer's fixed costs weigh less than on SmolLM2-135M; its
tokens mean nothing (speed only). There `--kinds` also takes Q4_K_M, the most common GGUF
(Q4_K with Q6_K in about half the layers' attn_v and ffn_down).

`--isa avx2` compares the AVX2 paths on a CPU with AVX-512, as an AVX2-only CPU would run
them: llama.cpp built with AVX2 at most (`benchmarks/llamacpp.py --isa avx2`, a build of its
own) and unikv's kernels and torch's with AVX-512 hidden (the run restarts itself with
`UNIKV_ISA=avx2 ATEN_CPU_CAPABILITY=avx2`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from benchmarks.kv_quant_speed import build, context_ids, decode, prefill  # noqa: E402
from benchmarks.llamacpp import converted, find_or_build  # noqa: E402
from benchmarks.random_gguf import SHAPES  # noqa: E402
from benchmarks.random_gguf import files as random_files  # noqa: E402
from unikv.engine.gguf_loader import resolve_model_path  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.kernels import gemv  # noqa: E402
from unikv.kernels.operators import summary  # noqa: E402


def llama_bench(bin_dir: Path, gguf: Path, threads: int, *args: str) -> tuple[float, str]:
    """tokens/s of one llama-bench test (its average over 1 repetition) on `threads` threads,
    and a note ("" or why the figure is not its default's). A run its weight repacking kills
    (llama.cpp's AMX kernels die by SIGSEGV on some virtual Intel Xeons: the prompt phase of
    Q8_0 and Q4_1 files) is run again with `--repack 0`, and the note says so."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o",
           "json", *args]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True)
    note = ""
    if run.returncode < 0 and "--repack" not in args:
        note = f"its repacked path died by signal {-run.returncode}: --repack 0"
        run = subprocess.run([*cmd, "--repack", "0"], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"llama-bench failed ({run.returncode}): {' '.join(cmd)}\n{run.stderr}")
    return float(json.loads(run.stdout)[0]["avg_ts"]), note


def unikv_decode(model, tok, strategy: str, depth: int, n: int, per_call: int = 1) -> float:
    """tokens/s of n greedy decode steps after a `depth`-token prefill (16 at least), up to
    `per_call` steps a native call (multi-step decoding; 1: a step a call)."""
    kv = build(model, tok, strategy)
    try:
        ids = context_ids(tok, max(16, depth))
        first = prefill(model, kv, ids, 0)
        return n / decode(model, kv, first, len(ids), n, 0, per_call=per_call)
    finally:
        kv.close()


def unikv_prefill(model, tok, n: int) -> float:
    kv = build(model, tok, "full")
    try:
        ids = context_ids(tok, n)
        t0 = time.perf_counter()
        prefill(model, kv, ids, 0, chunk=n)
        return n / (time.perf_counter() - t0)
    finally:
        kv.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="*", default=[2048, 8000])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", nargs="*", default=[], choices=["weights", "prefill", "context"])
    kinds = ["F32", "Q8_0", "Q4_1"]
    p.add_argument(
        "--kinds", nargs="*", default=kinds, choices=[*kinds, "Q4_K_M"],
        help="decode and prefill cases' weights (Q4_K_M: with --shape only, SmolLM2's rows "
             "are no whole super-blocks)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=2, help="both engines' threads")
    p.add_argument("--shape", default="smollm2", choices=["smollm2", *sorted(SHAPES)],
                   help="the packaged SmolLM2 (default), or a shape of random weights "
                        "(benchmarks/random_gguf.py; the weights and prefill cases)")  # fmt: skip
    p.add_argument("--decode-steps", type=int, default=1,
                   help="unikv's batch-1 decode rows: up to this many steps a native call "
                        "(multi-step decoding, as `unikv run`; default 1: a step a call, as "
                        "llama-bench's)")  # fmt: skip
    p.add_argument("--isa", default="native", choices=["native", "avx2"],
                   help="native: both engines use this CPU's instructions; avx2: both use "
                        "AVX2 at most (llama.cpp built so, unikv's kernels and torch's with "
                        "AVX-512 hidden)")  # fmt: skip
    args = p.parse_args()
    hidden = {"UNIKV_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2"}
    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in hidden.items()):
        # torch reads ATEN_CPU_CAPABILITY once, as it loads: this process is too late
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **hidden})
    torch.set_num_threads(args.threads)
    t = args.threads
    bins = find_or_build(isa=args.isa)
    if args.shape == "smollm2" and "Q4_K_M" in args.kinds:
        p.error("--kinds Q4_K_M: with --shape only (SmolLM2's rows are no whole super-blocks)")
    if args.shape == "smollm2":
        shipped = resolve_model_path("smollm2")
        files = {"F32": converted(shipped, "F32", bins), "Q8_0": converted(shipped, "Q8_0", bins),
                 "Q4_1": shipped}  # fmt: skip
    else:
        if "context" not in args.skip:
            p.error("--shape: the context cases run on SmolLM2 only (add --skip context)")
        files = random_files(args.shape, args.kinds, bins)
    n = args.new_tokens
    # (case, llama.cpp call, unikv call, model): the callables return tokens/s.
    cases: list[tuple[str, object, object, object]] = []
    models: dict[str, tuple] = {}

    def model(kind: str, weights: str):
        if (kind, weights) not in models:
            models[kind, weights] = load_model(str(files[kind]), progress=False, weights=weights)
        return models[kind, weights]

    if "weights" not in args.skip:
        for kind in args.kinds:
            weights = "float32" if kind == "F32" else "native"
            m, tok = model(kind, weights)
            cases.append((f"decode b1, {kind} weights (unikv --weights {weights})",
                          lambda f=files[kind]: llama_bench(bins, f, t, "-p", "0", "-n", str(n)),
                          lambda m=m, tok=tok: unikv_decode(m, tok, "full", 16, n,
                                                            args.decode_steps), m))  # fmt: skip
    if "prefill" not in args.skip:
        for kind in args.kinds:
            weights = "float32" if kind == "F32" else "native"
            m, tok = model(kind, weights)
            cases.append((f"prefill 512 tokens, {kind} weights (unikv --weights {weights})",
                          lambda f=files[kind]: llama_bench(bins, f, t, "-p", "512", "-n", "0"),
                          lambda m=m, tok=tok: unikv_prefill(m, tok, 512), m))  # fmt: skip
    if "context" not in args.skip:
        m, tok = model("F32", "float32")
        for ctx in args.contexts:
            for kv_llama, strategy in (("f16", "full"), ("q4_0", "hybrid_fp16_int4")):
                flags = ("-p", "0", "-n", str(n), "-d", str(ctx), "-fa", "on",
                         "-ctk", kv_llama, "-ctv", kv_llama)  # fmt: skip
                name = f"decode at {ctx} context: llama.cpp {kv_llama} KV, unikv {strategy}"
                cases.append((name,
                              lambda flags=flags: llama_bench(bins, files["F32"], t, *flags),
                              lambda c=ctx, s=strategy: unikv_decode(m, tok, s, c, n),
                              m))  # fmt: skip
    rows = []
    for name, peer, ours, served in cases:
        ours()  # warm-up (calibration files, lazy packing, page cache)
        a, b, notes = [], [], set()
        for _ in range(args.repeats):
            tok_s, note = peer()
            a.append(tok_s)
            notes.add(note)
            b.append(ours())
        row = {"case": name, "llama_cpp_tok_s": statistics.median(a),
               "unikv_tok_s": statistics.median(b)}  # fmt: skip
        row["ratio"] = row["unikv_tok_s"] / row["llama_cpp_tok_s"]
        row["llama_cpp_note"] = "; ".join(sorted(n for n in notes if n))
        # which registry entry served each op (gemv.c for decode matmuls where this CPU has it;
        # a breaker may have switched one for being slow on a busy machine)
        row["kernels"] = summary(served.operators.report())
        rows.append(row)
        print(json.dumps(row), flush=True)
    report("vs_llamacpp", rows, ["case", "llama_cpp_tok_s", "unikv_tok_s", "ratio",
                                "llama_cpp_note"],
           {"new_tokens": n, "repeats": args.repeats, "threads": t, "shape": args.shape,
            "decode_steps": args.decode_steps, "isa": args.isa, "kernels_isa": gemv.isa(),
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "llama_cpp": str(bins)})  # fmt: skip


if __name__ == "__main__":
    main()
