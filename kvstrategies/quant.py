"""Integer quantization primitives of the `hybrid_fp16_int4` strategy, in plain PyTorch.

Asymmetric min/max quantization: a group of values x is stored as codes q in [0, 2^b - 1] with
one fp16 `scale` and one fp16 `low` per group, and read back as q * scale + low. Codes are packed
`8 // b` to a byte along one axis in *split* order: byte j holds elements j, j + m, j + 2m, ...
(m = n * b // 8), so that unpacking with one shift yields a contiguous run of elements. That is
what lets the attention kernel (`unikv/kernels/native.py`) read packed blocks with plain loops.

`ChannelPlan` orders the channels of each layer and KV head by importance (from the
channel-importance evaluator, `calibration.py`); `channel_counts` says how many of them stay
fp16, get the main bit width, or the low one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (2, 4, 8)  # widths that pack a whole number of codes into a byte
_MIN_SCALE = 2.0**-14  # fp16's smallest normal: a constant group gets this scale, codes 0


SCALES = ("fp16", "fp8")  # group header formats: fp16 scale + fp16 low (32 bits), or
# an fp8 (e4m3) scale + an int8 zero point (16 bits): half the overhead, for the low-bit settings


def quantize(
    x: torch.Tensor,
    bits: int,
    dim: int,
    scales: str = "fp16",
    skip: int = 0,
    again: bool = False,
    skip_groups: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max quantize `x` in groups along `dim`.

    Returns (codes uint8 shaped like x, scale, low) with `dim` kept as size 1 in the last two:
    fp16 scale and fp16 low, or (scales="fp8") a float8_e4m3fn scale and an int8 zero point
    (value = (code - zero) * scale). The codes are computed against the stored (rounded) header,
    so `dequantize(*quantize(x))` is exactly what a reader of the stored bytes gets. With
    `skip`, the first `skip` elements of group 0 along the leading axis (attention sinks, stored
    apart) are left out of the min/max; of the groups `skip_groups` (indices along the leading
    axis) instead where it is given (blocks of several layers quantized at once).

    `again` is for values that are already one quantizer's output (re-packing compacted
    blocks): the fp8 scale is rounded up to the next e4m3 value instead of scaled by 1.07 and
    rounded to nearest: a scale never grows when its group is quantized again (and a group
    whose codes span the full range keeps header and codes). With the 1.07 rule each pass
    could grow a scale by one e4m3 step, and a block compacted a few dozen times lost its codes
    (pruned x hybrid at 2,048 tokens: PPL 1,388 instead of 16).
    """
    levels = (1 << bits) - 1
    if skip and (skip_groups is None or skip_groups.numel()):  # (no group has sinks: none)
        out = torch.zeros_like(x, dtype=torch.bool)
        if skip_groups is None:
            out.narrow(0, 0, 1).narrow(dim, 0, skip).fill_(True)
        else:
            out.narrow(dim, 0, skip)[skip_groups] = True
        lo = x.masked_fill(out, float("inf")).amin(dim, keepdim=True)
        hi = x.masked_fill(out, float("-inf")).amax(dim, keepdim=True)
    else:
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    if scales == "fp8":
        # The zero point must fit an int8: a group far from 0 gets a coarser scale. Rounded up
        # (x 1.07 > one e4m3 half-step) so that the codes still cover [lo, hi].
        s = torch.maximum((hi - lo) / levels, lo.abs() / 127).clamp(2.0**-9, 400.0)
        scale = _fp8_ceil(s) if again else (s * 1.07).to(torch.float8_e4m3fn)
        zero = torch.round(-lo / scale.float()).clamp_(-128, 127)
        codes = (x / scale.float() + zero).round_().clamp_(0, levels).to(torch.uint8)
        return codes, scale, zero.to(torch.int8)
    scale = ((hi - lo) / levels).clamp_min(_MIN_SCALE).half()
    low = lo.half()
    codes = ((x - low.float()) / scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale, low


def _fp8_ceil(s: torch.Tensor) -> torch.Tensor:
    """The smallest e4m3 value >= `s` (positive, at most 448)."""
    r = s.to(torch.float8_e4m3fn)
    up = (r.view(torch.uint8) + 1).view(torch.float8_e4m3fn)  # the next value up
    return torch.where(r.float() < s, up, r)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The values of `quantize`'s output in float32 (header broadcast over the group axis)."""
    s = scale.float()
    return codes.float() * s + header_low(s, low)


def header_low(scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """The additive term of a group header: its fp16 low, or -zero * scale for an int8 zero."""
    return -low.float() * scale if low.dtype == torch.int8 else low.float()


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
