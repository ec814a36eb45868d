"""The packed record of the hybrid and int8 formats: its byte layout and its codec.

One pool block holds, per layer and KV head, one byte record with the fields listed in
`Record` (the layout `unikv/kernels/hybrid_attend.c` reads). `PackedCodec` quantizes blocks of keys
and values into records and dequantizes records back; `channel_plan` is the stored channel
order a calibration file gives. Keys are quantized per channel over the tokens of one block,
values per token over each class of channels; min/max with fp16 scale and low, or fp8 scale and
int8 zero point. What does not live here: when blocks are packed and how they are attended
(`hybrid.PackedFormat`), the quantizers themselves (`quant.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .calibration import ChannelStats
from .kv import KVSpec
from .quant import ChannelPlan, channel_counts, header_low, pack, plan_from_scores, quantize, unpack


@dataclass(frozen=True, slots=True)
class Record:
    """Byte layout of one (layer, block, KV head) record; sizes in bytes, in this order."""

    T: int
    k: tuple[int, int, int]  # key channels: (fp16, main width, low width)
    v: tuple[int, int, int]  # value channels
    bits: int
    low_bits: int
    scales: str = "fp16"  # group headers: fp16 scale + low, or fp8 scale + int8 zero point

    @property
    def fields(self) -> list[tuple[str, int]]:
        t, (kf, km, kl), (vf, vm, vl) = self.T, self.k, self.v
        hb = 2 if self.scales == "fp16" else 1  # bytes of one header entry
        return [
            # All channel-major: [channels][T], codes packed along the block's tokens.
            ("kfp", 2 * kf * t),  # f16 [kf][T]
            ("vfp", 2 * vf * t),  # f16 [vf][T]
            ("ksc", hb * 2 * (km + kl)),  # [2][km + kl]: scale, low (or zero) per key channel
            ("vsc", hb * 2 * self.v_classes * t),  # [2 * classes][T]: per token scale, low
            ("km", km * t * self.bits // 8),  # u8 [km][T * b / 8]
            ("kl", kl * t * self.low_bits // 8),
            ("vm", vm * t * self.bits // 8),
            ("vl", vl * t * self.low_bits // 8),
        ]

    @property
    def v_classes(self) -> int:
        """Quantized value classes present (main, low): each has per-token scales."""
        return (self.v[1] > 0) + (self.v[2] > 0)

    @property
    def offsets(self) -> list[int]:
        out, at = [], 0
        for _, size in self.fields:
            out.append(at)
            at += size
        return out

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.fields)


def record(spec: KVSpec, block_size: int, opts: dict[str, Any]) -> Record:
    """The record of one (layer, block, KV head) for checked options `opts`."""
    d, b, lb = spec.head_dim, opts["bits"], opts["low_bits"]
    k = channel_counts(d, opts["fp16_share"], opts["low_share"], b, lb)
    v = channel_counts(d, opts["v_fp16_share"], opts["v_low_share"], b, lb)
    if spec.latent:  # its values are its keys: no value channels of their own
        v = (0, 0, 0)
    if block_size * opts["low_bits"] % 8 or block_size * opts["bits"] % 8:
        raise ValueError(
            f"strategy 'hybrid_fp16_int4': block_size {block_size} must be a "
            "multiple of 4 (codes are packed along a block's tokens)"
        )
    if opts["sink_tokens"] > block_size:
        raise ValueError(
            f"strategy 'hybrid_fp16_int4': option sink_tokens = {opts['sink_tokens']}; "
            f"allowed: at most the block size ({block_size})"
        )
    return Record(block_size, k, v, b, lb, opts["scales"])


def channel_plan(spec: KVSpec, o: dict[str, Any]) -> ChannelPlan:
    """The stored channel order for checked options `o` (from their calibration file)."""
    shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    if o["calibration"] is None:
        # No model to calibrate on (the transformers adapter, unit tests): channel order.
        flat = torch.arange(spec.head_dim, 0, -1, dtype=torch.float32).expand(shape)
        ks = vs = flat
    else:
        stats = ChannelStats.load(o["calibration"], spec.identity, shape)
        ks, vs = stats.scores(o["method"])
    return plan_from_scores(ks, ks if spec.latent else vs)


class PackedCodec:
    """Blocks of K/V in stored channel order <-> records [B, H, REC] uint8."""

    def __init__(self, rec: Record, latent: bool) -> None:
        self.rec, self.latent = rec, latent

    def quantize(
        self, k: torch.Tensor, v: torch.Tensor, mask0: int, again: bool = False,
        sink_blocks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Records [B, H, REC] uint8 of blocks k, v: [B, H, T, D] in stored channel order;
        `mask0` leading tokens of the first block (of the blocks `sink_blocks`, indices along
        B, where given) are sinks, left out of its key ranges."""
        r = self.rec
        bsz, h, t, _ = k.shape
        parts = {"kfp": k[..., : r.k[0]].transpose(-1, -2).half()}  # [B, H, kf, T]
        parts["vfp"] = v[..., : r.v[0]].transpose(-1, -2).half()  # [B, H, vf, T]
        empty = k.new_zeros(bsz, h, 0, dtype=torch.uint8)
        parts |= {"km": empty, "kl": empty, "vm": empty, "vl": empty}  # classes without channels
        k_sc = []
        for lo, hi, bits, name in _present_classes(r.k, r):
            # Keys: per channel over the block's tokens, sinks left out of the range.
            kc = k[..., lo:hi].transpose(-1, -2)  # [B, H, C, T]
            codes, scale, low = quantize(kc, bits, -1, r.scales, skip=mask0, again=again,
                                         skip_groups=sink_blocks)  # fmt: skip
            k_sc.append(torch.cat([_bytes1(scale), _bytes1(low)], -1))  # [B, H, C, 2 * hb]
            parts["k" + name] = pack(codes, bits)  # [B, H, C, T * bits / 8]
        # [B, H, C, 2 * hb] -> rows [scales][lows] of [B, H, 2, C * hb]
        ksc = torch.cat(k_sc, -2) if k_sc else k.new_zeros(bsz, h, 0, 2, dtype=torch.uint8)
        hb = ksc.shape[-1] // 2
        parts["ksc"] = ksc.view(bsz, h, -1, 2, hb).transpose(2, 3).reshape(bsz, h, 2, -1)
        v_sc = []
        for lo, hi, bits, name in _present_classes(r.v, r):
            # Values: per token over the class's channels.
            codes, scale, low = quantize(v[..., lo:hi], bits, -1, r.scales, again=again)
            v_sc += [_bytes1(scale), _bytes1(low)]  # rows of [B, H, 2 * classes, T * hb]
            parts["v" + name] = pack(codes.transpose(-1, -2), bits)  # [B, H, C, T * bits / 8]
        parts["vsc"] = torch.stack([x.reshape(bsz, h, -1) for x in v_sc], -2) if v_sc else empty
        return torch.cat([_bytes(parts[name], bsz, h) for name, _ in r.fields], -1)

    def dequantize(
        self, recs: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V [B, H, T, D] (stored channel order) of rows `ids` of one layer's
        records `recs` [*, H, REC]."""
        r = self.rec
        raw = recs.index_select(0, ids)  # [B, H, REC]
        bsz, h, _ = raw.shape
        t, (kf, km, kl), (vf, vm, vl) = r.T, r.k, r.v
        f = {}
        for (name, size), at in zip(r.fields, r.offsets, strict=True):
            f[name] = raw[..., at : at + size]

        def half(x: torch.Tensor, *shape: int) -> torch.Tensor:
            return x.contiguous().view(torch.float16).view(bsz, h, *shape).float()

        def header(x: torch.Tensor, rows: int, n: int) -> torch.Tensor:
            """[B, H, rows, n] float: scale rows, then low rows (from fp16 or fp8 + zero)."""
            if not rows or not n:  # no quantized channel class (e.g. fp16_share = 1)
                return x.new_zeros((bsz, h, rows, n), dtype=torch.float32)
            x = x.contiguous().view(bsz, h, rows // 2, 2, -1)
            if r.scales == "fp16":
                return x.view(torch.float16).view(bsz, h, rows, n).float()
            scale = x[..., 0, :].view(torch.float8_e4m3fn).float()
            low = header_low(scale, x[..., 1, :].view(torch.int8))
            return torch.stack([scale, low], -2).view(bsz, h, rows, n)

        ksc = header(f["ksc"], 2, km + kl)
        kparts = [half(f["kfp"], kf, t).transpose(-1, -2)]
        at = 0  # key scale column of the class
        for n, bits, name in ((km, r.bits, "m"), (kl, r.low_bits, "l")):
            if n:
                codes = unpack(f["k" + name].reshape(bsz, h, n, -1), bits).float()  # [B, H, n, T]
                sc = ksc[..., at : at + n, None]  # [B, H, 2, n, 1]
                kparts.append((codes * sc[..., 0, :, :] + sc[..., 1, :, :]).transpose(-1, -2))
                at += n
        k = torch.cat(kparts, -1)
        if self.latent:  # no value fields: the values are the keys
            return k, k
        vsc = header(f["vsc"], 2 * r.v_classes, t)
        vparts = [half(f["vfp"], vf, t).transpose(-1, -2)]
        at = 0  # value scale row of the class
        for n, bits, name in ((vm, r.bits, "m"), (vl, r.low_bits, "l")):
            if n:
                codes = unpack(f["v" + name].reshape(bsz, h, n, -1), bits).float()
                scale, low = vsc[..., at : at + 1, :], vsc[..., at + 1 : at + 2, :]
                vparts.append((codes * scale + low).transpose(-1, -2))
                at += 2
        return k, torch.cat(vparts, -1)

    # ---- attention ---------------------------------------------------------------------------


def channel_classes(counts: tuple[int, int, int]) -> list[tuple[int, int]]:
    """Channel ranges [lo, hi) of the main and the low class after the fp16 channels."""
    nf, nm, nl = counts
    return [(nf, nf + nm), (nf + nm, nf + nm + nl)]


def _present_classes(counts: tuple[int, int, int], rec: Record) -> list[tuple[int, int, int, str]]:
    """(lo, hi, bits, name) of the main ("m") and low ("l") channel classes that have channels."""
    widths = (rec.bits, rec.low_bits)
    classes = zip(channel_classes(counts), widths, "ml", strict=True)
    return [(lo, hi, bits, name) for (lo, hi), bits, name in classes if hi > lo]


def _bytes1(x: torch.Tensor) -> torch.Tensor:
    """A header tensor [..., n, 1] (fp16, fp8 or int8) as raw bytes [..., n, itemsize]."""
    return x.contiguous().view(torch.uint8)


def _bytes(x: torch.Tensor, bsz: int, h: int) -> torch.Tensor:
    """A field as raw bytes [B, H, nbytes]."""
    if x.numel() == 0:
        return torch.zeros(bsz, h, 0, dtype=torch.uint8, device=x.device)
    x = x.contiguous()
    if x.dtype != torch.uint8:
        x = x.view(torch.uint8)
    return x.reshape(bsz, h, -1)
