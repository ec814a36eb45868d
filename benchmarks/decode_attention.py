"""A decode step's attention over the whole dense cache: the C kernel (`attention.blocks`,
`unikv/kernels/sparse.c`, every block read in place) against PyTorch's attention over the
arena's runs (`attention_runs`: `scaled_dot_product_attention` per run), same model, same
cache, same process.

For each `--contexts` length one sequence is prefilled through `full` (float32 K/V), then
`--rounds` rounds of `--steps` greedy decode steps alternate between the two paths
(`kvstrategies.full.DECODE_ROWS` 0: PyTorch; its default: the C kernel), and the medians of the
whole step and of the strategy's `attend` (all layers) are printed with their ratios, beside the
CPU model and the instruction sets the kernels use.

`--ppl N` instead scores each development text's first N tokens one token per step (every
step a decode step, so every attention call is the kernel's under the new path) through both
paths, and prints the perplexities and their relative difference (issue 34: within 0.01% for
`full` at float32).

    python benchmarks/decode_attention.py [--contexts 64 1024 4096 8000] [--steps 16]
        [--rounds 5] [--weights native] [--ppl 512]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from benchmarks.decode_profile import cpu_name  # noqa: E402
from benchmarks.kv_quant_speed import build, context_ids, prefill  # noqa: E402
from benchmarks.sparse import TEXTS  # noqa: E402  (the development texts)
from unikv.engine.loading import load_model  # noqa: E402
from unikv.kernels import gemv  # noqa: E402
from unikv.kernels import native as ckernels  # noqa: E402
from unikv.kernels.operators import summary  # noqa: E402
from unikv.kvstrategies import full  # noqa: E402
from unikv.kvstrategies.kv import StepBatch  # noqa: E402

PATHS = {"pytorch": 0, "c": full.DECODE_ROWS}  # label -> DECODE_ROWS


def decode_ppl(model, tok, text: Path, tokens: int) -> dict:
    """Perplexity of the text's first `tokens` tokens fed one per step through `full`, by each
    path (the first token is only read)."""
    ids = tok.encode(text.read_text(encoding="utf-8"))[:tokens]
    out: dict = {"text": text.name, "tokens": len(ids)}
    for label, rows in PATHS.items():
        full.DECODE_ROWS = rows
        kv = build(model, tok, "full")
        nll = 0.0
        for i in range(len(ids) - 1):
            logits = model.forward(torch.tensor([ids[i]]), torch.tensor([i]), kv,
                                   StepBatch([0], [1]))  # fmt: skip
            nll -= torch.log_softmax(logits[0].double(), -1)[ids[i + 1]].item()
        kv.close()
        out[f"{label}_ppl"] = math.exp(nll / (len(ids) - 1))
    full.DECODE_ROWS = PATHS["c"]
    out["difference"] = f"{out['c_ppl'] / out['pytorch_ppl'] - 1:+.5%}"
    return out


def measure(model, tok, context: int, steps: int, rounds: int) -> dict:
    kv = build(model, tok, "full")
    ids = context_ids(tok, context)
    token = prefill(model, kv, ids, 0)
    pos = len(ids)
    attend = kv.attend
    spent = [0.0]

    def timed_attend(layer, q):
        t0 = time.perf_counter()
        out = attend(layer, q)
        spent[0] += time.perf_counter() - t0
        return out

    kv.attend = timed_attend
    samples = {label: {"step": [], "attend": []} for label in PATHS}
    for r in range(rounds + 1):  # the first round warms both paths up and is not counted
        for label, rows in PATHS.items():
            full.DECODE_ROWS = rows
            for _ in range(steps):
                spent[0] = 0.0
                attended = gemv.step_seconds()[1]
                t0 = time.perf_counter()
                logits = model.forward(torch.tensor([token]), torch.tensor([pos]), kv,
                                       StepBatch([0], [1]))  # fmt: skip
                token = int(logits[0].argmax())
                if r:
                    samples[label]["step"].append(time.perf_counter() - t0)
                    # a one-call step (gemv.c's, with the kernel's attention inside it) times
                    # its attention itself; the layer-by-layer path goes through `attend`
                    samples[label]["attend"].append(spent[0] or gemv.step_seconds()[1] - attended)
                pos += 1
    full.DECODE_ROWS = PATHS["c"]
    kernels = summary(kv.format.operators.report())
    kv.close()
    med = {k: {p: statistics.median(v) * 1e3 for p, v in s.items()} for k, s in samples.items()}
    return {
        "context": context,
        "pytorch_step_ms": med["pytorch"]["step"],
        "c_step_ms": med["c"]["step"],
        "step_speedup": med["pytorch"]["step"] / med["c"]["step"],
        "pytorch_attend_ms": med["pytorch"]["attend"],
        "c_attend_ms": med["c"]["attend"],
        "attend_speedup": med["pytorch"]["attend"] / med["c"]["attend"],
        "kernels": kernels,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 1024, 4096, 8000])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--weights", default="native")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ppl", type=int, default=0, help="score N tokens per text one per step")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2", progress=False, weights=args.weights)
    if args.ppl:
        rows = [decode_ppl(model, tok, t, args.ppl) for t in TEXTS]
        print(f"{cpu_name()}, kernels {ckernels.isa()}; {args.weights} weights, `full`, "
              f"{args.ppl} tokens a text, one per step")  # fmt: skip
        report("decode_attention_ppl", rows, ["text", "tokens", "pytorch_ppl", "c_ppl",
                                              "difference"], {"cpu": cpu_name()})  # fmt: skip
        return
    room = model.cfg.context_length - (args.rounds + 1) * len(PATHS) * args.steps
    rows = [measure(model, tok, min(c, room), args.steps, args.rounds) for c in args.contexts]
    print(f"{cpu_name()}, kernels {ckernels.isa()}, torch "
          f"{torch.backends.cpu.get_cpu_capability()}; {args.weights} weights, "
          f"{args.threads} threads, medians of {args.rounds} x {args.steps} steps")  # fmt: skip
    report("decode_attention", rows, ["context", "pytorch_step_ms", "c_step_ms", "step_speedup",
                                      "pytorch_attend_ms", "c_attend_ms", "attend_speedup",
                                      "kernels"], {"cpu": cpu_name()})  # fmt: skip


if __name__ == "__main__":
    main()
