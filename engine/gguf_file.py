"""Read a GGUF file's metadata and tensor table: `read_gguf(path) -> GGUFFile`.

Why not `gguf.GGUFReader`: it builds a numpy view for every part of every metadata value, and
a tokenizer's vocabulary and merges are a few hundred thousand strings. Opening SmolLM2's 98 MB
file took it 8.3-10.5 s on an AMD EPYC (Zen 1) at every model load: each `unikv serve`, replica
and `unikv run` paid it before its first token, and the test suite about 40 times. This reader
walks the same bytes with `struct` and reads numeric arrays with one `np.frombuffer` each: 0.43 s
for the same file there (tests/test_gguf.py compares the two on every value and tensor). The `gguf`
package still names the tensor types and their block sizes, decodes the blocks and writes files.

The format (version 2 and 3, little-endian; ggml's docs/gguf.md): the magic b"GGUF", a uint32
version, uint64 tensor and key counts; the keys (a uint64-length UTF-8 name, a uint32 value
type, the value: scalars, strings as uint64 length + bytes, arrays as a uint32 element type, a
uint64 count and the elements); then per tensor its name, a uint32 number of dimensions, the
uint64 dimensions (fastest first), the uint32 type and a uint64 offset into the data section,
which starts at the next multiple of `general.alignment` (32 by default).

Every count and length is checked against the bytes left before it is used, so a damaged or
hostile file fails with a `ValueError` that says where, never a huge allocation.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS

# Value types (GGUFValueType): struct code of the scalars; 8 string, 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Tensor types gguf.GGUFReader exposes as typed elements (by GGMLQuantizationType name);
# every other type as its raw bytes, [..., row bytes].
_ELEMENT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                   "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of the file. `shape`: GGUF's order (fastest first, as ggml writes it);
    `data`: a read-only view of the mapped file, as `gguf.GGUFReader` shapes it (elements of
    the float and integer types, [rows..., row bytes] of uint8 for the block types)."""

    name: str
    tensor_type: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]
    data: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True)
class GGUFFile:
    """A GGUF file's metadata (`fields`: key -> int, float, bool, str or list of them) and
    tensors, in file order."""

    path: Path
    version: int
    fields: dict[str, Any]
    tensors: list[GGUFTensor]


class _Cursor:
    """Reads little-endian values from a buffer, refusing to read past its end."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at, self.end = buf, 0, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.end - self.at:
            raise ValueError(f"{what} at byte {self.at} needs {n} bytes; "
                             f"{self.end - self.at} remain")  # fmt: skip

    def scalar(self, code: str, what: str):
        size = struct.calcsize(code)
        self.need(size, what)
        (value,) = struct.unpack_from("<" + code, self.buf, self.at)
        self.at += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.at : self.at + n])
        self.at += n
        return raw.decode("utf-8")

    def strings(self, count: int, what: str) -> list[str]:
        # The hot loop of a tokenizer's 100k strings: locals, no method calls per element.
        self.need(8 * count, what)  # each string is at least its length field
        buf, at, end, out = self.buf, self.at, self.end, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if end - at < 8:
                raise ValueError(f"{what} ends inside a string length at byte {at}")
            (n,) = unpack(buf, at)
            at += 8
            if n > end - at:
                raise ValueError(f"{what} at byte {at} has a string of {n} bytes; "
                                 f"{end - at} remain")  # fmt: skip
            out.append(str(buf[at : at + n], "utf-8"))
            at += n
        self.at = at
        return out

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise ValueError(f"{what}: unknown value type {vtype}")
        etype = self.scalar("I", what)
        count = self.scalar("Q", what)
        if etype == _STRING:
            return self.strings(count, what)
        if etype in _SCALARS:
            code = "<" + _SCALARS[etype]
            size = struct.calcsize(code)
            self.need(count * size, what)
            arr = np.frombuffer(self.buf, dtype=np.dtype(code), count=count, offset=self.at)
            self.at += count * size
            return arr.tolist()
        if etype == _ARRAY:  # arrays of arrays: no GGUF key this engine reads has them
            return [self.value(_ARRAY, what) for _ in range(count)]
        raise ValueError(f"{what}: unknown array element type {etype}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse `path`'s header, metadata and tensor table (the tensors' bytes stay mapped, read
    when used). Raises ValueError naming what is wrong for a file that is not a readable GGUF
    file (bad magic, an unsupported version, a length past the end, a duplicate name, a tensor
    type the `gguf` package does not know)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped))
    cur.need(4, "the magic number")
    if bytes(cur.buf[:4]) != MAGIC:
        raise ValueError(f"bad magic {bytes(cur.buf[:4])!r}, want {MAGIC!r}")
    cur.at = 4
    version = cur.scalar("I", "the version")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} (read little-endian); supported: "
                         f"{', '.join(map(str, VERSIONS))}")  # fmt: skip
    n_tensors = cur.scalar("Q", "the tensor count")
    n_fields = cur.scalar("Q", "the key count")
    fields: dict[str, Any] = {}
    for i in range(n_fields):
        key = cur.string(f"key {i}")
        if key in fields:
            raise ValueError(f"key {key!r} appears twice")
        fields[key] = cur.value(cur.scalar("I", key), key)
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor {i}'s name")
        n_dims = cur.scalar("I", name)
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions; 1 to {MAX_DIMS} exist")
        dims = tuple(cur.scalar("Q", name) for _ in range(n_dims))
        infos.append((name, dims, cur.scalar("I", name), cur.scalar("Q", name)))
    align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align < 1 or align & (align - 1):
        raise ValueError(f"general.alignment {align!r} is not a power of two")
    start = -(-cur.at // align) * align
    tensors, names = [], set()
    for name, dims, raw_type, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        qtype = GGMLQuantizationType(raw_type)  # ValueError for a type gguf does not know
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims, dtype=np.int64)) if all(d > 0 for d in dims) else 0
        if dims[0] % block:
            raise ValueError(f"tensor {name!r}: rows of {dims[0]} are not whole {qtype.name} "
                             f"blocks of {block}")  # fmt: skip
        n_bytes = n_elems // block * type_size
        at = start + offset
        if offset % align or at + n_bytes > cur.end:
            raise ValueError(f"tensor {name!r} ({n_bytes} bytes at {at}) lies outside the "
                             f"data section of a {cur.end}-byte file")  # fmt: skip
        shape = tuple(reversed(dims))
        dtype = _ELEMENT_DTYPES.get(qtype.name)
        if dtype is None:  # block types: [..., row bytes]
            data = mapped[at : at + n_bytes].reshape(*shape[:-1], dims[0] // block * type_size)
        else:
            data = mapped[at : at + n_bytes].view(dtype).reshape(shape)
        tensors.append(GGUFTensor(name, int(qtype), dims, data))
    return GGUFFile(path, version, fields, tensors)
