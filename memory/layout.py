"""What one block holds: `ArenaSpec` (one tensor of a block layout) and `BlockLayout`.

What lives here: the *description* of a block, as a strategy declares it (names, dtypes,
shapes with the block axis marked `BLOCKS`, bytes per block). What does not: the memory that
holds blocks (`memory.tiers`), allocating them (`memory.allocator`) or the pool (`memory.pool`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCKS = -1  # marks the block axis in an ArenaSpec shape


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
