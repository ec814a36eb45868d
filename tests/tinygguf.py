"""Writes tiny random Llama GGUF files for loader tests (no download, milliseconds)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 64, 4, 2, 96, 2, 320


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to Q and K (the loader must undo it)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in HF layout names of the loader's output (GGUF tensor names)."""
    rng = np.random.default_rng(seed)
    d = HIDDEN // HEADS

    def r(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    out = {"token_embd.weight": r(VOCAB, HIDDEN), "output_norm.weight": 1 + r(HIDDEN)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        out |= {
            p + "attn_norm.weight": 1 + r(HIDDEN),
            p + "attn_q.weight": r(HEADS * d, HIDDEN),
            p + "attn_k.weight": r(KV_HEADS * d, HIDDEN),
            p + "attn_v.weight": r(KV_HEADS * d, HIDDEN),
            p + "attn_output.weight": r(HIDDEN, HEADS * d),
            p + "ffn_norm.weight": 1 + r(HIDDEN),
            p + "ffn_gate.weight": r(FFN, HIDDEN),
            p + "ffn_up.weight": r(FFN, HIDDEN),
            p + "ffn_down.weight": r(HIDDEN, FFN),
        }
    return out


def write(
    path: Path, qtype: str = "F32", arch: str = "llama", seed: int = 0, pre: str | None = None
) -> dict[str, np.ndarray]:
    """Write a tiny model (with `tokenizer.ggml.pre` when `pre` is given); return the original
    (unpermuted, unquantized) weights."""
    w = weights(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list([chr(0x100 + i) for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([])
    q = gguf.GGMLQuantizationType[qtype]
    for name, arr in w.items():
        if ".attn_q." in name:
            arr = permute(arr, HEADS)
        elif ".attn_k." in name:
            arr = permute(arr, KV_HEADS)
        if arr.ndim == 2 and qtype != "F32":
            data = gguf.quants.quantize(arr, q)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=q)
        else:
            writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return w
