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
        while nxt is not None and len(ids) < need and alloc.take(nxt, seq):
            self.forget(nxt)
            ids.append(nxt)
            nxt += 1
        if len(ids) < need:
            rest = alloc.allocate(need - len(ids), seq, avoid=_RoomOfOthers(self._room, seq))
            assert rest is not None  # can_allocate said they fit
            for b in rest:
                self.forget(b)
            ids += rest
        self._keep(seq, ids[-1])
        return ids

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
            ids += alloc.allocate(len(todo) - len(ids), seq)
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
            blk = alloc.block(b)
            if blk.ref_count or blk.block_hash is not None or self._room.get(b, seq) != seq:
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
