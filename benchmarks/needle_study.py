"""Where a quantized cache loses the passkey: the answer's NLL under variants of one strategy.

Passkey prompts (`engine.passkey`, the synthetic filler) of `--length` tokens with the needle at
`--depth`; per variant, the prompt is prefilled in chunks of 512 and the answer " NNNNN." is
scored teacher-forced: its mean NLL over the keys (lower is better) and how many answers had
every token as the argmax. A variant is a strategy with options, optionally applied to a set of
layers only (the other layers use `full`), so keys against values, channel classes and layer
ranges can be told apart.

    python benchmarks/needle_study.py [--length 1024] [--depth 0.1] [--samples 9] [--variants F]

`--variants` is a JSON file {name: {"strategy": S, "options": {...}, "layers": [...]}}; the
default set is the study of docs/strategies.md (the old hybrid default against each change).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import report  # noqa: E402
from unikv.engine.assembly import assemble_for  # noqa: E402
from unikv.engine.loading import load_model  # noqa: E402
from unikv.engine.passkey import passkey_prompt  # noqa: E402
from unikv.kvstrategies.kv import StepBatch  # noqa: E402

H = "hybrid_fp16_int4"
OLD = {"scales": "fp16", "low_share": 0.5}  # the default before issue 21
VARIANTS = {
    "full": {"strategy": "full"},
    "old default": {"strategy": H, "options": OLD},
    "keys fp16 (56 of 64)": {"strategy": H, "options": {**OLD, "fp16_share": 0.875,
                                                         "low_share": 0.0}},
    "values fp16 (56 of 64)": {"strategy": H, "options": {**OLD, "v_fp16_share": 0.875}},
    "no int2 keys": {"strategy": H, "options": {**OLD, "low_share": 0.0}},
    "no sinks": {"strategy": H, "options": {**OLD, "sink_tokens": 0}},
    "layers 0-9 only": {"strategy": H, "options": OLD, "layers": list(range(0, 10))},
    "layers 10-19 only": {"strategy": H, "options": OLD, "layers": list(range(10, 20))},
    "layers 20-29 only": {"strategy": H, "options": OLD, "layers": list(range(20, 30))},
    "new default": {"strategy": H},
}  # fmt: skip


class LayerMix:
    """`inner` serves the layers in `layers`, `rest` the others (both see every step)."""

    wants_token_logprobs = False

    def __init__(self, inner, rest, layers) -> None:
        self.inner, self.rest, self.layers = inner, rest, set(layers)

    def _of(self, layer: int):
        return self.inner if layer in self.layers else self.rest

    def begin_step(self, batch) -> None:
        self.inner.begin_step(batch)
        self.rest.begin_step(batch)

    def append(self, layer, k, v) -> None:
        self._of(layer).append(layer, k, v)

    def attend(self, layer, q):
        return self._of(layer).attend(layer, q)

    def end_step(self) -> None:
        self.inner.end_step()
        self.rest.end_step()

    def abort_step(self) -> None:
        self.inner.abort_step()
        self.rest.abort_step()

    def free(self, seq: int) -> None:
        self.inner.free(seq)
        self.rest.free(seq)


def answer_logits(model, kv, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """Logits predicting each answer token, after the prompt (all but its last token) is
    prefilled in chunks of 512."""
    body, tail = prompt[:-1], [prompt[-1], *answer[:-1]]
    seq = 7
    try:
        for start in range(0, len(body), 512):
            part = body[start : start + 512]
            model.forward(torch.tensor(part), torch.arange(start, start + len(part)), kv,
                          StepBatch([seq], [len(part)]), torch.tensor([len(part) - 1]))  # fmt: skip
        n = len(body)
        return model.forward(torch.tensor(tail), torch.arange(n, n + len(tail)), kv,
                             StepBatch([seq], [len(tail)]), torch.arange(len(tail)))  # fmt: skip
    finally:
        kv.free(seq)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--depth", type=float, default=0.1)
    p.add_argument("--samples", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", type=Path, help="JSON file of variants (default: the study)")
    a = p.parse_args()
    variants = json.loads(a.variants.read_text()) if a.variants else VARIANTS
    torch.set_num_threads(a.threads)
    model, tok = load_model("smollm2", progress=False)
    rng = random.Random(a.seed)
    keys = [rng.randrange(10_000, 100_000) for _ in range(a.samples)]
    cases = [(passkey_prompt(tok, a.length, a.depth, k), tok.encode(f" {k}.")) for k in keys]
    rows = []
    for name, v in variants.items():
        with assemble_for(model, tok, v["strategy"], None, None, v.get("options")) as built:
            kv = built.kv.strategy
            if v.get("layers") is not None:
                full = assemble_for(model, tok, "full")
                kv = LayerMix(kv, full.kv.strategy, v["layers"])
            nll, right = [], 0
            for prompt, answer in cases:
                logits = answer_logits(model, kv, prompt, answer).float()
                t = torch.tensor(answer)
                nll.append(-torch.log_softmax(logits, -1).gather(1, t[:, None]).sum().item())
                right += int((logits.argmax(-1) == t).all())
            if v.get("layers") is not None:
                full.close()
        rows.append({"variant": name, "answer NLL": statistics.mean(nll),
                     "all digits right": f"{right} of {len(cases)}"})  # fmt: skip
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    report("needle_study", rows, ["variant", "answer NLL", "all digits right"],
           {"length": a.length, "depth": a.depth, "samples": a.samples})  # fmt: skip


if __name__ == "__main__":
    main()
