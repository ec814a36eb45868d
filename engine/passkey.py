"""Passkey retrieval through the cache, following the protocol of docs/protocol.md.

A raw prompt (no chat template): a one-line instruction, filler sentences, the needle "The pass
key is NNNNN. Remember it. NNNNN is the pass key." at a depth of 10%, 50% or 90% of the filler,
more filler, then the question "What is the pass key? The pass key is". The model continues
with 8 greedy tokens; a sample is correct when the 5-digit key appears in them. The question
is the prompt's last tokens: a strategy that keeps a recent window never drops it.

`filler` replaces the repeated sentences by a text of your own (a development text, so that
retrieval is measured per text): its first tokens fill the prompt, the text repeated if short.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from unikv.kvstrategies.kv import KVCache, StepBatch

from .model import LlamaModel

INSTRUCTION = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will ask you about it afterwards.\n"
)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
QUESTION = "\nWhat is the pass key? The pass key is"
DEPTHS = (0.1, 0.5, 0.9)
NEW_TOKENS = 8
MIN_LENGTH = 128


def needle(key: int) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key."


@dataclass(slots=True)
class PasskeyResult:
    """Accuracy of one passkey run, overall and per depth."""

    accuracy: float
    samples: int
    length: int  # prompt tokens (the mean over samples, rounded)
    by_depth: dict[str, float]
    kept_ratio: float  # mean over samples of tokens whose KV was stored / tokens seen
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def passkey_prompt(
    tokenizer, length: int, depth: float, key: int, filler: str | None = None
) -> list[int]:
    """Token ids of a prompt of about `length` tokens (never more) with the needle at `depth`;
    `filler` is the text around the needle (default: the repeated FILLER sentences)."""
    if length < MIN_LENGTH:
        raise ValueError(f"--length must be at least {MIN_LENGTH} tokens, got {length}")
    if filler is not None and not filler.strip():
        raise ValueError("the passkey filler text is empty")
    head = tokenizer.encode(INSTRUCTION)
    pin = tokenizer.encode(needle(key))
    tail = tokenizer.encode(QUESTION)
    sentence = tokenizer.encode(FILLER if filler is None else filler)
    budget = length - len(head) - len(pin) - len(tail)
    filler_ids = (sentence * (budget // len(sentence) + 1))[:budget]
    # Sentences stay whole: the filler ends, and the needle goes, after a period that ends a
    # sentence (whitespace follows: not the one in "Node.js").
    period = tokenizer.encode(".")[-1]

    def ends_sentence(j: int) -> bool:
        if filler_ids[j - 1] != period:
            return False
        return j == len(filler_ids) or tokenizer.decode([filler_ids[j]])[:1].isspace()

    def boundary(i: int) -> int:
        j = i
        while j > 0 and not ends_sentence(j):
            j -= 1
        # A text with no sentence end before i (code, a heading) keeps the cut where it was.
        return j if j > 0 else i

    filler_ids = filler_ids[: boundary(len(filler_ids))]
    at = boundary(round(depth * len(filler_ids)))
    return head + filler_ids[:at] + pin + filler_ids[at:] + tail


def passkey(
    model: LlamaModel,
    tokenizer,
    kv: KVCache,
    length: int,
    samples: int,
    seed: int = 0,
    chunk: int = 512,
    progress: bool = False,
    filler: str | None = None,
) -> PasskeyResult:
    """Run `samples` passkey prompts of `length` tokens through `kv` (depths cycle 10/50/90%),
    around `filler` text if given (see `passkey_prompt`)."""
    if samples < 1:
        raise ValueError(f"--samples must be >= 1, got {samples}")
    if length + NEW_TOKENS > model.cfg.context_length:
        raise ValueError(
            f"--length {length} + {NEW_TOKENS} answer tokens exceeds the model's context of "
            f"{model.cfg.context_length}"
        )
    rng = random.Random(seed)
    dev = model.device
    hits: dict[str, list[bool]] = {f"{d:.0%}": [] for d in DEPTHS}
    kept, lengths = [], []
    t0 = time.perf_counter()
    for i in tqdm(range(samples), desc="passkey", unit="sample", disable=not progress):
        depth = DEPTHS[i % len(DEPTHS)]
        key = rng.randrange(10_000, 100_000)
        ids = passkey_prompt(tokenizer, length, depth, key, filler)
        lengths.append(len(ids))
        seq = 1_000_000 + i
        out: list[int] = []
        try:
            for start in range(0, len(ids), chunk):
                part = ids[start : start + chunk]
                logits = model.forward(
                    torch.tensor(part, device=dev),
                    torch.arange(start, start + len(part), device=dev),
                    kv,
                    StepBatch([seq], [len(part)], [start + chunk < len(ids)]),
                    torch.tensor([len(part) - 1], device=dev),
                )
            token = int(logits[0].argmax())
            for j in range(NEW_TOKENS):
                out.append(token)
                if j == NEW_TOKENS - 1:
                    break
                pos = len(ids) + j
                logits = model.forward(
                    torch.tensor([token], device=dev),
                    torch.tensor([pos], device=dev),
                    kv,
                    StepBatch([seq], [1]),
                )
                token = int(logits[0].argmax())
            kept.append(kv.stored_tokens(seq) / (len(ids) + NEW_TOKENS - 1))
        finally:
            kv.free(seq)
        hits[f"{depth:.0%}"].append(str(key) in tokenizer.decode(out))
    every = [h for v in hits.values() for h in v]
    return PasskeyResult(
        accuracy=sum(every) / len(every),
        samples=samples,
        length=round(sum(lengths) / len(lengths)),
        by_depth={d: sum(v) / len(v) for d, v in hits.items() if v},
        kept_ratio=sum(kept) / len(kept),
        seconds=time.perf_counter() - t0,
    )
