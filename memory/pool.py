"""The unified memory pool: per-tier arenas of fixed-size blocks, sequence tables, prefix
sharing, moves between tiers, budgets, statistics and health.

What lives here: `ArenaSpec`/`BlockLayout` (a strategy's description of what one block holds),
`Tier` (the seam every tier implements), `TensorTier` (device and host tiers: preallocated torch
tensors), `UnifiedMemoryPool` (everything a KV strategy asks of memory) and `AsyncPool` (the same
from asyncio). What does not: how K/V are encoded or attended (`kvstrategies/`), on-disk and
remote block stores (`storage/`, plugged in as `Tier`s), the bookkeeping without torch
(`memory.allocator`, `memory.prefix`, `memory.stats`).

Every byte of KV lives in a block of some tier; blocks move between tiers only through
`UnifiedMemoryPool.move`, which copies the data and updates the sequence's table together.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from memory.allocator import BlockTable, TierAllocator
from memory.config import PoolConfig
from memory.prefix import BlockRef, PrefixCache, block_hash
from memory.stats import HealthMonitor, HealthReport, PoolStats

BLOCKS = -1  # marks the block axis in an ArenaSpec shape
SeqId = Hashable


@dataclass(frozen=True, slots=True)
class ArenaSpec:
    """One tensor of a block layout: its name, dtype, and shape with the block axis as BLOCKS.

    A strategy chooses where the block axis goes: the `full` strategy puts it after the heads
    ([layers, 2, heads, BLOCKS, block_size, dim]) so that gathering a sequence's blocks yields
    [heads, tokens, dim] without a second copy.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.shape.count(BLOCKS) != 1:
            raise ValueError(
                f"arena {self.name!r}: shape {self.shape} needs exactly one BLOCKS axis"
            )
        if any(d <= 0 for d in self.shape if d != BLOCKS):
            raise ValueError(f"arena {self.name!r}: shape {self.shape} has a non-positive size")

    @property
    def block_dim(self) -> int:
        """Index of the block axis."""
        return self.shape.index(BLOCKS)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies in this arena."""
        return math.prod(d for d in self.shape if d != BLOCKS) * self.dtype.itemsize

    def full_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The arena tensor's shape for `num_blocks` blocks."""
        return tuple(num_blocks if d == BLOCKS else d for d in self.shape)


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """What one block holds, as declared by a strategy: block size and the arenas."""

    block_size: int
    arenas: tuple[ArenaSpec, ...]

    @property
    def page_bytes(self) -> int:
        """Bytes per block over all arenas."""
        return sum(a.bytes_per_block for a in self.arenas)


class Tier(ABC):
    """Storage for the blocks of one tier. Block ids are the allocator's; data is per arena."""

    name: str
    num_blocks: int

    @abstractmethod
    def read(self, block_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """Copies of the blocks' data per arena (block axis holds `block_ids` in order)."""

    @abstractmethod
    def write(self, block_ids: Sequence[int], data: Mapping[str, torch.Tensor]) -> None:
        """Store data (as returned by `read`) into the blocks `block_ids`."""


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

    def read(self, block_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return {n: t.index_select(self._dims[n], idx) for n, t in self.arenas.items()}

    def write(self, block_ids: Sequence[int], data: Mapping[str, torch.Tensor]) -> None:
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        for n, t in self.arenas.items():
            t.index_copy_(self._dims[n], idx, data[n].to(self.device, non_blocking=True))


class BlockLostError(RuntimeError):
    """A block could not be read back (missing, or its checksum failed): never served as data."""


class StoreTier(Tier):
    """A tier whose blocks live in a `storage` block store (the SSD tier: LMDB).

    Values: with `parts` = 1, one value per block (its bytes of every arena, in layout order).
    With `parts` = P > 1, every arena's first axis has P entries (a KV layout's layers) and each
    (block, part) is its own value, so a strategy can read one layer of many blocks while the
    previous layer computes (`read_part`).

    Keys: a block written by `write` is keyed by this pool session and its id (`transient`,
    deleted when the block is released). A block `assign`ed a content key (its prefix chain
    hash) is stored under that key instead: content is written once, shared by every block
    that holds it, survives the process, and is found again by `has_content` (the persistent
    prefix cache). The store checksums every value; a missing or corrupt block raises
    `BlockLostError` naming it, and a corrupt content entry is deleted so it is not hit again.
    """

    def __init__(self, name: str, layout: BlockLayout, num_blocks: int, store, parts: int = 1):
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        for a in layout.arenas:
            if parts > 1 and (a.shape[0] != parts or a.block_dim == 0):
                raise ValueError(
                    f"arena {a.name!r} (shape {a.shape}) cannot be split into {parts} parts "
                    "along its first axis"
                )
        self.name, self.layout, self.num_blocks, self.store = name, layout, num_blocks, store
        self.parts = parts
        self._session = os.urandom(8)
        self._content: dict[int, bytes] = {}  # block id -> content key (else transient)
        # Per arena: the shape of one part of one block, and the block axis within a part.
        self._part_shape = {
            a.name: tuple(d for d in a.shape[1 if parts > 1 else 0 :] if d != BLOCKS)
            for a in layout.arenas
        }
        self._part_dim = {a.name: a.block_dim - (1 if parts > 1 else 0) for a in layout.arenas}
        self.part_bytes = layout.page_bytes // parts

    # -- keys ------------------------------------------------------------------------------

    def assign(self, block_id: int, content_key: bytes) -> None:
        """Key block `block_id` by content from now on (before `write`, or to attach stored
        content without writing: see `has_content`)."""
        self._content[block_id] = content_key

    def release(self, block_ids: Sequence[int]) -> None:
        """The blocks were freed: delete their transient values; content stays stored."""
        transient = [b for b in block_ids if self._content.pop(b, None) is None]
        keys = [self._key(b, p) for b in transient for p in range(self.parts)]
        if keys:
            self.store.delete_many(keys)

    def has_content(self, content_key: bytes) -> bool:
        """Whether the store holds a block under `content_key` (written whole, all parts)."""
        return self.store.contains(content_key + _part(0))

    def _key(self, block_id: int, part: int) -> bytes:
        content = self._content.get(block_id)
        if content is None:
            content = b"t" + self._session + block_id.to_bytes(8, "little")
        return content + _part(part)

    # -- data ------------------------------------------------------------------------------

    def read(self, block_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        if self.parts == 1:
            return self._decode(block_ids, 0, None)
        per_part = [self.read_part(block_ids, p) for p in range(self.parts)]
        return {n: torch.stack([d[n] for d in per_part]) for n in per_part[0]}

    def read_part(self, block_ids: Sequence[int], part: int) -> dict[str, torch.Tensor]:
        """Part `part` of the blocks, per arena with the block axis holding `block_ids`."""
        return self._decode(block_ids, part, part)

    def _decode(self, block_ids: Sequence[int], part: int, one: int | None):
        keys = [self._key(b, part) for b in block_ids]
        # Per arena: the output tensor with the block axis, and for each value the contiguous
        # byte runs of its block's slice, in the value's order: the store reads straight into
        # them. numpy, not torch, for the slicing: this runs on I/O threads, where a torch op
        # could start a second OpenMP team and slow the compute thread (engine/compute.py).
        out, targets = {}, [[] for _ in keys]
        for a in self.layout.arenas:
            shape = list(self._part_shape[a.name] if one is not None else a.shape)
            if one is None:
                shape.remove(BLOCKS)
            dim = self._part_dim[a.name] if one is not None else a.block_dim
            shape.insert(dim, len(keys))
            t = out[a.name] = torch.empty(shape, dtype=a.dtype)
            raw = t.view(torch.uint8).numpy()
            for i, runs in enumerate(targets):
                runs += _chunks(raw[(slice(None),) * dim + (i,)])
        found = self.store.read_into(keys, targets)
        bad = [i for i, ok in enumerate(found) if not ok]
        if bad:
            lost = [block_ids[i] for i in bad]
            # A content entry that failed its checksum (or has another layout's length) would
            # be hit again by every later lookup: remove it, so the next request recomputes.
            stale = [
                self._content[block_ids[i]] + _part(p)
                for i in bad
                if block_ids[i] in self._content
                for p in range(self.parts)
            ]
            if stale:
                self.store.delete_many(stale)
            raise BlockLostError(
                f"tier {self.name!r}: block(s) {lost} missing or corrupt in the store"
            )
        return out

    def write(self, block_ids: Sequence[int], data: Mapping[str, torch.Tensor]) -> None:
        items = []
        for i, b in enumerate(block_ids):
            content = self._content.get(b)
            if content is not None and self.has_content(content):
                continue  # the same content is stored already (written through, or shared)
            for p in range(self.parts):
                parts = []
                for a in self.layout.arenas:
                    x = data[a.name].select(a.block_dim, i)
                    if self.parts > 1:
                        x = x[p]
                    parts.append(x.contiguous().cpu().view(torch.uint8).numpy().tobytes())
                items.append((self._key(b, p), b"".join(parts)))
        if items:
            self.store.put_many(items)  # one transaction: all blocks land, or none


def _chunks(a: np.ndarray) -> list[memoryview]:
    """The bytes of array `a` as the fewest contiguous runs, in C order."""
    if a.flags.c_contiguous:
        return [memoryview(a).cast("B")]
    return [c for sub in a for c in _chunks(sub)]


def _part(part: int) -> bytes:
    return part.to_bytes(2, "little")


class UnifiedMemoryPool:
    """Blocks in tiers, one table per sequence, a prefix cache over full blocks."""

    def __init__(
        self,
        config: PoolConfig,
        layout: BlockLayout,
        *,
        device: torch.device | str = "cpu",
        identity: str = "",
        stores: Mapping[str, Tier] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.block_size is not None and layout.block_size != config.block_size:
            raise ValueError(
                f"layout block size {layout.block_size} != config block_size {config.block_size}"
            )
        self.config, self.layout, self.identity = config, layout, identity
        self.block_size = layout.block_size
        self.device = torch.device(device)
        self.prefix = PrefixCache()
        self.tiers: dict[str, Tier] = {}
        self.allocators: dict[str, TierAllocator] = {}
        stores = dict(stores or {})
        for tc in config.tiers:
            num_blocks = tc.capacity_bytes // layout.page_bytes
            if num_blocks < 1:
                raise ValueError(
                    f"{config.source}: [tiers.{tc.name}] capacity = {tc.capacity_bytes} bytes "
                    f"holds no block of {layout.page_bytes} bytes; give at least that much"
                )
            if tc.name in stores:
                tier = stores.pop(tc.name)
                num_blocks = tier.num_blocks
            elif tc.name in ("device", "host"):
                dev = self.device if tc.name == "device" else torch.device("cpu")
                tier = TensorTier(tc.name, layout, num_blocks, dev)
            else:
                raise ValueError(
                    f"{config.source}: [tiers.{tc.name}] needs a block store "
                    f"(pass stores={{'{tc.name}': ...}}); none is built in for this tier yet"
                )
            self.tiers[tc.name] = tier
            self.allocators[tc.name] = TierAllocator(
                tc.name,
                num_blocks,
                self.block_size,
                low_watermark=tc.low_watermark,
                # Device and host blocks can be found by content; a store tier is its own index.
                prefix_cache=self.prefix if isinstance(tier, TensorTier) else None,
            )
        if stores:
            raise ValueError(f"stores given for tiers not in the config: {', '.join(stores)}")
        self.stats = PoolStats(self.allocators, self.prefix)
        self.health_monitor = HealthMonitor(clock=clock)
        self._clock = clock
        self._last_sample = float("-inf")
        self._tables: dict[SeqId, BlockTable] = {}
        self._hashes: dict[SeqId, list[bytes]] = {}  # published chain of each sequence
        self._room: dict[int, SeqId] = {}  # free device block -> sequence it is kept for
        self._room_of: dict[SeqId, list[int]] = {}

    # ---- queries ------------------------------------------------------------------------------

    def arena(self, name: str, tier: str = "device") -> torch.Tensor:
        """The tensor of arena `name` in a tensor tier (strategies read and write it in place)."""
        t = self.tiers[tier]
        if not isinstance(t, TensorTier):
            raise RuntimeError(f"tier {tier!r} is not held in tensors")
        return t.arenas[name]

    def table(self, seq: SeqId) -> BlockTable | None:
        """The block table of `seq`, or None if the pool holds nothing for it."""
        return self._tables.get(seq)

    def num_tokens(self, seq: SeqId) -> int:
        """Token slots filled for `seq` (0 when unknown)."""
        t = self._tables.get(seq)
        return t.num_tokens if t is not None else 0

    def total_tokens(self) -> int:
        """Token slots filled over all sequences (a shared block counts once per sequence)."""
        return sum(t.num_tokens for t in self._tables.values())

    def capacity_tokens(self, tier: str = "device") -> int:
        """Tokens the whole tier can hold."""
        return self.allocators[tier].num_blocks * self.block_size

    def usage(self, tier: str = "device") -> float:
        """Used fraction of a tier."""
        return self.allocators[tier].usage

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_admit(self, num_tokens: int, tier: str = "device") -> bool:
        """Whether a new sequence of `num_tokens` fits and leaves the tier's watermark free."""
        return self.allocators[tier].can_admit(self.blocks_for(num_tokens))

    def can_append(self, seq: SeqId, num_tokens: int) -> bool:
        """Whether `seq` can grow by `num_tokens` now (growth may use the watermark)."""
        t = self._tables.get(seq)
        need = t.slots_needed(num_tokens) if t is not None else self.blocks_for(num_tokens)
        return self.allocators["device"].can_allocate(need)

    # ---- sequences ----------------------------------------------------------------------------

    def reserve(self, seq: SeqId, num_tokens: int) -> bool:
        """Make room on the device tier for `num_tokens` more tokens of `seq`.

        Returns False, changing nothing, when the blocks are not there.
        """
        table = self._tables.get(seq) or BlockTable(seq, self.block_size)
        self._check_on_device(table)
        need = table.slots_needed(num_tokens)
        if need:
            alloc = self.allocators["device"]
            if not alloc.can_allocate(need):
                return False
            # Prefer the blocks right after the sequence's last one: attention then reads
            # one run of consecutive slots in place instead of attending piece by piece.
            ids: list[int] = []
            last = table[len(table) - 1] if len(table) else None
            nxt = last.block_id + 1 if last is not None and last.tier == "device" else None
            while nxt is not None and len(ids) < need and alloc.take(nxt, seq):
                self._forget_room(nxt)
                ids.append(nxt)
                nxt += 1
            if len(ids) < need:
                rest = alloc.allocate(need - len(ids), seq, avoid=_RoomOfOthers(self._room, seq))
                assert rest is not None  # can_allocate said they fit
                for b in rest:
                    self._forget_room(b)
                ids += rest
            table.append_blocks("device", ids)
            self._keep_room(seq, ids[-1])
        self._tables[seq] = table
        return True

    GROWTH_ROOM_BLOCKS = 8  # free blocks after a sequence that others pass over while they can

    def _keep_room(self, seq: SeqId, last: int) -> None:
        """Soft-reserve the free blocks after `last` for the growth of `seq`.

        They stay free (usable by anyone once nothing else is left); other sequences' blocks
        are just taken elsewhere first, so concurrent sequences do not interleave.
        """
        alloc = self.allocators["device"]
        self._drop_room(seq)
        room: list[int] = []
        self._room_of[seq] = room
        # Room pays while memory is plentiful; once rooms would cover most of the free blocks,
        # keeping them only makes every allocation pass over them.
        if len(self._room) + self.GROWTH_ROOM_BLOCKS > alloc.num_free // 2:
            return
        for b in range(last + 1, min(last + 1 + self.GROWTH_ROOM_BLOCKS, alloc.num_blocks)):
            blk = alloc.block(b)
            if blk.ref_count or blk.block_hash is not None or self._room.get(b, seq) != seq:
                break
            self._room[b] = seq
            room.append(b)

    def _forget_room(self, block_id: int) -> None:
        """`block_id` was allocated: it is nobody's growth room any more."""
        owner = self._room.pop(block_id, None)
        if owner is not None:
            self._room_of[owner].remove(block_id)

    def _drop_room(self, seq: SeqId) -> None:
        """Give up the growth room of `seq`."""
        for b in self._room_of.pop(seq, ()):
            del self._room[b]

    def commit(self, seq: SeqId, num_tokens: int) -> None:
        """Record that `num_tokens` reserved slots of `seq` now hold data."""
        self._require(seq).append_tokens(num_tokens)

    def free(self, seq: SeqId) -> None:
        """Release every block of `seq` (its cached prefix blocks stay revivable)."""
        table = self._tables.pop(seq, None)
        self._hashes.pop(seq, None)
        self._drop_room(seq)
        if table is None:
            return
        by_tier: dict[str, list[int]] = {}
        for ref in table:
            by_tier.setdefault(ref.tier, []).append(ref.block_id)
        for tier, ids in by_tier.items():
            self._release(tier, ids)

    def _release(self, tier: str, ids: list[int]) -> None:
        self.allocators[tier].free(ids)
        t = self.tiers[tier]
        if isinstance(t, StoreTier):
            t.release([b for b in ids if self.allocators[tier].ref_count(b) == 0])

    def truncate(self, seq: SeqId, num_tokens: int) -> None:
        """Keep the first `num_tokens` slots of `seq`; trailing blocks go back to the pool."""
        table = self._require(seq)
        dropped = table.truncate(num_tokens)
        hashes = self._hashes.get(seq)
        if hashes is not None:
            del hashes[num_tokens // self.block_size :]
        for ref in dropped:
            self._release(ref.tier, [ref.block_id])

    def slot_ids(self, seq: SeqId, start: int, end: int) -> torch.Tensor:
        """Device-arena slot index (block_id * block_size + offset) of tokens [start, end)."""
        table = self._require(seq)
        bs = self.block_size
        first, last = start // bs, -(-end // bs)
        refs = table.refs[first:last]
        if any(r.tier != "device" for r in refs):
            raise RuntimeError(f"sequence {seq!r} has blocks off the device tier; swap it in first")
        ids = torch.tensor([r.block_id for r in refs], dtype=torch.long)
        slots = (ids[:, None] * bs + torch.arange(bs)).flatten()
        return slots[start - first * bs : end - first * bs].to(self.device)

    def slot_runs(self, seq: SeqId, end: int) -> list[tuple[int, int]]:
        """Tokens [0, end) of `seq` as (start_slot, end_slot) runs of consecutive device slots."""
        table = self._require(seq)
        bs = self.block_size
        runs: list[list[int]] = []
        for i in range(-(-end // bs)):
            ref = table[i]
            if ref.tier != "device":
                raise RuntimeError(f"sequence {seq!r} has blocks off the device tier")
            start = ref.block_id * bs
            if runs and runs[-1][1] == start:
                runs[-1][1] += bs
            else:
                runs.append([start, start + bs])
        runs[-1][1] -= -(-end // bs) * bs - end  # the last block may be partly filled
        return [(s, e) for s, e in runs]

    def check(self, seq: SeqId) -> None:
        """Raise RuntimeError if the table of `seq` points at freed or foreign blocks."""
        self._require(seq).check(self.allocators)

    # ---- prefix sharing -----------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> list[BlockRef]:
        """The cached device blocks that start `token_ids` (longest verified chain)."""
        return self.prefix.match_prefix(token_ids, self.block_size, self.identity)

    def attach_prefix(self, seq: SeqId, refs: Sequence[BlockRef]) -> int:
        """Start the new sequence `seq` on shared cached blocks; return the tokens they hold."""
        if seq in self._tables:
            raise RuntimeError(f"sequence {seq!r} already has blocks; attach a prefix first")
        table = BlockTable(seq, self.block_size)
        hashes = []
        for ref in refs:
            self.allocators[ref.tier].acquire_cached(ref.block_id)
            table.append_blocks(ref.tier, [ref.block_id])
            hashes.append(self.prefix.hash_of(ref))
        table.append_tokens(len(refs) * self.block_size)
        self._tables[seq], self._hashes[seq] = table, hashes
        return table.num_tokens

    def stored_prefix(
        self, token_ids: Sequence[int], after: Sequence[BlockRef] = (), tier: str = "ssd"
    ) -> list[bytes]:
        """Content hashes of the blocks of `token_ids` that follow the blocks `after` (a
        `match_prefix` result) and are held by the store tier `tier` (stored by an earlier
        process, or written through by this one): the longest such chain."""
        t = self.tiers.get(tier)
        if not isinstance(t, StoreTier):
            return []
        bs = self.block_size
        parent = self.prefix.hash_of(after[-1]) if after else None
        if after and parent is None:
            return []
        found: list[bytes] = []
        for start in range(len(after) * bs, len(token_ids) - bs + 1, bs):
            h = block_hash(parent, token_ids[start : start + bs], self.identity)
            if not t.has_content(h):
                break
            found.append(h)
            parent = h
        return found

    def attach_stored(self, seq: SeqId, hashes: Sequence[bytes], tier: str = "ssd") -> int:
        """Append to `seq` (new, or just attached) blocks of the store tier `tier` that hold
        the stored content `hashes`, without reading them; return the tokens of `seq`.
        Nothing changes (0 is returned) when the tier has no room for them."""
        t = self.tiers[tier]
        assert isinstance(t, StoreTier)
        table = self._tables.get(seq) or BlockTable(seq, self.block_size)
        if table.num_free_slots:
            raise RuntimeError(f"sequence {seq!r} ends in a partial block; cannot attach more")
        ids = self.allocators[tier].allocate(len(hashes), seq) if hashes else []
        if ids is None:
            return table.num_tokens if seq in self._tables else 0
        for b, h in zip(ids, hashes, strict=True):
            t.assign(b, h)
        table.append_blocks(tier, ids)
        table.append_tokens(len(ids) * self.block_size)
        self._tables[seq] = table
        self._hashes.setdefault(seq, []).extend(hashes)
        return table.num_tokens

    def content_hashes(self, seq: SeqId) -> list[bytes]:
        """The published chain of `seq`: one content hash per full block, in order."""
        return list(self._hashes.get(seq, ()))

    def publish(self, seq: SeqId, token_ids: Sequence[int]) -> int:
        """Offer the full blocks of `seq` (holding `token_ids`) to the prefix cache.

        Returns how many blocks of `seq` are now part of its published chain. Cached blocks
        become read-only; a sequence only ever writes into its last, partial block.
        """
        table = self._require(seq)
        hashes = self._hashes.setdefault(seq, [])
        full = min(table.num_tokens, len(token_ids)) // self.block_size
        for i in range(len(hashes), full):
            ref = table[i]
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hashes[-1] if hashes else None
            h = None
            alloc = self.allocators[ref.tier]
            if alloc.prefix_cache is not None:
                h = alloc.cache_block(ref.block_id, parent, tokens, self.identity)
            # Another block may already hold this content; the chain continues either way.
            hashes.append(h or block_hash(parent, tokens, self.identity))
        return len(hashes)

    # ---- moves between tiers ------------------------------------------------------------------

    def move(
        self, seq: SeqId, indices: Sequence[int], dst: str, relocate_cache: bool = False
    ) -> bool:
        """Move blocks at table positions `indices` of `seq` to tier `dst`; False if no room.

        By default a block cached for prefix sharing keeps its cached copy where it was (it
        stays revivable there). With `relocate_cache`, the cache follows a block that only
        `seq` uses, so the source block is freed for good (recency tiering: the content now
        lives, and is found, in `dst`). Blocks of `seq` with a published content hash are
        stored by that hash in a store tier: content stored before is not written again.
        """
        table = self._require(seq)
        if dst not in self.tiers:
            raise ValueError(f"no tier {dst!r} in this pool (tiers: {', '.join(self.tiers)})")
        todo = [i for i in indices if table[i].tier != dst]
        if not todo:
            return True
        new_ids = self._allocate_near(dst, seq, table, todo)
        if new_ids is None:
            return False
        if dst == "device":
            for b in new_ids:
                self._forget_room(b)
        dst_tier = self.tiers[dst]
        if isinstance(dst_tier, StoreTier):
            hashes = self._hashes.get(seq, [])
            for i, new_id in zip(todo, new_ids, strict=True):
                if i < len(hashes):
                    dst_tier.assign(new_id, hashes[i])
        by_src: dict[str, list[tuple[int, int]]] = {}
        for i, new_id in zip(todo, new_ids, strict=True):
            by_src.setdefault(table[i].tier, []).append((i, new_id))
        # Copy everything first: a failed read or write leaves the table as it was.
        copies = []
        try:
            for src, pairs in by_src.items():
                data = self.tiers[src].read([table[i].block_id for i, _ in pairs])
                self.tiers[dst].write([n for _, n in pairs], data)
                copies.append((src, pairs))
        except Exception:
            self._release(dst, new_ids)
            raise
        for src, pairs in copies:
            for i, new_id in pairs:
                old = table.move(i, BlockRef(dst, new_id))
                if relocate_cache:
                    self._relocate(old, BlockRef(dst, new_id))
                self._release(src, [old.block_id])
            self.stats.record_move(src, dst, len(pairs))
        return True

    def _allocate_near(
        self, tier: str, seq: SeqId, table: BlockTable, todo: list[int]
    ) -> list[int] | None:
        """Blocks of `tier` for table positions `todo`, continuing after the sequence's last
        block in that tier where free: runs of consecutive slots are attended in one piece."""
        alloc = self.allocators[tier]
        if not alloc.can_allocate(len(todo)):
            return None
        ids: list[int] = []
        before = [r.block_id for r in table.refs[: todo[0]] if r.tier == tier]
        nxt = before[-1] + 1 if before else None
        while nxt is not None and len(ids) < len(todo) and alloc.take(nxt, seq):
            ids.append(nxt)
            nxt += 1
        if len(ids) < len(todo):
            ids += alloc.allocate(len(todo) - len(ids), seq)
        return ids

    def _relocate(self, old: BlockRef, new: BlockRef) -> None:
        """Let the prefix cache entry of `old` (if only its sequence uses it) point at `new`."""
        src = self.allocators[old.tier]
        h = self.prefix.hash_of(old)
        if h is None or src.ref_count(old.block_id) != 1:
            return
        entry = self.prefix.get(h)
        src.uncache(old.block_id)
        dst = self.allocators[new.tier]
        if dst.prefix_cache is not None:
            dst.cache_block(new.block_id, entry.parent, entry.token_ids, entry.identity)

    def swap_out(self, seq: SeqId, dst: str = "host") -> bool:
        """Move every device block of `seq` to `dst` (preemption by swapping)."""
        table = self._require(seq)
        if dst not in self.tiers:
            return False
        ok = self.move(seq, [i for i, r in enumerate(table) if r.tier == "device"], dst)
        if ok:
            self.record_preemption()
        return ok

    def swap_in(self, seq: SeqId) -> bool:
        """Bring every block of `seq` back to the device tier; False if it does not fit."""
        table = self._require(seq)
        return self.move(seq, [i for i, r in enumerate(table) if r.tier != "device"], "device")

    # ---- statistics and health ----------------------------------------------------------------

    def record_preemption(self) -> None:
        """Count a preempted sequence (swapped out or dropped for recompute)."""
        self.stats.record_preemption()
        self.health_monitor.record_preemption()

    SAMPLE_EVERY_S = 0.25  # usage samples for the OOM predictor: 240 per one-minute window

    def sample_usage(self) -> None:
        """Feed the OOM predictor the device usage, at most every SAMPLE_EVERY_S seconds."""
        now = self._clock()
        if now - self._last_sample >= self.SAMPLE_EVERY_S:
            self._last_sample = now
            self.health_monitor.predictor.record(self.usage("device"), now)

    def health(self) -> HealthReport:
        """Green / yellow / red from device usage and recent events (see memory.stats)."""
        return self.health_monitor.observe(self.usage("device"))

    def snapshot(self) -> dict:
        """Usage per tier, prefix hit rate, allocations, evictions, preemptions, health."""
        snap = self.stats.snapshot()
        snap["health"] = self.health().as_dict()
        snap["block_size"] = self.block_size
        snap["page_bytes"] = self.layout.page_bytes
        snap["sequences"] = len(self._tables)
        return snap

    # ---- internals ----------------------------------------------------------------------------

    def _require(self, seq: SeqId) -> BlockTable:
        table = self._tables.get(seq)
        if table is None:
            raise RuntimeError(f"sequence {seq!r} has no blocks in the pool")
        return table

    @staticmethod
    def _check_on_device(table: BlockTable) -> None:
        # Only the last block is ever written into, and only while it has free slots.
        if len(table) and table.num_free_slots and table[len(table) - 1].tier != "device":
            raise RuntimeError(
                f"sequence {table.seq_id!r} is swapped out; swap it in before appending"
            )


class _RoomOfOthers:
    """`block in view`: the block is kept as growth room for a sequence other than `seq`."""

    __slots__ = ("room", "seq")

    def __init__(self, room: dict[int, SeqId], seq: SeqId) -> None:
        self.room, self.seq = room, seq

    def __contains__(self, block_id: object) -> bool:
        owner = self.room.get(block_id, self.seq)
        return owner != self.seq

    def __bool__(self) -> bool:
        return bool(self.room)


class AsyncPool:
    """The pool from asyncio: one lock around each operation; waiting for room without polling.

    Data copies of `move`/`swap_*` run in `executor` (default: asyncio's), off the event loop.
    """

    def __init__(self, pool: UnifiedMemoryPool, executor=None) -> None:
        self.pool, self._executor = pool, executor
        self._lock = asyncio.Lock()
        self._room = asyncio.Condition(self._lock)

    async def reserve(self, seq: SeqId, num_tokens: int, timeout: float | None = None) -> bool:
        """Reserve room for `num_tokens` of `seq`, waiting up to `timeout` s for frees."""

        async def wait() -> bool:
            async with self._room:
                await self._room.wait_for(lambda: self.pool.reserve(seq, num_tokens))
                return True

        try:
            return await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            return False

    async def free(self, seq: SeqId) -> None:
        """Free every block of `seq` and wake waiters."""
        async with self._room:
            self.pool.free(seq)
            self._room.notify_all()

    async def match_prefix(self, token_ids: Sequence[int]) -> list[BlockRef]:
        """Cached blocks that start `token_ids`."""
        async with self._lock:
            return self.pool.match_prefix(token_ids)

    async def attach_prefix(self, seq: SeqId, refs: Sequence[BlockRef]) -> int:
        """Start `seq` on shared cached blocks."""
        async with self._lock:
            return self.pool.attach_prefix(seq, refs)

    async def commit(self, seq: SeqId, num_tokens: int) -> None:
        """Record that `num_tokens` reserved slots of `seq` now hold data."""
        async with self._lock:
            self.pool.commit(seq, num_tokens)

    async def publish(self, seq: SeqId, token_ids: Sequence[int]) -> int:
        """Offer the full blocks of `seq` to the prefix cache."""
        async with self._lock:
            return self.pool.publish(seq, token_ids)

    async def move(self, seq: SeqId, indices: Sequence[int], dst: str) -> bool:
        """Move blocks of `seq` to tier `dst`."""
        async with self._room:
            loop = asyncio.get_running_loop()
            ok = await loop.run_in_executor(self._executor, self.pool.move, seq, indices, dst)
            self._room.notify_all()
            return ok

    async def snapshot(self) -> dict:
        """Statistics and health."""
        async with self._lock:
            return self.pool.snapshot()
