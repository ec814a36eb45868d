"""The sparse selection's kernels `sparse.c`: built on first use, loaded, and called.

What lives here: `unavailable()` (why this machine cannot run the kernels, or None),
`choose_blocks` (one sequence's blocks for one layer: the sinks, the best-scoring candidates
per KV head, the window) and `attend_blocks` (attention over those blocks, read in place
wherever each lies: the dense format's arenas, staged tensors), `summarize` (a decode step's
keys into the centres' summaries) and `quantize_key_tiles` (keys in 4 bits), and
`choose_address` / `attend_address` (the same choice and attention for native callers: the
decode step of `gemv.c`). What does not: the PyTorch
references and the registry entries that choose between them (`kvstrategies.sparse`,
`kvstrategies.full`), the build and its cache (`kernels.native.build`: the same flags, cache
directory and libgomp as the other kernels).
"""

from __future__ import annotations

import ctypes
from importlib import resources
from pathlib import Path

import torch

from unikv.kernels import native as kernels

SOURCE = Path(resources.files(__package__) / "sparse.c")
_state: dict[str, object] = {}  # "lib": the CDLL, or "error": why there is none


def _load() -> ctypes.CDLL | None:
    if "lib" in _state or "error" in _state:
        return _state.get("lib")  # type: ignore[return-value]
    lib = kernels.open_library(SOURCE, _state, "sparse selection kernels sparse.c")
    if lib is None:
        return None
    p, i, lng, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
    lib.sparse_choose.argtypes = [p, i, i, i, i, p, p, lng, lng, i, i, lng, lng, lng, lng, f, f,
                                  p, i]  # fmt: skip
    lib.sparse_choose.restype = ctypes.c_int
    lib.sparse_quantize_keys.argtypes = [p, lng, lng, lng, i, i, p, p, i]
    lib.sparse_quantize_keys.restype = ctypes.c_int
    lib.sparse_attend.argtypes = [p, i, i, i, i, i, p, p, p, p, p, lng, lng, f, p, i]
    lib.sparse_attend.restype = ctypes.c_int
    lib.sparse_summarize.argtypes = [p, lng, lng, lng, i, i, p, i, i, p, lng, p, lng, lng]
    lib.sparse_summarize.restype = ctypes.c_int
    lib.sparse_add_keys.argtypes = [p, lng, lng, lng, i, i, p, p, i, lng, p, lng, p, lng, i]
    lib.sparse_add_keys.restype = ctypes.c_int
    _state["lib"] = lib
    return lib


def unavailable() -> str | None:
    """None when the kernel is built and loaded here, else why not."""
    _load()
    return _state.get("error")  # type: ignore[return-value]


def _lib() -> ctypes.CDLL:
    lib = _load()
    if lib is None:
        raise RuntimeError(f"sparse.c is unavailable: {_state.get('error')}")
    return lib


def _address(name: str) -> int:
    """The address of C function `name`, worked out once per loaded build (a ctypes cast:
    about 10 us, every decode step asks)."""
    got = _state.get(f"address:{name}")
    if got is None:
        got = _state[f"address:{name}"] = kernels.address(_lib(), name)
    return got  # type: ignore[return-value]


def choose_address() -> int:
    """The address of `sparse_choose`, for native code that calls it (`gemv.decode_layers`)."""
    return _address("sparse_choose")


def attend_address() -> int:
    """The address of `sparse_attend`, for native code that calls it (`gemv.decode_layers`)."""
    return _address("sparse_attend")


TILE = 16  # summaries per tile (sparse.c's layout)


def tile(codes: torch.Tensor) -> torch.Tensor:
    """Summaries' codes [..., S, w] (S % 16 == 0, w % 4 == 0) in the layout `sparse_choose`
    reads: tiles of 16 summaries, each [w / 4, 16, 4] (4 channels of the 16 side by side)."""
    *lead, n, w = codes.shape
    return codes.reshape(*lead, n // TILE, TILE, w // 4, 4).transpose(-3, -2).contiguous()


def untile(tiles: torch.Tensor) -> torch.Tensor:
    """`tile`'s inverse: [..., S / 16, w / 4, 16, 4] -> [..., S, w] (a copy)."""
    *lead, g, c, t, four = tiles.shape
    return tiles.transpose(-3, -2).reshape(*lead, g * t, c * four)


def tile_keys(codes: torch.Tensor) -> torch.Tensor:
    """4-bit key codes [..., tiles, 16, D] (0 to 15, uint8; D % 8 == 0) in the layout
    `sparse_choose` reads: per tile [D / 8, 16, 4] bytes, byte (j, k, i) holding token k's
    channel 8j + i in its low nibble and 8j + 4 + i in its high one (one load gives 4 channels
    of 16 tokens twice over)."""
    *lead, tiles, t, d = codes.shape
    c = codes.view(*lead, tiles, t, d // 8, 2, 4)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).transpose(-3, -2).contiguous()


def untile_keys(tiles: torch.Tensor) -> torch.Tensor:
    """`tile_keys`'s inverse, flattened: [..., tiles, D / 8, 16, 4] -> [..., tiles x 16, D]."""
    *lead, n, g, t, four = tiles.shape
    b = tiles.transpose(-3, -2)  # [..., n, 16, D / 8, 4]
    return torch.stack((b & 15, b >> 4), dim=-2).reshape(*lead, n * t, g * 2 * four)


def quantize_key_tiles(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys x [rows, n, D] float32 (each row's n x D contiguous, the rows at any stride: a
    slice of a longer buffer) in 4 bits per group of `group` tokens (a multiple of 16; the
    last group may hold fewer), as `kvstrategies.sparse.quantize_key_tiles` makes them, byte
    for byte: codes [rows, tiles, D / 8, 16, 4] uint8 (`tile_keys`; tiles = n / 16 rounded up,
    a last tile padded with its last key) and per group its minima and steps [rows, groups, 2,
    D] float16."""
    rows, n, d = x.shape
    if (x.dtype != torch.float32 or n < 1 or group % TILE or group < 1 or d % 8 or d > 1024 or
            x.stride(2) != 1 or (n > 1 and x.stride(1) != d) or x.stride(0) < n * d):  # fmt: skip
        raise ValueError(f"quantize_key_tiles takes float32 keys [rows, n >= 1, D], D a "
                         f"multiple of 8, each row contiguous, and a group that is a multiple of "
                         f"16 (got {tuple(x.shape)}, {x.dtype}, group {group})")  # fmt: skip
    codes = torch.empty(rows, -(-n // TILE), d // 8, TILE, 4, dtype=torch.uint8)
    params = torch.empty(rows, -(-n // group), 2, d, dtype=torch.float16)
    rc = _lib().sparse_quantize_keys(x.data_ptr(), rows, n, x.stride(0) if rows > 1 else n * d,
                                     group, d, codes.data_ptr(), params.data_ptr(),
                                     torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError("sparse_quantize_keys rejected its arguments")
    return codes, params


def summarize(
    k: torch.Tensor,
    opened: torch.Tensor,
    goes_on: bool,
    ranged: bool,
    codes: torch.Tensor,
    scales: torch.Tensor,
    index: int,
) -> None:
    """Summary `index` of every layer and KV head updated in place with a step's keys k [L,
    n, Hkv, D] float32 (all n tokens within that summary), as
    `kvstrategies.sparse.summarize_torch` does it, byte for byte: its running minimum and
    maximum `opened` [2, L, Hkv, D] (continued where `goes_on`), its int8 codes in `codes` [L,
    Hkv, tiles, w / 4, 16, 4] (w = 2D `ranged`, else D) and its scale in `scales` [L, Hkv,
    cap]. Raises ValueError, having written nothing, for tensors it does not take."""
    layers, n, h, d = k.shape
    w = 2 * d if ranged else d
    if (k.dtype != torch.float32 or k.stride(3) != 1 or k.stride(2) != d
            or (n > 1 and k.stride(1) != h * d) or (layers > 1 and k.stride(0) < n * h * d)
            or opened.dtype != torch.float32 or not opened.is_contiguous()
            or tuple(opened.shape) != (2, layers, h, d) or codes.dtype != torch.int8
            or not codes.is_contiguous() or codes.dim() != 6
            or tuple(codes.shape[:2]) != (layers, h) or tuple(codes.shape[3:]) != (w // 4, TILE, 4)
            or scales.dtype != torch.float32 or not scales.is_contiguous()
            or tuple(scales.shape[:2]) != (layers, h) or scales.dim() != 3):  # fmt: skip
        raise ValueError(
            "summarize takes float32 keys [L, n, Hkv, D] (each token's heads contiguous), "
            "contiguous float32 `opened` [2, L, Hkv, D], int8 tiles [L, Hkv, tiles, w / 4, 16, "
            "4] and float32 scales [L, Hkv, cap]"
        )
    rc = _lib().sparse_summarize(
        k.data_ptr(), layers, n, k.stride(0) if layers > 1 else n * h * d, h, d,
        opened.data_ptr(), int(goes_on), int(ranged), codes.data_ptr(), codes.shape[2],
        scales.data_ptr(), scales.shape[2], index,
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"sparse_summarize rejected its arguments (summary {index})")


def add_keys(
    k: torch.Tensor,
    opened: torch.Tensor,
    span: torch.Tensor,
    have: int,
    codes: torch.Tensor,
    params: torch.Tensor,
    group_index: int,
) -> None:
    """A decode step's keys k [L, n, Hkv, D] float32 into the open group `group_index` of every
    layer's and KV head's 4-bit keys, in place, as `kvstrategies.sparse.add_keys_torch` does
    it, byte for byte: copied to tokens [have, have + n) of `opened` [L, Hkv, G, D] (the
    group's keys so far; G the group), taken into its running minimum and maximum `span` [L,
    Hkv, 2, D] float32, and the group's first have + n keys quantized as one group: their
    tiles into `codes` [L, Hkv, tiles, D / 8, 16, 4] uint8 from the group's first tile, their
    minima and steps into `params` [L, Hkv, groups, 2, D] float16 (incrementally: see
    sparse.c). Raises ValueError, having written nothing, for tensors it does not take."""
    layers, n, h, d = k.shape
    g = opened.shape[2] if opened.dim() == 4 else 0
    first = group_index * g // TILE
    if (k.dtype != torch.float32 or k.stride(3) != 1 or k.stride(2) != d
            or (n > 1 and k.stride(1) != h * d) or (layers > 1 and k.stride(0) < n * h * d)
            or opened.dtype != torch.float32 or not opened.is_contiguous()
            or tuple(opened.shape[:2]) != (layers, h) or opened.shape[-1] != d
            or g % TILE or not 0 <= have <= g - n or span.dtype != torch.float32
            or not span.is_contiguous() or tuple(span.shape) != (layers, h, 2, d)
            or codes.dtype != torch.uint8 or not codes.is_contiguous() or codes.dim() != 6
            or tuple(codes.shape[:2]) != (layers, h) or tuple(codes.shape[3:]) != (d // 8, TILE, 4)
            or codes.shape[2] < first + -(-(have + n) // TILE)
            or params.dtype != torch.float16 or not params.is_contiguous() or params.dim() != 5
            or tuple(params.shape[:2]) != (layers, h) or tuple(params.shape[3:]) != (2, d)
            or not 0 <= group_index < params.shape[2]):  # fmt: skip
        raise ValueError(
            "add_keys takes float32 keys [L, n, Hkv, D] (each token's heads contiguous), a "
            "contiguous float32 open group [L, Hkv, G, D] with room for them and its range [L, "
            "Hkv, 2, D], uint8 tiles [L, Hkv, tiles, D / 8, 16, 4] and float16 minima and "
            "steps [L, Hkv, groups, 2, D]"
        )
    rc = _lib().sparse_add_keys(
        k.data_ptr(), layers, n, k.stride(0) if layers > 1 else n * h * d, h, d,
        opened.data_ptr(), span.data_ptr(), g, have, codes[:, :, first].data_ptr(), codes.stride(1),
        params[:, :, group_index].data_ptr(), params.stride(1), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"sparse_add_keys rejected its arguments (group {group_index})")


def choose_blocks(
    q: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, lo: int, hi: int, room: int,
    end: int, alpha: float, parts: int = 1, temp: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """[Hkv, lo + room + (end - hi)] int64: per KV head the sink blocks 0..lo-1, the `room`
    candidates of [lo, hi) whose score is largest (in ascending order), then the window
    hi..end-1. q: the step's queries [rows, Hq, D] float32; codes: the layer's summaries, int8
    in tiles ([Hkv, S / 16, w / 4, 16, 4], `tile`; w: 2D, centre and half-range, or D, the
    centre alone), `parts` per block; scales [Hkv, S] float32, one per summary. The score of a
    block: the largest over its summaries and the group's queries of q . centre + alpha |q| .
    half-range, with q quantized to int8 as `kvstrategies.sparse.quantize_queries` does; with
    `temp` > 0, the log-sum-exp of temp times its summaries' scores (each the largest over the
    queries). With 4-bit keys (codes uint8 [Hkv, tiles, D / 8, 16, 4], `tile_keys`; scales
    float16 [Hkv, groups, 2, D], per group of tiles / groups tiles the channels' minimum and
    step: the kernel takes that ratio from the two head strides) a summary is a token, scored
    as `kvstrategies.sparse.key_scores` does (alpha unread)."""
    lib = _lib()
    rows, hq, d = q.shape
    h, g, c, t, four = codes.shape
    keys = codes.dtype == torch.uint8  # 4-bit keys: `tile_keys`, float16 minima and steps
    w = 4 * c  # bytes of a summary's codes: d / 2 for keys
    if q.dtype != torch.float32 or (codes.dtype, scales.dtype) not in (
        (torch.int8, torch.float32), (torch.uint8, torch.float16)
    ):  # fmt: skip
        raise ValueError("choose_blocks takes float32 queries, int8 summaries, float32 scales "
                         "(or uint8 keys, float16 minima and steps)")  # fmt: skip
    if (t, four) != (TILE, 4) or w > 1024 or not codes.is_contiguous() or (
        w != d // 2 or d % 8 if keys else w not in (d, 2 * d)
    ):  # fmt: skip
        raise ValueError("the summaries must be tiles of 16 rows of 2 x head dim (or head dim; "
                         "keys: head dim / 2 bytes)")  # fmt: skip
    if keys and (
        scales.dim() != 4
        or scales.shape[::2] != (h, 2)
        or scales.shape[3] != d
        or not 0 < scales.shape[1] <= g
        or g % scales.shape[1]
        or scales.stride(0) != scales.shape[1] * 2 * d
        or not scales[0].is_contiguous()
    ):
        raise ValueError("the keys' minima and steps must be [Hkv, groups, 2, head dim], the "
                         "groups dividing the tiles, contiguous")  # fmt: skip
    if not keys and (scales.stride(1) != 1 or scales.shape != (h, g * TILE)):
        raise ValueError("the scales must be contiguous rows, one per summary")
    if g * TILE < hi * parts:
        raise ValueError(f"{g * TILE} summaries do not cover {hi} blocks of {parts}")
    q = q.contiguous()
    out = torch.empty(h, lo + room + (end - hi), dtype=torch.int64)
    rc = lib.sparse_choose(
        q.data_ptr(), rows, hq, h, d, codes.data_ptr(), scales.data_ptr(), codes.stride(0),
        scales.stride(0), parts, w, lo, hi, room, end, alpha, temp, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise ValueError(
            f"sparse.c refused rows={rows} heads={hq}/{h} blocks [{lo}, {hi}) room={room} end={end}"
        )
    return out


def attend_blocks(
    q: torch.Tensor, places: list[torch.Tensor], where: torch.Tensor | None, ids: torch.Tensor,
    blocks: torch.Tensor, block_size: int, past: int, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Attention of one sequence's new queries q [T, Hq, D] over the blocks it chose, read
    where they lie. `blocks` [Hkv, B]: the chosen blocks' positions in the sequence's block
    list; per position p, `where[p]` the place it lies in (None: all in places[0]) and `ids[p]`
    its block index there; `places`: [2, Hkv, slots, D] float32 tensors (K, V; contiguous: a
    tier's arena for the layer, a staged tensor). Query row t sees positions up to past + t.
    Returns [T, Hq, D]."""
    lib = _lib()
    t, hq, d = q.shape
    h = blocks.shape[0]
    for a in places:
        if a.dtype != torch.float32 or not a.is_contiguous() or a.shape[0] != 2 \
                or a.shape[1] != h or a.shape[3] != d:  # fmt: skip
            raise ValueError("attend_blocks reads contiguous float32 [2, Hkv, slots, D] places")
    if q.dtype != torch.float32:
        raise ValueError("attend_blocks takes float32 queries")
    for x in (where, ids, blocks):  # int64, contiguous: read by address
        if x is not None and (x.dtype != torch.int64 or not x.is_contiguous()):
            raise ValueError("attend_blocks takes contiguous int64 where, ids and blocks")
    n = len(places)
    bases = (ctypes.c_int64 * n)(*(a.data_ptr() for a in places))
    slots = (ctypes.c_int64 * n)(*(a.shape[2] for a in places))
    q = q.contiguous()
    out = torch.empty_like(q)
    rc = lib.sparse_attend(
        q.data_ptr(), t, hq, h, d, block_size, bases, slots,
        None if where is None else where.data_ptr(), ids.data_ptr(), blocks.data_ptr(),
        blocks.shape[1], past, scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc:
        raise ValueError(f"sparse.c refused attention over {blocks.shape[1]} blocks of {t} rows")
    return out
