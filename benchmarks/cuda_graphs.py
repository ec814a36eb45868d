"""A GPU decode step through CUDA graphs against the same step run eagerly (issue 34).

Two models of the same random weights on one GPU, in one process: one whose `model.layers`
serves from `graphs` (engine/graphs.py), one built with `UNIKV_CUDA_GRAPHS=0` (the eager
layer loop). Random weights because a lent GPU machine receives the repository without the
packaged model; the shape is a real model's (`--shape`): SmolLM2-135M's by default, or a
Llama 3.2 1B's. For each batch size (`--batch`), `--rounds` rounds alternate the two models;
a round prefills `--context` tokens for each of the batch's sequences, then decodes `--steps`
greedy steps of all of them at once (one row each, `model.forward` as the engine calls it),
timed between two device synchronizations. Printed: the median ms per step of each, tokens/s,
eager / graphs, and the largest logit difference of the two models' first decode step (the
same inputs; cuBLAS may round a product of the bucket's rows differently).

    python benchmarks/cuda_graphs.py [--shape smollm2-135m | llama-1b] [--batch 1 8 32]
        [--context 128] [--steps 64] [--rounds 5] [--strategy full]

`--device cpu` runs the same loop on the CPU (both models then take the CPU's own step: a
check of the script, not a measurement of graphs).
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

from benchmarks.common import MODEL_SHAPES, env_set, report  # noqa: E402
from unikv.engine import graphs  # noqa: E402
from unikv.engine.assembly import build_kv  # noqa: E402
from unikv.engine.config import ModelConfig  # noqa: E402
from unikv.engine.model import LlamaModel  # noqa: E402
from unikv.kvstrategies.kv import StepBatch  # noqa: E402

SHAPES = MODEL_SHAPES


def random_weights(shape: str, seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A Llama config of `shape` and float32 weights drawn at the scale of a trained model's
    (rows of unit norm on average), under the GGUF tensor names the loader gives."""
    hidden, ffn, layers, heads, kv_heads, vocab = SHAPES[shape]
    d = hidden // heads
    cfg = ModelConfig(name=f"random-{shape}", architecture="llama", vocab_size=vocab,
                      hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=d, rms_norm_eps=1e-5,
                      rope_theta=10000.0, context_length=4096)  # fmt: skip
    g = torch.Generator().manual_seed(seed)

    def rand(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    t = {"token_embd.weight": rand(vocab, hidden), "output_norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": torch.ones(hidden), p + "ffn_norm.weight": torch.ones(hidden),
              p + "attn_q.weight": rand(heads * d, hidden),
              p + "attn_k.weight": rand(kv_heads * d, hidden),
              p + "attn_v.weight": rand(kv_heads * d, hidden),
              p + "attn_output.weight": rand(hidden, heads * d),
              p + "ffn_gate.weight": rand(ffn, hidden), p + "ffn_up.weight": rand(ffn, hidden),
              p + "ffn_down.weight": rand(hidden, ffn)}  # fmt: skip
    return cfg, t


def make_model(cfg, tensors, device: str, graphs_on: bool) -> LlamaModel:
    """The model, its `model.layers` breaker made with CUDA graphs on or off (the variable is
    read when the breaker is made: set only while the model is built)."""
    with env_set(graphs.OFF_ENV, "1" if graphs_on else "0"):
        return LlamaModel(cfg, tensors, device=device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_round(model, strategy: str, batch: int, context: int, steps: int, device: str):
    """(seconds per decode step of `batch` sequences, the first decode step's logits)."""
    kv = build_kv(model.kv_spec(), strategy, device=device).strategy
    g = torch.Generator().manual_seed(batch)
    first = []
    with torch.inference_mode():
        for s in range(batch):
            ids = torch.randint(0, model.cfg.vocab_size, (context,), generator=g).to(device)
            pos = torch.arange(context, device=device)
            logits = model.forward(ids, pos, kv, StepBatch([s], [context]),
                                   torch.tensor([context - 1], device=device))  # fmt: skip
            first.append(logits.argmax(-1))
        tokens = torch.cat(first)
        seqs = StepBatch(list(range(batch)), [1] * batch)
        first_logits = None
        _sync(device)
        t0 = time.perf_counter()
        for i in range(steps):
            pos = torch.full((batch,), context + i, device=device)
            logits = model.forward(tokens, pos, kv, seqs)
            if first_logits is None:
                first_logits = logits.float().cpu()  # (a sync: outside the timed steps below)
                _sync(device)
                t0 = time.perf_counter()
            tokens = logits.argmax(-1)
        _sync(device)
        seconds = (time.perf_counter() - t0) / max(1, steps - 1)
    for s in range(batch):
        kv.free(s)
    return seconds, first_logits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--strategy", default="full")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("cuda_graphs: no CUDA device here (`--device cpu` checks the script only)")
    if any(b < 1 or b > graphs.BUCKETS[-1] for b in args.batch):
        p.error(f"--batch: 1 .. {graphs.BUCKETS[-1]} (the largest bucket)")
    if args.steps < 2 or args.rounds < 1 or args.context < 1:
        p.error("--steps at least 2, --rounds and --context at least 1")
    cfg, tensors = random_weights(args.shape)
    models = {"eager": make_model(cfg, tensors, args.device, False),
              "graphs": make_model(cfg, tensors, args.device, True)}  # fmt: skip
    active = {k: m._stack.active.name for k, m in models.items()}
    rows = []
    for batch in args.batch:
        times: dict[str, list[float]] = {k: [] for k in models}
        logits = {}
        for _ in range(args.rounds + 1):  # the first round warms (and captures): not counted
            for name, model in models.items():
                sec, first = run_round(model, args.strategy, batch, args.context, args.steps,
                                       args.device)  # fmt: skip
                times[name].append(sec)
                logits[name] = first
        eager, graph = (statistics.median(times[k][1:]) for k in ("eager", "graphs"))
        diff = (logits["eager"] - logits["graphs"]).abs().max().item()
        rows.append({"batch": batch, "eager_ms": eager * 1e3, "graphs_ms": graph * 1e3,
                     "eager_tok_s": batch / eager, "graphs_tok_s": batch / graph,
                     "eager_over_graphs": eager / graph, "max_logit_diff": diff})  # fmt: skip
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report("cuda_graphs", rows,
           ["batch", "eager_ms", "graphs_ms", "eager_tok_s", "graphs_tok_s", "eager_over_graphs",
            "max_logit_diff"],
           {"device": device, "model.layers": active, "settings": vars(args)})  # fmt: skip


if __name__ == "__main__":
    main()
