"""`FileBlockStore`: blocks as files under a directory on a shared filesystem (NFS and similar).

What lives here: the store (one file per value, written atomically), its size bound with
clean-up by access time, and its asyncio forms through `aiofiles`. What does not: the value
frame and its checksum (`storage.base`: the same frame as the LMDB store), choosing a store
from a URL (`storage.registry.open_url`), and any notion of what a block holds.

Layout: ``<path>/<namespace>/<2 hex chars>/<hex of the key>``; the namespace names the model +
layout identity, so processes with other weights never meet each other's files. A value is
written to a temporary file in the same directory and renamed over its name: a reader (in any
process on any machine sharing the mount) sees the old file or the new one, never half of one;
two writers of one key both write whole files and the last rename wins. Each file is the
checksummed frame, so damage on the server, or a file written under another name, is a miss (the
file is deleted) and never data.

Size: after a write takes the store past `max_bytes`, the files read least recently (access
time, which this store sets on every read because `relatime` mounts would not) are deleted
until it is under 90% of the bound. The size is re-counted from the directory then, so several
processes sharing the directory keep one bound between them.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.os

from .base import (
    HEADER_BYTES,
    Accounting,
    BlockStore,
    Buffer,
    ChecksumError,
    StoreCounters,
    StoreFullError,
    VerifyReport,
    check_namespace,
    decode_frame,
    frame_bytes,
    prepare_dir,
    secret_bytes,
)
from .registry import register

logger = logging.getLogger(__name__)

MAX_KEY_BYTES = 100  # 200 hex characters: a file name stays well under NAME_MAX (255)
_TMP = ".tmp-"
_LOW = 0.9  # clean-up stops below this fraction of max_bytes
# A writer's temporary file older than this is a killed writer's: collected at open.
STALE_TMP_S = 3600.0
# Opened without following a symlink (a planted `ln -s /dev/zero` is refused, not read), and
# without blocking (a planted FIFO would hang the read).
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


@dataclass(slots=True)
class _Counters(StoreCounters):
    evictions: int = 0  # files deleted to stay under max_bytes


@register
class FileBlockStore(BlockStore):
    """One file per value under `path`/`namespace`; safe for threads and processes sharing it.

    - `max_bytes`: the size bound (files' bytes); past it the least recently read are deleted.
    - `fsync`: flush each file before its rename (a crash of the *machine* then keeps it; a
      killed process never leaves a partial file either way).
    - `secret`: sign every value and refuse unsigned or foreign ones (as the Redis store).
    """

    name = "fs"

    def __init__(
        self,
        path: str | os.PathLike[str],
        namespace: str = "default",
        max_bytes: int = 64 << 30,
        fsync: bool = False,
        secret: str | bytes | None = None,
    ) -> None:
        self._secret = secret_bytes(secret)
        self.namespace = check_namespace(namespace)
        if "/" in namespace or namespace in (".", ".."):
            raise ValueError(f"a store namespace must not name a path, got {namespace!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be an integer >= 1, got {max_bytes!r}")
        self.root = Path(path)
        self.path = self.root / namespace
        self.max_bytes, self.fsync = max_bytes, fsync
        prepare_dir(self.path)
        self.stale_removed = self._collect_stale()
        self._lock = threading.Lock()
        self._acct = Accounting(str(self.path), _Counters())
        self._size = self._count_files()[1]
        self._closed = False
        self._max_key = MAX_KEY_BYTES

    # -- keys and files --------------------------------------------------------------------

    def _file(self, key: bytes) -> Path:
        name = key.hex()
        return self.path / name[:2] / name

    def _files(self) -> Iterator[os.DirEntry]:
        """Every value file (not temporary ones) under the namespace."""
        try:
            subdirs = [e for e in os.scandir(self.path) if e.is_dir()]
        except FileNotFoundError:
            return
        for sub in subdirs:
            try:
                entries = list(os.scandir(sub.path))
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            for e in entries:
                if not e.name.startswith(_TMP):
                    yield e

    # -- reading ---------------------------------------------------------------------------

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        """The value of each key in order; None where absent or corrupt (a corrupt file is
        deleted, so the next reader recomputes instead of meeting it again)."""
        keys = [self._check(k) for k in keys]
        self._check_open()
        out = []
        for key in keys:
            frame = self._read(self._file(key))
            out.append(None if frame is None else self._decode(key, frame))
        self._count_reads(len(keys), sum(v is not None for v in out),
                          sum(len(v) for v in out if v is not None))  # fmt: skip
        return out

    def _read(self, file: Path) -> bytes | None:
        """The file's frame, read only as far as its header declares (None: absent). Anything
        that is not a regular file of exactly header + declared bytes reads as b"" (corrupt:
        the caller deletes it): a symlink, a device, a FIFO, a file with trailing bytes."""
        try:
            fd = os.open(file, _OPEN_FLAGS)
        except FileNotFoundError:
            return None
        except OSError:  # ELOOP: a symlink (O_NOFOLLOW); or unreadable
            return b""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER_BYTES:
                return b""
            with os.fdopen(fd, "rb", closefd=False) as f:
                head = f.read(HEADER_BYTES)
                declared = frame_bytes(head)  # header, payload and tag, as the header says
                if declared != st.st_size or declared > self.max_bytes + HEADER_BYTES + 64:
                    return b""
                frame = head + f.read(declared - HEADER_BYTES)
        finally:
            os.close(fd)
        _touch(file)
        return frame

    def _collect_stale(self) -> int:
        """Delete temporary files that killed writers left (older than STALE_TMP_S)."""
        removed, now = 0, time.time()
        try:
            subdirs = [e for e in os.scandir(self.path) if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return 0
        for sub in subdirs:
            try:
                entries = list(os.scandir(sub.path))
            except FileNotFoundError:
                continue
            for e in entries:
                try:
                    if e.name.startswith(_TMP) and now - e.stat().st_mtime > STALE_TMP_S:
                        os.unlink(e.path)
                        removed += 1
                except FileNotFoundError:
                    continue
        if removed:
            logger.info("file store %s: removed %d stale temporary file(s)", self.path, removed)
        return removed

    def _decode(self, key: bytes, frame: bytes) -> bytes | None:
        try:
            return decode_frame(key, frame, self._secret)
        except ChecksumError as e:
            self._report_corrupt(e)
            self._unlink(self._file(key), len(frame))
            return None

    def contains(self, key: bytes) -> bool:
        """Whether `key` is stored (its value is not read or checked)."""
        key = self._check(key)
        self._check_open()
        return self._file(key).exists()

    def keys(self) -> Iterator[bytes]:
        """Every stored key (listed first: writing while iterating is safe)."""
        self._check_open()
        found = []
        for e in self._files():
            try:
                found.append(bytes.fromhex(e.name))
            except ValueError:  # not a value file of ours
                continue
        return iter(found)

    def stats(self) -> dict[str, Any]:
        """Counters since open, and sizes: entries, bytes of the files, the bound."""
        self._check_open()
        entries, nbytes = self._count_files()
        counters = self._acct.snapshot()
        return {
            "backend": self.name,
            "path": str(self.path),
            "namespace": self.namespace,
            "entries": entries,
            "bytes": nbytes,
            "map_size": self.max_bytes,  # the bound, in the key the other stores use
            "max_bytes": self.max_bytes,
            **counters,
        }

    def verify(self) -> VerifyReport:
        """Check every file's checksum; list (and log) the corrupt keys (they are kept)."""
        self._check_open()

        def stored() -> Iterator[tuple[bytes, bytes | None]]:
            for e in self._files():
                try:
                    key = bytes.fromhex(e.name)
                except ValueError:
                    continue
                yield key, self._read(Path(e.path))

        return self._verify_frames(stored())

    # -- writing ---------------------------------------------------------------------------

    def put_many(self, items: Mapping[bytes, Buffer] | Iterable[tuple[bytes, Buffer]]) -> None:
        """Store every pair, each file written whole and renamed into place; if one fails, the
        batch's files written so far are removed again (old values stay readable elsewhere)."""
        frames = self._frame_batch(items)
        self._check_open()
        done: list[Path] = []
        added = 0
        try:
            for key, frame in frames.items():
                file = self._file(key)
                added += len(frame) - _size_of(file)
                self._write(file, frame)
                done.append(file)
        except OSError as e:
            for file in done:
                file.unlink(missing_ok=True)
            raise self._write_error(e, sum(len(f) for f in frames.values())) from e
        self._wrote(len(frames), sum(len(f) for f in frames.values()), added)

    def _write(self, file: Path, frame: bytes) -> None:
        file.parent.mkdir(exist_ok=True)
        tmp = file.with_name(f"{_TMP}{file.name}-{os.getpid()}-{threading.get_ident()}")
        try:
            with open(tmp, "wb") as f:
                f.write(frame)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, file)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _wrote(self, n: int, nbytes: int, added: int) -> None:
        self._acct.wrote(n, nbytes)
        with self._lock:
            self._size += added
            over = self._size > self.max_bytes
        if over:
            self.clean_up()

    def clean_up(self) -> int:
        """Delete the least recently read files until the store is under 90% of `max_bytes`;
        how many were deleted."""
        files = []
        for e in self._files():
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_atime_ns, st.st_size, e.path))
        total = sum(size for _, size, _ in files)
        removed = 0
        for _, size, path in sorted(files):
            if total <= _LOW * self.max_bytes:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:  # another process cleaned it up first
                pass
            else:
                removed += 1
            total -= size
        with self._lock:
            self._size = total
        self._acct.add("evictions", removed)
        return removed

    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove the keys' files; how many were present."""
        unique = list(dict.fromkeys(self._check(k) for k in keys))
        self._check_open()
        removed = sum(self._unlink(self._file(k)) for k in unique)
        self._acct.add("deletes", removed)
        return removed

    def _unlink(self, file: Path, size: int | None = None) -> bool:
        size = _size_of(file) if size is None else size
        try:
            file.unlink()
        except FileNotFoundError:
            return False
        with self._lock:
            self._size -= size
        return True

    def clear(self) -> None:
        """Remove every entry of this namespace."""
        self._check_open()
        for e in list(self._files()):
            Path(e.path).unlink(missing_ok=True)
        with self._lock:
            self._size = 0

    def close(self) -> None:
        """Mark the store closed (files need no closing); closing twice is harmless."""
        self._closed = True

    # -- asyncio, through aiofiles -----------------------------------------------------------

    async def aget(self, key: bytes) -> bytes | None:
        """`get` from asyncio: the file is read through aiofiles."""
        return (await self.aget_many([key]))[0]

    async def aget_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        """`get_many` from asyncio (files read through aiofiles, off the event loop)."""
        keys = [self._check(k) for k in keys]
        self._check_open()
        out = []
        for key in keys:
            file = self._file(key)
            try:
                async with aiofiles.open(file, "rb") as f:
                    frame = await f.read()
            except FileNotFoundError:
                out.append(None)
                continue
            await aiofiles.os.wrap(_touch)(file)
            out.append(self._decode(key, frame))
        self._count_reads(len(keys), sum(v is not None for v in out),
                          sum(len(v) for v in out if v is not None))  # fmt: skip
        return out

    async def aput(self, key: bytes, value: Buffer) -> None:
        """`put` from asyncio."""
        await self.aput_many([(key, value)])

    async def aput_many(
        self, items: Mapping[bytes, Buffer] | Iterable[tuple[bytes, Buffer]]
    ) -> None:
        """`put_many` from asyncio: temporary files written through aiofiles, then renamed."""
        frames = self._frame_batch(items)
        self._check_open()
        done: list[Path] = []
        added = 0
        try:
            for key, frame in frames.items():
                file = self._file(key)
                added += len(frame) - _size_of(file)
                await aiofiles.os.makedirs(file.parent, exist_ok=True)
                tmp = file.with_name(f"{_TMP}{file.name}-{os.getpid()}-a{id(frame)}")
                try:
                    async with aiofiles.open(tmp, "wb") as f:
                        await f.write(frame)
                        if self.fsync:
                            await f.flush()
                            await aiofiles.os.wrap(os.fsync)(f.fileno())
                    await aiofiles.os.replace(tmp, file)
                except BaseException:
                    await aiofiles.os.wrap(tmp.unlink)(missing_ok=True)
                    raise
                done.append(file)
        except OSError as e:
            for file in done:
                await aiofiles.os.wrap(file.unlink)(missing_ok=True)
            raise self._write_error(e, sum(len(f) for f in frames.values())) from e
        # The size check may scan the directory: off the event loop too.
        await aiofiles.os.wrap(self._wrote)(
            len(frames), sum(len(f) for f in frames.values()), added
        )

    # -- internals ---------------------------------------------------------------------------

    def _count_files(self) -> tuple[int, int]:
        """(value files, their bytes) now."""
        entries = nbytes = 0
        for e in self._files():
            try:
                nbytes += e.stat().st_size
                entries += 1
            except FileNotFoundError:
                continue
        return entries, nbytes

    def _write_error(self, e: OSError, nbytes: int) -> OSError:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return StoreFullError(
                str(self.path),
                f"block store {self.path}: the filesystem cannot take a write of {nbytes} bytes "
                f"({e.strerror}); the batch was removed and everything stored before is intact",
            )
        return OSError(e.errno, f"block store {self.path}: write failed ({e.strerror})", e.filename)


def _touch(file: Path) -> None:
    """Set the access time to now (the LRU order), keeping the modification time."""
    try:
        st = os.stat(file)
        os.utime(file, ns=(time.time_ns(), st.st_mtime_ns))
    except OSError:  # removed meanwhile, or a read-only mount: the order is only a hint
        pass


def _size_of(file: Path) -> int:
    try:
        return file.stat().st_size
    except FileNotFoundError:
        return 0
