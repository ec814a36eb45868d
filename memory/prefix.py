"""Prefix caching: stable chained content hashes and the hash -> block map.

What lives here: `block_hash` (a content hash of one full block, chained to its parent block's
hash, stable across processes and machines), `BlockRef` (which block in which tier) and
`PrefixCache` (hash -> block, with hit/miss counting and `match_prefix` over a prompt).

What does not: allocation and reference counts (`memory.allocator`), the KV bytes themselves
(tiers and strategies). The cache maps content to a block; keeping that block alive, reviving it
from the free queue and evicting it when the block is reused is the allocator's job, which calls
`PrefixCache.evict` at that point.

Why the stored token ids: a hash is only a claim. A hit is served only when the stored token ids,
parent hash and identity equal the requested ones (as in nano-vllm), so a collision, or a bug
that produces equal digests, can never serve another prompt's KV. What is left is a collision
in an earlier block of the chain whose child was verified against the colliding parent digest,
which needs a 256-bit blake2b collision.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

# Versioned personalisation: changing the encoding below must change this string, so old
# digests (e.g. persisted by the SSD tier) can never be confused with new ones.
_PERSON = b"unikv.block.v1"
_DIGEST_SIZE = 32
_MAX_TOKEN_ID = 2**64 - 1


class BlockRef(NamedTuple):
    """A block in a tier: `(tier, block_id)`."""

    tier: str
    block_id: int


def block_hash(parent: bytes | None, token_ids: Sequence[int], identity: str) -> bytes:
    """Content hash of one block: blake2b-256 over (identity, parent hash, token ids)."""
    if parent is not None and not isinstance(parent, bytes):
        raise ValueError(f"parent hash must be bytes or None, got {type(parent).__name__}")
    if not isinstance(identity, str) or not identity:
        raise ValueError(f"identity must be a non-empty string, got {identity!r}")
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE, person=_PERSON)
    ident = identity.encode()
    # Every variable-length field is length-prefixed so that no two different inputs can
    # produce the same byte stream (e.g. identity "ab"+tokens vs identity "a"+...).
    h.update(struct.pack("<I", len(ident)))
    h.update(ident)
    if parent is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01")
        h.update(struct.pack("<I", len(parent)))
        h.update(parent)
    h.update(struct.pack("<I", len(token_ids)))
    try:
        # Explicit little-endian uint64: the same bytes on every machine.
        h.update(struct.pack(f"<{len(token_ids)}Q", *token_ids))
    except struct.error as exc:
        bad = next(
            (t for t in token_ids if not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN_ID),
            None,
        )
        raise ValueError(
            f"token ids must be integers in [0, 2**64), got {bad!r} in block of {len(token_ids)}"
        ) from exc
    return h.digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, identity: str) -> Iterator[bytes]:
    """Yield the chained hash of each full block of `token_ids`, first block first."""
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size], identity)
        yield parent


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """What the cache stores per hash: the block and the content it was computed from."""

    ref: BlockRef
    parent: bytes | None
    token_ids: tuple[int, ...]
    identity: str


class PrefixCache:
    """Map from block content hash to the block holding that content.

    Hit-rate accounting is per full block: `match_prefix` counts every full block of the prompt
    as a query (so blocks after the first miss are misses too) and `lookup` counts one query.
    The hashes of the last `EVICTED_KEPT` blocks evicted for room are remembered by tier, so a
    lookup that stops at one of them is counted in `evicted_misses[tier]`: prefixes a larger
    tier would have kept (the advice on tier sizes reads it).
    """

    EVICTED_KEPT = 8192

    def __init__(self) -> None:
        self._by_hash: dict[bytes, CacheEntry] = {}
        self._by_ref: dict[BlockRef, bytes] = {}
        self.queries = 0
        self.hits = 0
        self._evicted: OrderedDict[bytes, str] = OrderedDict()  # hash -> tier it was evicted from
        self.evicted_misses: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, h: object) -> bool:
        return h in self._by_hash

    @property
    def misses(self) -> int:
        """Queries that were not served from the cache."""
        return self.queries - self.hits

    @property
    def hit_rate(self) -> float:
        """Hits ÷ queries (0.0 before the first query)."""
        return self.hits / self.queries if self.queries else 0.0

    def get(self, h: bytes) -> CacheEntry | None:
        """The entry stored under hash `h` (no verification, no counting)."""
        return self._by_hash.get(h)

    def newest(self, limit: int) -> list[bytes]:
        """The hashes of the `limit` most recently cached blocks, newest last (what a replica
        tells a request router about its prefix cache)."""
        if limit <= 0:
            return []
        keys = reversed(self._by_hash)  # dicts keep insertion order: the newest come first
        out = [h for _, h in zip(range(limit), keys, strict=False)]
        return out[::-1]

    def hash_of(self, ref: BlockRef) -> bytes | None:
        """The hash a block is cached under, or None."""
        return self._by_ref.get(ref)

    def _verified(
        self, h: bytes, parent: bytes | None, token_ids: tuple[int, ...], identity: str
    ) -> BlockRef | None:
        entry = self._by_hash.get(h)
        if entry is None:
            return None
        # NOTE: the digest alone is never trusted; see the module docstring.
        if entry.token_ids != token_ids or entry.parent != parent or entry.identity != identity:
            return None
        return entry.ref

    def lookup(
        self, parent: bytes | None, token_ids: Sequence[int], identity: str
    ) -> BlockRef | None:
        """The cached block holding exactly `token_ids` after `parent`, or None (counted)."""
        tokens = tuple(token_ids)
        h = block_hash(parent, tokens, identity)
        ref = self._verified(h, parent, tokens, identity)
        self.queries += 1
        if ref is not None:
            self.hits += 1
        else:
            self._missed(h)
        return ref

    def insert(
        self, ref: BlockRef, parent: bytes | None, token_ids: Sequence[int], identity: str
    ) -> bytes | None:
        """Cache `ref` as holding `token_ids` after `parent`; return its hash.

        Returns None (and caches nothing) when another block already holds this content: the
        first copy stays canonical and the caller's block simply stays uncached.
        Re-inserting the same block with the same content returns the same hash.
        """
        tokens = tuple(token_ids)
        h = block_hash(parent, tokens, identity)
        old = self._by_ref.get(ref)
        if old is not None:
            if old == h:
                return h
            raise RuntimeError(
                f"block {ref.block_id} in tier {ref.tier!r} is already cached with other content"
            )
        if h in self._by_hash:
            return None
        self._by_hash[h] = CacheEntry(ref, parent, tokens, identity)
        self._by_ref[ref] = h
        return h

    def evict(self, ref: BlockRef, for_room: bool = False) -> bool:
        """Forget the content of block `ref`; True if it was cached. `for_room`: the block was
        taken for other content (remembered, so a later lookup of it counts as evicted)."""
        h = self._by_ref.pop(ref, None)
        if h is None:
            return False
        del self._by_hash[h]
        if for_room:
            self._evicted[h] = ref.tier
            self._evicted.move_to_end(h)
            if len(self._evicted) > self.EVICTED_KEPT:
                self._evicted.popitem(last=False)
        return True

    def _missed(self, h: bytes) -> None:
        tier = self._evicted.get(h)
        if tier is not None:
            self.evicted_misses[tier] = self.evicted_misses.get(tier, 0) + 1

    def match_prefix(
        self, token_ids: Sequence[int], block_size: int, identity: str
    ) -> list[BlockRef]:
        """The longest chain of cached full blocks that starts the prompt `token_ids`.

        The caller decides how much of the match to use (e.g. it must still compute at least
        the last prompt token to get logits) and takes references through the allocator.
        """
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        tokens = tuple(token_ids)
        refs: list[BlockRef] = []
        parent: bytes | None = None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            chunk = tokens[start : start + block_size]
            h = block_hash(parent, chunk, identity)
            ref = self._verified(h, parent, chunk, identity)
            if ref is None:
                self._missed(h)
                break
            refs.append(ref)
            parent = h
        self.queries += len(tokens) // block_size
        self.hits += len(refs)
        return refs
