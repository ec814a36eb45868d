"""Where a sequence's new blocks go inside a tier: contiguous growth and growth room.

What lives here: `Placement`, which picks the block ids for a sequence's growth on the device
tier (continuing after its last block, passing over blocks kept as growth room for other
sequences) and for blocks moving into a tier (continuing after the sequence's blocks there).
Runs of consecutive slots are attended in one piece, so keeping a sequence's blocks adjacent
pays on every step.

What does not: which tier a block belongs in (the strategies), reference counts and the free
queue (`memory.allocator`), the data (`memory.tiers`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from unikv.memory.allocator import BlockTable, TierAllocator
from unikv.memory.tiers import TierKind

SeqId = Hashable


class Placement:
    """Block ids for growth and moves; soft-reserved growth room on the device tier."""

    GROWTH_ROOM_BLOCKS = 8  # free blocks after a sequence that others pass over while they can
    RUN_SEARCH = 64  # blocks a new sequence looks below the queue's head for its run's start

    def __init__(self, allocators: Mapping[str, TierAllocator]) -> None:
        self._allocators = allocators
        self._room: dict[int, SeqId] = {}  # free device block -> sequence it is kept for
        self._room_of: dict[SeqId, list[int]] = {}

    def grow(self, seq: SeqId, table: BlockTable, need: int) -> list[int] | None:
        """`need` device blocks for the growth of `seq` (table `table`); None if they do not
        fit (nothing is taken). Keeps growth room after the last one."""
        alloc = self._allocators[TierKind.DEVICE]
        if not alloc.can_allocate(need):
            return None
        # Prefer the blocks right after the sequence's last one: attention then reads
        # one run of consecutive slots in place instead of attending piece by piece.
        ids: list[int] = []
        last = table[len(table) - 1] if len(table) else None
        nxt = last.block_id + 1 if last is not None and last.tier == TierKind.DEVICE else None
        if last is None:
            nxt = self._run_start(alloc, seq)
        while nxt is not None and len(ids) < need and alloc.take(nxt, seq):
            self.forget(nxt)
            ids.append(nxt)
            nxt += 1
        if len(ids) < need:
            rest = alloc.allocate(need - len(ids), seq, avoid=_RoomOfOthers(self._room, seq))
            assert rest is not None  # can_allocate said they fit
            # In ascending order: the free queue returns a finished sequence's blocks last
            # first, and blocks that were one run stay one run only in the order of their ids.
            rest.sort()
            for b in rest:
                self.forget(b)
            ids += rest
        self._keep(seq, ids[-1])
        return ids

    def _run_start(self, alloc: TierAllocator, seq: SeqId) -> int | None:
        """Where a new sequence starts: the low end of the free run the queue hands out next.

        A finished sequence's blocks go back to the queue last first, so the queue hands its
        run out from the top down; a sequence that started there and grew block by block
        would hold the run in descending order, one piece per block. Starting at the run's
        low end, it grows upward through it (`take`), in one piece."""
        head, others = alloc.next_free(), _RoomOfOthers(self._room, seq)
        if head is None or head in others:
            return None  # `allocate` passes over the room others keep
        low = head
        while low > 0 and head - low < self.RUN_SEARCH and alloc.takeable(low - 1) \
                and (low - 1) not in others:  # fmt: skip
            low -= 1
        return low

    def near(self, tier: str, seq: SeqId, table: BlockTable, todo: list[int]) -> list[int] | None:
        """Blocks of `tier` for table positions `todo`, continuing after the sequence's last
        block in that tier where free; None (nothing taken) if they do not fit."""
        alloc = self._allocators[tier]
        if not alloc.can_allocate(len(todo)):
            return None
        ids: list[int] = []
        before = [r.block_id for r in table.refs[: todo[0]] if r.tier == tier]
        nxt = before[-1] + 1 if before else None
        while nxt is not None and len(ids) < len(todo) and alloc.take(nxt, seq):
            ids.append(nxt)
            nxt += 1
        if len(ids) < len(todo):
            ids += sorted(alloc.allocate(len(todo) - len(ids), seq))  # runs stay runs (`grow`)
        if tier == TierKind.DEVICE:
            for b in ids:
                self.forget(b)
        return ids

    def _keep(self, seq: SeqId, last: int) -> None:
        """Soft-reserve the free blocks after `last` for the growth of `seq`.

        They stay free (usable by anyone once nothing else is left); other sequences' blocks
        are just taken elsewhere first, so concurrent sequences do not interleave.
        """
        alloc = self._allocators[TierKind.DEVICE]
        self.drop(seq)
        room: list[int] = []
        self._room_of[seq] = room
        # Room pays while memory is plentiful; once rooms would cover most of the free blocks,
        # keeping them only makes every allocation pass over them.
        if len(self._room) + self.GROWTH_ROOM_BLOCKS > alloc.num_free // 2:
            return
        for b in range(last + 1, min(last + 1 + self.GROWTH_ROOM_BLOCKS, alloc.num_blocks)):
            if not alloc.takeable(b) or self._room.get(b, seq) != seq:
                break
            self._room[b] = seq
            room.append(b)

    def forget(self, block_id: int) -> None:
        """Device block `block_id` was allocated: it is nobody's growth room any more."""
        owner = self._room.pop(block_id, None)
        if owner is not None:
            self._room_of[owner].remove(block_id)

    def drop(self, seq: SeqId) -> None:
        """Give up the growth room of `seq`."""
        for b in self._room_of.pop(seq, ()):
            del self._room[b]


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
