"""Perplexity through the cache, following the measurement protocol of docs/protocol.md.

Tokenize, keep the first `tokens` tokens, prefill `prefill` of them in one step, then feed the rest
in chunks of `chunk` tokens through the cache, scoring every token after the prefill.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from unikv.kvstrategies.kv import KVCache, StepBatch

from .model import LlamaModel


@dataclass(slots=True)
class PPLResult:
    """Perplexity and the KV footprint of one protocol run."""

    ppl: float
    nll: float  # mean negative log-likelihood (nats per scored token)
    tokens: int  # tokens fed through the model
    scored: int  # tokens scored (all after the prefill)
    kv_bytes: int  # bytes stored in the cache at the end of the run
    bits_per_element: float
    kept_ratio: float  # tokens whose KV is stored / tokens seen
    seconds: float

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)


def check_protocol(n_ids: int, tokens: int, prefill: int, chunk: int) -> None:
    """Validate protocol sizes against each other and the text, naming the bad value."""
    for name, value in (("tokens", tokens), ("prefill", prefill), ("chunk", chunk)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be an integer >= 1, got {value!r}")
    if prefill >= tokens:
        raise ValueError(f"--prefill ({prefill}) must be smaller than --tokens ({tokens})")
    if n_ids <= prefill:
        raise ValueError(f"the text has {n_ids} tokens; it needs more than --prefill ({prefill})")


def perplexity(
    model: LlamaModel,
    ids: list[int],
    kv: KVCache,
    prefill: int = 256,
    chunk: int = 16,
    progress: bool = False,
    logits_out: list[torch.Tensor] | None = None,
    seq_id: int = 0,
) -> PPLResult:
    """Run the protocol on `ids` (already cut to length) through `kv`.

    If `logits_out` is a list, the logits of every scored token are appended to it ([n, V] chunks),
    for comparisons against another cache.
    """
    check_protocol(len(ids), len(ids), prefill, chunk)
    cfg = model.cfg
    if len(ids) > cfg.context_length:
        raise ValueError(f"--tokens {len(ids)} exceeds the model's context of {cfg.context_length}")
    dev = model.device
    t0 = time.perf_counter()
    nll_sum, scored = 0.0, 0
    starts = [0, *range(prefill, len(ids), chunk)]
    bar = tqdm(total=len(ids), desc="perplexity", unit="tok", disable=not progress)
    try:
        for i, start in enumerate(starts):
            end = prefill if i == 0 else min(start + chunk, len(ids))
            toks = torch.tensor(ids[start:end], device=dev)
            pos = torch.arange(start, end, device=dev)
            # Prefill: only its last row predicts a scored token. Chunks: every row does, except
            # the very last row of the text, which has nothing to predict.
            first = end - 1 if i == 0 else start
            last = min(end, len(ids) - 1)
            rows = torch.arange(first - start, last - start, device=dev)
            logits = model.forward(toks, pos, kv, StepBatch([seq_id], [end - start]), rows)
            if rows.numel():
                targets = torch.tensor(ids[first + 1 : last + 1], device=dev)
                logp = torch.log_softmax(logits.float(), dim=-1)
                nll_sum -= logp.gather(1, targets[:, None]).sum().item()
                scored += targets.numel()
                if logits_out is not None:
                    logits_out.append(logits.float().cpu())
            bar.update(end - start)
    finally:
        bar.close()
    kv_bytes = kv.bytes_used()
    stored = kv.stored_tokens(seq_id)
    kv.free(seq_id)

    elems = len(ids) * model.kv_spec().elements_per_token  # latent caches: K only
    nll = nll_sum / scored
    return PPLResult(
        ppl=math.exp(nll),
        nll=nll,
        tokens=len(ids),
        scored=scored,
        kv_bytes=kv_bytes,
        bits_per_element=kv_bytes * 8 / elems,
        kept_ratio=stored / len(ids),
        seconds=time.perf_counter() - t0,
    )


def read_text(path: str) -> str:
    """Read a UTF-8 text file, or fail with a one-line reason."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"text file not found: {path}") from None
    except IsADirectoryError:
        raise ValueError(f"text path is a directory, not a file: {path}") from None
    except PermissionError:
        raise ValueError(f"text file is not readable (permission denied): {path}") from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"text file is not UTF-8 text: {path} ({e.reason} at byte {e.start})"
        ) from None
    if not text.strip():
        raise ValueError(f"text file is empty: {path}")
    return text
