"""Linear layers in their stored weight format, and the engine's ops in the kernel registry.

What lives here: `SplitLinear` (float weights, multiplied as column slices), `PackedWeight` (a
GGUF-quantized weight kept packed, with the forms its kernels prepared), `Linear` (one layer:
a weight plus the breaker of its format's matmul op), `StackedLinear` (a fused layer whose
parts are packed in different formats), `build_linear`, and the registry entries of
the matmul ops (one per weight format), `rmsnorm` and `rope`. What does not: the registry and the
breaker (`kernels.operators`), the block formats (`engine.quantized`), the forward pass
(`engine.model`).

Ops and their entries, in preference order (the last is the reference, available everywhere):
- matmul.float (weights in the compute dtype): gemv (CPU, AVX-512: `unikv/kernels/gemv.c` for
  decode, at most `gemv.MAX_ROWS` rows of float32; larger batches go on to split_bmm),
  split_bmm (CPU), mm.
- matmul.bf16 (bf16 weights, float32 compute): split_bmm (CPU, CUDA), mm (dequantize).
- matmul.q8_0: gemv_i8 (CPU, AVX512-VNNI: the activations rounded per 32-element block to two
  int8 codes, llama.cpp's Q8_0 / Q8_1 activations plus a code for the rest, and the GGUF blocks
  multiplied in integers; decode, 16-token chunks, and a prefill's rows where `_prefill`
  measured that faster than the decoded GEMM), gemv
  (CPU, AVX-512: the GGUF blocks decoded in registers, float32 activations; up to
  `gemv.MAX_ROWS` rows), int4x2 (CPU: PyTorch's int4 kernel over two nibble planes,
  group-exact), int8 (CPU: PyTorch's weight-only int8 kernel, requantized per row), dequant.
  From `gemv.GEMM_ROWS` rows on (a prefill) gemv, and gemv_i8 where `_prefill` chose so, decode
  the blocks in panels for PyTorch's float32 GEMM (`gemv.gemm_packed`): at 512 rows 2.1x
  gemv_i8 and 1.8x the int4 kernel on SmolLM2's layers (Intel Xeon, AVX-512), with the exact
  weights; 0.70x gemv_i8 on the AMD EPYC (Zen 4).
- matmul.q4_0, matmul.q4_1: gemv_i8, gemv (as for Q8_0), int4 (CPU:
  `_weight_int4pack_mm_for_cpu`, group size 32), dequant.
- matmul.q4_k, matmul.q6_k: gemv_i8 (CPU: `gemv.c`'s gemv_ki8, the activations rounded as for
  the 32-element formats and the super-blocks multiplied in integers), gemv (CPU: its gemv_k,
  float32 activations, the super-blocks decoded in registers; from `gemv.GEMM_ROWS` rows on
  both take the decoded GEMM), dequant.
- rmsnorm: fused (`F.rms_norm`, CPU and CUDA), torch. rope: rotate_half.

NOTE: PyTorch's int4 and int8 CPU kernels (what larger batches use on packed weights) are fast
only for bf16 activations (measured here at batch 1 on SmolLM2's 49152 x 576 head: int4 1.2 ms
in bf16, 56 ms in float32, against 8 ms for float32 weights), so those entries multiply in bf16
and return the caller's dtype: the activations and the group scales are rounded to bf16
(docs/kernels.md gives the error). The gemv entry (decode) keeps float32 activations; gemv_i8
rounds them to two int8 codes per element (1.2-1.8x faster than gemv here, within 1e-4 of
float32 activations per matmul; the model's decode is checked in tests/test_linear.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from unikv.kernels import gemv
from unikv.kernels.operators import Breaker, FnImplementation, OperatorSet, choose, register
from unikv.memory import hugepages

from .quantized import K_FORMATS, QuantizedTensor, dequantize, int4_groups, int8_rows

log = logging.getLogger(__name__)
BLOCK_FORMATS = ("Q8_0", "Q4_0", "Q4_1")  # 32-element blocks: int8 and int4 entries too
NATIVE_FORMATS = (*BLOCK_FORMATS, *K_FORMATS)


class SplitLinear:
    """y = x @ W.T with W stored row-major [out, in], multiplied by the decode kernel (a few rows,
    `kernels.gemv`) or, for larger batches, as column slices by one `bmm`.

    NOTE: on CPU, MKL runs a matrix-vector product (decode at batch 1) on one core, and skinny
    matrix products poorly. Splitting the output columns into P slices and multiplying them as a
    batch lets every core stream its own slice of the weights: measured here 33 -> 16 ms per token
    at batch 1 (two cores), and never slower up to 256 rows. The slices are a view of the
    row-major weight ([P, out/P, in] read transposed, which `bmm` takes as it is: measured here
    as fast as the copied [P, in, out/P] layout from 8 to 512 rows), so the gemv kernel and the
    bmm share one copy of the weights. From gemv.GEMM_ROWS rows on (a prefill) one plain product of
    the whole weight is faster again (10.7 against 11.8 ms for a SmolLM2 layer's four at 512
    rows, Intel Xeon).
    """

    def __init__(self, weight: torch.Tensor, parts: int) -> None:
        out_features, in_features = weight.shape
        while out_features % parts:
            parts //= 2
        self.parts, self.out_features, self.in_features = parts, out_features, in_features
        self.weight = weight.contiguous()  # [out, in]
        # [out, in] -> [P, out/P, in] -> [P, in, out/P]: a view, no copy
        self.slices = self.weight.view(parts, out_features // parts, in_features).transpose(1, 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in] -> [N, out]."""
        n = x.shape[0]
        if self.parts == 1 or n >= gemv.GEMM_ROWS:  # a prefill: one GEMM does more per second
            return x @ self.weight.t()
        y = torch.bmm(x.expand(self.parts, n, x.shape[1]), self.slices)  # [P, N, out/P]
        return y.permute(1, 0, 2).reshape(n, self.out_features)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows of W (as an embedding table) for `index`: [N] -> [N, in]."""
        return self.weight[index]

    def to_dense(self) -> torch.Tensor:
        """W as float32 [out, in]."""
        return self.weight.float()


# Forms built by every PackedWeight so far (`weight_formats` counts their bytes again only when
# this changes: the engine's memory report is built every few steps).
forms_built = 0


# Whether gemv_i8 interleaves the weights its path reads so (`gemv.can_interleave`: VNNI, or
# AVX2's Q4_0 / Q4_1; `PackedWeight.interleave`), read as each PackedWeight is made;
# benchmarks/kernel_ab.py --layouts loads one model without.
INTERLEAVE = True

# Whether a fused layer of packed parts in different formats stays packed (`StackedLinear`),
# read as each layer is built; benchmarks/kernel_ab.py --stack loads one model without (its
# mixed layers decoded to float32, as before).
STACK = True


class PackedWeight:
    """A quantized weight kept as its GGUF blocks, plus the forms its kernels prepared from
    them (built once, on a kernel's first use, and kept).

    The blocks are held once, in one of two orders: GGUF's (`q`), or, where gemv_i8's path
    reads it (`gemv.can_interleave`), interleaved by 16 rows (`rows16`, gemv.c's ROWS16
    layout: the same bytes, 1.2-1.3x faster to multiply at decode). An interleaved weight
    gives up its GGUF copy; an entry that still asks for `q` (a fallback after the breaker
    tripped, the reference) has it rebuilt once and kept, and `nbytes` then counts both."""

    def __init__(self, q: QuantizedTensor, dtype: torch.dtype) -> None:
        self._q: QuantizedTensor | None = q
        self.qtype, self.dtype = q.qtype, dtype
        self.out_features, self.in_features = q.shape
        self.rows16: torch.Tensor | None = None
        self.may_interleave = INTERLEAVE  # (read when it is made: a model keeps its layout)
        self.forms: dict[str, object] = {}

    @property
    def q(self) -> QuantizedTensor:
        """The GGUF blocks (rebuilt from `rows16` on first use after `interleave`)."""
        if self._q is None:
            self._q = QuantizedTensor(self.qtype, gemv.deinterleave(self.rows16, self.qtype))
            _built()
        return self._q

    def interleave(self) -> None:
        """Hold the blocks interleaved by 16 rows instead of in GGUF order (gemv_i8's form)."""
        if self.rows16 is None:
            rows16 = hugepages.place(gemv.interleave(self._q.blocks, self.qtype))
            self.rows16, self._q = rows16, None
            for name in ("blocks", "i8"):  # forms of the GGUF order: rebuilt if asked for
                self.forms.pop(name, None)
            _built()

    def place(self) -> None:
        """Hold the GGUF blocks in huge pages (`memory.hugepages`), and every form that is
        those blocks themselves; an interleaved weight's blocks were placed by `interleave`."""
        if self._q is None:
            return
        old = self._q.blocks
        new = hugepages.place(old)
        if new is not old:
            self._q = QuantizedTensor(self.qtype, new)
            self.forms = {k: new if f is old else f for k, f in self.forms.items()}

    def form(self, name: str, build: Callable[[QuantizedTensor], object]) -> object:
        f = self.forms.get(name)
        if f is None:
            f = self.forms[name] = build(self.q)
            _built()
        return f

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows of W (as an embedding table) for `index`, decoded: [N] -> [N, in]. gemv.c
        reads only those rows, in one call (in either order); without it, torch decodes the
        rows' blocks."""
        flat = index.reshape(-1)
        if gemv.unavailable() is None and self.qtype in gemv.FORMAT_CODE:
            blocks = self.rows16 if self._q is None else self._q.blocks
            if blocks.is_contiguous() and blocks.device.type == "cpu":
                rows = gemv.dequantize_index(blocks, self.qtype, flat, self._q is None)
                return rows.view(*index.shape, -1).to(self.dtype)
        if self._q is None:  # interleaved: only the groups of these rows are decoded
            blocks = gemv.deinterleave_rows(self.rows16, self.qtype, flat)
        else:
            blocks = self._q.blocks[flat]
        rows = dequantize(QuantizedTensor(self.qtype, blocks))
        return rows.view(*index.shape, -1).to(self.dtype)

    def to_dense(self) -> torch.Tensor:
        if self._q is None:  # not kept: a one-off copy
            blocks = gemv.deinterleave(self.rows16, self.qtype)
            return dequantize(QuantizedTensor(self.qtype, blocks))
        return dequantize(self.q)

    @property
    def nbytes(self) -> int:
        held = (self._q.nbytes if self._q is not None else 0) + (
            self.rows16.numel() if self.rows16 is not None else 0
        )
        return held + sum(
            sum(t.numel() * t.element_size() for t in f if isinstance(t, torch.Tensor))
            for f in self.forms.values()
            if isinstance(f, tuple)
        )


def _built() -> None:
    """A packed weight gained (or changed) a form: `weight_formats` counts their bytes again."""
    global forms_built
    forms_built += 1


class Linear:
    """One linear layer: its weight in its stored format and the breaker of that format's op."""

    __slots__ = ("weight", "op", "fmt", "note")

    def __init__(
        self, weight: SplitLinear | PackedWeight, op: Breaker, fmt: str, note: str = ""
    ) -> None:
        # note: how a GGUF format is run here, or why it was decoded at load
        self.weight, self.op, self.fmt, self.note = weight, op, fmt, note

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    @property
    def in_features(self) -> int:
        return self.weight.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in] -> [N, out]."""
        if x.shape[0] == 0:  # (a prompt chunk's logits: none) no kernel decodes a weight for it
            return x.new_empty(0, self.weight.out_features)
        return self.op(x, self.weight)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.weight.rows(index)

    def to_dense(self) -> torch.Tensor:
        """The weight as float32 [out, in] (decoded if packed)."""
        return self.weight.to_dense()


class StackedLinear:
    """One fused layer whose GGUF tensors were quantized in different formats, each part kept
    packed and multiplied by its own format's entry, the outputs side by side: Q4_K_M quantizes
    attn_v (and ffn_down) in Q6_K in about half of a model's layers, beside attn_q and attn_k
    in Q4_K. Decoded to float32 instead, as they were before, such a QKV is read at 4 bytes a
    weight: in a Llama 3.2 1B-shaped Q4_K_M, 8 of 16 layers' QKV held 192 MiB of float32
    where their blocks are 30 MiB, and the decode step read 1.25x the bytes it needs. A part
    in a format no packed kernel reads (Q4_K_S gives its first 4 layers' attn_v Q5_K, which
    the GGUF loader decodes) stays float alone, the others packed. gemv.c's layer calls take
    the parts as one chain (`gemv.chain`, engine.fused), a float32 part among them."""

    __slots__ = ("parts", "fmt", "note")

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts
        self.fmt = "+".join(p.fmt for p in parts)  # e.g. "Q4_K+Q6_K"
        self.note = "; ".join(dict.fromkeys(p.note for p in parts if p.note))

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in] -> [N, out], each part's columns after the one before."""
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` [N] of the stacked weight, [N, in] (each from its part)."""
        out = torch.empty(index.numel(), self.in_features)
        start = 0
        for p in self.parts:
            end = start + p.out_features
            mine = (index >= start) & (index < end)
            if mine.any():
                out[mine] = p.rows(index[mine] - start).to(out.dtype)
            start = end
        return out

    def to_dense(self) -> torch.Tensor:
        """The stacked weight as float32 [out, in] (each part decoded)."""
        return torch.cat([p.to_dense().float() for p in self.parts])


def layer_parts(lin: Linear | StackedLinear) -> list[Linear]:
    """A layer's Linears: a `StackedLinear`'s parts, or the Linear itself."""
    return lin.parts if isinstance(lin, StackedLinear) else [lin]


# The packed entries whose activations stay float32 or two int8 codes (within 0.1% PPL of the
# float32 model on every development text); int4 / int8 (bf16 activations) are not among them.
EXACT_PACKED = ("gemv_i8", "gemv")


def native_op(qtype: str, device: torch.device) -> tuple[str | None, str]:
    """(the matmul op that runs `qtype` packed on `device`, or None when no entry there keeps
    the activations exact enough: then the weight is decoded once at load; why)."""
    if qtype not in NATIVE_FORMATS:
        return None, f"no packed kernel reads {qtype}"
    op = f"matmul.{qtype.lower()}"
    chosen, skipped = choose(op, device)
    first = next((i.name for i in chosen if i.name in EXACT_PACKED), None)
    if first is not None:
        return op, f"{first} ({gemv.i8_isa() if first == 'gemv_i8' else gemv.isa()})"
    why = "; ".join(f"{n}: {skipped[n]}" for n in EXACT_PACKED if n in skipped)
    return None, f"decoded to float at load: no kernel with float32 or int8x2 activations ({why})"


def build_linear(
    tensors: Sequence[torch.Tensor | QuantizedTensor],
    dtype: torch.dtype,
    device: torch.device,
    parts: int,
    operators: OperatorSet,
    prepare: bool = True,
) -> Linear | StackedLinear:
    """One fused layer of `tensors` (stacked along the output rows). Packed tensors of one
    format with a native kernel on `device` stay packed (the kernel's form is prepared now
    unless `prepare` is False: an embedding table only reads rows); tensors of several formats,
    one at least packed with one, are a `StackedLinear` of one Linear per run of a format
    (each packed where its format has a kernel, else float); anything else is decoded to
    `dtype` (`Linear.note` says why). bf16 tensors under a float32
    model keep bf16 (matmul.bf16). What a kernel streams (the float weight, the packed blocks in
    the order its kernel reads) is held in huge pages where the host has them
    (`memory.hugepages`)."""
    qtypes = {t.qtype if isinstance(t, QuantizedTensor) else None for t in tensors}
    note = ""
    if len(qtypes) == 1 and (qtype := next(iter(qtypes))) is not None:
        op, note = native_op(qtype, device)
        if op is not None:
            q = QuantizedTensor(qtype, torch.cat([t.blocks for t in tensors]))
            lin = Linear(PackedWeight(q, dtype), operators[op], qtype, note)
            if prepare:  # (interleaved now where gemv_i8 reads that: `interleave` places it)
                _prepare(lin)
                lin.weight.place()
            return lin
        note = f"{qtype} {note}"
    elif STACK and len(qtypes) > 1 and any(native_op(q, device)[0] is not None
                                           for q in qtypes if q is not None):  # fmt: skip
        # (a run no packed kernel reads stays float alone: Q4_K_S's first layers' attn_v in
        # Q5_K, which the GGUF loader decoded)
        runs: list[list] = []  # consecutive tensors of one format (or float)

        def fmt(t) -> str | None:
            return t.qtype if isinstance(t, QuantizedTensor) else None

        for t in tensors:
            if runs and fmt(runs[-1][0]) == fmt(t):
                runs[-1].append(t)
            else:
                runs.append([t])
        stacked = [build_linear(r, dtype, device, parts, operators, prepare) for r in runs]
        return StackedLinear(stacked)  # type: ignore[arg-type]
    dense = [dequantize(t) if isinstance(t, QuantizedTensor) else t for t in tensors]
    keep_bf16 = all(t.dtype == torch.bfloat16 for t in dense) and dtype != torch.bfloat16
    wdtype = torch.bfloat16 if keep_bf16 else dtype
    w = _cat([t.to(device=device, dtype=wdtype) for t in dense])
    op = "matmul.bf16" if keep_bf16 else "matmul.float"
    return Linear(SplitLinear(w, parts), operators[op], "BF16" if keep_bf16 else "float", note)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along the rows, written straight into huge pages on the CPU
    (`memory.hugepages`): a weight stacked, then copied, left about 100 MiB of freed heap
    behind a float32 SmolLM2 that glibc kept (resident 1,343 against 1,246 MiB)."""
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    out = hugepages.empty(shape, parts[0].dtype) if parts[0].device.type == "cpu" else None
    return torch.cat(parts, out=out) if out is not None else torch.cat(parts)


def _prepare(lin: Linear) -> None:
    impl = lin.op.active
    prep = getattr(impl, "prepare", None)
    if prep is not None:
        prep(lin.weight)


# ---- the registry entries -----------------------------------------------------------------


def _aten(name: str) -> Callable[[torch.device, object], str | None]:
    def available(device: torch.device, owner: object) -> str | None:
        if device.type != "cpu":
            return "a CPU kernel"
        try:
            getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            return f"this torch build has no aten.{name}"
        return None

    return available


def _mm_slices(x: torch.Tensor, w: SplitLinear) -> torch.Tensor:
    """The reference float matmul: one plain product."""
    wd = w.weight
    if wd.dtype != x.dtype:
        return (x.float() @ wd.float().t()).to(x.dtype)
    return x @ wd.t()


def _mm_dequant(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """The reference packed matmul: decode the whole weight, then a float32 product."""
    return (x.float() @ dequantize(w.q).t()).to(x.dtype)


def _int4_form(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    c, s, z = int4_groups(q)  # [N, K'], [N, K'/32] x 2
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(c, 2)
    sz = torch.stack((s.t(), z.t()), dim=-1).to(torch.bfloat16).contiguous()  # [K'/32, N, 2]
    return packed, sz


def _int4_mm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    packed, sz = w.form("int4", _int4_form)
    xb = x.to(torch.bfloat16)
    if w.qtype == "Q8_0":
        xb = torch.cat((xb, xb), dim=-1)  # [N, 2K]: the high and the low nibble plane
    return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, 32, sz).to(x.dtype)


def _int8_form(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    w8, s = int8_rows(q)
    return w8, s.to(torch.bfloat16)


def _int8_mm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    w8, s = w.form("int8", _int8_form)
    return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), w8, s).to(x.dtype)


class _Packed(FnImplementation):
    """A packed-weight entry that can build its form ahead of the first call."""

    def __init__(self, op, name, fn, form_name, build, available) -> None:
        super().__init__(op, name, fn, ("cpu",), available)
        self._form = (form_name, build)

    def prepare(self, w: PackedWeight) -> None:
        w.form(*self._form)


def _gemv_available(device: torch.device, owner: object) -> str | None:
    return "a CPU kernel" if device.type != "cpu" else gemv.unavailable()


def _gemv_float(x: torch.Tensor, w: SplitLinear) -> torch.Tensor:
    """Decode (at most gemv.MAX_ROWS rows of float32) by the C kernel, anything else by bmm."""
    n = x.shape[0]
    if not 0 < n <= gemv.MAX_ROWS or x.dtype != torch.float32 or w.weight.dtype != torch.float32:
        return w(x)
    return gemv.gemv_float(x, w.weight)


def _blocks(q: QuantizedTensor) -> torch.Tensor:
    return q.blocks.contiguous()  # the same tensor when it already is (no copy)


def _gemv_packed(large: Callable[[torch.Tensor, PackedWeight], torch.Tensor]):
    """The packed entry: decode rows by the C kernel on the GGUF blocks (float32 activations),
    larger batches by `large` (the format's next entry: prefill keeps PyTorch's kernels)."""

    def fn(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        if not 0 < x.shape[0] <= gemv.MAX_ROWS or w.in_features > gemv.MAX_IN:
            return large(x, w)
        y = gemv.gemv_packed(x.float(), w.form("blocks", _blocks), w.qtype)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    return fn


def _gemm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """A prefill's many rows: the blocks decoded in panels for PyTorch's float32 GEMM
    (`gemv.gemm_packed`; the exact weights and float32 activations; from gemv.GEMM_ROWS rows on
    it does more work per second than the int8 kernel on some machines: `_prefill`)."""
    if w.rows16 is not None:
        y = gemv.gemm_packed(x.float(), w.rows16, w.qtype, rows16=True)
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    y = gemv.gemm_packed(x.float(), w.form("blocks", _blocks), w.qtype)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


# How a prefill's many rows (gemv.GEMM_ROWS or more) multiply packed weights on the int8 entries:
# the int8 kernel in chunks of gemv.I8_MAX_ROWS, or the blocks decoded for PyTorch's float32 GEMM
# (`_gemm`: exact weights, float32 activations). Which is faster is a fact about the machine, not
# the code: on the Intel Xeon (AVX-512) the GEMM did 2.1x the int8 kernel's work at 512 rows; on
# the AMD EPYC (Zen 4) the int8 kernel prefilled 512 tokens of the Q8_0 model at 1.43x the GEMM's
# rate (885 against 620 tok/s; PyTorch's float32 GEMM there is slower). So the first
# prefill-sized product of each format times both on its own arguments (twice each, alternating)
# and the format keeps the int8 kernel only where it was PREFILL_MARGIN times faster (a near tie
# keeps the exact weights, and the choice cannot flip between runs on a tie). `PREFILL` holds
# the choices: qtype -> "int8" or "gemm" (tests and benchmarks may set them).
PREFILL: dict[str, str] = {}
PREFILL_MARGIN = 1.15
_clock = time.perf_counter  # (the tests' fake clock replaces it)


def _prefill(x: torch.Tensor, w: PackedWeight, int8: Callable) -> torch.Tensor:
    """x (gemv.GEMM_ROWS rows or more) @ w.T by this machine's faster way for w's format."""
    way = PREFILL.get(w.qtype)
    if way == "int8":
        return int8(x, w)
    if way == "gemm":
        return _gemm(x, w)
    best: dict[str, float] = {}
    ys: dict[str, torch.Tensor] = {}
    for name, f in (("gemm", _gemm), ("int8", int8)) * 2:
        t0 = _clock()
        ys[name] = f(x, w)
        best[name] = min(best.get(name, float("inf")), _clock() - t0)
    faster = best["gemm"] > PREFILL_MARGIN * best["int8"]
    PREFILL[w.qtype] = "int8" if faster else "gemm"
    log.info("prefill rows of %s weights: %s (%d rows: the int8 kernel %.2f ms, the decoded GEMM "
             "%.2f ms)", w.qtype, PREFILL[w.qtype], x.shape[0], 1e3 * best["int8"],
             1e3 * best["gemm"])  # fmt: skip
    return ys[PREFILL[w.qtype]]  # (the chosen way's numbers from the first call on)


def _gemv_k(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """Q4_K / Q6_K: every batch by gemv.c's K-quant kernel (float32 activations)."""
    if x.shape[0] == 0:
        return _mm_dequant(x, w)
    if x.shape[0] >= gemv.GEMM_ROWS:
        return _gemm(x, w)
    y = gemv.gemv_kquant(x.float(), w.form("blocks", _blocks), w.qtype)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _gemv_k_i8(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """Q4_K / Q6_K with int8 activations (gemv.c's gemv_ki8): every batch (from GEMM_ROWS rows
    on where `_prefill` found it faster than the decoded GEMM); rows wider than gemv.MAX_IN by
    the float-activation kernel."""
    if x.shape[0] == 0 or w.in_features > gemv.MAX_IN:
        return _gemv_k(x, w)
    if x.shape[0] >= gemv.GEMM_ROWS:
        return _prefill(x, w, _k_i8)
    return _k_i8(x, w)


def _k_i8(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    blocks, _, rows16 = i8_weight(w)
    y = gemv.gemv_kquant_i8(x.float(), blocks, w.qtype, rows16=rows16)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _gemv_i8_available(device: torch.device, owner: object) -> str | None:
    return "a CPU kernel" if device.type != "cpu" else gemv.i8_unavailable()


def _i8_form(q: QuantizedTensor) -> tuple[torch.Tensor]:
    """The block headers gemv_i8 reads (a tuple: `PackedWeight.nbytes` counts its bytes)."""
    return (gemv.headers(q.blocks, q.qtype),)


NO_HEADERS = torch.zeros((0,), dtype=torch.int16)


def i8_weight(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """What gemv_i8 multiplies: (blocks, headers, interleaved). Where its path reads the format
    interleaved (`gemv.can_interleave`) a weight of whole groups of 16 rows is interleaved
    first (once), and needs no headers (Q4_K too, on the VNNI and AVX2 paths). (Where the
    kernel's path changed since, as the tests' `isa` fixture does, the GGUF blocks are read.)"""
    here = gemv.can_interleave(w.qtype, w.out_features)
    if w.rows16 is None and w.may_interleave and here:
        w.interleave()
    if w.rows16 is not None and here:
        return w.rows16, NO_HEADERS, True
    if w.qtype in K_FORMATS:  # super-blocks in GGUF order: their own headers
        return w.form("blocks", _blocks), NO_HEADERS, False
    return w.form("blocks", _blocks), w.form("i8", _i8_form)[0], False


def _gemv_packed_i8(large: Callable[[torch.Tensor, PackedWeight], torch.Tensor]):
    """The int8-activation entry: every batch (decode, chunks; a prefill's rows in chunks of
    gemv.I8_MAX_ROWS where `_prefill` found that faster than the decoded GEMM) by gemv.c's int8
    kernel; rows wider than gemv.MAX_IN, or none, by `large`."""

    def i8(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        blocks, head, rows16 = i8_weight(w)
        y = gemv.gemv_packed_i8(x.float(), blocks, head, w.qtype, rows16=rows16)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def fn(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        if x.shape[0] == 0 or w.in_features > gemv.MAX_IN:
            return large(x, w)
        if x.shape[0] >= gemv.GEMM_ROWS:
            return _prefill(x, w, i8)
        return i8(x, w)

    return fn


class _PackedI8(_Packed):
    """gemv_i8: prepares its weight (interleaved where its path reads that, else the blocks and
    their headers; no other form: it takes every batch size)."""

    def __init__(self, op, fn) -> None:
        super().__init__(op, "gemv_i8", fn, "blocks", _blocks, _gemv_i8_available)

    def prepare(self, w: PackedWeight) -> None:
        i8_weight(w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as the reference implementation does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one op: a decode step makes 61
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def _register() -> None:
    register(FnImplementation("matmul.float", "gemv", _gemv_float, ("cpu",), _gemv_available), 5)
    register(FnImplementation("matmul.float", "split_bmm", lambda x, w: w(x)), 10)
    register(FnImplementation("matmul.float", "mm", _mm_slices, ("*",)), 90, reference=True)
    register(
        FnImplementation(
            "matmul.bf16", "split_bmm", lambda x, w: w(x.to(torch.bfloat16)).to(x.dtype),
            ("cpu", "cuda"),
        ), 10,
    )  # fmt: skip
    register(FnImplementation("matmul.bf16", "mm", _mm_slices, ("*",)), 90, reference=True)
    int4 = _aten("_weight_int4pack_mm_for_cpu")
    for fmt in K_FORMATS:
        op = f"matmul.{fmt.lower()}"
        register(_PackedI8(op, _gemv_k_i8), 3)
        register(_Packed(op, "gemv", _gemv_k, "blocks", _blocks, _gemv_available), 5)
        register(FnImplementation(op, "dequant", _mm_dequant, ("*",)), 90, reference=True)
    for fmt in BLOCK_FORMATS:
        op = f"matmul.{fmt.lower()}"
        # gemv's batches above MAX_ROWS: the decoded GEMM (`_gemm`, the same blocks)
        register(_PackedI8(op, _gemv_packed_i8(_mm_dequant)), 3)
        register(_Packed(op, "gemv", _gemv_packed(_gemm), "blocks", _blocks, _gemv_available), 5)
        name = "int4x2" if fmt == "Q8_0" else "int4"
        register(_Packed(op, name, _int4_mm, "int4", _int4_form, int4), 10)
        if fmt == "Q8_0":
            int8 = _aten("_weight_int8pack_mm")
            register(_Packed(op, "int8", _int8_mm, "int8", _int8_form, int8), 20)
        register(FnImplementation(op, "dequant", _mm_dequant, ("*",)), 90, reference=True)
    has_fused = hasattr(F, "rms_norm")
    register(
        FnImplementation(
            "rmsnorm", "fused", _fused_rms_norm, ("cpu", "cuda"),
            lambda d, o: None if has_fused else "this torch has no F.rms_norm",
        ), 10,
    )  # fmt: skip
    register(FnImplementation("rmsnorm", "torch", rms_norm, ("*",)), 90, reference=True)
    register(
        FnImplementation("rope", "rotate_half", lambda t, x, pos: t.apply(x, pos), ("*",)),
        90, reference=True,
    )  # fmt: skip


_register()
