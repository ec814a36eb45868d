"""The `tiered` placement (`TieredPlacement`): blocks by recency on the device, host and SSD
tiers (the `hierarchical_offload` preset is it over the dense format).

It works over any format: the format says which leading blocks attention reads from the pool
and what a staged group becomes (`Format.pool_blocks`, `Format.stage`), and attends over the
groups this placement puts in the step (`Step.groups`, `Step.staged`, `Step.in_place`). A
quantized format's blocks move, are staged and written through as their packed records. Over
the dense format attention is exact and the strategy lossless. Where a sequence's blocks live:

    oldest ................................................................ newest
    [ SSD tier (LMDB, one value per block and layer) | host tier | device tier ]
                                                       host_window  device_window

Before each step (`before_step`) every sequence of the batch is rebalanced: blocks that fell out
of the device window move to host, those out of the host window to the SSD tier; blocks inside
a window that sit lower (an SSD prefix hit, a swapped-in sequence) are promoted. A full tier
keeps the block one level up instead (nothing is lost; a full disk is logged, not fatal).

Attention per layer is `attention_runs` over the pieces in token order: the device runs and
(on a CPU, where host memory is directly addressable) the host runs are views into the
arenas; SSD blocks (and host blocks on an accelerator, or with `host_access = "stage"`) are
fetched into staging tensors by the pool's `Prefetcher` (memory.services) a few layers ahead,
so reading layer L+depth overlaps the compute of layer L; the last layers of a step start the
next step's first ones.

Persistent prefix cache: the pool's service for every placement (`memory.persistence`, used
by `Placement`'s `match_prefix` and `publish`): a prefill's full blocks go through to the SSD
tier (and the remote tier) by content hash, and a later request, in this process or another,
that starts with the same tokens attaches them. This placement attaches them *without reading
them*: they stay in the SSD tier until their window promotes them, and attention reads them
through the prefetcher; a hit is taken when reading beats recomputing by the rates this
process measured (`_reading_pays`) and it is at least `min_disk_hit_tokens` long.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from unikv.memory.services import Prefetcher
from unikv.memory.tiers import StoreTier, TierKind

from .axes import PERSIST_OPTIONS, PLACEMENTS, Placement, Step
from .kv import KVSpec, StepBatch
from .options import Option

log = logging.getLogger(__name__)

_HOST_ACCESS = ("auto", "stage")


@PLACEMENTS.register
class TieredPlacement(Placement):
    """A format's blocks move device -> host -> SSD as they age: it places blocks, stages those
    attention cannot read in place and writes prefixes through; the format attends over what
    the step's groups say."""

    name = "tiered"
    help = "device -> host -> SSD -> remote by recency, prefetched"
    offloads = True

    options = (
        Option("device_window", int, 1024, "newest tokens kept on the device tier", low=1,
               allowed_text=">= 1 (the block being written is always on the device)"),
        Option("host_window", int, 2048, "the next newest tokens, kept in host memory (older "
               "ones in the SSD tier)", low=0),
        Option("prefetch_depth", int, None, "layers fetched ahead", low=1,
               none="the chip profile's"),
        Option("host_access", str, "auto", "auto: attend host blocks in place where the device "
               "can read host memory; stage: always copy them first", choices=_HOST_ACCESS),
        *PERSIST_OPTIONS,
        Option("io_threads", int, 2, "threads reading the SSD tier (each runs one layer's "
               "fetch)", low=1),
        Option("sparse_staging", str, "likely", "under a sparse selection, stage ahead only "
               "the blocks each layer read at the step before (likely; others are read when "
               "chosen), or all of them", choices=("likely", "all")),
    )  # fmt: skip
    # 64-token blocks: one SSD value per block and layer is then 96 KiB for SmolLM2 (fp32),
    # large enough that disk reads run near the device's bandwidth (16-token values of 24 KiB
    # spend most of a read on per-value overhead: measured 0.53 GB/s cold vs ... at 64).
    default_block_size = 64
    # What the contract tests run with: windows small enough that every tier is used.
    contract_options = {"device_window": 8, "host_window": 8, "min_disk_hit_tokens": 0}

    @classmethod
    def store_slices(cls, spec: KVSpec) -> int:
        return spec.num_layers  # one value per (block, layer): layers are fetched one by one

    @classmethod
    def from_profile(cls, profile, options: dict[str, Any]) -> dict[str, Any]:
        if options.get("prefetch_depth") is None:
            options = {**options, "prefetch_depth": max(1, profile.tuned.l2_prefetch_depth)}
        return options

    def __init__(self, pool, spec: KVSpec, opts: dict[str, Any], fmt, label: str) -> None:
        super().__init__(pool, spec, opts, fmt, label)
        o = self.opts
        bs = pool.block_size
        self.device_blocks = max(1, math.ceil(o["device_window"] / bs))
        self.host_blocks = math.ceil(o["host_window"] / bs)
        self.host = pool.tiers.get(TierKind.HOST)
        ssd = pool.tiers.get(TierKind.SSD)
        self.ssd = ssd if isinstance(ssd, StoreTier) else None
        if self.ssd is not None and self.ssd.slices != spec.num_layers:
            raise ValueError(
                f"strategy {self.label!r}: the SSD tier must store one value per layer "
                f"(slices = {spec.num_layers}), got slices = {self.ssd.slices}"
            )
        # Host blocks are attended in place when the compute device reads host memory.
        self.stage_host = o["host_access"] == "stage" or pool.device.type != "cpu"
        self._tier_layers = {
            tier: fmt.arena_layers(pool.arena("kv", tier))
            for tier in (TierKind.DEVICE, TierKind.HOST)
            if tier in pool.tiers and self._in_place(tier)
        }
        depth = o["prefetch_depth"] or 1
        self.prefetcher = Prefetcher(
            pool.tiers, spec.num_layers, depth, o["io_threads"], device=pool.device,
            stage=fmt.stage,
        )  # fmt: skip
        # Measured rate for the disk-hit decision (EMA): prefill seconds per token, None until
        # first seen; the prefetcher measures the SSD tier's read rate.
        self.prefill_s_per_token: float | None = None
        self._step_t0 = 0.0
        self.demotion_failures = 0
        self.ssd_moves_skipped = 0  # blocks a failing SSD tier could not take
        self._failing: set[str] = set()  # tiers whose last move failed (logged on a change)
        self._plan, self._partial, self._spans = None, False, []  # the step's staging (`place`)

    # ---- the step ----------------------------------------------------------------------------

    def _in_place(self, tier: str) -> bool:
        """Whether attention reads blocks of `tier` in place (else they are staged)."""
        return tier == TierKind.DEVICE or (tier == TierKind.HOST and not self.stage_host)

    def before_step(self, batch: StepBatch) -> None:
        self._step_t0 = time.perf_counter()
        super().before_step(batch)
        for sid in batch.seq_ids:
            if self.pool.table(sid) is not None:
                self.rebalance(sid)

    def place(self, step: Step) -> None:
        pool, batch = self.pool, step.batch
        # Per sequence: the blocks attention reads from the pool (the format's count), grouped
        # by tier in token order: (tier, ids) read in place or ("staged", index) filled by the
        # prefetcher; the plan lists what is to be staged.
        # A selection that reads some blocks (sparse) says which it will likely read: only
        # those are staged ahead, the others when chosen (`reading`).
        step.groups, plan = [], []
        self._spans = []  # per sequence: (first block, blocks) of each staged group
        for sid, p, n in zip(batch.seq_ids, step.past, batch.query_lens, strict=True):
            refs = pool.table(sid).refs[: self.format.pool_blocks(p, n)]
            likely = step.likely(sid) if self.opts["sparse_staging"] == "likely" else None
            groups, staged, spans, at = [], [], [], 0
            for tier, ids in _segments(refs):
                if self._in_place(tier):
                    groups.append((tier, ids))
                else:
                    groups.append(("staged", len(staged)))
                    staged.append((tier, tuple(ids), _ahead(likely, at, len(ids))))
                    spans.append((at, len(ids)))
                at += len(ids)
            step.groups.append(groups)
            plan.append((sid, tuple(staged)))
            self._spans.append(spans)
        self._plan = tuple(plan) if any(staged for _, staged in plan) else None
        self._partial = self._plan is not None and any(
            rows is not None for _, staged in plan for _, _, rows in staged
        )
        self.prefetcher.start_step(self._plan)
        step.staged, step.in_place = self._staged, self._tier_layers

    def stages(self, step: Step) -> bool:
        # Nothing staged this step (no SSD blocks; host blocks read in place): no layer work.
        return self._plan is not None

    def _staged(self, layer: int, count: bool) -> list | None:
        if self._plan is None:
            return None
        out = self.prefetcher.get(layer, count)
        if self._partial and not count:  # a whole read (`Format.read`): every block
            self.prefetcher.fill_all(layer)
        return out

    def reading(self, layer: int, step: Step, chosen) -> None:
        """The chosen blocks that were not staged ahead are read now (late), before attention
        reads them; a sequence reading everything gets every block."""
        if not self._partial:
            return
        self.prefetcher.get(layer)
        for i, spans in enumerate(self._spans):
            blocks = None if chosen is None else chosen[i]
            picked = None if blocks is None else blocks.unique().tolist()
            for g, (start, n) in enumerate(spans):
                rows = None if picked is None else [b - start for b in picked
                                                    if start <= b < start + n]  # fmt: skip
                self.prefetcher.fill(layer, i, g, rows)

    def after_step(self, step: Step) -> None:
        super().after_step(step)
        b = step.batch
        if b.num_tokens >= self.pool.block_size:  # a prefill chunk: what recomputing costs
            rate = (time.perf_counter() - self._step_t0) / b.num_tokens
            self.prefill_s_per_token = _ema(self.prefill_s_per_token, rate)

    def abort(self) -> None:
        self.prefetcher.start_step(None)

    # ---- placement by recency ----------------------------------------------------------------

    def rebalance(self, seq_id: int) -> None:
        """Put each block of `seq_id` in the tier its age asks for, as far as tiers have room."""
        pool = self.pool
        table = pool.table(seq_id)
        n = len(table)
        # Blocks from the first one with free slots on are (about to be) written: device.
        device_from = max(0, min(n - self.device_blocks, table.num_tokens // pool.block_size))
        host_from = max(0, device_from - self.host_blocks) if self.host is not None else device_from
        if self.ssd is None:
            host_from = 0  # no SSD tier: the host tier takes everything older
        want = [TierKind.SSD] * host_from + [TierKind.HOST] * (device_from - host_from)
        want += [TierKind.DEVICE] * (n - device_from)
        # Demote first (it frees device room), then promote.
        for dst in (TierKind.SSD, TierKind.HOST, TierKind.DEVICE):
            todo = [i for i, r in enumerate(table.refs) if want[i] == dst and r.tier != dst]
            if todo:
                self._move(seq_id, todo, dst)

    def _move(self, seq_id: int, todo: list[int], dst: str) -> None:
        fallbacks = {
            TierKind.SSD: (TierKind.SSD, TierKind.HOST),
            TierKind.HOST: (TierKind.HOST,),
            TierKind.DEVICE: (TierKind.DEVICE,),
        }[dst]
        for tier in fallbacks:
            if tier not in self.pool.tiers:
                continue
            try:
                moved = self.pool.move(seq_id, todo, tier, relocate_cache=True)
            except OSError as e:  # a full disk, an I/O error: keep the blocks where they are
                self.demotion_failures += 1
                if tier == TierKind.SSD:
                    self.ssd_moves_skipped += len(todo)
                if tier not in self._failing:  # once per state change, not at every step
                    self._failing.add(tier)
                    log.warning("%s: blocks stay off the %s tier (reported once until a move "
                                "succeeds; skipped blocks are counted): %s",
                                self.label, tier, e)  # fmt: skip
                continue
            if tier in self._failing:
                self._failing.discard(tier)
                log.info("%s: the %s tier takes blocks again", self.label, tier)
            if moved:
                return

    # ---- prefix sharing: the base's, with disk hits read in place (prefetched) -------------

    def _reading_pays(self, blocks: int) -> bool:
        """Whether reading `blocks` from the SSD tier is expected to be quicker than computing
        them again, by the rates measured in this process (True until both are known)."""
        read_rate = self.prefetcher.read_bytes_per_s
        if self.prefill_s_per_token is None or read_rate is None:
            return True
        read_s = blocks * self.pool.layout.page_bytes / read_rate
        return read_s < blocks * self.pool.block_size * self.prefill_s_per_token

    # ---- memory management hooks -------------------------------------------------------------

    def capacity_tokens(self) -> int | None:
        return sum(self.pool.capacity_tokens(t) for t in self.pool.tiers)

    def can_admit(self, num_tokens: int) -> bool:
        # Only the newest `device_window` tokens (and the block being written) need the device.
        on_device = min(num_tokens, (self.device_blocks + 1) * self.pool.block_size)
        return self.pool.can_admit(on_device)

    def swap_out(self, seq_id: int) -> bool:
        table = self.pool.table(seq_id)
        if table is None:
            return False
        on_device = [i for i, r in enumerate(table.refs) if r.tier == TierKind.DEVICE]
        for dst in (TierKind.HOST, TierKind.SSD):
            if dst in self.pool.tiers and self.pool.move(seq_id, on_device, dst, True):
                self.pool.record_preemption()
                return True
        return False

    def swap_in(self, seq_id: int) -> bool:
        self.rebalance(seq_id)
        table = self.pool.table(seq_id)
        return not table.num_free_slots or table[len(table) - 1].tier == TierKind.DEVICE

    def close(self) -> None:
        """Stop the I/O threads; finish pending writes and close the store tiers (the base)."""
        self.prefetcher.close()
        super().close()

    def stats(self) -> dict:
        out = {"disk_prefix_hits": {}, "blocks_written_through": 0, "side_values_written": 0,
               "remote": None, "ssd_writes_skipped": 0} | super().stats()  # fmt: skip
        # Blocks the SSD tier could not take (a full disk): not written through, or kept in
        # host memory instead of moving down. /metrics: unikv_ssd_writes_skipped_total.
        out["ssd_writes_skipped"] += self.ssd_moves_skipped
        return out | {
            "tokens_by_tier": self.pool.tokens_by_tier(),
            "prefetch": self.prefetcher.stats(),
            "demotion_failures": self.demotion_failures,
        }


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def _ahead(likely: list[set[int] | None] | None, start: int, n: int):
    """Rows of a staged group of `n` blocks from block `start` to read ahead, per layer (None
    for a layer: all of them); None: all, at every layer."""
    if likely is None:
        return None
    rows = tuple(
        None if want is None else tuple(r for r in range(n) if start + r in want) for want in likely
    )
    return None if all(r is None or len(r) == n for r in rows) else rows


def _segments(refs) -> list[tuple[str, list[int]]]:
    """Consecutive refs of one tier grouped: [(tier, [block ids])] in table order."""
    out: list[tuple[str, list[int]]] = []
    for r in refs:
        if out and out[-1][0] == r.tier:
            out[-1][1].append(r.block_id)
        else:
            out.append((r.tier, [r.block_id]))
    return out
