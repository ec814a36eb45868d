"""Integer quantization primitives of the `hybrid_fp16_int4` strategy, in plain PyTorch.

Asymmetric min/max quantization: a group of values x is stored as codes q in [0, 2^b - 1] with
one fp16 `scale` and one fp16 `low` per group, and read back as q * scale + low. Codes are packed
`8 // b` to a byte along one axis in *split* order: byte j holds elements j, j + m, j + 2m, ...
(m = n * b // 8), so that unpacking with one shift yields a contiguous run of elements. That is
what lets the attention kernel (`kvstrategies/kernels.py`) read packed blocks with plain loops.

`ChannelPlan` orders the channels of each layer and KV head by importance (from the
channel-importance evaluator, `calibration.py`); `channel_counts` says how many of them stay
fp16, get the main bit width, or the low one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (2, 4, 8)  # widths that pack a whole number of codes into a byte
_MIN_SCALE = 2.0**-14  # fp16's smallest normal: a constant group gets this scale, codes 0


def quantize(
    x: torch.Tensor, bits: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max quantize `x` in groups along `dim`.

    Returns (codes uint8 shaped like x, scale fp16, low fp16), the last two with `dim` kept as
    size 1. The codes are computed against the fp16-rounded scale and low, so that
    `dequantize(*quantize(x))` is exactly what a reader of the stored bytes gets.
    """
    levels = (1 << bits) - 1
    lo = x.amin(dim, keepdim=True)
    hi = x.amax(dim, keepdim=True)
    scale = ((hi - lo) / levels).clamp_min(_MIN_SCALE).half()
    low = lo.half()
    codes = ((x - low.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale, low


def dequantize(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """codes * scale + low in float32 (scale and low broadcast over the group axis)."""
    return codes.float() * scale.float() + low.float()


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes along the last axis, `8 // bits` per byte in split order."""
    per = 8 // bits
    n = codes.shape[-1]
    if n % per:
        raise ValueError(f"cannot pack {n} codes of {bits} bits: not a multiple of {per}")
    m = n // per
    out = codes[..., :m].clone()
    for i in range(1, per):
        out |= codes[..., i * m : (i + 1) * m] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: [..., m] bytes -> [..., m * 8 // bits] codes."""
    per = 8 // bits
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * i)) & mask for i in range(per)], dim=-1)


@dataclass(frozen=True, slots=True)
class ChannelPlan:
    """Stored channel order per (layer, KV head): `k_order`/`v_order` are [layers, kv_heads,
    head_dim] permutations, most important channel first. Storage keeps channels in this order
    (the fp16 class first, then the main width, then the low width); queries are permuted the
    same way for keys, outputs are permuted back for values."""

    k_order: torch.Tensor
    v_order: torch.Tensor


def channel_counts(head_dim: int, fp16_share: float, low_share: float, bits: int, low_bits: int):
    """(n_fp16, n_main, n_low) for the shares, each class packable into whole bytes.

    The low class is rounded to a multiple of its codes per byte; fp16 takes the share rounded
    to the nearest count that leaves the main class packable.
    """
    per_main, per_low = 8 // bits, 8 // low_bits
    n_low = int(round(low_share * head_dim / per_low)) * per_low if low_share > 0 else 0
    rest = head_dim - n_low
    n_fp16 = int(round(fp16_share * head_dim))
    n_fp16 = min(rest, n_fp16 + (rest - n_fp16) % per_main)
    return n_fp16, rest - n_fp16, n_low


def plan_from_scores(k_scores: torch.Tensor, v_scores: torch.Tensor) -> ChannelPlan:
    """Order channels by importance ([layers, kv_heads, head_dim], higher = keep more precision)."""
    k_order = torch.argsort(k_scores, dim=-1, descending=True, stable=True)
    v_order = torch.argsort(v_scores, dim=-1, descending=True, stable=True)
    return ChannelPlan(k_order, v_order)
