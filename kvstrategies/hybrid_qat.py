"""What `hybrid_fp16_int4` stores, as a differentiable function: quantization-aware tuning.

`FakeQuant` takes a window's keys and values (all layers' shapes, model channel order, the
window starting at position 0 like a sequence) and returns them as a reader of the strategy's
stored blocks gets them, with gradients passed straight through the rounding (the
straight-through estimator). It calls the strategy's own `quant.quantize` with the strategy's
own record layout and channel plan, so the values are the same numbers the strategy's
attention reads (a test checks it against `PackedCodec.dequantize`):

- channels in the calibration's order: the first `kf` fp16, then the main width, then the low;
- keys per channel over each complete block of `block` tokens, the first `sink_tokens` tokens
  left out of block 0's ranges; values per token over each class's channels;
- fp16 or fp8 + int8-zero headers, codes against the rounded header.

Which copy a query reads is `read_mask`'s business: the strategy packs a block once it is
complete, so a query reads earlier blocks quantized and its own block (the side buffer) and the
sinks at full precision. That is what `eval ppl` sees with chunks that divide the block size.

`error` is the quantization term of the tuning loss: the mean squared error of the quantized
elements over their mean square, keys and values averaged; gradients move the keys and values
toward what the grid represents (the quantized copy is a constant there).
"""

from __future__ import annotations

from typing import Any

import torch

from . import registry
from .hybrid import PackedFormat
from .kv import KVSpec
from .packed import channel_classes, record
from .quant import ChannelPlan, dequantize, quantize


class FakeQuant:
    """The stored-and-read-back values of `hybrid_fp16_int4` for one setting and channel plan."""

    def __init__(self, spec: KVSpec, options: dict[str, Any], plan: ChannelPlan,
                 block: int = PackedFormat.default_block_size, device=None) -> None:  # fmt: skip
        opts = registry.get("hybrid_fp16_int4").check_options(options)
        self.rec = record(spec, block, opts)
        self.block, self.sinks = block, opts["sink_tokens"]
        self.k_order, self.v_order = plan.k_order.to(device), plan.v_order.to(device)
        self.k_inverse = self.k_order.argsort(-1)
        self.v_inverse = self.v_order.argsort(-1)

    def __call__(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k, v: [B, H, T, D] (T a multiple of the block) -> (k read, v read, error term).

        The read copies equal what the strategy dequantizes from its records for complete
        blocks; the sinks come back as fp16. Gradients: identity (straight through)."""
        b, h, t, d = k.shape
        if t % self.block:
            raise ValueError(f"window of {t} tokens is not a multiple of the block ({self.block})")
        kp = _permute(k, self.k_order[layer])
        vp = _permute(v, self.v_order[layer])
        with torch.no_grad():
            kq, vq = self._keys(kp.detach()), self._values(vp.detach())
        err = (_rel_error(kp, kq, self.sinks) + _rel_error(vp, vq, self.sinks)) / 2
        k_read = kp + (kq - kp).detach()
        v_read = vp + (vq - vp).detach()
        return _permute(k_read, self.k_inverse[layer]), _permute(v_read, self.v_inverse[layer]), err

    def _keys(self, kp: torch.Tensor) -> torch.Tensor:
        """Keys per channel over each block's tokens; sinks excluded from block 0's ranges."""
        r = self.rec
        b, h, t, d = kp.shape
        nb = t // self.block
        blocks = kp.reshape(b, h, nb, self.block, d).transpose(0, 2)  # [NB, H, B, T, D]
        out = blocks.clone()
        out[..., : r.k[0]] = blocks[..., : r.k[0]].half().float()
        for (lo, hi), bits in zip(channel_classes(r.k), (r.bits, r.low_bits), strict=True):
            if hi == lo:
                continue
            kc = blocks[..., lo:hi].transpose(-1, -2)  # [NB, H, B, C, T]: ranges along T
            # `skip` leaves the sinks out of group 0 of the leading axis: block 0, as in the
            # strategy, whose leading axis is the block too.
            codes, scale, low = quantize(kc, bits, -1, r.scales, skip=self.sinks)
            out[..., lo:hi] = dequantize(codes, scale, low).transpose(-1, -2)
        out = out.transpose(0, 2).reshape(b, h, t, d)
        return _sinks_fp16(out, kp, self.sinks)

    def _values(self, vp: torch.Tensor) -> torch.Tensor:
        """Values per token over each class's channels."""
        r = self.rec
        out = vp.clone()
        out[..., : r.v[0]] = vp[..., : r.v[0]].half().float()
        for (lo, hi), bits in zip(channel_classes(r.v), (r.bits, r.low_bits), strict=True):
            if hi > lo:
                out[..., lo:hi] = dequantize(*quantize(vp[..., lo:hi], bits, -1, r.scales))
        return _sinks_fp16(out, vp, self.sinks)


def read_mask(t: int, block: int, sinks: int, device=None) -> torch.Tensor:
    """Which copy each query reads, as a boolean mask [T, 2T] over (quantized keys, full keys):
    query i reads key j < i's block start quantized (sinks excepted) and the rest of its causal
    past at full precision."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    packed = (j // block < i // block) & (j >= sinks)
    return torch.cat([packed, (j <= i) & ~packed], dim=1)


def _permute(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] with channels gathered by order [H, D]."""
    return torch.gather(x, -1, order[None, :, None, :].expand_as(x))


def _sinks_fp16(out: torch.Tensor, x: torch.Tensor, sinks: int) -> torch.Tensor:
    """The first `sinks` tokens are stored fp16 in the side buffer, whatever their block."""
    if sinks:
        out[:, :, :sinks] = x[:, :, :sinks].half().float()
    return out


def _rel_error(x: torch.Tensor, xq: torch.Tensor, sinks: int) -> torch.Tensor:
    """Mean squared error of the quantized (non-sink) elements over their mean square."""
    x, xq = x[:, :, sinks:], xq[:, :, sinks:]
    return (x - xq).square().mean() / x.detach().square().mean().clamp_min(1e-12)
