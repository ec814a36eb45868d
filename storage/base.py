"""The block-store plug point: the `BlockStore` ABC, its asyncio facade and the value frame.

What lives here: `BlockStore` (a persistent key -> bytes store of KV blocks; keys and values are
opaque bytes), `AsyncBlockStore` (the same from asyncio, blocking calls on worker threads),
`VerifyReport`, the errors `StoreFullError`, `StoreUnavailableError` and `ChecksumError`, and
the frame every backend stores a value in (`encode_frame`/`decode_frame`: a 16-byte header
with a CRC-32 + the payload).
What does not: a backend (`storage.lmdb_store`, `storage.redis_store`, `storage.fs_store`),
the name -> class registry
(`storage.registry`), and anything about tokens, layers or tiers (the pool and the strategies
decide what a block means and where it lives; a store only keeps bytes safe).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import logging
import os
import struct
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import crc32c

Buffer = bytes | bytearray | memoryview

# Frame: magic, format version, flags (0), checksum, payload length; then the payload.
# Why a CRC and not blake2b: it is a media/torn-write check, not a defence against an adversary,
# and it sits on every read and write. Why CRC-32C (Castagnoli, the `crc32c` package, SSE4.2 /
# ARMv8 instructions) since frame version 2: measured on 98,304-byte values on this host,
# crc32c 21 GB/s, zlib.crc32 2.4 GB/s, blake2b 1.4 GB/s; with zlib the checksum alone cost more
# than sending the value to Redis on loopback. CRC-32C finds every burst of <= 32 bits and
# misses random damage with probability 2**-32. The CRC covers the key and the length as well as
# the payload, so a value written under the wrong key is caught too. Version 1 frames (zlib's
# CRC-32) are still read. Content identity (prefix hashes) is the pool's business (a real hash).
_MAGIC = b"uK"
FRAME_VERSION = 2  # 1: zlib.crc32; 2: CRC-32C
_HEADER = struct.Struct("<2sBBIQ")
HEADER_BYTES = _HEADER.size  # 16


class StoreFullError(OSError):
    """The store cannot take the write: its map is at `max_map_size` or the disk is full.

    The failed write was aborted as a whole; everything committed before stays readable.
    """

    def __init__(self, path: str, message: str) -> None:
        super().__init__(errno.ENOSPC, message, path)
        self.path = path


class StoreUnavailableError(ConnectionError):
    """The store's server cannot be reached now: a timeout, a refused or reset connection.

    Raised by remote stores (Redis) during operation; the caller treats it as a miss (the
    remote tier's circuit breaker). Opening a store against an unreachable server is a
    `ValueError` instead: that is a configuration to fix, not a passing outage.
    """

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"block store {where}: {message}")
        self.where = where


class ChecksumError(RuntimeError):
    """A stored value does not match its checksum (or its frame is damaged)."""

    def __init__(self, key: bytes, reason: str) -> None:
        super().__init__(f"corrupt block {key.hex()}: {reason}")
        self.key = key


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What `BlockStore.verify` found: how many entries it checked and which are corrupt."""

    checked: int
    bytes_checked: int
    corrupted: list[bytes] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no entry is corrupt."""
        return not self.corrupted


# Authorship, for tiers other processes can write (a shared Redis, a shared directory): with a
# deployment secret, a frame's header carries the SIGNED flag and an HMAC-SHA256 tag (its first
# TAG_BYTES) over the key, the header and the payload follows the payload. The CRC catches
# damage; only the tag stops an author without the secret from planting KV under a known
# prompt's hash. A store given a secret refuses unsigned frames and wrong tags (a miss).
SIGNED = 1
TAG_BYTES = 16


def _tag(secret: bytes, key: bytes, header: Buffer, payload: Buffer) -> bytes:
    h = hmac.new(secret, len(key).to_bytes(2, "little") + key, hashlib.sha256)
    h.update(header)
    h.update(payload)
    return h.digest()[:TAG_BYTES]


def frame_bytes(header: Buffer) -> int:
    """The whole frame's length its header declares (header, payload, tag if signed)."""
    _magic, _version, flags, _crc, length = _HEADER.unpack_from(header)
    return HEADER_BYTES + length + (TAG_BYTES if flags & SIGNED else 0)


def encode_frame(key: bytes, payload: Buffer, secret: bytes | None = None) -> bytes:
    """The stored form of `payload` under `key`: header (with the CRC) + payload (+ the HMAC
    tag with a `secret`)."""
    crc = crc32c.crc32c(payload, _seed(key, len(payload), FRAME_VERSION))
    header = _HEADER.pack(_MAGIC, FRAME_VERSION, SIGNED if secret else 0, crc, len(payload))
    if not secret:
        return header + payload
    return header + bytes(payload) + _tag(secret, key, header, payload)


def check_frame(key: bytes, frame: Buffer, secret: bytes | None = None) -> int:
    """The payload length of a stored frame; a ChecksumError if the frame is damaged (or,
    with a `secret`, not signed with it)."""
    if len(frame) < HEADER_BYTES:
        raise ChecksumError(key, f"{len(frame)} bytes, shorter than the {HEADER_BYTES}-byte header")
    view = memoryview(frame)
    signed = bool(view[3] & SIGNED)
    end = len(frame) - (TAG_BYTES if signed else 0)
    if end < HEADER_BYTES:
        raise ChecksumError(key, "shorter than its header and tag")
    # The CRC runs on the buffer in place (zlib releases the GIL on large buffers), so reading
    # straight out of a memory map faults the pages in without holding other threads up.
    check_parts(key, frame, [view[HEADER_BYTES:end]])
    if secret:
        if not signed:
            raise ChecksumError(key, "not signed (this deployment requires its secret's HMAC)")
        want = _tag(secret, key, view[:HEADER_BYTES], view[HEADER_BYTES:end])
        if not hmac.compare_digest(want, bytes(view[end:])):
            raise ChecksumError(key, "HMAC mismatch: not written with this deployment's secret")
    return end - HEADER_BYTES


def check_parts(key: bytes, header: Buffer, parts: Sequence[Buffer]) -> None:
    """Check a frame read in pieces (its header, then the payload scattered over `parts`, in
    order); a ChecksumError if it is damaged."""
    magic, version, _flags, crc, length = _HEADER.unpack_from(header)
    if magic != _MAGIC or version not in _CRC:
        raise ChecksumError(key, f"bad header (magic {magic!r}, version {version})")
    stored = sum(len(p) for p in parts)
    if length != stored:
        raise ChecksumError(key, f"length {length} in header, {stored} stored")
    fn = _CRC[version]
    c = _seed(key, length, version)
    for p in parts:
        c = fn(p, c)
    if c != crc:
        raise ChecksumError(key, "checksum mismatch")


def scatter(payload: memoryview, buffers: Sequence[memoryview]) -> None:
    """Copy `payload` into `buffers` in order (their sizes add up to its length)."""
    offset = 0
    for b in buffers:
        b[:] = payload[offset : offset + len(b)]
        offset += len(b)


def decode_frame(key: bytes, frame: Buffer, secret: bytes | None = None) -> bytes:
    """The payload of a stored frame (a copy); a ChecksumError if the frame is damaged (or not
    signed with `secret`, given one)."""
    n = check_frame(key, frame, secret)
    return bytes(memoryview(frame)[HEADER_BYTES : HEADER_BYTES + n])


def secret_bytes(secret: str | bytes | None) -> bytes | None:
    """A deployment secret as bytes (None or empty: no secret); at least 16 bytes."""
    if not secret:
        return None
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(raw) < 16:
        raise ValueError(
            f"a store secret (UNIKV_STORE_SECRET) needs at least 16 bytes, got {len(raw)}"
        )
    return raw


_CRC = {1: zlib.crc32, 2: crc32c.crc32c}  # frame version -> CRC function (data, running crc)


def _seed(key: bytes, length: int, version: int) -> int:
    fn = _CRC[version]
    return fn(length.to_bytes(8, "little"), fn(key))


def check_key(key: object, max_bytes: int) -> bytes:
    """`key` as bytes; a ValueError unless it is 1..max_bytes bytes."""
    if not isinstance(key, bytes | bytearray | memoryview):
        raise ValueError(f"a block key must be bytes, got {type(key).__name__}")
    key = bytes(key)
    if not 1 <= len(key) <= max_bytes:
        raise ValueError(f"a block key must be 1..{max_bytes} bytes, got {len(key)}")
    return key


def check_namespace(namespace: object) -> str:
    """`namespace` if it is a non-empty string of printable characters without ':'."""
    if not isinstance(namespace, str) or not namespace or not namespace.isprintable():
        raise ValueError(
            f"a store namespace must be a non-empty printable string, got {namespace!r}"
        )
    if ":" in namespace:
        raise ValueError(f"a store namespace must not contain ':', got {namespace!r}")
    return namespace


def check_value(key: bytes, value: object) -> Buffer:
    """`value` if it is bytes-like; a ValueError naming the key otherwise."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise ValueError(f"the value for key {key.hex()} must be bytes, got {type(value).__name__}")
    return value


log = logging.getLogger(__name__)


@dataclass(slots=True)
class StoreCounters:
    """What every store counts since it was opened (its `stats()` reports them); a backend
    with more to count subclasses this."""

    puts: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    deletes: int = 0
    checksum_failures: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class Accounting:
    """A store's counters under their own lock, and the bookkeeping every backend shares:
    reads (hits, misses, bytes), writes, deletes, and a corrupt value (logged, counted, a miss)."""

    def __init__(self, where: str, counters: StoreCounters | None = None) -> None:
        self.where = where  # the store's path or URL, for messages
        self.n = counters if counters is not None else StoreCounters()
        self._lock = threading.Lock()

    def read(self, asked: int, hits: int, nbytes: int) -> None:
        """`asked` keys read, `hits` of them found whole, `nbytes` returned."""
        with self._lock:
            self.n.gets += asked
            self.n.hits += hits
            self.n.misses += asked - hits
            self.n.bytes_read += nbytes

    def wrote(self, n: int, nbytes: int) -> None:
        """`n` values stored, `nbytes` written."""
        with self._lock:
            self.n.puts += n
            self.n.bytes_written += nbytes

    def add(self, counter: str, n: int = 1) -> None:
        """Add `n` to one counter (deletes, evictions, a backend's own)."""
        with self._lock:
            setattr(self.n, counter, getattr(self.n, counter) + n)

    def corrupt(self, e: ChecksumError) -> None:
        """A stored value failed its check: logged with its key, counted, read as a miss."""
        log.warning("block store %s: %s; treated as a miss", self.where, e)
        self.add("checksum_failures")

    def snapshot(self) -> dict[str, int]:
        """The counters, read together."""
        with self._lock:
            return asdict(self.n)


class BlockStore(ABC):
    """A persistent store of blocks: opaque `bytes` keys (e.g. content hashes) -> `bytes`.

    Contract, checked for every registered backend by tests/test_storage.py:
    - `get` returns the bytes last put, or None when the key is absent *or its value is
      corrupt* (a corruption is logged with the key in hex and counted, never returned);
    - a batched write is atomic: after an error nothing of the batch is stored, and everything
      stored before still reads back;
    - a write that cannot fit raises `StoreFullError`; bad input raises `ValueError`;
    - the instance is safe to share between threads; `AsyncBlockStore` wraps it for asyncio.
    Subclasses set `name` and register with `storage.registry.register`.
    """

    name: ClassVar[str]
    # Set by every backend: its counters (`Accounting`) and whether it is closed; a backend
    # that signs its frames sets `_secret`.
    _acct: Accounting
    _closed: bool
    _secret: bytes | None = None
    _max_key: int  # the longest key the backend takes, in bytes

    def _check(self, key: object) -> bytes:
        """`key` as bytes, or a ValueError naming what is wrong with it."""
        return check_key(key, self._max_key)

    def _count_reads(self, n: int, hits: int, nbytes: int,
                     corrupt: Iterable[ChecksumError] = ()) -> None:  # fmt: skip
        """Count a read of `n` keys, `hits` found with `nbytes` bytes, and the corrupt ones."""
        self._acct.read(n, hits, nbytes)
        for e in corrupt:
            self._report_corrupt(e)

    def _frame_batch(self, items) -> dict[bytes, bytes]:
        """Validate and frame a `put_many` batch before anything is written, so bad input
        writes nothing (a repeated key: the last value wins)."""
        pairs = items.items() if isinstance(items, Mapping) else items
        frames: dict[bytes, bytes] = {}
        for item in pairs:
            try:
                key, value = item
            except (TypeError, ValueError):
                raise ValueError(f"put_many takes (key, value) pairs, got {item!r:.60}") from None
            key = self._check(key)
            frames[key] = encode_frame(key, check_value(key, value), self._secret)
        return frames

    def _verify_frames(self, frames: Iterable[tuple[bytes, Buffer | None]]) -> VerifyReport:
        """`verify` over (key, stored frame) pairs read back (None: gone since listed): the
        corrupt keys are listed, logged and counted."""
        checked = nbytes = 0
        corrupted: list[bytes] = []
        for key, frame in frames:
            if frame is None:
                continue
            checked += 1
            nbytes += len(frame)
            try:
                check_frame(key, frame, self._secret)
            except ChecksumError as e:
                corrupted.append(key)
                self._report_corrupt(e)
        return VerifyReport(checked, nbytes, corrupted)

    def _report_corrupt(self, e: ChecksumError) -> None:
        self._acct.corrupt(e)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"block store {self._acct.where} is closed")

    # -- batched forms: what a backend implements ------------------------------------------

    @abstractmethod
    def put_many(self, items: Mapping[bytes, Buffer] | Iterable[tuple[bytes, Buffer]]) -> None:
        """Store every (key, value) pair in one atomic write."""

    @abstractmethod
    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        """The value of each key in order; None where absent or corrupt."""

    @abstractmethod
    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove the keys in one atomic write; how many were present."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether `key` is stored (its value is not read or checked)."""

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Every stored key, in the backend's order; safe to write while iterating."""

    def __len__(self) -> int:
        """Number of stored entries (a backend that counts them cheaper overrides this)."""
        return int(self.stats()["entries"])

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and sizes: entries, bytes, map size, checksum failures, puts/gets/hits/..."""

    @abstractmethod
    def verify(self) -> VerifyReport:
        """Check every stored value's checksum; list the corrupt keys."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every entry."""

    @abstractmethod
    def close(self) -> None:
        """Release the store; later calls raise ValueError. Closing twice is harmless."""

    # -- single forms: defaults through the batched ones; backends may specialise --------

    def put(self, key: bytes, value: Buffer) -> None:
        """Store `value` under `key`, replacing any previous value."""
        self.put_many([(key, value)])

    def get(self, key: bytes) -> bytes | None:
        """The value under `key`; None when absent or corrupt."""
        return self.get_many([key])[0]

    def delete(self, key: bytes) -> bool:
        """Remove `key`; whether it was present."""
        return self.delete_many([key]) == 1

    def read_into(self, keys: Iterable[bytes], buffers: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Copy each key's payload into its writable `buffers` (filled in order; their sizes
        add up to the payload's); False where absent, corrupt or of another size. Backends
        read straight into the buffers where they can (LMDB: one `preadv` per value)."""
        found = []
        for value, bufs in zip(self.get_many(keys), buffers, strict=True):
            views = [memoryview(b).cast("B") for b in bufs]
            ok = value is not None and len(value) == sum(len(b) for b in views)
            if ok:
                scatter(memoryview(value), views)
            found.append(ok)
        return found

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.contains(key)

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncBlockStore:
    """Any `BlockStore` from asyncio: every call runs in a worker thread (`asyncio.to_thread`).

    Store calls block on disk I/O and fsync; on the event loop they would stall every other
    request. The wrapped store is thread-safe, so concurrent awaits simply run in parallel.
    """

    def __init__(self, store: BlockStore) -> None:
        self.store = store

    async def put(self, key: bytes, value: Buffer) -> None:
        """Store `value` under `key`."""
        await asyncio.to_thread(self.store.put, key, value)

    async def get(self, key: bytes) -> bytes | None:
        """The value under `key`; None when absent or corrupt."""
        return await asyncio.to_thread(self.store.get, key)

    async def delete(self, key: bytes) -> bool:
        """Remove `key`; whether it was present."""
        return await asyncio.to_thread(self.store.delete, key)

    async def contains(self, key: bytes) -> bool:
        """Whether `key` is stored."""
        return await asyncio.to_thread(self.store.contains, key)

    async def put_many(
        self, items: Mapping[bytes, Buffer] | Iterable[tuple[bytes, Buffer]]
    ) -> None:
        """Store every pair in one atomic write."""
        # Materialise here: a generator must not be consumed on another thread behind our back.
        items = list(items.items()) if isinstance(items, Mapping) else list(items)
        await asyncio.to_thread(self.store.put_many, items)

    async def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        """The value of each key in order; None where absent or corrupt."""
        return await asyncio.to_thread(self.store.get_many, list(keys))

    async def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove the keys in one atomic write; how many were present."""
        return await asyncio.to_thread(self.store.delete_many, list(keys))

    async def keys(self) -> list[bytes]:
        """Every stored key."""
        return await asyncio.to_thread(lambda: list(self.store.keys()))

    async def count(self) -> int:
        """Number of stored entries (`len` of the store)."""
        return await asyncio.to_thread(len, self.store)

    async def stats(self) -> dict[str, Any]:
        """The store's counters and sizes."""
        return await asyncio.to_thread(self.store.stats)

    async def verify(self) -> VerifyReport:
        """Check every checksum."""
        return await asyncio.to_thread(self.store.verify)

    async def clear(self) -> None:
        """Remove every entry."""
        await asyncio.to_thread(self.store.clear)

    async def close(self) -> None:
        """Close the wrapped store."""
        await asyncio.to_thread(self.store.close)

    async def __aenter__(self) -> AsyncBlockStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def prepare_dir(path: Path) -> None:
    """Create the store directory if missing; a ValueError naming it if it cannot be used."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"block store path {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create block store directory {path}: {e.strerror}") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"block store directory {path} is not writable")
