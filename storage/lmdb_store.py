"""`LmdbBlockStore`: the block store on LMDB (one environment directory on a local SSD).

What lives here: the store, its map growth, the translation of LMDB/OS failures into the
storage errors, and location hints (prefetch of a value's file range before LMDB touches it).
What does not: the value frame and its checksum (`storage.base`), the registry
(`storage.registry`), and any notion of what a block holds.

Layout inside the environment: three named databases. `blocks` maps key -> frame (16-byte
header with a CRC-32, then the payload). `locs` maps key -> (file offset, length) of that frame
inside data.mdb, a *hint* used only to prefetch (see `_advise`). `meta` holds the format tag, so
a directory holding some other LMDB environment is refused instead of being written into.

Crash safety comes from LMDB itself: a transaction is committed by writing its pages to free
space and then switching the meta page, so a killed process leaves the last committed state;
the store adds nothing that could be half-written (a batch is one transaction).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import resource
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import numpy as np

from .base import (
    HEADER_BYTES,
    Accounting,
    BlockStore,
    Buffer,
    ChecksumError,
    StoreCounters,
    StoreFullError,
    VerifyReport,
    check_frame,
    check_parts,
    decode_frame,
    prepare_dir,
    scatter,
)
from .registry import register

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_FORMAT = b"unikv.storage.lmdb/1"
_LOC = struct.Struct("<QQ")  # file offset, length of a frame inside data.mdb
_MIN_MAP = 64 * 1024
_KEY_CHUNK = 1024  # keys read per read transaction when iterating (see `keys`)
_VERIFY_CHUNK = 32  # frames prefetched together by `verify` (~24 MB of 737 KB blocks)
# Prefetch needs posix_fadvise and /proc/self/maps (Linux); elsewhere it is simply off.
_CAN_PREFETCH = hasattr(os, "posix_fadvise") and os.path.exists("/proc/self/maps")


@dataclass(slots=True)
class _Counters(StoreCounters):
    map_growths: int = 0  # times the memory map was grown


class _Gate:
    """Shared/exclusive lock: transactions hold it shared, remapping the environment exclusive.

    LMDB may only change the map size (or close) while this process has no transaction open.
    A waiting exclusive holder stops new shared entries, so growth cannot starve. Not
    re-entrant: code never takes it twice on one thread.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the gate shared (any number of threads at once)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if not self._shared:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the gate alone, after every shared holder has left."""
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._exclusive and not self._shared)
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class _MapLocator:
    """File offset of a buffer that points into this process's mapping of data.mdb."""

    def __init__(self, data_file: Path) -> None:
        self._file = os.path.realpath(data_file)
        self._ranges: list[tuple[int, int, int]] = []  # (start, end, file offset of start)

    def invalidate(self) -> None:
        """Forget the mappings (after LMDB remapped the file)."""
        self._ranges = []

    def offset(self, buf: memoryview) -> int | None:
        """Offset in data.mdb of `buf`'s first byte; None if it is not in a mapping of it."""
        # The address of a read-only buffer without touching (faulting) its pages.
        addr = np.frombuffer(buf, np.uint8).ctypes.data
        for attempt in range(2):
            for start, end, file_offset in self._ranges:
                if start <= addr < end:
                    return addr - start + file_offset
            if attempt == 0:
                self._ranges = self._read_maps()
        return None

    def _read_maps(self) -> list[tuple[int, int, int]]:
        ranges = []
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n") == self._file:
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    ranges.append((start, end, int(parts[2], 16)))
        return ranges


@register
class LmdbBlockStore(BlockStore):
    """Blocks in an LMDB environment: one directory, shared safely by threads and processes.

    - `map_size`: initial map (virtual address space, not disk); doubled on demand up to
      `max_map_size`, after which a write raises `StoreFullError`.
    - `sync=True, metasync=False` (default): each commit fdatasyncs the data pages but not the
      meta page, which LMDB documents as keeping integrity (A, C, I) while a *power loss* may
      undo the last commit: right for a cache whose blocks can be recomputed. A killed process
      loses nothing committed with any setting. Measured here, 737 KB puts, one per commit:
      metasync=True 0.65 ms/block, metasync=False 0.53, sync=False 0.15 (sync=False can
      corrupt the file on power loss: only for scratch stores).
    - `readahead=False` (default): LMDB madvises the map MADV_RANDOM. Readahead on turns each
      cold read into the kernel's mmap read-around (read_ahead_kb, 8 MiB on this VM): the
      device read 3.7-5.5x the bytes asked for, and payload bandwidth was 0.28-0.39x of raw
      O_DIRECT. Off, py-lmdb's `get` touches a value page by page and every 4 KiB page is its
      own disk read: 67 MB/s on one thread (0.05x raw).
    - `prefetch=True` (default): location hints fix that. After a commit the store learns
      where each multi-page frame landed in data.mdb and keeps it in `locs`; a read first asks
      the kernel for that whole range (POSIX_FADV_WILLNEED), so one large read is in flight
      before LMDB touches the first page. Cold 737 KB blocks (benchmarks/store_bandwidth.py):
      0.80-1.17x raw with 4-16 threads, 0.70x with one thread calling `get`, 1.0x with one
      thread calling `get_many` of 8. Hints are advisory: a stale or missing one costs speed,
      never correctness (LMDB still finds the value, and the CRC still checks it).
    """

    name = "lmdb"

    def __init__(
        self,
        path: str | os.PathLike[str],
        map_size: int = 1 << 30,
        max_map_size: int = 1 << 40,
        sync: bool = True,
        metasync: bool = False,
        readahead: bool = False,
        prefetch: bool = True,
        max_readers: int = 126,
    ) -> None:
        self.path = Path(path)
        if map_size < _MIN_MAP:
            raise ValueError(f"map_size must be >= {_MIN_MAP} bytes, got {map_size}")
        if max_map_size < map_size:
            raise ValueError(f"max_map_size ({max_map_size}) must be >= map_size ({map_size})")
        if max_readers < 1:
            raise ValueError(f"max_readers must be >= 1, got {max_readers}")
        prepare_dir(self.path)
        self.readahead, self.sync, self.metasync = readahead, sync, metasync
        self.prefetch = prefetch and _CAN_PREFETCH
        self._gate = _Gate()
        self._write_lock = threading.Lock()
        self._acct = Accounting(str(self.path), _Counters())
        self._closed = True  # until the environment is fully open (see __del__)
        # Hints learned after the last commit, written with the next transaction (or on close):
        # key -> packed (offset, length). Only the writer mutates it (under _write_lock);
        # readers do single dict lookups, which are atomic in CPython.
        self._pending: dict[bytes, bytes] = {}
        try:
            self._env = lmdb.open(
                str(self.path),
                map_size=map_size,
                subdir=True,
                max_dbs=3,
                sync=sync,
                metasync=metasync,
                readahead=readahead,
                # writemap would make the file sparse at full map size: a full disk then kills
                # the process with SIGBUS instead of failing the commit.
                writemap=False,
                max_readers=max_readers,
            )
        except lmdb.Error as e:
            raise ValueError(f"cannot open block store {self.path}: {e}") from e
        try:
            self._max_map_size = max(max_map_size, self._env.info()["map_size"])
            # A process killed inside a read transaction leaves its reader slot behind, which
            # would pin old pages forever; clear those first.
            self._env.reader_check()
            self._blocks, self._locs = self._open_dbs()
            self._page = self._env.stat()["psize"]
            self._max_key = self._env.max_key_size()
            self._data_file = self.path / "data.mdb"
            self._fd = os.open(self._data_file, os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            self._env.close()
            raise
        self._locator = _MapLocator(self._data_file)
        self._closed = False

    def _open_dbs(self) -> tuple[Any, Any]:
        with self._env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
        if names and b"meta" not in names:
            shown = ", ".join(repr(n) for n in names[:5])
            raise ValueError(
                f"{self.path} holds an LMDB environment that is not a unikv block store "
                f"(its keys start {shown}); use an empty directory"
            )
        with self._env.begin(write=True) as txn:
            meta = self._env.open_db(b"meta", txn=txn)
            blocks = self._env.open_db(b"blocks", txn=txn)
            locs = self._env.open_db(b"locs", txn=txn)
            found = txn.get(b"format", db=meta)
            if found is None:
                txn.put(b"format", _FORMAT, db=meta)
            elif found != _FORMAT:
                raise ValueError(
                    f"block store {self.path} has format {found!r}; this version reads {_FORMAT!r}"
                )
        return blocks, locs

    # -- reading ---------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The value under `key`; None when absent or corrupt."""
        return self.get_many([key])[0]

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        """The value of each key in order; None where absent or corrupt."""
        keys = [self._check(k) for k in keys]
        out: list[bytes | None] = []
        corrupt: list[ChecksumError] = []
        nbytes = 0
        with self._reading() as txn:
            # All hints first: one thread then has every block of the batch in flight at once.
            self._advise(txn, keys)
            for key in keys:
                frame = txn.get(key)
                if frame is None:
                    out.append(None)
                    continue
                try:
                    out.append(decode_frame(key, frame))
                    nbytes += len(frame)
                except ChecksumError as e:
                    corrupt.append(e)
                    out.append(None)
        self._count_reads(len(keys), sum(v is not None for v in out), nbytes, corrupt)
        return out

    def read_into(self, keys: Iterable[bytes], buffers: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Each key's payload read straight into its `buffers` (in order); False where absent,
        corrupt or of another size.

        Every value of the batch is first asked of the kernel at once from its location hint
        (POSIX_FADV_WILLNEED); then, per value, `get` (which touches only the value's first
        page, already on its way) gives the value's exact place in the map, and one `preadv`
        there scatters header and payload into the buffers, where the CRC is checked. Nothing
        is copied twice and a stale hint costs speed, never data: the offset read is the live
        one. The read transaction is held throughout, so LMDB cannot reuse those pages.
        """
        keys = [self._check(k) for k in keys]
        found: list[bool] = []
        corrupt: list[ChecksumError] = []
        nbytes = 0
        head = bytearray(HEADER_BYTES)
        with self._reading() as txn:
            self._advise(txn, keys)
            for key, bufs in zip(keys, buffers, strict=True):
                frame = txn.get(key)
                off = None if frame is None else self._locator.offset(frame)
                views = [memoryview(b).cast("B") for b in bufs]
                size = sum(len(b) for b in views)
                ok = frame is not None and len(frame) == HEADER_BYTES + size
                if ok:
                    try:
                        if off is not None and _preadv(self._fd, [head, *views], off) == len(frame):
                            check_parts(key, head, views)
                        else:  # not in a mapping we know: copy through the map
                            check_frame(key, frame)
                            scatter(memoryview(frame)[HEADER_BYTES:], views)
                    except ChecksumError as e:
                        corrupt.append(e)
                        ok = False
                found.append(ok)
                nbytes += (HEADER_BYTES + size) if ok else 0
        self._count_reads(len(keys), sum(found), nbytes, corrupt)
        return found

    def contains(self, key: bytes) -> bool:
        """Whether `key` is stored (its value is not read or checked)."""
        key = self._check(key)
        with self._reading() as txn:
            # A cursor positions on the key and touches at most the value's first page (measured:
            # 4 KiB read per cold call); `get` would read the whole value from disk.
            return txn.cursor().set_key(key)

    def keys(self) -> Iterator[bytes]:
        """Every stored key in byte order; writing while iterating is safe."""
        for chunk in self._key_chunks(_KEY_CHUNK):
            yield from chunk

    def __len__(self) -> int:
        """Number of stored entries."""
        with self._reading() as txn:
            return txn.stat(self._blocks)["entries"]

    def stats(self) -> dict[str, Any]:
        """Counters since open, and sizes: entries, bytes (pages used), map and file size."""
        with self._reading() as txn:
            st = txn.stat(self._blocks)
            hints = txn.stat(self._locs)["entries"]
            map_size = self._env.info()["map_size"]
        counters = self._acct.snapshot()
        pages = st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return {
            "backend": self.name,
            "path": str(self.path),
            "entries": st["entries"],
            "bytes": pages * self._page,
            "file_bytes": os.fstat(self._fd).st_size,
            "map_size": map_size,
            "max_map_size": self._max_map_size,
            "page_size": self._page,
            "location_hints": hints,
            "readahead": self.readahead,
            "prefetch": self.prefetch,
            "sync": self.sync,
            "metasync": self.metasync,
            **counters,
        }

    def verify(self) -> VerifyReport:
        """Check every stored frame's checksum; list (and log) the corrupt keys."""

        def stored() -> Iterator[tuple[bytes, Buffer | None]]:
            for chunk in self._key_chunks(_VERIFY_CHUNK):
                with self._reading() as txn:
                    self._advise(txn, chunk)
                    # None: deleted since the keys were listed; frames are checked in the txn
                    yield from ((key, txn.get(key)) for key in chunk)

        return self._verify_frames(stored())

    def drop_page_cache(self) -> bool:
        """Evict this store's file from the OS page cache, so the next reads come from the disk.

        For benchmarks that measure cold reads in a running process: LMDB reads through a
        memory map, and the kernel never drops pages a process has mapped, so the map's pages
        are unmapped first (MADV_DONTNEED on a read-only file mapping only drops page-table
        entries; the next access faults them in again from the file). False where the OS
        offers no way (non-Linux).
        """
        if not _CAN_PREFETCH:
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with self._gate.exclusive():  # no transaction is reading the map meanwhile
            self._check_open()
            for start, end, _ in self._locator._read_maps():
                libc.madvise(start, end - start, 4)  # MADV_DONTNEED
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True

    # -- writing ---------------------------------------------------------------------------

    def put(self, key: bytes, value: Buffer) -> None:
        """Store `value` under `key`, replacing any previous value."""
        self.put_many([(key, value)])

    def put_many(self, items: Mapping[bytes, Buffer] | Iterable[tuple[bytes, Buffer]]) -> None:
        """Store every (key, value) pair in one transaction: all of them or, on error, none."""
        # Framed before the transaction starts: bad input never leaves a partial batch, and the
        # write lock is not held while CRCs are computed.
        frames = self._frame_batch(items)
        if not frames:
            return
        nbytes = sum(len(f) for f in frames.values())

        def body(txn: lmdb.Transaction) -> None:
            for key, frame in frames.items():
                txn.delete(key, db=self._locs)  # the old location is stale from now on
                txn.put(key, frame, db=self._blocks)

        with self._write_lock:
            self._write(body, nbytes, frames.keys())
            self._learn(k for k, f in frames.items() if len(f) >= 2 * self._page)
        self._acct.wrote(len(frames), nbytes)

    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove the keys in one transaction; how many were present."""
        unique = list(dict.fromkeys(self._check(k) for k in keys))
        if not unique:
            return 0

        def body(txn: lmdb.Transaction) -> int:
            for key in unique:
                txn.delete(key, db=self._locs)
            return sum(txn.delete(key, db=self._blocks) for key in unique)

        with self._write_lock:
            removed = self._write(body, 0, unique)
        self._acct.add("deletes", removed)
        return removed

    def clear(self) -> None:
        """Remove every entry (one transaction)."""

        def body(txn: lmdb.Transaction) -> None:
            txn.drop(self._blocks, delete=False)
            txn.drop(self._locs, delete=False)

        with self._write_lock:
            self._pending.clear()
            self._write(body, 0, ())

    def close(self) -> None:
        """Write the pending hints, then close the environment; closing twice is harmless."""
        with self._write_lock:
            if self._closed:
                return
            if self._pending:
                try:
                    self._write(lambda txn: None, 0, ())
                except (OSError, lmdb.Error) as e:
                    # Hints only speed reads up; losing them must not stop a close.
                    logger.warning("block store %s: location hints not saved: %s", self.path, e)
            with self._gate.exclusive():
                self._closed = True
                self._env.close()
                os.close(self._fd)

    def __del__(self) -> None:
        # A store dropped without close() would keep its reader slots and file open.
        if not getattr(self, "_closed", True):
            self.close()

    # -- internals ---------------------------------------------------------------------------

    @contextmanager
    def _reading(self) -> Iterator[lmdb.Transaction]:
        """A read transaction on `blocks` (buffers: values are views into the map)."""
        for _ in range(3):
            with self._gate.shared():
                self._check_open()
                try:
                    txn = self._env.begin(db=self._blocks, buffers=True)
                except lmdb.MapResizedError:
                    pass  # another process grew the map: adopt its size below, then retry
                else:
                    with txn:
                        yield txn
                    return
            self._adopt_map_size()
        raise RuntimeError(f"block store {self.path}: map keeps being resized by another process")

    def _write(
        self, body: Callable[[lmdb.Transaction], _T], nbytes: int, touched: Iterable[bytes]
    ) -> _T:
        """Run `body` in one write transaction (with the pending hints), growing the map as
        needed; the caller holds `_write_lock`. On any error the transaction is aborted."""
        touched = set(touched)
        while True:
            hints = {k: v for k, v in self._pending.items() if k not in touched}
            grow = False
            with self._gate.shared():
                self._check_open()
                try:
                    with self._env.begin(write=True) as txn:
                        for key, loc in hints.items():
                            txn.put(key, loc, db=self._locs)
                        result = body(txn)
                except lmdb.MapFullError:
                    grow = True
                except lmdb.MapResizedError:
                    pass
                except lmdb.Error as e:
                    raise self._write_error(e, nbytes) from e
                else:
                    self._pending.clear()
                    return result
            if grow:
                self._grow(nbytes)
            else:
                self._adopt_map_size()

    def _grow(self, nbytes: int) -> None:
        """Double the map (up to max_map_size); StoreFullError when it cannot grow."""
        with self._gate.exclusive():
            current = self._env.info()["map_size"]
            if current >= self._max_map_size:
                raise StoreFullError(
                    str(self.path),
                    f"block store {self.path} is full: its map is at max_map_size "
                    f"({self._max_map_size} bytes); a write of {nbytes} bytes was aborted and "
                    "everything stored before is intact",
                )
            new = min(2 * current, self._max_map_size)
            self._env.set_mapsize(new)
            self._locator.invalidate()
        logger.info("block store %s: map grown %d -> %d bytes", self.path, current, new)
        self._acct.add("map_growths")

    def _adopt_map_size(self) -> None:
        with self._gate.exclusive():
            self._check_open()
            self._env.set_mapsize(0)  # 0: take the size another process set
            self._locator.invalidate()

    def _write_error(self, e: lmdb.Error, nbytes: int) -> OSError:
        """The OSError for a failed commit: StoreFullError when the disk cannot take it."""
        code = getattr(e, "code", 0) or errno.EIO
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize
        size = os.fstat(self._fd).st_size
        limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        over_limit = limit != resource.RLIM_INFINITY and size + nbytes > limit
        # LMDB reports a short write (what a full disk or a file-size limit gives) as EIO, so a
        # bare EIO counts as "full" when the disk or the limit has no room for the write.
        if (
            code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
            or free < nbytes + (1 << 20)
            or (over_limit)
        ):
            why = f"file size limit {limit} bytes" if over_limit else f"{free} bytes free on disk"
            return StoreFullError(
                str(self.path),
                f"block store {self.path}: the disk cannot take a write of {nbytes} bytes "
                f"(data.mdb is {size} bytes, {why}); the write was aborted and everything "
                "stored before is intact",
            )
        return OSError(
            code,
            f"block store {self.path}: write failed ({e}); aborted, earlier data intact",
            str(self.path),
        )

    def _learn(self, keys: Iterable[bytes]) -> None:
        """Remember where just-committed frames lie in data.mdb (for `_advise`)."""
        keys = list(keys)
        if not self.prefetch or not keys:
            return
        try:
            with self._reading() as txn:
                for key in keys:
                    # The pages were just written, so touching them here costs no disk read.
                    frame = txn.get(key)
                    offset = None if frame is None else self._locator.offset(frame)
                    if offset is not None:
                        self._pending[key] = _LOC.pack(offset, len(frame))
        except (OSError, lmdb.Error) as e:
            # The data is committed; without a hint it reads back correctly, only slower.
            logger.warning("block store %s: no location hints for this write: %s", self.path, e)

    def _advise(self, txn: lmdb.Transaction, keys: Iterable[bytes]) -> None:
        """Ask the kernel to start reading each key's frame (whole range, one request)."""
        if not self.prefetch:
            return
        for key in keys:
            loc = self._pending.get(key) or txn.get(key, db=self._locs)
            if loc is not None:
                offset, length = _LOC.unpack(loc)
                os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_WILLNEED)

    def _key_chunks(self, n: int) -> Iterator[list[bytes]]:
        """Keys in order, `n` per read transaction: no transaction stays open across a yield
        (one would block map growth, so a caller writing while iterating would deadlock)."""
        after: bytes | None = None
        while True:
            chunk: list[bytes] = []
            with self._reading() as txn:
                cur = txn.cursor()
                more = cur.first() if after is None else cur.set_range(after)
                if more and after is not None and bytes(cur.key()) == after:
                    more = cur.next()
                while more and len(chunk) < n:
                    chunk.append(bytes(cur.key()))
                    more = cur.next()
            if chunk:
                yield chunk
            if not more:
                return
            after = chunk[-1]


def _preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
    """`os.preadv` until the buffers are full or the file ends; the bytes read."""
    total = sum(len(b) for b in buffers)
    done = 0
    while done < total:
        n = os.preadv(fd, buffers, offset + done)
        if n <= 0:
            break
        done += n
        while buffers and n >= len(buffers[0]):  # drop what is filled; resume inside the next
            n -= len(buffers[0])
            buffers = buffers[1:]
        if buffers and n:
            buffers = [buffers[0][n:], *buffers[1:]]
    return done
