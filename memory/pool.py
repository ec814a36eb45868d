"""The unified memory pool: the façade strategies and the scheduler ask for memory.

What lives here: `UnifiedMemoryPool`, which builds a pool's tiers from its config, keeps one
block table per sequence, and answers every request of a KV strategy or the scheduler
(reserve, commit, free, truncate, slots, prefixes, moves between tiers, stats and health) by
delegating to parts with one job each:

- `memory.tiers`: the tiers' data (`TensorTier` arenas, store-backed `StoreTier`);
- `memory.allocator`: blocks, reference counts and the LRU free queue of each tier;
- `memory.placement`: which block ids a sequence's growth and moves take (growth room);
- `memory.prefix_index`: prefix sharing in memory and content stored in a store tier;
- `memory.stats`: counters, the OOM predictor and health.

What does not: how K/V are encoded or attended (`kvstrategies/`), on-disk and remote block
stores (`storage/`, plugged in as `StoreTier`s), and the services strategies run beside the
pool (write-through, prefetch: `memory.services`).

Every byte of KV lives in a block of some tier; blocks move between tiers only through
`UnifiedMemoryPool.move`, which copies the data and updates the sequence's table together.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from unikv.memory.allocator import BlockTable, TierAllocator
from unikv.memory.health import HealthView, evaluate
from unikv.memory.layout import BLOCKS, ArenaSpec, BlockLayout
from unikv.memory.persistence import PrefixPersistence
from unikv.memory.placement import Placement
from unikv.memory.prefix import BlockRef
from unikv.memory.prefix_index import PrefixIndex
from unikv.memory.remote import RemoteTier
from unikv.memory.stats import HealthMonitor, PoolReport, PoolStats
from unikv.memory.tiers import BlockLostError, StoreTier, TensorTier, Tier, TierKind
from unikv.settings.config import PoolConfig

# Re-exported: strategies and the engine import the layout and tier types from here.
__all__ = [
    "BLOCKS",
    "ArenaSpec",
    "BlockLayout",
    "BlockLostError",
    "StoreTier",
    "TensorTier",
    "Tier",
    "TierKind",
    "Reservation",
    "UnifiedMemoryPool",
]

SeqId = Hashable
# One owner (docs/architecture.md): a pool has no lock; an engine makes its compute thread the
# pool's `owner`, and with this on (`UNIKV_CHECK_OWNER=1`; the tests turn it on) a mutation
# from any other thread raises instead of racing.
CHECK_OWNER = os.environ.get("UNIKV_CHECK_OWNER") == "1"


class Reservation:
    """Room `reserve` made: `tokens` more tokens of a sequence fit in its device blocks,
    `new_blocks` of them appended for it. The step that follows uses it (`covers`)."""

    __slots__ = ("_table", "new_blocks", "seq", "tokens")

    def __init__(self, table: BlockTable, tokens: int, new_blocks: tuple[int, ...]) -> None:
        self._table, self.seq = table, table.seq_id
        self.tokens, self.new_blocks = tokens, new_blocks

    def covers(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens still fit in what was reserved."""
        return num_tokens <= self.tokens and num_tokens <= self._table.num_free_slots

    def __repr__(self) -> str:
        return f"Reservation(seq={self.seq!r}, tokens={self.tokens}, new_blocks={self.new_blocks})"


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
        self.tiers: dict[str, Tier] = {}
        self.allocators: dict[str, TierAllocator] = {}
        self.prefixes = PrefixIndex(self.allocators, self.tiers, self.block_size, identity)
        self.stats = PoolStats(self.allocators, self.prefixes.cache)
        self.health_monitor = HealthMonitor(clock=clock, stats=self.stats)
        _build_tiers(self, dict(stores or {}))
        self.placement = Placement(self.allocators)
        self._clock = clock
        self._last_sample = float("-inf")
        self._tables: dict[SeqId, BlockTable] = {}
        self.sharing = PrefixSharing(self.prefixes, self._tables, self.tiers, self.block_size,
                                     self._owned)  # fmt: skip
        # Prompt blocks written through to the SSD and remote tiers by content, and found
        # there again: a service for every strategy (None without either tier).
        ssd, remote = self.tiers.get(TierKind.SSD), self.tiers.get(TierKind.REMOTE)
        ssd = ssd if isinstance(ssd, StoreTier) else None
        remote = remote if isinstance(remote, RemoteTier) else None
        has_store = ssd is not None or remote is not None
        self.persistence = PrefixPersistence(self, ssd, remote) if has_store else None
        self.owner: int | None = None  # the thread that alone may mutate the pool (None: any)

    def _owned(self) -> None:
        if CHECK_OWNER and self.owner is not None and threading.get_ident() != self.owner:
            raise RuntimeError(
                f"the pool was mutated from thread {threading.current_thread().name!r}; only "
                "its owner (the engine's compute thread) may: hand it the work instead"
            )

    # ---- queries ------------------------------------------------------------------------------

    def arena(self, name: str, tier: str = TierKind.DEVICE) -> torch.Tensor:
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

    def tokens_by_tier(self) -> dict[str, int]:
        """Filled token slots per tier over all sequences (a shared block once per sequence)."""
        bs = self.block_size
        tokens = dict.fromkeys(self.tiers, 0)
        for table in list(self._tables.values()):
            for i, ref in enumerate(table.refs):
                tokens[ref.tier] += min(bs, table.num_tokens - i * bs)
        return tokens

    def capacity_tokens(self, tier: str = TierKind.DEVICE) -> int:
        """Tokens the whole tier can hold."""
        return self.allocators[tier].num_blocks * self.block_size

    def usage(self, tier: str = TierKind.DEVICE) -> float:
        """Used fraction of a tier."""
        return self.allocators[tier].usage

    def can_admit(self, num_tokens: int, tier: str = TierKind.DEVICE) -> bool:
        """Whether a new sequence of `num_tokens` fits and leaves the tier's watermark free."""
        return self.allocators[tier].can_admit(-(-num_tokens // self.block_size))

    # ---- sequences ----------------------------------------------------------------------------

    def reserve(self, seq: SeqId, num_tokens: int) -> Reservation | None:
        """Make room on the device tier for `num_tokens` more tokens of `seq`: what was
        reserved, or None, changing nothing, when the blocks are not there."""
        self._owned()
        table = self._tables.get(seq) or BlockTable(seq, self.block_size)
        _check_on_device(table)
        need = table.slots_needed(num_tokens)
        ids: list[int] = []
        if need:
            ids = self.placement.grow(seq, table, need)
            if ids is None:
                return None
            table.append_blocks(TierKind.DEVICE, ids)
        self._tables[seq] = table
        return Reservation(table, num_tokens, tuple(ids))

    def commit(self, seq: SeqId, num_tokens: int) -> None:
        """Record that `num_tokens` reserved slots of `seq` now hold data."""
        self._owned()
        self._require(seq).append_tokens(num_tokens)

    def free(self, seq: SeqId) -> None:
        """Release every block of `seq` (its cached prefix blocks stay revivable)."""
        self._owned()
        table = self._tables.pop(seq, None)
        self.prefixes.forget(seq)
        self.placement.drop(seq)
        if table is None:
            return
        by_tier: dict[str, list[int]] = {}
        for ref in table:
            by_tier.setdefault(ref.tier, []).append(ref.block_id)
        for tier, ids in by_tier.items():
            self._release(tier, ids)

    def truncate(self, seq: SeqId, num_tokens: int) -> None:
        """Keep the first `num_tokens` slots of `seq`; trailing blocks go back to the pool."""
        self._owned()
        table = self._require(seq)
        dropped = table.truncate(num_tokens)
        self.prefixes.truncate(seq, num_tokens)
        for ref in dropped:
            self._release(ref.tier, [ref.block_id])

    def slot_ids(self, seq: SeqId, start: int, end: int) -> torch.Tensor:
        """Device-arena slot index (block_id * block_size + offset) of tokens [start, end)."""
        if end - start <= self.block_size:  # a decode step's few tokens: a tensor made from ints
            slots = self.slot_list(seq, start, end)
            return torch.tensor(slots, dtype=torch.long, device=self.device)
        refs = self._device_refs(seq, start, end)
        bs, first = self.block_size, start // self.block_size
        ids = torch.tensor([r.block_id for r in refs], dtype=torch.long)
        slots = (ids[:, None] * bs + torch.arange(bs)).flatten()
        return slots[start - first * bs : end - first * bs].to(self.device)

    def slot_list(self, seq: SeqId, start: int, end: int) -> list[int]:
        """`slot_ids` as a list of ints (a decode step's few tokens: the caller makes one
        tensor of every sequence's)."""
        refs, bs = self._device_refs(seq, start, end), self.block_size
        first = start // bs
        return [refs[t // bs - first].block_id * bs + t % bs for t in range(start, end)]

    def _device_refs(self, seq: SeqId, start: int, end: int) -> tuple[BlockRef, ...]:
        """The blocks of `seq` that hold tokens [start, end), refused unless all on the device."""
        table, bs = self._require(seq), self.block_size
        refs = table.refs[start // bs : -(-end // bs)]
        if any(r.tier != TierKind.DEVICE for r in refs):
            raise RuntimeError(f"sequence {seq!r} has blocks off the device tier; swap it in first")
        return refs

    def slot_runs(self, seq: SeqId, end: int) -> list[tuple[int, int]]:
        """Tokens [0, end) of `seq` as (start_slot, end_slot) runs of consecutive device slots."""
        table = self._require(seq)
        bs = self.block_size
        runs: list[list[int]] = []
        for i in range(-(-end // bs)):
            ref = table[i]
            if ref.tier != TierKind.DEVICE:
                raise RuntimeError(f"sequence {seq!r} has blocks off the device tier")
            start = ref.block_id * bs
            if runs and runs[-1][1] == start:
                runs[-1][1] += bs
            else:
                runs.append([start, start + bs])
        runs[-1][1] -= -(-end // bs) * bs - end  # the last block may be partly filled
        return [(s, e) for s, e in runs]

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
        self._owned()
        table = self._require(seq)
        if dst not in self.tiers:
            raise ValueError(f"no tier {dst!r} in this pool (tiers: {', '.join(self.tiers)})")
        todo = [i for i in indices if table[i].tier != dst]
        if not todo:
            return True
        new_ids = self.placement.near(dst, seq, table, todo)
        if new_ids is None:
            return False
        dst_tier = self.tiers[dst]
        if isinstance(dst_tier, StoreTier):
            self.prefixes.key_by_content(seq, dst_tier, todo, new_ids)
        by_src: dict[str, list[tuple[int, int]]] = {}
        for i, new_id in zip(todo, new_ids, strict=True):
            by_src.setdefault(table[i].tier, []).append((i, new_id))
        # Copy everything first: a failed read or write leaves the table as it was.
        copies = []
        try:
            for src, pairs in by_src.items():
                data = self.tiers[src].read([table[i].block_id for i, _ in pairs])
                dst_tier.write([n for _, n in pairs], data)
                copies.append((src, pairs))
        except Exception:
            self._release(dst, new_ids)
            raise
        for src, pairs in copies:
            for i, new_id in pairs:
                old = table.move(i, BlockRef(dst, new_id))
                if relocate_cache:
                    self.prefixes.relocate(old, BlockRef(dst, new_id))
                self._release(src, [old.block_id])
            self.stats.record_move(src, dst, len(pairs))
        return True

    def swap_out(self, seq: SeqId, dst: str = TierKind.HOST) -> bool:
        """Move every device block of `seq` to `dst` (preemption by swapping)."""
        self._owned()
        table = self._require(seq)
        if dst not in self.tiers:
            return False
        ok = self.move(seq, [i for i, r in enumerate(table) if r.tier == TierKind.DEVICE], dst)
        if ok:
            self.record_preemption()
        return ok

    def swap_in(self, seq: SeqId) -> bool:
        """Bring every block of `seq` back to the device tier; False if it does not fit."""
        self._owned()
        table = self._require(seq)
        todo = [i for i, r in enumerate(table) if r.tier != TierKind.DEVICE]
        return self.move(seq, todo, TierKind.DEVICE)

    # ---- statistics and health ----------------------------------------------------------------

    def record_preemption(self) -> None:
        """Count a preempted sequence (swapped out or dropped for recompute)."""
        self._owned()
        self.health_monitor.record_preemption()

    SAMPLE_EVERY_S = 0.25  # usage samples for the OOM predictor: 240 per one-minute window

    def sample_usage(self) -> None:
        """Feed the OOM predictor the device usage, at most every SAMPLE_EVERY_S seconds."""
        self._owned()
        now = self._clock()
        if now - self._last_sample >= self.SAMPLE_EVERY_S:
            self._last_sample = now
            self.health_monitor.predictor.record(self.usage(TierKind.DEVICE), now)

    def health(self) -> HealthView:
        """Green / yellow / red by the one health rule (`memory.health`) over what the pool
        measures: device usage, recent preemptions, checksum failures, OOM warnings and the
        problems a store tier reports (the remote tier's open circuit breaker)."""
        return evaluate(_health_inputs(self))

    def snapshot(self) -> PoolReport:
        """Usage per tier, prefix hit rate, allocations, evictions, preemptions, health (with
        the readings it was coloured from, which the server's view adds to); `as_dict()` for
        JSON."""
        inputs = _health_inputs(self)
        return PoolReport(
            counters=self.stats.snapshot(),
            health=evaluate(inputs),
            readings=inputs,
            tier_services={
                name: t.stats()
                for name, t in self.tiers.items()
                if callable(getattr(t, "problem", None))
            },
            block_size=self.block_size,
            page_bytes=self.layout.page_bytes,
            sequences=len(self._tables),
            oom_warnings=self.health_monitor.predictor.warnings,
        )

    # ---- internals ----------------------------------------------------------------------------

    def _release(self, tier: str, ids: list[int]) -> None:
        self.allocators[tier].free(ids)
        t = self.tiers[tier]
        if isinstance(t, StoreTier):
            t.release([b for b in ids if self.allocators[tier].ref_count(b) == 0])

    def _require(self, seq: SeqId) -> BlockTable:
        table = self._tables.get(seq)
        if table is None:
            raise RuntimeError(f"sequence {seq!r} has no blocks in the pool")
        return table


def _health_inputs(pool: UnifiedMemoryPool):
    """The pool's readings for the health rule: device usage, its recent events, and the
    problems its store tiers report (the remote tier's open circuit breaker)."""
    problems = tuple(p for t in pool.tiers.values() if (p := _problem(t)))
    return pool.health_monitor.inputs(pool.usage(TierKind.DEVICE), problems)


def _build_tiers(pool: UnifiedMemoryPool, stores: dict[str, Tier]) -> None:
    """The tiers and their allocators of `pool`'s config (store tiers from `stores`)."""
    config, layout = pool.config, pool.layout
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
        elif tc.name in (TierKind.DEVICE, TierKind.HOST):
            dev = pool.device if tc.name == TierKind.DEVICE else torch.device("cpu")
            tier = TensorTier(tc.name, layout, num_blocks, dev)
        else:
            raise ValueError(
                f"{config.source}: [tiers.{tc.name}] needs a block store (pass "
                f"stores={{'{tc.name}': ...}}: engine.assembly.build_kv opens it)"
            )
        pool.tiers[tc.name] = tier
        if isinstance(tier, StoreTier):  # corrupt values it finds count here (health)
            tier.on_corrupt = pool.health_monitor.record_checksum_failure
        pool.allocators[tc.name] = TierAllocator(
            tc.name,
            num_blocks,
            pool.block_size,
            low_watermark=tc.low_watermark,
            # Device and host blocks can be found by content; a store tier is its own index.
            prefix_cache=pool.prefixes.cache if isinstance(tier, TensorTier) else None,
        )
    if stores:
        raise ValueError(f"stores given for tiers not in the config: {', '.join(stores)}")


def _check_on_device(table: BlockTable) -> None:
    # Only the last block is ever written into, and only while it has free slots.
    if len(table) and table.num_free_slots and table[len(table) - 1].tier != TierKind.DEVICE:
        raise RuntimeError(f"sequence {table.seq_id!r} is swapped out; swap it in before appending")


def _problem(tier: Tier) -> str | None:
    """What a tier reports as wrong now (only tiers that fail soft have `problem`)."""
    problem = getattr(tier, "problem", None)
    return problem() if callable(problem) else None


class PrefixSharing:
    """A pool's prefix sharing by sequence (`pool.sharing`): find cached blocks that start a
    prompt, attach them (from a tensor tier, or content a store tier holds), publish a
    sequence's full blocks, and list what a write-through copies. It works on the pool's
    tables (handed in) through its `PrefixIndex`; every mutation is the pool owner's."""

    def __init__(self, index: PrefixIndex, tables: dict, tiers: Mapping[str, Tier],
                 block_size: int, owned: Callable[[], None]) -> None:  # fmt: skip
        self.index, self._tables, self._tiers = index, tables, tiers
        self.block_size, self._owned = block_size, owned

    def _require(self, seq: SeqId) -> BlockTable:
        table = self._tables.get(seq)
        if table is None:
            raise RuntimeError(f"sequence {seq!r} has no blocks in the pool")
        return table

    def match(self, token_ids: Sequence[int]) -> list[BlockRef]:
        """The cached device blocks that start `token_ids` (longest verified chain)."""
        return self.index.match(token_ids)

    def attach(self, seq: SeqId, refs: Sequence[BlockRef]) -> int:
        """Start the new sequence `seq` on shared cached blocks; return the tokens they hold."""
        self._owned()
        if seq in self._tables:
            raise RuntimeError(f"sequence {seq!r} already has blocks; attach a prefix first")
        table = BlockTable(seq, self.block_size)
        self.index.attach(table, refs)
        self._tables[seq] = table
        return table.num_tokens

    def stored(
        self, token_ids: Sequence[int], after: Sequence[BlockRef] = (), tier: str = TierKind.SSD
    ) -> list[bytes]:
        """Content hashes of the blocks of `token_ids` that follow the blocks `after` (a
        `match` result) and are held by the store tier `tier` (stored by an earlier
        process, or written through by this one): the longest such chain."""
        return self.index.stored(token_ids, after, tier)

    def attach_stored(self, seq: SeqId, hashes: Sequence[bytes], tier: str = TierKind.SSD) -> int:
        """Append to `seq` (new, or just attached) blocks of the store tier `tier` that hold
        the stored content `hashes`, without reading them; return the tokens of `seq`.
        Nothing changes (0 is returned) when the tier has no room for them."""
        self._owned()
        table = self._tables.get(seq) or BlockTable(seq, self.block_size)
        if not self.index.attach_stored(table, hashes, tier):
            return table.num_tokens if seq in self._tables else 0
        self._tables[seq] = table
        return table.num_tokens

    def chain(self, seq: SeqId) -> list[bytes]:
        """The published chain of `seq`: one content hash per full block, in order."""
        return self.index.chain(seq)

    def publish(self, seq: SeqId, token_ids: Sequence[int]) -> int:
        """Offer the full blocks of `seq` (holding `token_ids`) to the prefix cache.

        Returns how many blocks of `seq` are now part of its published chain. Cached blocks
        become read-only; a sequence only ever writes into its last, partial block.
        """
        self._owned()
        return self.index.publish(self._require(seq), token_ids)

    def resident_chain(self, seq: SeqId, start: int = 0) -> dict[str, list[tuple[int, bytes]]]:
        """Published blocks [start, ...) of `seq` held in tensor tiers, per tier: (block id,
        content hash) in table order (what a write-through copies to a store tier)."""
        hashes = self.index.chain(seq)
        refs = self._require(seq).refs
        by_tier: dict[str, list[tuple[int, bytes]]] = {}
        for i in range(start, len(hashes)):
            if isinstance(self._tiers[refs[i].tier], TensorTier):
                by_tier.setdefault(refs[i].tier, []).append((refs[i].block_id, hashes[i]))
        return by_tier
