"""The tiers blocks live in: the `Tier` seam, tensor arenas and store-backed tiers.

What lives here: `TierKind` (the tier kinds a pool knows: device, host, ssd, remote),
`Tier` (what every tier implements: read and write blocks per arena), `TensorTier` (device and
host tiers: preallocated torch tensors), `StoreTier` (a tier whose blocks are values of a
`storage` block store: the SSD tier) and `BlockLostError`.

What does not: which blocks a sequence holds (`memory.allocator`, `memory.pool`), the layout
description (`memory.layout`), the stores themselves (`storage/`), and moving blocks between
tiers (`UnifiedMemoryPool.move`).

Side values: a block stored by content may have one side value beside it (`write_content`'s
`sides`, `read_side`), bytes a format keeps next to the block that a sequence attaching it
needs too (hybrid's fp16 attention sinks beside block 0). It is written in the block's
transaction and checksummed like a block; a missing or corrupt one is a miss.

Slices: a block may be read in slices, one per entry of each arena's first axis (a KV layout's
layers), so a strategy can read one layer of many blocks while the previous layer computes.
A `StoreTier` with `slices` > 1 stores each (block, slice) as its own value.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum

import numpy as np
import torch

from unikv.memory.layout import BLOCKS, BlockLayout
from unikv.storage import StoreFullError

log = logging.getLogger(__name__)


class TierKind(StrEnum):
    """The tier kinds a pool knows; members compare and hash equal to the config's names."""

    DEVICE = "device"
    HOST = "host"
    SSD = "ssd"
    REMOTE = "remote"

    def __repr__(self) -> str:
        # Tier names appear in error messages and reports as the config spells them.
        return repr(self.value)


class BlockLostError(RuntimeError):
    """A block could not be read back (missing, or its checksum failed): never served as data.

    `corrupt`: how many stored values failed their checksum (and were deleted)."""

    def __init__(self, message: str, corrupt: int = 0) -> None:
        super().__init__(message)
        self.corrupt = corrupt


class Tier(ABC):
    """Storage for the blocks of one tier. Block ids are the allocator's; data is per arena."""

    name: str
    num_blocks: int
    layout: BlockLayout

    @abstractmethod
    def read(self, block_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """Copies of the blocks' data per arena (block axis holds `block_ids` in order)."""

    @abstractmethod
    def write(self, block_ids: Sequence[int], data: Mapping[str, torch.Tensor]) -> None:
        """Store data (as returned by `read`) into the blocks `block_ids`."""

    @abstractmethod
    def read_slice(self, block_ids: Sequence[int], index: int) -> dict[str, torch.Tensor]:
        """Slice `index` of the blocks, per arena, with the block axis at `block_dims`."""

    @property
    @abstractmethod
    def block_dims(self) -> dict[str, int]:
        """Per arena, the block axis of what `read_slice` returns."""


class TensorTier(Tier):
    """A tier held in preallocated torch tensors on one device (device and host tiers)."""

    def __init__(
        self, name: str, layout: BlockLayout, num_blocks: int, device: torch.device | str
    ) -> None:
        self.name, self.layout, self.num_blocks = name, layout, num_blocks
        self.device = torch.device(device)
        # torch.empty maps the memory lazily: pages are only touched once blocks are written.
        try:
            self.arenas = {
                a.name: torch.empty(a.full_shape(num_blocks), dtype=a.dtype, device=self.device)
                for a in layout.arenas
            }
        except (RuntimeError, MemoryError) as e:  # torch's failed allocation is a RuntimeError
            size = num_blocks * layout.page_bytes
            raise ValueError(
                f"the {name} tier cannot allocate {size / 2**30:.1f} GiB on {self.device} "
                f"({type(e).__name__}); lower [tiers.{name}] capacity"
            ) from None
        self._dims = {a.name: a.block_dim for a in layout.arenas}
        # Byte views for I/O threads, made here: there numpy must do the work, because a torch
        # op could start a second OpenMP team and slow the compute thread (engine/compute.py).
        self._raw = (
            {n: t.view(torch.uint8).numpy() for n, t in self.arenas.items()}
            if self.device.type == "cpu"
            else None
        )

    @property
    def block_dims(self) -> dict[str, int]:
        return {n: d - 1 for n, d in self._dims.items()}

    def read(self, block_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return {n: t.index_select(self._dims[n], idx) for n, t in self.arenas.items()}

    def write(self, block_ids: Sequence[int], data: Mapping[str, torch.Tensor]) -> None:
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        for n, t in self.arenas.items():
            t.index_copy_(self._dims[n], idx, data[n].to(self.device, non_blocking=True))

    def read_slice(self, block_ids: Sequence[int], index: int) -> dict[str, torch.Tensor]:
        """Copies of slice `index` of the blocks (numpy on a CPU tier: safe on I/O threads)."""
        ids = list(block_ids)
        if self._raw is None:
            idx = torch.tensor(ids, dtype=torch.long, device=self.device)
            return {
                n: t[index].index_select(self._dims[n] - 1, idx) for n, t in self.arenas.items()
            }
        return {
            n: torch.from_numpy(np.take(raw[index], ids, axis=self._dims[n] - 1)).view(
                self.arenas[n].dtype
            )
            for n, raw in self._raw.items()
        }

    def snapshot(self, block_ids: Sequence[int]) -> dict[str, np.ndarray]:
        """Byte copies of the blocks per arena, block axis first (numpy: for I/O threads)."""
        ids = list(block_ids)
        if self._raw is None:
            out = {}
            for n, t in self.arenas.items():
                idx = torch.tensor(ids, dtype=torch.long, device=self.device)
                picked = t.index_select(self._dims[n], idx)
                out[n] = picked.movedim(self._dims[n], 0).contiguous().view(torch.uint8)
                out[n] = out[n].cpu().numpy()
            return out
        return {
            n: np.ascontiguousarray(np.moveaxis(np.take(raw, ids, self._dims[n]), self._dims[n], 0))
            for n, raw in self._raw.items()
        }


class StoreTier(Tier):
    """A tier whose blocks live in a `storage` block store (the SSD tier: LMDB).

    Values: with `slices` = 1, one value per block (its bytes of every arena, in layout order).
    With `slices` = S > 1, every arena's first axis has S entries and each (block, slice) is
    its own value (`read_slice` reads one slice of many blocks).

    Keys: a block written by `write` is keyed by this pool session and its id (`transient`,
    deleted when the block is released). A block `assign`ed a content key (its prefix chain
    hash) is stored under that key instead: content is written once, shared by every block
    that holds it, survives the process, and is found again by `has_content` (the persistent
    prefix cache). The store checksums every value; a missing or corrupt block raises
    `BlockLostError` naming it, and a corrupt content entry is deleted so it is not hit again.

    `bounded` (the SSD tier): the tier stays usable forever. Stored content is indexed at open
    and kept within `num_blocks` (less the blocks held under transient keys) by last use: a
    new content block evicts the least recently used one that no block of this tier holds
    now, and a full disk evicts an eighth of it and retries once. Transient values of sessions
    whose process is gone (a SIGKILL skips `release`) are collected at open; each session
    records its process id under `b"s" + session` for that.
    """

    def __init__(
        self,
        name: str,
        layout: BlockLayout,
        num_blocks: int,
        store,
        slices: int = 1,
        bounded: bool = False,
    ):
        if slices < 1:
            raise ValueError(f"slices must be >= 1, got {slices}")
        for a in layout.arenas:
            if slices > 1 and (a.shape[0] != slices or a.block_dim == 0):
                raise ValueError(
                    f"arena {a.name!r} (shape {a.shape}) cannot be split into {slices} slices "
                    "along its first axis"
                )
        self.name, self.layout, self.num_blocks, self._store = name, layout, num_blocks, store
        self.slices = slices
        self._session = os.urandom(8)
        self._content: dict[int, bytes] = {}  # block id -> content key (else transient)
        # Per arena: the shape of one slice of one block, and the block axis within a slice.
        cut = 1 if slices > 1 else 0
        self._slice_shape = {
            a.name: tuple(d for d in a.shape[cut:] if d != BLOCKS) for a in layout.arenas
        }
        self._slice_dim = {a.name: a.block_dim - cut for a in layout.arenas}
        self.slice_bytes = layout.page_bytes // slices
        # Called with the number of corrupt values found (the pool counts checksum failures).
        self.on_corrupt: Callable[[int], None] | None = None
        self.bounded = bounded
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # stored content, oldest first
        self._transient: set[int] = set()  # blocks written under this session's keys
        self._lru_lock = threading.Lock()  # write-through threads and the compute thread
        self.evicted = self.orphans_collected = 0
        if bounded:
            self._open_bounded()

    # -- a bounded tier ----------------------------------------------------------------------

    def _open_bounded(self) -> None:
        """Index the stored content (its order unknown: key order) and collect the transient
        values of sessions whose process is gone; record this session."""
        orphans, dead = [], {}
        for key in list(self._store.keys()):
            if len(key) == _CONTENT_KEY + 2 and key[-2:] == _slice_suffix(0):
                self._lru[key[:-2]] = None
            elif len(key) == _TRANSIENT_KEY:
                session = key[1:9]
                if session not in dead:
                    dead[session] = not _alive(self._store.get(_SESSION + session))
                if dead[session]:
                    orphans.append(key)
        gone = [_SESSION + s for s, d in dead.items() if d]
        if orphans or gone:
            self._store.delete_many(orphans + gone)
            self.orphans_collected = len(orphans)
            log.info("tier %r: collected %d value(s) of %d ended session(s)", self.name,
                     len(orphans), len(gone))  # fmt: skip
        self._store.put(_SESSION + self._session, os.getpid().to_bytes(8, "little"))

    def _room(self, new: Sequence[bytes]) -> None:
        """Evict least recently used content (none held here) so `new` fits in the bound."""
        with self._lru_lock:
            fresh = [k for k in dict.fromkeys(new) if k not in self._lru]
            over = len(self._lru) + len(fresh) - max(0, self.num_blocks - len(self._transient))
            if over <= 0:
                return
            victims = self._victims(over)
        self._evict(victims)

    def _victims(self, n: int) -> list[bytes]:
        """Take the `n` least recently used content keys that no block here holds out of the
        index (under `_lru_lock`)."""
        held = set(self._content.values())
        victims = []
        for key in self._lru:
            if len(victims) >= n:
                break
            if key not in held:
                victims.append(key)
        for key in victims:
            del self._lru[key]
        return victims

    def _evict(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._store.delete_many(
                [k + _slice_suffix(s) for k in keys for s in range(self.slices)]
                + [_side_key(k) for k in keys]
            )
            self.evicted += len(keys)

    def _used(self, keys: Sequence[bytes]) -> None:
        """Content just written, found or read: the most recently used now."""
        if not self.bounded:
            return
        with self._lru_lock:
            for k in keys:
                self._lru[k] = None
                self._lru.move_to_end(k)

    def _put(self, items: list, content: Sequence[bytes]) -> None:
        """Write `items` (one transaction), first making room for the `content` keys; a full
        store evicts an eighth of the stored content and is tried once more."""
        if self.bounded:
            self._room(content)
        try:
            self._store.put_many(items)
        except StoreFullError:  # the disk or the map cannot take it
            if not self.bounded:
                raise
            with self._lru_lock:
                victims = self._victims(max(1, len(self._lru) // 8))
            self._evict(victims)
            self._store.put_many(items)
        self._used(content)

    @property
    def block_dims(self) -> dict[str, int]:
        return dict(self._slice_dim)

    # -- keys ------------------------------------------------------------------------------

    def assign(self, block_id: int, content_key: bytes) -> None:
        """Key block `block_id` by content from now on (before `write`, or to attach stored
        content without writing: see `has_content`)."""
        self._content[block_id] = content_key

    def release(self, block_ids: Sequence[int]) -> None:
        """The blocks were freed: delete their transient values; content stays stored."""
        transient = [b for b in block_ids if self._content.pop(b, None) is None]
        self._transient.difference_update(transient)
        keys = [self._key(b, s) for b in transient for s in range(self.slices)]
        if keys:
            self._store.delete_many(keys)

    def has_content(self, content_key: bytes) -> bool:
        """Whether the store holds a block under `content_key` (written whole, all slices)."""
        found = self._store.contains(content_key + _slice_suffix(0))
        if found:
            self._used([content_key])
        return found

    def _key(self, block_id: int, index: int) -> bytes:
        content = self._content.get(block_id)
        if content is None:
            content = b"t" + self._session + block_id.to_bytes(8, "little")
        return content + _slice_suffix(index)

    # -- data ------------------------------------------------------------------------------

    def read(self, block_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        if self.slices == 1:
            return self._decode(block_ids, 0, None)
        per_slice = [self.read_slice(block_ids, s) for s in range(self.slices)]
        return {n: torch.stack([d[n] for d in per_slice]) for n in per_slice[0]}

    def read_slice(self, block_ids: Sequence[int], index: int) -> dict[str, torch.Tensor]:
        """Slice `index` of the blocks, per arena with the block axis holding `block_ids`."""
        return self._decode(block_ids, index, index)

    def _decode(self, block_ids: Sequence[int], index: int, one: int | None):
        keys = [self._key(b, index) for b in block_ids]
        # Per arena: the output tensor with the block axis, and for each value the contiguous
        # byte runs of its block's slice, in the value's order: the store reads straight into
        # them. numpy, not torch, for the slicing: this runs on I/O threads, where a torch op
        # could start a second OpenMP team and slow the compute thread (engine/compute.py).
        out, targets = {}, [[] for _ in keys]
        for a in self.layout.arenas:
            shape = list(self._slice_shape[a.name] if one is not None else a.shape)
            if one is None:
                shape.remove(BLOCKS)
            dim = self._slice_dim[a.name] if one is not None else a.block_dim
            shape.insert(dim, len(keys))
            t = out[a.name] = torch.empty(shape, dtype=a.dtype)
            raw = t.view(torch.uint8).numpy()
            for i, runs in enumerate(targets):
                runs += _byte_runs(raw[(slice(None),) * dim + (i,)])
        found = self._store.read_into(keys, targets)
        bad = [i for i, ok in enumerate(found) if not ok]
        if bad:
            lost = [block_ids[i] for i in bad]
            corrupt = self._drop_corrupt(block_ids)
            raise BlockLostError(
                f"tier {self.name!r}: block(s) {lost} missing or corrupt in the store "
                f"({corrupt} corrupt stored values deleted)",
                corrupt,
            )
        return out

    def _drop_corrupt(self, block_ids: Sequence[int]) -> int:
        """After a failed read of `block_ids`: check every slice of every content-keyed block
        the tier holds now (not only the slice, or the blocks, that failed: the rest of the
        stored chains attached, whose other layers and blocks were not read yet) and delete
        each block with a bad slice; return the corrupt values found.

        One recompute then suffices: a stored chain is found again only up to its first
        deleted block (the rest of it is a miss), and every block before that was checked.
        Without this, each read (a layer, a promotion) would find the next corrupt block, one
        recompute each. The cost is bounded by what the tier holds for running sequences,
        which an offloading step reads anyway, and is paid only when corruption is found.
        """
        held = [self._content[b] for b in block_ids if b in self._content]
        content = list(dict.fromkeys([*held, *self._content.values()]))
        keys = [c + _slice_suffix(s) for c in content for s in range(self.slices)]
        if not keys:
            return 0
        values = self._store.get_many(keys)  # None: missing, or failed its checksum
        # Present but unusable: failed its checksum, or has another layout's length.
        bad = [
            k
            for k, v in zip(keys, values, strict=True)
            if (v is None and self._store.contains(k))
            or (v is not None and len(v) != self.slice_bytes)
        ]
        corrupt = len(bad)
        bad_blocks = {k[:-2] for k in bad}
        bad_blocks |= {k[:-2] for k, v in zip(keys, values, strict=True) if v is None}
        stale = [c + _slice_suffix(s) for c in bad_blocks for s in range(self.slices)]
        if stale:
            # Such an entry would be hit again by every later lookup: remove it, so the next
            # request recomputes (and writes the block through again).
            self._store.delete_many(stale)
        if corrupt and self.on_corrupt is not None:
            self.on_corrupt(corrupt)
        return corrupt

    def write(self, block_ids: Sequence[int], data: Mapping[str, torch.Tensor]) -> None:
        items, content_keys = [], []
        for i, b in enumerate(block_ids):
            content = self._content.get(b)
            if content is not None and self.has_content(content):
                continue  # the same content is stored already (written through, or shared)
            if content is None:
                self._transient.add(b)
            else:
                content_keys.append(content)
            for s in range(self.slices):
                pieces = []
                for a in self.layout.arenas:
                    x = data[a.name].select(a.block_dim, i)
                    if self.slices > 1:
                        x = x[s]
                    pieces.append(x.contiguous().cpu().view(torch.uint8).numpy().tobytes())
                items.append((self._key(b, s), b"".join(pieces)))
        if items:
            self._put(items, content_keys)  # one transaction: all blocks land, or none

    def write_content(
        self,
        content_keys: Sequence[bytes],
        snapshot: Mapping[str, np.ndarray],
        sides: Sequence[tuple[bytes, bytes]] = (),
    ):
        """Store blocks by content key, from a `TensorTier.snapshot` of them (same order), and
        `sides` [(content key, bytes)]: side values, in the same transaction.

        The values are byte for byte those `write` stores for the same blocks.
        """
        items = [(_side_key(key), data) for key, data in sides]
        for i, key in enumerate(content_keys):
            for s in range(self.slices):
                views = [
                    memoryview(
                        snapshot[a.name][i, s] if self.slices > 1 else snapshot[a.name][i]
                    ).cast("B")
                    for a in self.layout.arenas
                ]
                items.append(
                    (key + _slice_suffix(s), views[0] if len(views) == 1 else b"".join(views))
                )
        if items:
            self._put(items, list(content_keys))  # one transaction: all blocks land, or none

    # -- side values -----------------------------------------------------------------------

    def read_side(self, content_key: bytes) -> bytes | None:
        """The side value stored beside the block of `content_key` (what a format keeps next
        to a block and a sequence attaching it needs: hybrid's fp16 sinks beside block 0), or
        None when missing or corrupt (a miss: the request recomputes)."""
        return self._store.get(_side_key(content_key))

    # -- the store -------------------------------------------------------------------------

    @property
    def store(self):
        """The block store behind this tier (for maintenance: stats, page cache, paths)."""
        return self._store

    def close(self) -> None:
        """Close the block store (a bounded tier's session record is deleted first: its
        transient values went with `release`)."""
        if self.bounded:
            # a read-only or failing store: the next open collects the record
            with contextlib.suppress(OSError, ValueError):
                self._store.delete_many([_SESSION + self._session])
        self._store.close()


def _byte_runs(a: np.ndarray) -> list[memoryview]:
    """The bytes of array `a` as the fewest contiguous runs, in C order."""
    if a.flags.c_contiguous:
        return [memoryview(a).cast("B")]
    return [c for sub in a for c in _byte_runs(sub)]


_CONTENT_KEY = 32  # a block's content hash (memory.prefix: blake2b-256)
_TRANSIENT_KEY = 1 + 8 + 8 + 2  # b"t", session, block id, slice
_SESSION = b"s"  # + session: the process id that owns the session's transient values


def _alive(record: bytes | None) -> bool:
    """Whether the process a session record names still runs (no record: an ended one)."""
    if not record or len(record) != 8:
        return False
    pid = int.from_bytes(record, "little")
    if not 0 < pid < 1 << 22:  # stored bytes: no Linux pid (pid_max <= 2**22) is out there
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _side_key(content_key: bytes) -> bytes:
    # A suffix no slice index reaches: a side value never meets a block's values.
    return content_key + b"\xff\xffside"


def _slice_suffix(index: int) -> bytes:
    # Part of the store key format: blocks persisted by earlier versions must still be found.
    return index.to_bytes(2, "little")
