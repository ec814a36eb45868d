"""Writes tiny random Llama GGUF files for loader tests (no download, milliseconds).

`write` takes the tensor type (any type `gguf.quants` decodes: the ones it cannot encode, such
as the K-quants, get random blocks with sane scales), the dimensions (K-quants and most IQ types
need rows of 256) and the vocabulary (`Vocab`: a byte-level or SentencePiece one with its flags).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, VOCAB = 64, 4, 2, 96, 2, 320
# Dimensions whose rows hold whole 256-element super-blocks (K-quants, most IQ types).
SUPER_HIDDEN = SUPER_FFN = 256

# Byte offsets of the fp16 scale fields in one block (ggml-common.h) of the formats
# `gguf.quants.quantize` cannot write; the other bytes of a synthetic block are random.
SCALE_FIELDS = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


@dataclass
class Vocab:
    """The tokenizer metadata of a file (`tokenizer.ggml.*`); None leaves a key out."""

    model: str = "gpt2"
    tokens: list[str] = field(default_factory=lambda: [chr(0x100 + i) for i in range(VOCAB)])
    types: list[int] | None = None  # llama.cpp token types; None: all NORMAL (1)
    merges: list[str] | None = field(default_factory=list)
    scores: list[float] | None = None
    pre: str | None = None
    bos: int | None = None
    eos: int | None = None
    unk: int | None = None
    add_bos: bool | None = None
    add_eos: bool | None = None
    add_space_prefix: bool | None = None

    def write_to(self, writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        optional = {
            writer.add_tokenizer_pre: self.pre,
            writer.add_token_merges: self.merges,
            writer.add_token_scores: self.scores,
            writer.add_bos_token_id: self.bos,
            writer.add_eos_token_id: self.eos,
            writer.add_unk_token_id: self.unk,
            writer.add_add_bos_token: self.add_bos,
            writer.add_add_eos_token: self.add_eos,
            writer.add_add_space_prefix: self.add_space_prefix,
        }
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types or [1] * len(self.tokens))
        for add, value in optional.items():
            if value is not None:
                add(value)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to Q and K (the loader must undo it)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute`."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def weights(
    seed: int = 0, vocab: int = VOCAB, hidden: int = HIDDEN, ffn: int = FFN
) -> dict[str, np.ndarray]:
    """Random weights in HF layout names of the loader's output (GGUF tensor names)."""
    rng = np.random.default_rng(seed)
    d = hidden // HEADS

    def r(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    out = {"token_embd.weight": r(vocab, hidden), "output_norm.weight": 1 + r(hidden)}
    for i in range(LAYERS):
        p = f"blk.{i}."
        out |= {
            p + "attn_norm.weight": 1 + r(hidden),
            p + "attn_q.weight": r(HEADS * d, hidden),
            p + "attn_k.weight": r(KV_HEADS * d, hidden),
            p + "attn_v.weight": r(KV_HEADS * d, hidden),
            p + "attn_output.weight": r(hidden, HEADS * d),
            p + "ffn_norm.weight": 1 + r(hidden),
            p + "ffn_gate.weight": r(ffn, hidden),
            p + "ffn_up.weight": r(ffn, hidden),
            p + "ffn_down.weight": r(hidden, ffn),
        }
    return out


def synthetic_blocks(shape: tuple[int, int], qtype: str, rng) -> np.ndarray:
    """Random `qtype` blocks for a [rows, cols] tensor, the fp16 scales set so that the decoded
    values are about as large as the random weights (|w| <= 0.05): uint8 [rows, bytes]."""
    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)

    def set_scales(value: float) -> None:
        for off in SCALE_FIELDS[qtype]:
            blocks[:, off : off + 2] = np.full((len(blocks), 1), value, np.float16).view(np.uint8)

    set_scales(1.0)
    peak = np.abs(gguf.quants.dequantize(blocks, q)).max()
    set_scales(0.05 / peak)
    return blocks.reshape(rows, -1)


# ---- K-quants quantized for real (gguf only decodes them) ----------------------------------


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """w float32 [R, K] (K a multiple of 256) -> Q4_K super-blocks, uint8 [R, K / 256, 144]:
    per sub-block of 32 the step (max - min) / 15 and the offset -min (min <= 0), both 6-bit
    multiples of the super-block's fp16 d and dmin, the codes rounded to nearest (no search,
    unlike llama-quantize's: valid blocks, a little less accurate than its)."""
    r, k = w.shape
    nb = k // 256
    x = w.reshape(r, nb, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)
    hi = x.max(-1)
    scale = (hi - lo) / 15.0  # [r, nb, 8]
    mins = -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)  # [r, nb]
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    df, dmf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    sc = np.clip(
        np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63
    ).astype(np.int32)
    m = np.clip(
        np.round(np.divide(mins, dmf, out=np.zeros_like(mins), where=dmf > 0)), 0, 63
    ).astype(np.int32)
    step = (df * sc)[..., None]
    off = (dmf * m)[..., None]
    q = np.clip(
        np.round(np.divide(x + off, step, out=np.zeros_like(x), where=step > 0)), 0, 15
    ).astype(np.uint8)
    out = np.zeros((r, nb, 144), dtype=np.uint8)
    out[..., 0:2] = d.view(np.uint8).reshape(r, nb, 2)
    out[..., 2:4] = dmin.view(np.uint8).reshape(r, nb, 2)
    s = np.zeros((r, nb, 12), dtype=np.int32)
    for i in range(4):
        s[..., i] = (sc[..., i] & 63) | ((sc[..., i + 4] >> 4) << 6)
        s[..., i + 4] = (m[..., i] & 63) | ((m[..., i + 4] >> 4) << 6)
        s[..., i + 8] = (sc[..., i + 4] & 0xF) | ((m[..., i + 4] & 0xF) << 4)
    out[..., 4:16] = s.astype(np.uint8)
    for c in range(4):
        out[..., 16 + 32 * c : 48 + 32 * c] = q[..., 2 * c, :] | (q[..., 2 * c + 1, :] << 4)
    return out


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """w float32 [R, K] (K a multiple of 256) -> Q6_K super-blocks, uint8 [R, K / 256, 210]:
    per sub-block of 16 the step max |w| / 31, an int8 multiple of the fp16 d, codes q - 32 in
    [-32, 31] rounded to nearest."""
    r, k = w.shape
    nb = k // 256
    x = w.reshape(r, nb, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31.0  # [r, nb, 16]
    d = (scale.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[..., None]
    sc = np.clip(
        np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127
    ).astype(np.int32)
    step = (df * sc)[..., None]
    q = (
        np.clip(np.round(np.divide(x, step, out=np.zeros_like(x), where=step != 0)), -32, 31) + 32
    ).astype(np.int32)
    q = q.reshape(r, nb, 256)
    ql = np.zeros((r, nb, 128), dtype=np.int32)
    qh = np.zeros((r, nb, 64), dtype=np.int32)
    for h in range(2):
        for g in range(4):
            part = q[..., 128 * h + 32 * g : 128 * h + 32 * g + 32]
            a = 64 * h + 32 * (g & 1)
            ql[..., a : a + 32] |= (part & 0xF) << (4 * (g >> 1))
            qh[..., 32 * h : 32 * h + 32] |= (part >> 4) << (2 * g)
    out = np.zeros((r, nb, 210), dtype=np.uint8)
    out[..., :128] = ql.astype(np.uint8)
    out[..., 128:192] = qh.astype(np.uint8)
    out[..., 192:208] = sc.astype(np.int8).view(np.uint8)
    out[..., 208:210] = d.view(np.uint8).reshape(r, nb, 2)
    return out


def quantize_k(w: np.ndarray, qtype: str) -> np.ndarray:
    """w float32 [R, K] as `qtype` (Q4_K or Q6_K) super-blocks, uint8 [R, K / 256, bytes]."""
    return {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}[qtype](w)


def write(
    path: Path,
    qtype: str = "F32",
    arch: str = "llama",
    seed: int = 0,
    pre: str | None = None,
    vocab: Vocab | None = None,
    hidden: int = HIDDEN,
    ffn: int = FFN,
    extra: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny model (with `tokenizer.ggml.pre` when `pre` is given, the vocabulary of
    `vocab`, its 2-D tensors of type `qtype`, then the `extra` arrays as they are, e.g. int8 ->
    I8); return the original (unpermuted, unquantized) weights. Where `gguf.quants` cannot encode
    `qtype` the blocks are synthetic, and what comes back is their exact decoding (unpermuted):
    what the loader must produce."""
    vocab = vocab or Vocab(pre=pre)
    w = weights(seed, len(vocab.tokens), hidden, ffn)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    vocab.write_to(writer)
    q = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed + 1)
    for name, arr in w.items():
        heads = HEADS if ".attn_q." in name else KV_HEADS if ".attn_k." in name else 0
        if heads:
            arr = permute(arr, heads)
        if arr.ndim != 2 or qtype == "F32":
            writer.add_tensor(name, arr)
            continue
        if qtype in SCALE_FIELDS:
            data = synthetic_blocks(arr.shape, qtype, rng)
            decoded = gguf.quants.dequantize(data, q)
            w[name] = unpermute(decoded, heads) if heads else decoded
        else:
            data = gguf.quants.quantize(arr, q)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=q)
    for name, arr in (extra or {}).items():
        writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return w
