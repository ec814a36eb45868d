"""Prefix persistence, a service of the pool for every strategy: a prompt's full blocks written
through to the SSD tier and the remote tier (the shared server) by content, and found there
again by a later request, in this process or another.

What lives here: `PrefixPersistence` (`pool.persistence`, present when the pool has an SSD or
a remote tier): `find` (the stored chain of blocks that follows a prompt's in-memory hits: the
SSD tier's, then the remote tier's, copied into the SSD tier when there is one so a step never
reads the network; without one, the hits are attached in the remote tier, `tier`, and a
resident placement loads them into device blocks before the step),
`read_side` / `write_through` (what a format keeps beside block 0, e.g. hybrid's fp16 sinks,
goes in the same transaction as block 0), the hit counters, and closing the writers. What does
not: whether a hit is worth reading, and where an attached block is read from (the strategy's
placement: a tiered one reads SSD blocks where they are, a resident one loads them into device
blocks), the writers themselves (`memory.services`, `memory.remote`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from unikv.memory.prefix import BlockRef, chain_hashes
from unikv.memory.remote import RemoteTier, RemoteWriteThrough
from unikv.memory.services import WriteThrough
from unikv.memory.tiers import StoreTier, TierKind

log = logging.getLogger(__name__)


class PrefixPersistence:
    """Write-through and lookup of prompt blocks by content in the SSD and remote tiers."""

    def __init__(self, pool: Any, ssd: StoreTier | None, remote: RemoteTier | None) -> None:
        # `pool`: the UnifiedMemoryPool this serves (its tiers, prefix sharing, identity).
        if ssd is None and remote is None:
            raise ValueError("prefix persistence needs an SSD or a remote tier")
        self.pool, self.ssd, self.remote = pool, ssd, remote
        # The tier hits are attached in: the SSD tier (remote hits are copied there first).
        self.tier = TierKind.SSD if ssd is not None else TierKind.REMOTE
        self.writer = WriteThrough(ssd) if ssd is not None else None
        self.remote_writer = RemoteWriteThrough(remote) if remote is not None else None
        self.hits: dict[str, int] = {"requests": 0, "blocks": 0, "skipped_short": 0,
                                     "skipped_slow": 0}  # fmt: skip
        self.side_values_written = 0

    def _writers(self) -> list[WriteThrough]:
        return [w for w in (self.writer, self.remote_writer) if w is not None]

    def wait_snapshots(self) -> None:
        """Wait until blocks being persisted are copied (before they may be reused)."""
        for w in self._writers():
            w.wait_snapshots()

    def find(self, ids: Sequence[int], refs: Sequence[BlockRef]) -> list[bytes]:
        """Content hashes of the blocks of `ids` after the in-memory hits `refs` that the SSD
        tier holds, then the remote tier (copied into the SSD tier; bounded by the store's
        timeouts, none while its breaker is open): the longest chain. Without an SSD tier the
        remote tier's chain, attached there (`self.tier`)."""
        stored: list[bytes] = []
        if self.writer is not None:
            self.writer.wait_writes()  # content written through by this process counts
            stored = self.pool.sharing.stored(ids, refs)
        if self.remote is not None:
            start = len(refs) + len(stored)
            bs = self.pool.block_size
            hashes = list(chain_hashes(ids, bs, self.pool.identity))[start:]
            if not hashes:
                found = []
            elif self.ssd is not None:
                found = self.remote.promote(hashes, self.ssd)
            else:  # read from the server when attached (a resident placement loads them)
                found = hashes[: self.remote.present(hashes)]
            if found:
                self.hits["remote_blocks"] = self.hits.get("remote_blocks", 0) + len(found)
            stored += found
        return stored

    def read_side(self, ids: Sequence[int]) -> bytes | None:
        """What a format persisted beside block 0 of `ids`: from the SSD tier, else from the
        remote tier (then copied into the SSD tier); None when neither holds it."""
        bs = self.pool.block_size
        if len(ids) < bs:
            return None
        first = next(chain_hashes(list(ids[:bs]), bs, self.pool.identity))
        data = self.ssd.read_side(first) if self.ssd is not None else None
        if data is None and self.remote is not None:
            data = self.remote.read_side(first)
            if data is not None and self.ssd is not None:
                try:
                    self.ssd.write_content([], {}, [(first, data)])
                except OSError as e:  # a full SSD: used for this request only
                    log.warning("prefix state not copied to the SSD tier: %s", e)
        if data is not None:
            self.hits["side_loads"] = self.hits.get("side_loads", 0) + 1
        return data

    def write_through(self, seq: object, before: int, side: bytes | None) -> None:
        """Blocks [before, published) of `seq` go through to the SSD tier (and the remote
        tier), by content; `side` (what the format keeps beside block 0) goes in the same
        transaction as block 0."""
        chain = self.pool.sharing.chain(seq)
        sides = [(chain[0], side)] if side is not None and before == 0 and chain else []
        jobs = self.pool.sharing.resident_chain(seq, before)
        if sides and not any(h == chain[0] for b in jobs.values() for _, h in b):
            jobs = {TierKind.DEVICE: [], **jobs}  # block 0 is not in a tensor tier
        for tier, blocks in jobs.items():
            mine = sides if any(h == chain[0] for _, h in blocks) or not blocks else []
            for w in self._writers():
                w.submit(self.pool.tiers[tier], blocks, mine)
            self.side_values_written += len(mine)

    def stats(self) -> dict[str, Any]:
        w = self.writer
        return {
            "disk_prefix_hits": dict(self.hits),
            "blocks_written_through": w.blocks_written if w is not None else 0,
            "side_values_written": self.side_values_written,
            "remote": None
            if self.remote is None
            else {
                **self.remote.stats(),
                "blocks_written": self.remote_writer.blocks_written,
                "blocks_dropped": self.remote_writer.blocks_dropped,
            },
            "ssd_writes_skipped": w.writes_skipped if w is not None else 0,
        }

    def close(self) -> None:
        """Finish pending writes and stop the writers' threads (the tiers are the pool's to
        close); idempotent."""
        for w in self._writers():
            w.close()
