"""The decode matrix-vector kernel `gemv.c`: built on first use, loaded, and called.

What lives here: `unavailable()` (why this machine cannot run the kernel, or None), `MAX_ROWS`
(the most activation rows one call takes: decode; larger batches keep PyTorch's matrix
products), `gemv_float` and `gemv_packed` (y = x @ W.T for float32 row-major weights and for
GGUF Q8_0 / Q4_0 / Q4_1 blocks, float32 activations), `gemv_kquant` (Q4_K / Q6_K super-blocks,
float32 activations, any number of rows), `i8_unavailable()`, `headers`, `gemv_packed_i8`
and `gemv_kquant_i8` (the same blocks and super-blocks against activations rounded per
32-element block to one or two int8 codes, multiplied in integers: VNNI where the CPU has it,
int16 products on AVX2 and in portable C), `isa()` / `i8_isa()` (which path the build holds),
`quantize_blocks` (that rounding in torch: what the int8 kernels' results are checked against),
`dequantize` and `gemm_packed` (packed rows decoded to float32 for PyTorch's GEMM: a prefill's
many rows), and `Layer` / `Lin`, `layer_qkv` / `layer_out` (a Llama layer's dense part in two
calls: `engine.fused`).
What does not: the registry entries that
choose between this and PyTorch (`engine.linear`), the build and its cache
(`kernels.native.build`, shared with the attention kernel: same flags, same cache
directory, the same libgomp as torch, so the kernel's OpenMP threads are torch's).
"""

from __future__ import annotations

import ctypes
from importlib import resources
from pathlib import Path

import torch

from unikv.kernels import native as kernels

SOURCE = Path(resources.files(__package__) / "gemv.c")
MAX_ROWS = 4  # gemv.c's GEMV_MAX_ROWS (checked against the library at load)
I8_MAX_ROWS = 16  # its GEMV_I8_MAX_ROWS: the int8 kernel's chunk of rows (checked too)
GEMM_ROWS = 64  # from this many rows on, packed weights multiply by `gemm_packed` (prefill)
MAX_IN = 131072  # the longest packed row gemv.c takes (32 x GEMV_MAX_BLOCKS, checked too)
FORMAT_CODE = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q6_K": 4}  # gemv.c's enums
ROWS16 = 8  # gemv.c's flag on a format code: the blocks interleaved by 16 rows (`interleave`)
F32_ROWS = 5  # gemv.c's code of a float32 embedding table (`dequant_index` reads its rows)
# gemv.c's GEMV_ISA for each instruction set of kernels.isa(), and the int8 paths' names.
ISA_CODE = {"avx512": 2, "avx2": 1, "portable": 0, "native": 0}
I8_PATHS = {2: "avx512-vnni", 1: "avx2", 0: "portable"}
_state: dict[str, object] = {}  # "lib": the CDLL, or "error": why there is none
# Extra compiler defines for the build `_load` makes: ("-DSTEP_PROFILE",) for the profiling
# build that `step_profile` reads (benchmarks/decode_profile.py --inside); set before the load.
DEFINES: tuple[str, ...] = ()
# step_profile's parts, in gemv.c's order (P_MAKE ... P_CALL; M_QKV ... M_HEAD)
PROFILE_PARTS = ("make", "multiply", "wait", "fork/join", "rope", "choose", "attention", "call")
PROFILE_MATRICES = ("qkv", "out", "gate|up", "down", "head")


def _load() -> ctypes.CDLL | None:
    if "lib" in _state or "error" in _state:
        return _state.get("lib")  # type: ignore[return-value]
    lib = kernels.open_library(SOURCE, _state, "matmul kernel gemv.c", DEFINES)
    if lib is None:
        return None
    isa = kernels.isa()  # what the build was made for (it raised already if unknown)
    lib.gemv_max_in.restype = ctypes.c_long
    if (
        lib.gemv_max_rows() != MAX_ROWS
        or lib.gemv_max_in() != MAX_IN
        or (lib.gemv_i8_max_rows() != I8_MAX_ROWS)
    ):
        _state["error"] = "gemv.c and unikv/kernels/gemv.py disagree on their limits (rebuild)"
        return None
    if lib.gemv_isa() != ISA_CODE[isa]:  # the flags did not reach the compiler as meant
        _state["error"] = f"gemv.c built for {isa} holds path {lib.gemv_isa()} (check $CC)"
        return None
    p, i, lng = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.gemv_f32.argtypes = [p, i, p, lng, lng, p, i]
    lib.gemv_q.argtypes = [i, p, i, p, lng, lng, p, i]
    lib.gemv_f32.restype = lib.gemv_q.restype = None
    lib.gemv_qi8.argtypes = [i, p, i, p, p, lng, lng, p, i, i]
    lib.gemv_qi8.restype = ctypes.c_int
    lib.gemv_k.argtypes = [i, p, i, p, lng, lng, p, i]
    lib.gemv_k.restype = ctypes.c_int
    lib.gemv_ki8.argtypes = [i, p, i, p, lng, lng, p, i, i]
    lib.gemv_ki8.restype = ctypes.c_int
    lib.dequant_rows.argtypes = [i, p, lng, lng, p, i]
    lib.dequant_rows.restype = ctypes.c_int
    lib.dequant_index.argtypes = [i, p, lng, lng, p, i, p]
    lib.dequant_index.restype = ctypes.c_int
    if lib.layer_struct_size() != ctypes.sizeof(Layer):
        _state["error"] = "gemv.c's layer_t and unikv/kernels/gemv.py's Layer disagree (rebuild)"
        return None
    lib.layer_qkv.argtypes = [p, p, i, p, p, p, p, i]
    lib.layer_out.argtypes = [p, p, p, i, p, i]
    lib.layer_qkv.restype = lib.layer_out.restype = ctypes.c_int
    if lib.kv_step_size() != ctypes.sizeof(KVStep) or lib.choice_size() != ctypes.sizeof(Choice):
        _state["error"] = "gemv.c's kv_step_t / choice_t and gemv.py's KVStep / Choice disagree"
        return None
    lib.decode_layers.argtypes = [p, i, p, p, i, p, p, i]
    lib.decode_layers.restype = ctypes.c_int
    if lib.step_struct_size() != ctypes.sizeof(Step):
        _state["error"] = "gemv.c's step_t and unikv/kernels/gemv.py's Step disagree (rebuild)"
        return None
    lib.decode_step.argtypes = [p, i, p, p, i, p, p, p, i]
    lib.decode_step.restype = ctypes.c_int
    lib.decode_steps.argtypes = [p, i, p, i, p, p, p, p, p, p, i]
    lib.decode_steps.restype = ctypes.c_int
    lib.argmax_rows.argtypes = [p, lng, lng, p]
    lib.argmax_rows.restype = None
    lib.sample_rows.argtypes = [p, lng, lng, p, p, p]
    lib.sample_rows.restype = None
    lib.exp_mismatches.argtypes = [ctypes.c_uint32, ctypes.c_uint32, lng]
    lib.exp_mismatches.restype = lng
    lib.decode_choose_seconds.restype = lib.decode_attend_seconds.restype = ctypes.c_double
    lib.step_profile.argtypes = [p]
    lib.decode_inside_layers.restype = lng
    _state["lib"], _state["isa"], _state["i8"] = lib, isa, I8_PATHS[lib.gemv_i8_isa()]
    return lib


def unavailable() -> str | None:
    """None when the kernel is built (or buildable) and this CPU runs it, else why not."""
    _load()
    return _state.get("error")  # type: ignore[return-value]


def i8_unavailable() -> str | None:
    """None when the int8-activation kernel (`gemv_packed_i8`) runs here, else why not (it
    has a path for every CPU the library builds for)."""
    return unavailable()


def isa() -> str | None:
    """The instruction set the float-activation paths were built for (None: no library)."""
    _load()
    return _state.get("isa")  # type: ignore[return-value]


def i8_isa() -> str | None:
    """The int8 kernel's path: "avx512-vnni", "avx2" or "portable" (None: no library)."""
    _load()
    return _state.get("i8")  # type: ignore[return-value]


def gemv_float(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: float32 [N, in] (N <= MAX_ROWS), w: float32 [out, in] contiguous -> [N, out]."""
    n = x.shape[0]
    x = x.contiguous()
    y = torch.empty((n, w.shape[0]), dtype=torch.float32)
    _state["lib"].gemv_f32(  # type: ignore[attr-defined]
        x.data_ptr(), n, w.data_ptr(), w.shape[0], w.shape[1], y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return y


def gemv_packed(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """x: float32 [N, in] (N <= MAX_ROWS, in <= MAX_IN), blocks: a contiguous uint8
    [out, in / 32, bytes] of `qtype` -> [N, out]."""
    n = x.shape[0]
    x = x.contiguous()
    y = torch.empty((n, blocks.shape[0]), dtype=torch.float32)
    _state["lib"].gemv_q(  # type: ignore[attr-defined]
        FORMAT_CODE[qtype], x.data_ptr(), n, blocks.data_ptr(), blocks.shape[0],
        blocks.shape[1], y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return y


def gemv_kquant(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """x: float32 [N, in] (any N), blocks: a contiguous uint8 [out, in / 256, bytes] of Q4_K or
    Q6_K super-blocks -> [N, out] (each super-block decoded once per call, in registers and L1)."""
    n = x.shape[0]
    x = x.contiguous()
    y = torch.empty((n, blocks.shape[0]), dtype=torch.float32)
    rc = _state["lib"].gemv_k(  # type: ignore[attr-defined]
        FORMAT_CODE[qtype], x.data_ptr(), n, blocks.data_ptr(), blocks.shape[0],
        blocks.shape[1], y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"gemv_k: {qtype} is not a K-quant it reads")
    return y


def gemv_kquant_i8(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, digits: int = 2, rows16: bool = False
) -> torch.Tensor:
    """As `gemv_kquant` (any N; in / 32 at most MAX_IN / 32 blocks) with x rounded per 32-element
    block to `digits` int8 codes first, as `gemv_packed_i8` rounds it (`quantize_blocks`), and
    the super-blocks multiplied in integers (gemv.c's gemv_ki8: vpdpbusd, vpmaddubsw on AVX2,
    int16 in portable C) -> float32 [N, out]. `rows16`: the blocks interleaved by `interleave`
    (Q4_K, where `can_interleave`)."""
    if digits not in (1, 2):
        raise ValueError(f"digits must be 1 or 2, got {digits}")
    if rows16 and not can_interleave(qtype, blocks.shape[0]):
        raise ValueError(f"no int8 path here ({i8_isa()}) reads {qtype} as interleaved rows "
                         f"of {blocks.shape[0]}: the VNNI and AVX2 paths read Q4_K so, in "
                         "whole groups of 16")  # fmt: skip
    n = x.shape[0]
    x = x.contiguous()
    y = torch.empty((n, blocks.shape[0]), dtype=torch.float32)
    rc = _state["lib"].gemv_ki8(  # type: ignore[attr-defined]
        FORMAT_CODE[qtype] | (ROWS16 if rows16 else 0), x.data_ptr(), n, blocks.data_ptr(),
        blocks.shape[0], blocks.shape[1], y.data_ptr(), torch.get_num_threads(), digits,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(
            f"gemv_ki8: {qtype} rows of {blocks.shape[1]} super-blocks are not "
            f"K-quant rows it reads (at most {MAX_IN // 256}), or no memory"
        )
    return y


PANEL_BYTES = 16 << 20  # `gemm_packed`'s decoded panel at most: a layer's matrices whole


def dequantize(blocks: torch.Tensor, qtype: str, rows16: bool = False) -> torch.Tensor:
    """The weights of packed rows: blocks, a contiguous uint8 [rows, nb, bytes] of `qtype`
    (Q8_0, Q4_0, Q4_1; Q4_K, Q6_K super-blocks; `rows16`: interleaved by `interleave`, whole
    groups of 16 rows) -> float32 [rows, nb x 32 or 256]."""
    rows, nb, _ = blocks.shape
    per = 256 if qtype in ("Q4_K", "Q6_K") else 32
    y = torch.empty((rows, nb * per), dtype=torch.float32)
    rc = _state["lib"].dequant_rows(  # type: ignore[attr-defined]
        FORMAT_CODE[qtype] | (ROWS16 if rows16 else 0), blocks.data_ptr(), rows, nb,
        y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"dequant_rows: {qtype} is not a format it reads")
    return y


def dequantize_index(
    blocks: torch.Tensor, qtype: str, index: torch.Tensor, rows16: bool = False
) -> torch.Tensor:
    """Rows `index` (int64 [N]) of packed rows as `dequantize` decodes them, reading only those
    rows (an embedding's lookup): -> float32 [N, nb x 32 or 256]."""
    rows, nb, _ = blocks.shape
    per = 256 if qtype in ("Q4_K", "Q6_K") else 32
    index = index.to(torch.int64).contiguous()
    y = torch.empty((index.numel(), nb * per), dtype=torch.float32)
    rc = _state["lib"].dequant_index(  # type: ignore[attr-defined]
        FORMAT_CODE[qtype] | (ROWS16 if rows16 else 0), blocks.data_ptr(), rows, nb,
        index.data_ptr(), index.numel(), y.data_ptr(),
    )  # fmt: skip
    if rc != 0:
        raise IndexError(f"dequant_index: an index outside [0, {rows}) or a format it does "
                         f"not read ({qtype}{', interleaved' if rows16 else ''})")  # fmt: skip
    return y


def gemm_packed(
    x: torch.Tensor, blocks: torch.Tensor, qtype: str, rows16: bool = False
) -> torch.Tensor:
    """x: float32 [N, in] (many rows: a prefill), blocks: a contiguous uint8 [out, nb, bytes]
    (`rows16`: interleaved) -> [N, out]: panels of rows decoded to float32 (`dequantize`, about
    PANEL_BYTES each, so the product reads them from the cache; a multiple of 16 rows, so an
    interleaved panel is whole groups) and multiplied by PyTorch's float32 GEMM. The exact
    weights against float32 activations: the reference entry's numbers, but for the order of
    the GEMM's sums."""
    out = blocks.shape[0]
    x = x.contiguous()
    y = torch.empty((x.shape[0], out), dtype=torch.float32)
    step = max(16, PANEL_BYTES // (4 * x.shape[1]) // 16 * 16)
    for r in range(0, out, step):
        w = dequantize(blocks[r : r + step], qtype, rows16)
        torch.mm(x, w.t(), out=y[:, r : r + step])
    return y


def headers(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """The int8 kernel's form of a weight's block headers: int16 [out, H], each row's fp16 d
    per block padded with zeros to a multiple of 16 blocks, then (Q4_1) its fp16 m the same way
    (gemv.c says why they are copied out of the blocks). Only the VNNI path reads them: for
    the others an empty tensor."""
    out, nb, _ = blocks.shape
    if i8_isa() != "avx512-vnni":
        return torch.zeros((out, 0), dtype=torch.int16)
    nb16 = -(-nb // 16) * 16
    fields = 2 if qtype == "Q4_1" else 1
    h = torch.zeros((out, fields, nb16), dtype=torch.int16)
    h[:, :, :nb] = blocks[..., : 2 * fields].contiguous().view(torch.int16).transpose(1, 2)
    return h.view(out, fields * nb16)


def gemv_packed_i8(
    x: torch.Tensor,
    blocks: torch.Tensor,
    head: torch.Tensor,
    qtype: str,
    digits: int = 2,
    rows16: bool = False,
) -> torch.Tensor:
    """As `gemv_packed` for any number of rows (in chunks of I8_MAX_ROWS; head:
    `headers(blocks, qtype)`, unused when `rows16`: the blocks interleaved by `interleave`,
    where `can_interleave`), with x rounded per 32-element block to
    `digits` int8 codes first (`quantize_blocks`, inside the C call; 1: ggml's Q8_0 rounding,
    2: a second code for the rest, gemv.c says why) and the blocks multiplied in integers
    (vpdpbusd, or vpmaddwd on AVX2) -> float32 [N, out]."""
    if digits not in (1, 2):
        raise ValueError(f"digits must be 1 or 2, got {digits}")
    n = x.shape[0]
    x = x.contiguous()
    y = torch.empty((n, blocks.shape[0]), dtype=torch.float32)
    if rows16 and not can_interleave(qtype, blocks.shape[0]):
        raise ValueError(f"no int8 path here ({i8_isa()}) reads {qtype} as interleaved rows "
                         f"of {blocks.shape[0]}: the VNNI path reads Q8_0, Q4_0 and Q4_1, the "
                         "AVX2 path Q4_0 and Q4_1, in whole groups of 16")  # fmt: skip
    rc = _state["lib"].gemv_qi8(  # type: ignore[attr-defined]
        FORMAT_CODE[qtype] | (ROWS16 if rows16 else 0), x.data_ptr(), n, blocks.data_ptr(),
        head.data_ptr(), blocks.shape[0], blocks.shape[1], y.data_ptr(),
        torch.get_num_threads(), digits,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError(f"gemv_qi8: no buffer for {n} x {blocks.shape[1]} blocks of activations")
    return y


# ---- rows interleaved by 16 (gemv.c's ROWS16 layout) -----------------------------------------

_HEADER = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}  # bytes of fp16 fields before a block's codes
# the formats each int8 path reads interleaved (gemv.c's gemv_qi8 / gemv_ki8 refuse the rest)
_ROWS16_FORMATS = {
    "avx512-vnni": ("Q8_0", "Q4_0", "Q4_1", "Q4_K"),
    "avx2": ("Q4_0", "Q4_1", "Q4_K"),
}


def weight_prefetch(on: bool | None = None) -> bool:
    """Whether the kernels ask for weights ahead in software where they stream in order (the
    VNNI path's interleaved groups, the float32 rows; gemv.c's weight_prefetch: on but on AMD's
    Zen 3 and later, chosen when the library loads); `on` sets it (the numbers are the same bits
    either way: a benchmark's or a test's switch)."""
    lib = _load()
    if lib is None:
        raise RuntimeError(f"gemv.c is unavailable: {unavailable()}")
    fn = lib.gemv_weight_prefetch
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return bool(fn(-1 if on is None else int(on)))


def can_interleave(qtype: str, rows: int) -> bool:
    """Whether the int8 kernel here reads `qtype` interleaved by 16 rows (`interleave`): a
    multiple of 16 rows, on the VNNI path Q8_0 / Q4_0 / Q4_1 / Q4_K, on the AVX2 path Q4_0 /
    Q4_1 / Q4_K."""
    return qtype in _ROWS16_FORMATS.get(i8_isa(), ()) and rows % 16 == 0


def interleave(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """GGUF blocks uint8 [rows, nb, bytes] (rows a multiple of 16) -> the same bytes in gemv.c's
    ROWS16 layout, the same shape: per group of 16 rows and block, the codes as [quads][16
    rows][4 bytes] (Q8_0's xor 0x80), then the 16 rows' fp16 d, then (Q4_1) their fp16 m.
    Q4_K, per super-block: its 128 code bytes so, then the 16 rows' fp16 d, their fp16 dmin,
    and their 12 scale bytes as [12][16 rows]."""
    rows, nb, bs = blocks.shape
    g = rows // 16
    if rows % 16:
        raise ValueError(f"{rows} rows: interleaving takes whole groups of 16")
    per = blocks.reshape(g, 16, nb, bs).permute(0, 2, 1, 3)  # [G, nb, 16 rows, bytes]
    if qtype == "Q4_K":
        quads = per[..., 16:].reshape(g, nb, 16, 32, 4).permute(0, 1, 3, 2, 4)
        scales = per[..., 4:16].transpose(2, 3)  # [G, nb, 12, 16 rows]
        parts = [quads.reshape(g, nb, 2048), per[..., 0:2].reshape(g, nb, 32),
                 per[..., 2:4].reshape(g, nb, 32), scales.reshape(g, nb, 192)]  # fmt: skip
        return torch.cat(parts, dim=-1).reshape(rows, nb, bs)
    hdr = _HEADER[qtype]
    codes = per[..., hdr:]
    if qtype == "Q8_0":
        codes = codes ^ 0x80
    quads = codes.reshape(g, nb, 16, (bs - hdr) // 4, 4).permute(0, 1, 3, 2, 4)
    parts = [quads.reshape(g, nb, -1), per[..., 0:2].reshape(g, nb, 32)]
    if qtype == "Q4_1":
        parts.append(per[..., 2:4].reshape(g, nb, 32))
    return torch.cat(parts, dim=-1).reshape(rows, nb, bs)


def deinterleave(rows16: torch.Tensor, qtype: str) -> torch.Tensor:
    """`interleave`'s inverse: the GGUF blocks, uint8 [rows, nb, bytes]."""
    rows, nb, bs = rows16.shape
    g = rows // 16
    flat = rows16.reshape(g, nb, 16 * bs)
    if qtype == "Q4_K":
        codes = flat[..., :2048].reshape(g, nb, 32, 16, 4).transpose(2, 3).reshape(g, nb, 16, 128)
        d, dmin = (flat[..., o : o + 32].reshape(g, nb, 16, 2) for o in (2048, 2080))
        scales = flat[..., 2112:].reshape(g, nb, 12, 16).transpose(2, 3)
        per = torch.cat((d, dmin, scales, codes), dim=-1)  # [G, nb, 16, 144]
        return per.permute(0, 2, 1, 3).reshape(rows, nb, bs)
    hdr = _HEADER[qtype]
    n = 16 * (bs - hdr)
    codes = flat[..., :n].reshape(g, nb, (bs - hdr) // 4, 16, 4).permute(0, 1, 3, 2, 4)
    codes = codes.reshape(g, nb, 16, bs - hdr)
    if qtype == "Q8_0":
        codes = codes ^ 0x80
    fields = flat[..., n:].reshape(g, nb, hdr // 2, 16, 2).permute(0, 1, 3, 2, 4)
    per = torch.cat((fields.reshape(g, nb, 16, hdr), codes), dim=-1)  # [G, nb, 16, bytes]
    return per.permute(0, 2, 1, 3).reshape(rows, nb, bs)


def deinterleave_rows(rows16: torch.Tensor, qtype: str, index: torch.Tensor) -> torch.Tensor:
    """The GGUF blocks of rows `index` [N] of an interleaved weight, [N, nb, bytes]: only their
    groups are read back (an embedding lookup in a tied, interleaved head)."""
    rows, nb, bs = rows16.shape
    index = index.reshape(-1)
    groups = rows16.reshape(rows // 16, 16 * nb * bs)[index // 16]  # [N, 16 nb bs]
    blocks = deinterleave(groups.reshape(-1, nb, bs), qtype).reshape(-1, 16, nb, bs)
    return blocks[torch.arange(index.numel()), index % 16]


def quantize_blocks(x: torch.Tensor, digits: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [N, K] (K a multiple of 32) rounded as gemv.c's int8 kernel rounds it:
    (codes int32 [N, K / 32, 32], scale float32 [N, K / 32, 1]) with x ~ codes * scale.
    Per block d = amax / 127 and q1 = round(x / d) to nearest even (ggml's quantize_row_q8_0,
    with a float32 d); with one digit codes = q1, scale = d; with two, q2 = round(256 (x / d -
    q1)) saturated to int8, codes = 256 q1 + q2, scale = d / 256."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    s = xb * inv
    q1 = torch.round(s)
    if digits == 1:
        return q1.to(torch.int32), d
    q2 = torch.round((s - q1) * 256).clamp(-128, 127)
    return (q1 * 256 + q2).to(torch.int32), d / 256


# ---- one decoder layer's dense part (gemv.c's layer_qkv and layer_out) ----------------------


class Lin(ctypes.Structure):
    """gemv.c's lin_t: one linear layer as the layer calls multiply it (`next`: the address of
    the Lin of the rows stacked below these, in another format, or None; `chain`)."""

    _fields_ = [("kind", ctypes.c_int), ("fmt", ctypes.c_int), ("w", ctypes.c_void_p),
                ("h", ctypes.c_void_p), ("out", ctypes.c_long), ("in_", ctypes.c_long),
                ("next", ctypes.c_void_p)]  # fmt: skip


class Layer(ctypes.Structure):
    """gemv.c's layer_t: a Llama layer's sizes, norm weights, RoPE tables and linear layers
    (pointers into tensors the caller keeps alive as long as this)."""

    _fields_ = [("hidden", ctypes.c_long), ("ffn", ctypes.c_long), ("context", ctypes.c_long),
                ("hq", ctypes.c_int),
                ("hkv", ctypes.c_int), ("d", ctypes.c_int), ("eps", ctypes.c_float),
                ("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin_signed", ctypes.c_void_p),
                ("qkv", Lin), ("wo", Lin), ("gu", Lin), ("down", Lin)]  # fmt: skip


# lin_t kinds: how gemv.c multiplies a linear layer (the entry point its registry entry calls)
KIND_FLOAT, KIND_PACKED, KIND_PACKED_I8, KIND_K = 0, 1, 2, 3


def lin(
    kind: int, w: torch.Tensor, out: int, in_: int, qtype: str = "", head=None,
    rows16: bool = False,
) -> Lin:  # fmt: skip
    """A lin_t over `w` (float32 [out, in], or uint8 blocks [out, in / 32, bytes]; `head`: the
    kind-2 headers of `headers`; `rows16`: kind 2's blocks interleaved, no headers)."""
    h = head.data_ptr() if head is not None and head.numel() else None
    code = FORMAT_CODE.get(qtype, 0) | (ROWS16 if rows16 else 0)
    return Lin(kind, code, w.data_ptr(), h, out, in_)


def chain(parts: list[Lin]) -> Lin:
    """The Lins of a layer's parts (stacked along its rows, one format each) as one: the first,
    each pointing to the next. The caller keeps `parts` alive as long as the result (which is
    copied where a Layer holds it: the later parts are pointed to, not copied)."""
    for a, b in zip(parts[:-1], parts[1:], strict=True):
        a.next = ctypes.addressof(b)
    return parts[0]


def layer_qkv(layer: Layer, x: torch.Tensor, positions: torch.Tensor):
    """Norm, QKV projection and RoPE of `x` float32 [N, hidden] at `positions` int64 [N]:
    (q [N, hq, d], k [N, hkv, d], v [N, hkv, d]), or None when gemv.c refused (sizes, rows)."""
    n = x.shape[0]
    q = torch.empty((n, layer.hq, layer.d), dtype=torch.float32)
    k = torch.empty((n, layer.hkv, layer.d), dtype=torch.float32)
    v = torch.empty((n, layer.hkv, layer.d), dtype=torch.float32)
    rc = _state["lib"].layer_qkv(  # type: ignore[attr-defined]
        ctypes.byref(layer), x.data_ptr(), n, positions.data_ptr(), q.data_ptr(), k.data_ptr(),
        v.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return None if rc else (q, k, v)


def layer_out(layer: Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor | None:
    """The rest of the layer: x + wo(attn), then + down(silu(gate) * up) of its norm; x float32
    [N, hidden], attn float32 [N, hq d] contiguous. None when gemv.c refused."""
    n = x.shape[0]
    out = torch.empty_like(x)
    rc = _state["lib"].layer_out(  # type: ignore[attr-defined]
        ctypes.byref(layer), x.data_ptr(), attn.data_ptr(), n, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return None if rc else out


# ---- a whole decode step (gemv.c's decode_layers) ----------------------------------------------


class KVStep(ctypes.Structure):
    """gemv.c's kv_step_t: a step's KV cache as plain float32 arenas, or as the cache's own
    function per layer (`own`, on `own_ctx`) (`KVCache.native_step`)."""

    _fields_ = [("attend", ctypes.c_void_p), ("base", ctypes.c_int64),
                ("layer_bytes", ctypes.c_int64), ("slots", ctypes.c_int64),
                ("bs", ctypes.c_int), ("nseq", ctypes.c_int), ("scale", ctypes.c_float),
                ("new_slots", ctypes.c_void_p), ("rows", ctypes.c_void_p),
                ("past", ctypes.c_void_p), ("nb", ctypes.c_void_p), ("ids", ctypes.c_void_p),
                ("blocks", ctypes.c_void_p), ("choice", ctypes.c_void_p),
                ("own", ctypes.c_void_p), ("own_ctx", ctypes.c_void_p),
                ("nplaces", ctypes.c_int), ("places", ctypes.c_void_p),
                ("where", ctypes.c_void_p), ("sub", ctypes.c_int)]  # fmt: skip


class Choice(ctypes.Structure):
    """gemv.c's choice_t: a sparse selection's per-layer choice inside the step."""

    _fields_ = [("choose", ctypes.c_void_p), ("first", ctypes.c_int), ("parts", ctypes.c_int),
                ("w", ctypes.c_int), ("alpha", ctypes.c_float), ("temp", ctypes.c_float),
                ("plan", ctypes.c_void_p),
                ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("codes_layer", ctypes.c_void_p), ("scales_layer", ctypes.c_void_p),
                ("head_stride", ctypes.c_void_p), ("scale_stride", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("at", ctypes.c_void_p),
                ("per_layer", ctypes.c_int64)]  # fmt: skip


def decode_layers(layers, kv: KVStep, x: torch.Tensor, positions: torch.Tensor):
    """`x` float32 [N, hidden] at `positions` int64 [N] through every layer of `layers` (a
    ctypes array of pointers to `Layer`), writing each layer's new keys and values and attending
    as `kv` describes: the hidden states after the last layer, or None when gemv.c refused (the
    caller then runs the step layer by layer)."""
    out = torch.empty_like(x)
    rc = _state["lib"].decode_layers(  # type: ignore[attr-defined]
        layers, len(layers), ctypes.byref(kv), x.data_ptr(), x.shape[0], positions.data_ptr(),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return None if rc else out


class Step(ctypes.Structure):
    """gemv.c's step_t: what a whole decode step does around its layers (`decode_step`): the
    rows' embedding (a packed table read by `dequantize_index`, or none: x is given), the final
    norm and the output layer of the rows whose logits are wanted."""

    _fields_ = [("embed", ctypes.c_void_p), ("embed_fmt", ctypes.c_int),
                ("embed_rows", ctypes.c_long), ("embed_nb", ctypes.c_long),
                ("tokens", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("eps", ctypes.c_float),
                ("head", Lin), ("rows", ctypes.c_void_p), ("nrows", ctypes.c_int)]  # fmt: skip


def decode_step(layers, kv: KVStep, step: Step, x: torch.Tensor | None, tokens: torch.Tensor,
                positions: torch.Tensor, rows: torch.Tensor):  # fmt: skip
    """A whole decode step in one call: the embedding rows of `tokens` int64 [N] (or x float32
    [N, hidden] where `step` has no table), every layer of `layers` (as `decode_layers`), the
    final norm and the output layer of `rows` int64 [M]: logits float32 [M, vocab], or None
    when gemv.c refused (the caller then runs the step as before)."""
    step.tokens, step.rows, step.nrows = tokens.data_ptr(), rows.data_ptr(), rows.numel()
    logits = torch.empty((rows.numel(), step.head.out), dtype=torch.float32)
    rc = _state["lib"].decode_step(  # type: ignore[attr-defined]
        layers, len(layers), ctypes.byref(kv), None if x is None else x.data_ptr(),
        tokens.numel(), positions.data_ptr(), ctypes.byref(step), logits.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return None if rc else logits


def decode_steps(
    layers,
    kv: KVStep,
    step: Step,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    steps: int,
    spec: torch.Tensor | None = None,
    draws: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`steps` decode steps in one call (gemv.c's decode_steps): `kv` describes a step of
    `steps` rows per sequence, run one row of each at a time; `tokens` int64 [nseq] are the
    first sub-step's, each next one's drawn from the logits before (`sample_rows`: the argmax,
    or where `spec` float64 [nseq, 4] is given and a sequence's temperature is above 0 a draw
    under its row with the uniform numbers `draws` float64 [steps, nseq]).
    Returns (tokens int64 [steps + 1, nseq]: the given row, then each sub-step's choice; logits
    float32 [steps, nseq, vocab]; how many sub-steps ran: fewer than `steps` where one was
    refused, whose outputs from there on are not written)."""
    nseq = tokens.numel()
    out = torch.empty(steps + 1, nseq, dtype=torch.int64)
    out[0] = tokens
    logits = torch.empty((steps, nseq, step.head.out), dtype=torch.float32)
    if spec is not None:
        spec = spec.to(torch.float64).contiguous()
        draws = draws.to(torch.float64).contiguous()  # type: ignore[union-attr]
        if spec.shape != (nseq, 4) or draws.shape != (steps, nseq):
            raise ValueError(f"spec [{nseq}, 4] and draws [{steps}, {nseq}] expected, got "
                             f"{list(spec.shape)} and {list(draws.shape)}")  # fmt: skip
    done = _state["lib"].decode_steps(  # type: ignore[attr-defined]
        layers, len(layers), ctypes.byref(kv), steps, positions.data_ptr(), ctypes.byref(step),
        out.data_ptr(), logits.data_ptr(), None if spec is None else spec.data_ptr(),
        None if draws is None else draws.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out, logits, done


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of x float32 [rows, n] as gemv.c's decode_steps picks it (torch.argmax's
    rule: the first NaN, else the first of the largest), int64 [rows]."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _load().argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())  # type: ignore[union-attr]
    return out


def sample_rows(x: torch.Tensor, spec: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """Each row of logits x float32 [rows, n] drawn as gemv.c's decode_steps draws it: under
    spec[r] (float64 [rows, 4]: temperature, top_k, top_p, min_p; temperature 0: the argmax)
    with the uniform number draws[r] (float64 [rows], in [0, 1)); int64 [rows], -1 for a row of
    NaN or only -inf logits (gemv.c's sample_row says how). ValueError where the C kernels are
    unavailable."""
    lib = _load()
    if lib is None:
        raise ValueError(f"gemv.c is unavailable: {unavailable()}")
    x = x.to(torch.float32).contiguous()
    spec = spec.to(torch.float64).contiguous()
    draws = draws.to(torch.float64).contiguous()
    if spec.shape != (x.shape[0], 4) or draws.shape != (x.shape[0],):
        raise ValueError(f"spec [{x.shape[0]}, 4] and draws [{x.shape[0]}] expected, got "
                         f"{list(spec.shape)} and {list(draws.shape)}")  # fmt: skip
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.sample_rows(x.data_ptr(), x.shape[0], x.shape[1], spec.data_ptr(), draws.data_ptr(),
                    out.data_ptr())  # fmt: skip
    return out


def vector_exp() -> bool:
    """Whether SiLU's exp runs vectorized here (AVX-512 or AVX2, and the check at load found it
    equal to this C library's expf; else it calls expf)."""
    lib = _load()
    return bool(lib is not None and lib.exp_vector())


def exp_mismatches(lo: int, step: int, count: int) -> int:
    """How many of `count` floats (the bit patterns lo, lo + step, ... modulo 2**32) get another
    exp from gemv.c's vector exp than from the C library's expf (0 without a vector exp)."""
    return int(_state["lib"].exp_mismatches(lo, step, count))  # type: ignore[attr-defined]


def step_seconds() -> tuple[float, float]:
    """Seconds decode_layers has spent (choosing a sparse selection's blocks, attending) so
    far; zeros where the kernel is not built."""
    lib = _load()
    return (0.0, 0.0) if lib is None else (lib.decode_choose_seconds(), lib.decode_attend_seconds())


def inside_layers() -> int:
    """How many layers of decode_layers / decode_step calls so far ran their attention inside
    the call's parallel region (a short attention, the other threads reading ahead: gemv.c's
    touch_ahead); 0 where the kernel is not built."""
    lib = _load()
    return 0 if lib is None else int(lib.decode_inside_layers())


def step_profile(reset: bool = False) -> dict | None:
    """What a profiling build (`DEFINES = ("-DSTEP_PROFILE",)`) has counted inside its decode
    steps so far: {"threads": [{part: seconds} per thread that counted], "matrices": {kind:
    (seconds, bytes) summed over the threads}}, the parts `PROFILE_PARTS` (the calling thread,
    0, alone counts rope, choose, attention and call) and the kinds `PROFILE_MATRICES`; then
    zeroed where `reset`. None where the build does not count (any other build)."""
    lib = _load()
    size = 0 if lib is None else lib.step_profile_size()
    if not size:
        return None
    buf = (ctypes.c_double * size)()
    lib.step_profile(buf)
    if reset:
        lib.step_profile_reset()
    nparts, nkinds = len(PROFILE_PARTS), len(PROFILE_MATRICES)
    threads = size // (nparts + 2 * nkinds)
    parts = [
        dict(zip(PROFILE_PARTS, buf[t * nparts : (t + 1) * nparts], strict=True))
        for t in range(threads)
    ]
    rows = buf[threads * nparts :]
    matrices = {
        kind: tuple(sum(rows[(t * nkinds + m) * 2 + j] for t in range(threads)) for j in (0, 1))
        for m, kind in enumerate(PROFILE_MATRICES)
    }
    return {"threads": [p for p in parts if any(p.values())], "matrices": matrices}
