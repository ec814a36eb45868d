"""GGUF block-quantized tensors kept packed: their bytes, a torch decoder, and the int4 form.

What lives here: `QuantizedTensor` (a 2-D weight as its GGUF blocks, [rows, blocks, bytes]),
`dequantize` (the blocks decoded in torch, the reference every native kernel is checked against
and what the fallback matmul uses), `int4_groups` (the weight as 4-bit codes with a scale and a
zero per 32-element group: what PyTorch's int4 CPU kernel reads) and `int8_rows` (per-output-row
int8, for its int8 kernel). What does not: reading the file (`engine.gguf_loader`) or the matmul
(`engine.linear`).

Formats (ggml's `ggml-common.h`; one block is 32 consecutive elements of a row):
- Q8_0: fp16 d, 32 x int8 q; w = d * q.
- Q4_0: fp16 d, 16 bytes of nibbles (element j in the low nibble of byte j, j + 16 in its high
  nibble); w = d * (q - 8).
- Q4_1: fp16 d, fp16 m, 16 bytes of nibbles as Q4_0; w = d * q + m.
and two K-quants, whose super-blocks hold 256 elements in 8 (Q4_K) or 16 (Q6_K) sub-blocks
with their own scales (`unikv/kernels/gemv.c` decodes them; here `gguf.quants` does, for the
reference path):
- Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes
  of nibbles; w = d * scale * q - dmin * min.
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 sub-block
  scales, fp16 d; w = d * scale * (q - 32).
The int4 and int8 forms exist for the 32-element formats only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
# name -> bytes per block
FORMATS = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}
K_FORMATS = ("Q4_K", "Q6_K")  # 256-element super-blocks
ELEMENTS = {name: 256 if name in K_FORMATS else BLOCK for name in FORMATS}  # per block


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A [rows, cols] weight stored as GGUF blocks: `blocks` is uint8 [rows, cols / 32, bytes]
    (cols / 256 for the K-quants)."""

    qtype: str
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        if self.qtype not in FORMATS:
            raise ValueError(f"no packed form for {self.qtype}; supported: {', '.join(FORMATS)}")
        b = self.blocks
        if b.dtype != torch.uint8 or b.dim() != 3 or b.shape[2] != FORMATS[self.qtype]:
            raise ValueError(
                f"{self.qtype} blocks must be uint8 [rows, blocks, {FORMATS[self.qtype]}], "
                f"got {b.dtype} {tuple(b.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.blocks.shape[1] * ELEMENTS[self.qtype])

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows at `index` (still packed)."""
        return QuantizedTensor(self.qtype, self.blocks[index])


def _half(b: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block, as float32: [R, NB, bytes] -> [R, NB, 1]."""
    return b[..., at : at + 2].contiguous().view(torch.float16).float()


def codes(q: QuantizedTensor) -> torch.Tensor:
    """The element codes [R, K]: int8 for Q8_0, 0..15 (uint8) for Q4_0 / Q4_1."""
    if q.qtype in K_FORMATS:
        raise ValueError(f"{q.qtype}: codes are read by gemv.c's decoder, not here")
    b = q.blocks
    r, nb, _ = b.shape
    if q.qtype == "Q8_0":
        return b[..., 2:].contiguous().view(torch.int8).reshape(r, nb * BLOCK)
    nib = b[..., 2 if q.qtype == "Q4_0" else 4 :]  # [R, NB, 16]
    return torch.cat((nib & 0x0F, nib >> 4), dim=-1).reshape(r, nb * BLOCK)


def scales(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d [R, NB], m [R, NB] for Q4_1 (Q4_K: its dmin) else None), float32: each block's fp16
    fields."""
    if q.qtype == "Q6_K":
        return _half(q.blocks, 208)[..., 0], None
    d = _half(q.blocks, 0)[..., 0]
    return d, (_half(q.blocks, 2)[..., 0] if q.qtype in ("Q4_1", "Q4_K") else None)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """The float32 weight [R, K], as ggml decodes it."""
    r, k = q.shape
    if q.qtype in K_FORMATS:
        from gguf import GGMLQuantizationType, quants

        raw = q.blocks.reshape(r, -1).numpy()
        return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[q.qtype]).copy())
    c = codes(q).float().view(r, -1, BLOCK)  # [R, NB, 32]
    d, m = scales(q)
    if q.qtype == "Q8_0":
        w = c * d[..., None]
    elif q.qtype == "Q4_0":
        w = (c - 8) * d[..., None]
    else:
        w = c * d[..., None] + m[..., None]
    return w.reshape(r, k)


def int4_groups(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes int32 [R, K'] in 0..15, scale [R, K'/32], zero [R, K'/32]) with
    w = (code - 8) * scale + zero: PyTorch's int4 convention, checked in tests/test_linear.py.

    Q4_0 and Q4_1 map exactly (K' = K). Q8_0 is split into two nibble planes, K' = 2K: its code
    q = 16 hi + lo with hi in -8..7 and lo in 0..15, so w = 16 d hi + d lo. The high plane (first
    K columns) has scale 16 d and zero 0, the low plane scale d and zero 8 d; multiplied with the
    input repeated twice ([x, x]) the sum is the Q8_0 product, group-exact (no requantization).
    """
    c = codes(q).to(torch.int32)
    d, m = scales(q)
    if q.qtype == "Q4_0":
        return c, d, torch.zeros_like(d)
    if q.qtype == "Q4_1":
        return c, d, m + 8 * d
    hi, lo = (c >> 4) + 8, c & 0x0F  # arithmetic shift: hi in -8..7, +8 -> 0..15
    return (
        torch.cat((hi, lo), dim=1),
        torch.cat((16 * d, d), dim=1),
        torch.cat((torch.zeros_like(d), 8 * d), dim=1),
    )


def int8_rows(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [R, K], scale [R]): the weight requantized to one scale per output row.

    NOTE: an extra rounding on top of the file's (a row's largest value sets its step, not each
    32-element block's): 0.55% of the weights' RMS on Gaussian test weights.
    """
    w = dequantize(q)
    s = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s
