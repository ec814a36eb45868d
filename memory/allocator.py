"""Block allocation for one memory tier: block metadata, the LRU free queue, block tables.

What lives here: `Block` (per-block metadata), `FreeBlockQueue` (intrusive doubly linked free
list in LRU order), `TierAllocator` (fixed-size blocks of one tier: allocate, free, reference
counts, prefix-cache revival, watermark admission) and `BlockTable` (the ordered blocks of one
sequence).

What does not: the tensors that hold KV bytes (the pool's arenas), moving data between tiers,
choosing a tier (the pool and the strategies) and content hashing (`memory.prefix`).

This module imports no torch, so its tests run in milliseconds.

Ownership: a block handed out by `allocate(n, owner)` is *owned* by that sequence, the only one
allowed to write into it. A block that becomes shared (a prefix-cache hit, `acquire_cached`)
or whose content is cached (`cache_block`) has owner `None` (`SHARED`): it is read-only, and a
writer must copy it first. `check_owner` / `BlockTable.check` detect a table that points at a block
owned by another sequence or at a freed block.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Container, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from unikv.memory.prefix import BlockRef, PrefixCache

SHARED = None  # owner of a read-only block referenced by several sequences or the prefix cache

SeqId = Hashable


@dataclass(slots=True, eq=False)
class Block:
    """Metadata of one fixed-size block; `prev`/`next` link it into the free queue."""

    block_id: int
    tier: str
    ref_count: int = 0
    # Set while the block's content is in the prefix cache; kept after the last free so a
    # later prompt with the same prefix can revive the block instead of recomputing it.
    block_hash: bytes | None = None
    owner: SeqId | None = None
    freed_at: int = 0  # the free queue's clock when it was last appended (its LRU age)
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks with sentinel head and tail.

    The head is the least recently freed block and is the next one handed out; freed blocks
    are appended at the tail. So cached prefix blocks freed recently survive longest, and
    `remove` (a prefix hit on a free block) is O(1) without searching. Like vLLM v1's
    `FreeKVCacheBlockQueue`.
    """

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        # Sentinels: no branch for "empty list" or "first/last element" in any operation.
        self._head = Block(-1, "<head>")
        self._tail = Block(-1, "<tail>")
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0
        self.clock = 0  # appends so far: a block's `freed_at` orders it in the queue
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def __contains__(self, block: object) -> bool:
        # A block is in the queue exactly when it is linked; sentinels are never "in" it.
        return isinstance(block, Block) and block.prev is not None and block.block_id >= 0

    def append(self, block: Block) -> None:
        """Put `block` at the tail (most recently freed)."""
        if block.prev is not None or block.next is not None:
            raise RuntimeError(f"block {block.block_id} in tier {block.tier!r} is already free")
        last = self._tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self._len += 1
        block.freed_at = self.clock
        self.clock += 1

    def in_older_half(self, block: Block) -> bool:
        """Whether free `block` was appended in the older half of the span from the head's
        append to now (O(1): it would be reused among the next half of the queue or so)."""
        head = self._head.next
        oldest = head.freed_at if head is not None and head is not self._tail else self.clock
        return block.freed_at - oldest <= (self.clock - oldest) // 2

    def peek(self) -> Block | None:
        """The head (the next block `popleft` hands out), or None when empty."""
        block = self._head.next
        return None if block is self._tail else block

    def popleft(self) -> Block:
        """Take the head (least recently freed) block."""
        block = self._head.next
        if block is self._tail or block is None:
            raise RuntimeError("popleft from an empty free block queue")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        """Unlink `block` from anywhere in the queue in O(1)."""
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} in tier {block.tier!r} is not free")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._len -= 1


def _check_count(n: object, what: str = "n") -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {n!r}")
    return n


class TierAllocator:
    """Fixed-size blocks of one tier, with reference counts and an LRU free queue.

    Budget semantics: `low_watermark` is the fraction of the tier's blocks kept free for the
    growth of sequences already running (decode appends). `can_admit(n)` (admitting a NEW
    sequence that needs `n` blocks) answers True only if at least `watermark_blocks` stay
    free afterwards; `can_allocate(n)` (growth of a running sequence) may use every free
    block. This keeps admission from starving running sequences into preemption.

    Free blocks whose content is in the prefix cache stay cached in the free queue; reusing
    one for a new allocation evicts its hash (counted in `num_evictions`).
    """

    MAX_PASSED = 8  # avoided blocks one allocate() passes over at most (one growth room)

    def __init__(
        self,
        tier: str,
        num_blocks: int,
        block_size: int,
        *,
        low_watermark: float = 0.0,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if not isinstance(tier, str) or not tier:
            raise ValueError(f"tier must be a non-empty string, got {tier!r}")
        _check_count(num_blocks, "num_blocks")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be an integer > 0, got {block_size!r}")
        if not isinstance(low_watermark, int | float) or not 0.0 <= low_watermark < 1.0:
            raise ValueError(f"low_watermark must be a fraction in [0, 1), got {low_watermark!r}")
        self.tier = tier
        self.block_size = block_size
        self.low_watermark = float(low_watermark)
        # Floor, so a tiny tier is not left without admissible blocks by rounding.
        self.watermark_blocks = int(low_watermark * num_blocks)
        self.prefix_cache = prefix_cache
        self._blocks = [Block(i, tier) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self._blocks)
        self.num_allocations = 0  # blocks handed out by allocate()
        self.num_frees = 0  # blocks whose last reference was dropped
        self.num_evictions = 0  # cached hashes dropped because their block was reused
        self.num_revived = 0  # free cached blocks taken back by a prefix hit
        self._num_cached = 0

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Total blocks in the tier."""
        return len(self._blocks)

    @property
    def num_free(self) -> int:
        """Blocks with no reference (cached-but-free blocks included: they are reusable)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with at least one reference."""
        return len(self._blocks) - len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks, used or free, whose content is in the prefix cache."""
        return self._num_cached

    @property
    def usage(self) -> float:
        """Used fraction of the tier, 0.0 to 1.0 (0.0 for an empty tier)."""
        return self.num_used / len(self._blocks) if self._blocks else 0.0

    def free_blocks(self) -> list[int]:
        """Ids of the free blocks in LRU order (next to be reused first)."""
        return [b.block_id for b in self._free]

    def block(self, block_id: int) -> Block:
        """The metadata of `block_id` (read it; mutate it only through this class)."""
        return self._get(block_id)

    def ref_count(self, block_id: int) -> int:
        """Current reference count of `block_id`."""
        return self._get(block_id).ref_count

    def can_allocate(self, n: int) -> bool:
        """Whether `n` blocks fit now, using every free block (growth of running sequences)."""
        return _check_count(n) <= len(self._free)

    def can_admit(self, n: int) -> bool:
        """Whether a new sequence needing `n` blocks fits and leaves the watermark free."""
        return len(self._free) - _check_count(n) >= self.watermark_blocks

    # -- mutations ---------------------------------------------------------------------------

    def allocate(
        self, n: int, owner: SeqId | None, avoid: Container[int] | None = None
    ) -> list[int] | None:
        """Take `n` blocks owned by `owner`; None when they do not fit (nothing is taken).

        Blocks in `avoid` are passed over (and moved to the tail of the queue) while enough
        other free blocks remain, at most `MAX_PASSED` of them per call so that a queue made
        mostly of avoided blocks cannot turn allocation into a scan.
        """
        _check_count(n)
        if n > len(self._free):
            return None
        ids: list[int] = []
        passed: list[Block] = []
        while len(ids) < n:
            block = self._free.popleft()
            if (
                avoid
                and len(passed) < self.MAX_PASSED
                and block.block_id in avoid
                and len(self._free) >= n - len(ids)
            ):
                passed.append(block)
                continue
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            block.owner = owner
            ids.append(block.block_id)
        for block in passed:
            self._free.append(block)
        self.num_allocations += n
        return ids

    def next_free(self) -> int | None:
        """The id of the block `allocate` would hand out next (None: none is free)."""
        block = self._free.peek()
        return None if block is None else block.block_id

    def takeable(self, block_id: int) -> bool:
        """Whether `take(block_id)` would succeed now (free, and uncached or cached but in the
        older half of the free queue)."""
        block = self._blocks[block_id] if 0 <= block_id < len(self._blocks) else None
        if block is None or block.ref_count != 0:
            return False
        return block.block_hash is None or self._free.in_older_half(block)

    def take(self, block_id: int, owner: SeqId | None) -> bool:
        """Allocate the specific block `block_id` if it is free (O(1)).

        Lets a growing sequence continue into the block after its last one, keeping its slots
        contiguous. False for a used block, and for a free block still holding cached prefix
        content that was freed in the newer half of the queue: that one is left for LRU order
        to decide. A cached block in the older half is taken (its hash evicted): LRU would hand
        it out soon anyway, and without it every sequence that starts where an older one
        ended is split in pieces once the cache is warm (attention then copies the pieces
        together on every step).
        """
        if not self.takeable(block_id):
            return False
        block = self._blocks[block_id]
        if block.block_hash is not None:
            self._evict(block)
        self._free.remove(block)
        block.ref_count, block.owner = 1, owner
        self.num_allocations += 1
        return True

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; a block at 0 goes to the free queue's tail.

        The ids are given in table order and returned to the queue in *reverse* order, so the
        end of a sequence is reused before its beginning: the first blocks of a prompt are the
        ones most likely to be shared by a later prompt (as in vLLM). A cached block keeps its
        hash while free. All ids are checked before anything changes, so a double free leaves
        the allocator untouched.
        """
        ids = list(block_ids)
        blocks = [self._get(i) for i in ids]
        # A block listed k times needs k references; the common case lists each block once
        # and skips the Counter (free is on the decode hot path).
        counts = Counter(ids) if len(ids) > 1 and len(set(ids)) != len(ids) else None
        for block in blocks:
            times = 1 if counts is None else counts[block.block_id]
            if block.ref_count < times:
                raise RuntimeError(
                    f"double free of block {block.block_id} in tier {self.tier!r} "
                    f"(ref count {block.ref_count}, freed {times}x)"
                )
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                block.owner = None
                self._free.append(block)
                self.num_frees += 1

    def acquire_cached(self, block_id: int) -> None:
        """Take a reference on a prefix-cache hit, reviving the block if it is free."""
        block = self._get(block_id)
        if block.block_hash is None:
            raise RuntimeError(
                f"block {block_id} in tier {self.tier!r} is not in the prefix cache "
                "(evicted or never cached)"
            )
        if block.ref_count == 0:
            self._free.remove(block)
            self.num_revived += 1
        block.ref_count += 1
        block.owner = SHARED

    def cache_block(
        self, block_id: int, parent: bytes | None, token_ids: Sequence[int], identity: str
    ) -> bytes | None:
        """Publish a full, live block's content in the prefix cache; return its hash.

        None when another block already holds the same content (this one stays uncached).
        The block becomes read-only (owner None): cached content must never change.
        """
        if self.prefix_cache is None:
            raise RuntimeError(f"tier {self.tier!r} was created without a prefix cache")
        block = self._live(block_id, "cache")
        if len(token_ids) != self.block_size:
            raise ValueError(
                f"only full blocks are cached: got {len(token_ids)} token ids for block "
                f"{block_id}, block size is {self.block_size}"
            )
        h = self.prefix_cache.insert(BlockRef(self.tier, block_id), parent, token_ids, identity)
        if h is not None:
            if block.block_hash is None:
                self._num_cached += 1
            block.block_hash = h
            block.owner = SHARED
        return h

    def uncache(self, block_id: int) -> bool:
        """Drop a block's content hash without counting an eviction (e.g. after a move)."""
        block = self._get(block_id)
        if block.block_hash is None:
            return False
        if self.prefix_cache is not None:
            self.prefix_cache.evict(BlockRef(self.tier, block_id))
        block.block_hash = None
        self._num_cached -= 1
        return True

    def check_owner(self, block_id: int, seq: SeqId) -> None:
        """Raise RuntimeError unless `seq` may reference `block_id` (owner or shared)."""
        block = self._get(block_id)
        if block.ref_count == 0:
            raise RuntimeError(
                f"block {block_id} in tier {self.tier!r} is free but sequence {seq!r} "
                "still references it"
            )
        if block.owner is not SHARED and block.owner != seq:
            raise RuntimeError(
                f"block {block_id} in tier {self.tier!r} is owned by sequence "
                f"{block.owner!r}, not by {seq!r}"
            )

    # -- internals ---------------------------------------------------------------------------

    def _get(self, block_id: int) -> Block:
        if (
            isinstance(block_id, bool)
            or not isinstance(block_id, int)
            or not 0 <= block_id < len(self._blocks)
        ):
            raise RuntimeError(
                f"block id {block_id!r} out of range for tier {self.tier!r} "
                f"(0..{len(self._blocks) - 1})"
            )
        return self._blocks[block_id]

    def _live(self, block_id: int, action: str) -> Block:
        block = self._get(block_id)
        if block.ref_count == 0:
            raise RuntimeError(f"{action} of freed block {block_id} in tier {self.tier!r}")
        return block

    def _evict(self, block: Block) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.evict(BlockRef(self.tier, block.block_id), for_room=True)
        block.block_hash = None
        self._num_cached -= 1
        self.num_evictions += 1


class BlockTable:
    """The ordered blocks of one sequence and how many token slots it has filled.

    NOTE: growth is append-only: a block's position in the table is its position in the
    sequence, and prefix hashes chain in that order, so blocks are never inserted in the
    middle. `move` swaps the block at a position (a tier move keeps the position) and
    `truncate` drops trailing blocks (after a strategy compacts the sequence).
    """

    __slots__ = ("seq_id", "block_size", "num_tokens", "version", "_refs")

    def __init__(self, seq_id: SeqId, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be an integer > 0, got {block_size!r}")
        self.seq_id = seq_id
        self.block_size = block_size
        self.num_tokens = 0
        self.version = 0  # counts the changes to which blocks the table lists
        self._refs: list[BlockRef] = []

    def __len__(self) -> int:
        return len(self._refs)

    def __iter__(self) -> Iterator[BlockRef]:
        return iter(self._refs)

    def __getitem__(self, index: int) -> BlockRef:
        return self._refs[index]

    @property
    def refs(self) -> tuple[BlockRef, ...]:
        """The blocks in sequence order."""
        return tuple(self._refs)

    @property
    def capacity(self) -> int:
        """Token slots in the table's blocks."""
        return len(self._refs) * self.block_size

    @property
    def num_free_slots(self) -> int:
        """Allocated but not yet filled token slots (internal waste while nothing is appended)."""
        return self.capacity - self.num_tokens

    def block_ids(self, tier: str | None = None) -> list[int]:
        """Block ids in order, optionally only those in `tier`."""
        return [r.block_id for r in self._refs if tier is None or r.tier == tier]

    def slots_needed(self, new_tokens: int) -> int:
        """How many new blocks must be appended before `new_tokens` more tokens fit."""
        _check_count(new_tokens, "new_tokens")
        blocks = math.ceil((self.num_tokens + new_tokens) / self.block_size)
        return max(0, blocks - len(self._refs))

    def append_blocks(self, tier: str, block_ids: Iterable[int]) -> None:
        """Append blocks of `tier` at the end of the table."""
        self._refs.extend(BlockRef(tier, b) for b in block_ids)
        self.version += 1

    def append_tokens(self, n: int) -> None:
        """Record that `n` more token slots are filled; the blocks must already be there."""
        _check_count(n)
        if self.num_tokens + n > self.capacity:
            raise RuntimeError(
                f"sequence {self.seq_id!r}: appending {n} tokens to {self.num_tokens} needs "
                f"{self.slots_needed(n)} more block(s) (capacity {self.capacity})"
            )
        self.num_tokens += n

    def move(self, index: int, ref: BlockRef) -> BlockRef:
        """Replace the block at `index` (its data moved tiers); return the old ref."""
        old = self._refs[index]
        self._refs[index] = ref
        self.version += 1
        return old

    def truncate(self, num_tokens: int) -> list[BlockRef]:
        """Keep the first `num_tokens` slots; return the dropped trailing blocks to free."""
        _check_count(num_tokens, "num_tokens")
        if num_tokens > self.num_tokens:
            raise ValueError(
                f"cannot truncate sequence {self.seq_id!r} to {num_tokens} tokens: "
                f"it has {self.num_tokens}"
            )
        keep = math.ceil(num_tokens / self.block_size)
        dropped = self._refs[keep:]
        del self._refs[keep:]
        self.version += 1
        self.num_tokens = num_tokens
        return dropped

    def check(self, allocators: Mapping[str, TierAllocator]) -> None:
        """Raise RuntimeError if a block is freed, owned by another sequence or listed twice."""
        seen: set[BlockRef] = set()
        for ref in self._refs:
            if ref in seen:
                raise RuntimeError(
                    f"sequence {self.seq_id!r} lists block {ref.block_id} in tier "
                    f"{ref.tier!r} twice"
                )
            seen.add(ref)
            allocator = allocators.get(ref.tier)
            if allocator is None:
                raise RuntimeError(
                    f"sequence {self.seq_id!r} references block {ref.block_id} in unknown "
                    f"tier {ref.tier!r} (tiers: {', '.join(allocators)})"
                )
            allocator.check_owner(ref.block_id, self.seq_id)
