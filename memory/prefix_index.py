"""Prefix sharing for a pool's sequences: in memory, and content stored in a store tier.

What lives here: `PrefixIndex`, which keeps each sequence's published chain of content hashes,
finds cached blocks that start a prompt (`match`), attaches them to a new sequence (`attach`),
publishes a sequence's full blocks (`publish`), and finds and attaches content a store tier
holds from an earlier process or a write-through (`stored`, `attach_stored`).

What does not: the hash function and the hash -> block map (`memory.prefix`), reference
counts and revival (`memory.allocator`), the sequences' tables (`memory.pool` owns them and
hands them in), and writing content through to a store (`memory.services`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from unikv.memory.allocator import BlockTable, TierAllocator
from unikv.memory.prefix import BlockRef, PrefixCache, block_hash
from unikv.memory.tiers import StoreTier, Tier

SeqId = Hashable


class PrefixIndex:
    """The prefix cache of a pool's tensor tiers plus each sequence's chain of hashes."""

    def __init__(
        self,
        allocators: Mapping[str, TierAllocator],
        tiers: Mapping[str, Tier],
        block_size: int,
        identity: str,
    ) -> None:
        self.cache = PrefixCache()
        self._allocators, self._tiers = allocators, tiers
        self.block_size, self.identity = block_size, identity
        self._chains: dict[SeqId, list[bytes]] = {}  # published chain of each sequence

    def match(self, token_ids: Sequence[int]) -> list[BlockRef]:
        """The cached blocks that start `token_ids` (longest verified chain)."""
        return self.cache.match_prefix(token_ids, self.block_size, self.identity)

    def attach(self, table: BlockTable, refs: Sequence[BlockRef]) -> None:
        """Fill the new, empty `table` with shared references to the cached blocks `refs`."""
        hashes = []
        for ref in refs:
            self._allocators[ref.tier].acquire_cached(ref.block_id)
            table.append_blocks(ref.tier, [ref.block_id])
            hashes.append(self.cache.hash_of(ref))
        table.append_tokens(len(refs) * self.block_size)
        self._chains[table.seq_id] = hashes

    def stored(self, token_ids: Sequence[int], after: Sequence[BlockRef], tier: str) -> list[bytes]:
        """Content hashes of the blocks of `token_ids` that follow the blocks `after` (a
        `match` result) and are held by the store tier `tier`: the longest such chain."""
        t = self._tiers.get(tier)
        if not isinstance(t, StoreTier):
            return []
        bs = self.block_size
        parent = self.cache.hash_of(after[-1]) if after else None
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

    def attach_stored(self, table: BlockTable, hashes: Sequence[bytes], tier: str) -> bool:
        """Append blocks of the store tier `tier` holding the stored content `hashes` to
        `table`, without reading them; False (nothing changes) when the tier has no room."""
        t = self._tiers[tier]
        assert isinstance(t, StoreTier)
        if table.num_free_slots:
            raise RuntimeError(
                f"sequence {table.seq_id!r} ends in a partial block; cannot attach more"
            )
        ids = self._allocators[tier].allocate(len(hashes), table.seq_id) if hashes else []
        if ids is None:
            return False
        for b, h in zip(ids, hashes, strict=True):
            t.assign(b, h)
        table.append_blocks(tier, ids)
        table.append_tokens(len(ids) * self.block_size)
        self._chains.setdefault(table.seq_id, []).extend(hashes)
        return True

    def chain(self, seq: SeqId) -> list[bytes]:
        """The published chain of `seq`: one content hash per full block, in order."""
        return list(self._chains.get(seq, ()))

    def publish(self, table: BlockTable, token_ids: Sequence[int]) -> int:
        """Offer the full blocks of `table` (holding `token_ids`) to the prefix cache; return
        how many blocks are now part of its published chain."""
        hashes = self._chains.setdefault(table.seq_id, [])
        full = min(table.num_tokens, len(token_ids)) // self.block_size
        for i in range(len(hashes), full):
            ref = table[i]
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            parent = hashes[-1] if hashes else None
            h = None
            alloc = self._allocators[ref.tier]
            if alloc.prefix_cache is not None:
                h = alloc.cache_block(ref.block_id, parent, tokens, self.identity)
            # Another block may already hold this content; the chain continues either way.
            hashes.append(h or block_hash(parent, tokens, self.identity))
        return len(hashes)

    def key_by_content(
        self, seq: SeqId, tier: StoreTier, positions: Sequence[int], block_ids: Sequence[int]
    ) -> None:
        """Blocks of `seq` at table `positions` are moving into `block_ids` of the store tier
        `tier`: key those with a published hash by it (stored content is not written again)."""
        hashes = self._chains.get(seq, [])
        for i, new_id in zip(positions, block_ids, strict=True):
            if i < len(hashes):
                tier.assign(new_id, hashes[i])

    def relocate(self, old: BlockRef, new: BlockRef) -> None:
        """Let the cache entry of `old` (if only its sequence uses it) point at `new`."""
        src = self._allocators[old.tier]
        h = self.cache.hash_of(old)
        if h is None or src.ref_count(old.block_id) != 1:
            return
        entry = self.cache.get(h)
        src.uncache(old.block_id)
        dst = self._allocators[new.tier]
        if dst.prefix_cache is not None:
            dst.cache_block(new.block_id, entry.parent, entry.token_ids, entry.identity)

    def truncate(self, seq: SeqId, num_tokens: int) -> None:
        """`seq` keeps its first `num_tokens` slots: its chain keeps the blocks they fill."""
        hashes = self._chains.get(seq)
        if hashes is not None:
            del hashes[num_tokens // self.block_size :]

    def forget(self, seq: SeqId) -> None:
        """`seq` was freed: drop its chain (the cached blocks stay revivable)."""
        self._chains.pop(seq, None)
