"""The peers the quality benchmarks run beside unikv, on the same model and tokens.

- transformers' `QuantizedCache` (quanto backend) and its full-precision `DynamicCache`, on
  transformers' Llama loaded from the same GGUF, through the DESIGN protocol (`hf_run`);
- llama.cpp's quantized KV through `llama-perplexity` on the F32 GGUF made from the same file
  (`llamacpp_perplexity`), which scores the second half of its window.

What does not live here: finding or building llama.cpp (`benchmarks.llamacpp`), unikv's own
perplexity (`engine.evaluate`).
"""

from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from unikv.engine.gguf_loader import resolve_model_path

# Bits per element of llama.cpp's KV cache types (block of 32 values plus an fp16 scale).
LLAMACPP_KV_BITS = {"f16": 16.0, "q8_0": 8.5, "q5_0": 5.5, "q4_0": 4.5}
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+|nan|inf)(?: \+/- ([0-9.]+|nan|inf))?")


@functools.cache
def hf_model(model: str = "smollm2"):
    """transformers' causal LM loaded from the packaged GGUF (float32, eval mode), loaded once."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def hf_run(ids: list[int], nbits: int | None, prefill: int = 256, chunk: int = 16, hf=None):
    """The protocol through transformers' Llama: `QuantizedCache(quanto, nbits, groups of 64,
    128-token residual)`, or `DynamicCache` (full precision) for `nbits=None`.

    Returns (PPL, logits of the scored tokens [n, V], bits per element at the end of the run).
    """
    from transformers import DynamicCache, QuantizedCache

    hf = hf_model() if hf is None else hf
    if nbits is None:
        cache = DynamicCache(config=hf.config)
    else:
        cache = QuantizedCache(
            backend="quanto", config=hf.config, nbits=nbits, q_group_size=64, residual_length=128
        )
    out, nll, scored = [], 0.0, 0
    starts = [0, *range(prefill, len(ids), chunk)]
    with torch.inference_mode():
        for i, start in enumerate(starts):
            end = prefill if i == 0 else min(start + chunk, len(ids))
            x = torch.tensor([ids[start:end]])
            logits = hf(input_ids=x, past_key_values=cache, use_cache=True).logits[0]
            first = end - 1 if i == 0 else start
            last = min(end, len(ids) - 1)
            rows = logits[first - start : last - start]
            if len(rows):
                t = torch.tensor(ids[first + 1 : last + 1])
                nll -= torch.log_softmax(rows, -1).gather(1, t[:, None]).sum().item()
                scored += len(t)
                out.append(rows)
    stored = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values"):
            stored += _tensor_bytes(getattr(layer, name, None))
        # The residual window (quanto) or the whole cache (full precision): keys and values.
        stored += _tensor_bytes(layer.keys) + _tensor_bytes(layer.values)
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elems = len(ids) * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim
    return float(torch.tensor(nll / scored).exp()), torch.cat(out), stored * 8 / elems


def quanto_run(ids: list[int], nbits: int, prefill: int = 256, chunk: int = 16, hf=None):
    """`hf_run` with transformers' quanto cache of `nbits` bits: (PPL, logits, bits)."""
    return hf_run(ids, nbits, prefill, chunk, hf)


def _tensor_bytes(t) -> int:
    """Bytes of a (possibly quanto-subclassed) tensor: the sum of its inner plain tensors."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def parse_perplexity(output: str) -> float:
    """llama-perplexity's final estimate ("Final estimate: PPL = 16.6178 +/- 2.60820")."""
    found = _FINAL.findall(output)
    if not found:
        tail = output.strip().splitlines()[-3:]
        raise ValueError(f"no 'Final estimate' in llama-perplexity's output: {tail}")
    return float(found[-1][0])


def llamacpp_perplexity(
    bin_dir: Path,
    gguf: Path,
    text: str,
    n_tokens: int,
    ctx: int,
    kv_type: str,
    threads: int = 1,
    ubatch: int = 16,
) -> float:
    """llama.cpp's PPL over the second half of the first `ctx`-token window of `text`, with
    keys and values of cache type `kv_type` (f16, q8_0, q5_0, q4_0).

    `llama-perplexity` refuses a text of fewer than 2 × ctx tokens, although one chunk scores
    only the first ctx: a shorter text (`n_tokens`, as unikv's tokenizer counts it: the same
    vocabulary, no BOS) is repeated, which leaves that window unchanged.
    """
    if kv_type not in LLAMACPP_KV_BITS:
        raise ValueError(f"llama.cpp KV type {kv_type!r}; known: {', '.join(LLAMACPP_KV_BITS)}")
    repeats = -(-(2 * ctx + 64) // max(n_tokens, 1))
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text * max(repeats, 1))
        f.flush()
        cmd = [str(bin_dir / "llama-perplexity"), "-m", str(gguf), "-f", f.name,
               "-c", str(ctx), "-b", str(ctx), "-ub", str(ubatch), "--chunks", "1",
               "-fa", "on", "-ctk", kv_type, "-ctv", kv_type, "-t", str(threads)]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True)
    output = res.stdout + res.stderr
    if res.returncode != 0:
        tail = " | ".join(output.strip().splitlines()[-3:])
        raise RuntimeError(f"llama-perplexity -ctk {kv_type} exited {res.returncode}: {tail}")
    return parse_perplexity(output)
