"""Pool services any strategy can use: write-through to a store tier, and prefetch.

What lives here: `WriteThrough` (copies blocks of a tensor tier into a store tier by content,
on a background thread: the persistent prefix cache) and `Prefetcher` (reads one slice, e.g.
one layer, of groups of blocks from the pool's tiers on I/O threads, a few slices ahead of the
compute that needs them).

What does not: which blocks to persist or stage (the strategies decide), the tiers themselves
(`memory.tiers`), the store key format (`StoreTier` owns it: the services only name blocks).

Both run work on their own threads; numpy, not torch, does the copies there, because a torch
op on such a thread could start a second OpenMP team and slow every parallel region of the
compute thread (engine/compute.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from unikv.memory.tiers import StoreTier, TensorTier, Tier

log = logging.getLogger(__name__)

# The rows of a group to read ahead at each slice (None at a slice: every row); the others are
# read when asked for (`Prefetcher.fill`).
Rows = tuple[tuple[int, ...] | None, ...]
# (tier name, block ids, rows ahead or None for every row at every slice), staged as one piece.
Group = tuple[str, tuple[int, ...], Rows | None]
# Per sequence, its groups in order. The sequence ids belong to the plan, so a next step's
# speculative fetch is used only for the same sequences.
StagePlan = tuple[tuple[Hashable, tuple[Group, ...]], ...]
# A plan at one slice: per group (tier, ids, the rows read ahead or None for all).
_Slice = tuple[
    tuple[Hashable, tuple[tuple[str, tuple[int, ...], tuple[int, ...] | None], ...]], ...
]


def _at(plan: StagePlan, index: int) -> _Slice:
    """What slice `index` of `plan` reads ahead (equal keys: the same fetch)."""
    return tuple(
        (sid, tuple((tier, ids, None if rows is None else rows[index]) for tier, ids, rows in gs))
        for sid, gs in plan
    )


@dataclass(slots=True)
class _Partial:
    """A group staged with some rows unread: its raw slice per arena (full size, on the
    device; what `stage` returned views it), and the rows read so far."""

    tier: str
    ids: tuple[int, ...]
    raw: dict[str, torch.Tensor]
    read: set[int]


class WriteThrough:
    """Writes blocks through to a store tier by content, on one background thread.

    A job first copies the blocks out of their tier (a snapshot), then writes them in one
    transaction. `wait_snapshots` returns once every submitted block has been copied, so its
    memory may be reused; `wait_writes` once written.

    A store that cannot take a write (a full disk) is logged once when writes start failing
    and once when they succeed again, not at every step; `writes_skipped` counts the blocks
    not written meanwhile (they miss later; nothing stored before is lost).
    """

    def __init__(self, dst: StoreTier) -> None:
        self.dst = dst
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="unikv-write")
        self._snapshots: list[threading.Event] = []
        self._writes: list[concurrent.futures.Future] = []
        self.blocks_written = 0
        self.writes_skipped = 0
        self.failing = False  # the last write failed (logged when this changes)

    def submit(
        self,
        src: TensorTier,
        blocks: Sequence[tuple[int, bytes]],
        sides: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        """Store blocks [(block id in `src`, content hash)] unless their content is stored,
        and the side values `sides` [(content hash, bytes)] in the same transaction."""
        done = threading.Event()
        self._snapshots.append(done)
        job = self._pool.submit(self._write, src, list(blocks), done, tuple(sides))
        self._writes.append(job)

    def _write(self, src: TensorTier, blocks: list[tuple[int, bytes]], done: threading.Event,
               sides: tuple[tuple[bytes, bytes], ...] = ()):  # fmt: skip
        try:
            fresh = [(b, h) for b, h in blocks if not self.dst.has_content(h)]
            snapshot = src.snapshot([b for b, _ in fresh])
        finally:
            done.set()
        try:
            if sides:
                self.dst.write_content([h for _, h in fresh], snapshot, sides)
            else:
                self.dst.write_content([h for _, h in fresh], snapshot)
        except OSError:
            self.writes_skipped += len(fresh)
            raise
        self.blocks_written += len(fresh)

    def wait_snapshots(self) -> None:
        """Wait until every submitted block has been copied out of its tier."""
        for e in self._snapshots:
            e.wait()
        self._snapshots.clear()

    def wait_writes(self) -> None:
        """Wait for every write; failing writes (a full disk) are logged once: those blocks
        miss, and are counted in `writes_skipped`."""
        for job in self._writes:
            try:
                job.result()
            except OSError as e:
                if not self.failing:
                    log.warning("prefix blocks not written through (reported once until a "
                                "write succeeds; skipped blocks are counted): %s", e)  # fmt: skip
                self.failing = True
            else:
                if self.failing:
                    log.info("prefix blocks are written through again (%d skipped meanwhile)",
                             self.writes_skipped)  # fmt: skip
                self.failing = False
        self._writes.clear()
        self._snapshots.clear()

    def close(self) -> None:
        """Finish pending writes and stop the thread."""
        self.wait_writes()
        self._pool.shutdown(wait=True)


class Prefetcher:
    """Reads slice `i` of a plan's block groups on I/O threads `depth` slices ahead of `get(i)`.

    A step's plan (what each sequence needs staged) is fixed by `start_step`. `get(i)` first
    submits slice i + depth (past the last slice: the next step's first slices, on the bet that
    they read what this step's do; `start_step` drops those that do not), then waits for slice
    i. A hit is a slice whose data was ready when asked for. The slice last returned is kept
    until the next, so a second `get` of it within the step reads nothing again.

    What `get` returns, per sequence and group: `stage(data)` (default: `data`), where `data`
    maps each arena to the group's slice (block axis at the tier's `block_dims`), moved to
    `device`. `stage` runs on the I/O thread: a strategy reshapes there into what it attends.

    A group may be read ahead in part (a sparse selection's likely blocks: `Group`'s rows):
    its staged tensor is then full size with the other rows unread until `fill` reads them
    into it (synchronously: a late read). Where `stage` does not return a view of its input
    the group is read whole.
    """

    def __init__(
        self,
        tiers: Mapping[str, Tier],
        num_slices: int,
        depth: int,
        threads: int,
        *,
        device: torch.device | str = "cpu",
        stage: Callable[[dict[str, torch.Tensor]], Any] | None = None,
    ) -> None:
        self.tiers, self.num_slices, self.depth = tiers, num_slices, depth
        self.device = torch.device(device)
        self.stage = stage
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(threads, 1), thread_name_prefix="unikv-prefetch"
        )
        self._plan: StagePlan | None = None
        # slice -> (what it reads, its fetch): this step's, and the next step's speculative ones
        self._jobs: dict[int, tuple[_Slice, concurrent.futures.Future]] = {}
        self._next: dict[int, tuple[_Slice, concurrent.futures.Future]] = {}
        self._last: tuple[int, Any, dict] | None = None  # the slice `get` returned last
        self.hits = self.misses = self.wasted = 0
        self.rows_ahead = self.rows_late = 0  # rows of partly read groups: ahead, by `fill`
        self.wait_s = self.fetch_s = 0.0
        # Measured read rate of store tiers (EMA over reads), None until first seen.
        self.read_bytes_per_s: float | None = None

    def start_step(self, plan: StagePlan | None) -> None:
        """Fix this step's plan (None: nothing to stage) and start its first slices; the next
        step's speculative fetches are kept where they read what this plan's slices do."""
        self._drop(self._jobs)
        self._last = None
        kept = {}
        for index, (key, job) in self._next.items():
            if plan is not None and key == _at(plan, index):
                kept[index] = (key, job)
            else:
                self._drop({index: (key, job)})
        self._jobs, self._next, self._plan = kept, {}, plan
        if plan is not None:
            for index in range(min(self.depth, self.num_slices)):
                self._submit(self._jobs, index, plan)

    def get(self, index: int, count: bool = True) -> list[list[Any]]:
        """Slice `index`'s staged data (waits for it), after starting the fetch `depth` ahead."""
        if self._last is not None and self._last[0] == index:
            return self._last[1]
        ahead = index + self.depth
        if count:
            if ahead < self.num_slices:
                self._submit(self._jobs, ahead, self._plan)
            else:
                self._submit(self._next, ahead - self.num_slices, self._plan)
        job = self._submit(self._jobs, index, self._plan)
        self._jobs.pop(index)  # consumed: kept as `_last` until the next slice is asked for
        if count:
            if job.done():
                self.hits += 1
            else:
                self.misses += 1
        t0 = time.perf_counter()
        result, partial = job.result()
        self.wait_s += time.perf_counter() - t0
        self._last = (index, result, partial)
        return result

    def fill(self, index: int, seq: int, group: int, rows=None) -> None:
        """Read rows `rows` (None: all) of group `group` of plan sequence `seq` into slice
        `index` as `get` returned it (the last slice asked for), where not read yet."""
        if self._last is None or self._last[0] != index:
            raise RuntimeError(f"fill: slice {index} is not the one staged last")
        part = self._last[2].get((seq, group))
        if part is None:  # read whole ahead
            return
        want = range(len(part.ids)) if rows is None else rows
        missing = sorted({int(r) for r in want} - part.read)
        if not missing:
            return
        tier = self.tiers[part.tier]
        data = tier.read_slice([part.ids[r] for r in missing], index)
        at = torch.tensor(missing, dtype=torch.long, device=self.device)
        for name, x in data.items():
            part.raw[name].index_copy_(tier.block_dims[name], at, x.to(self.device))
        part.read.update(missing)
        self.rows_late += len(missing)

    def fill_all(self, index: int) -> None:
        """Every unread row of slice `index` (the last one asked for), for a caller that reads
        whole groups."""
        if self._last is not None and self._last[0] == index:
            for seq, group in list(self._last[2]):
                self.fill(index, seq, group)

    def _submit(self, jobs, index: int, plan: StagePlan | None):
        got = jobs.get(index)
        if got is None:
            key = _at(plan, index)
            got = jobs[index] = (key, self._pool.submit(self._timed, index, key))
        return got[1]

    def _timed(self, index: int, plan: _Slice):
        t0 = time.perf_counter()
        try:
            return self._fetch(index, plan)
        finally:
            self.fetch_s += time.perf_counter() - t0

    def _fetch(self, index: int, plan: _Slice) -> tuple[list[list[Any]], dict]:
        """Slice `index` of every group of `plan`, per sequence, and the groups read in part
        (runs on an I/O thread)."""
        # Each store tier is read once for all its groups: one transaction, values in order.
        wanted: dict[str, list[int]] = {}
        for _, groups in plan:
            for tier, ids, rows in groups:
                if isinstance(self.tiers[tier], StoreTier):
                    wanted.setdefault(tier, []).extend(_rows(ids, rows))
        read: dict[str, dict[str, torch.Tensor]] = {}
        for tier, ids in wanted.items():
            t = self.tiers[tier]
            t0 = time.perf_counter()
            read[tier] = t.read_slice(ids, index) if ids else {}
            rate = len(ids) * t.slice_bytes / max(time.perf_counter() - t0, 1e-6)
            if ids:
                self.read_bytes_per_s = _ema(self.read_bytes_per_s, rate)
        out, partial, at = [], {}, dict.fromkeys(read, 0)
        for s, (_, groups) in enumerate(plan):
            pieces = []
            for g, (tier, ids, rows) in enumerate(groups):
                t = self.tiers[tier]
                n = len(ids) if rows is None else len(rows)
                if tier in read:
                    dims = t.block_dims
                    data = {
                        name: x.narrow(dims[name], at[tier], n) for name, x in read[tier].items()
                    }
                    at[tier] += n
                else:
                    data = t.read_slice(_rows(ids, rows), index)
                if rows is None or n == len(ids):
                    pieces.append(self._to_device(self.stage(data) if self.stage else data))
                    continue
                staged, part = self._partly(tier, ids, rows, data, index)
                pieces.append(staged)
                if part is not None:
                    partial[(s, g)] = part
            out.append(pieces)
        return out, partial

    def _partly(self, tier: str, ids, rows, data, index: int):
        """A group with only `rows` read (`data`): full-size raw slices with them in place, and
        what `stage` makes of them; read whole where `stage` does not view its input. numpy
        places the rows: a torch op here, on an I/O thread, could start a second OpenMP team
        and slow the compute thread (see `StoreTier.read_slice`)."""
        t = self.tiers[tier]
        dims = t.block_dims
        raw = {}
        for name, x in data.items():
            b = x.cpu().view(torch.uint8).numpy()  # bytes: every dtype (bf16 has no numpy one)
            shape = list(b.shape)
            shape[dims[name]] = len(ids)
            full = np.empty(shape, dtype=np.uint8)
            full[(slice(None),) * dims[name] + (np.asarray(rows),)] = b
            raw[name] = self._to_device(torch.from_numpy(full).view(x.dtype))
        staged = self.stage(raw) if self.stage else raw
        views = isinstance(staged, dict) or any(
            staged.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            for x in raw.values()
        )
        if views:
            self.rows_ahead += len(rows)
            return staged, _Partial(tier, ids, raw, set(rows))
        whole = t.read_slice(ids, index)  # `stage` copies: the group is read whole
        return self._to_device(self.stage(whole) if self.stage else whole), None

    def _to_device(self, x):
        if isinstance(x, torch.Tensor):
            return x if x.device == self.device else x.to(self.device, non_blocking=True)
        return {n: self._to_device(t) for n, t in x.items()}

    def drain(self) -> None:
        """Wait until every fetch submitted so far has finished."""
        for _, job in [*self._jobs.values(), *self._next.values()]:
            concurrent.futures.wait([job])

    def _drop(self, jobs) -> None:
        for _, job in jobs.values():
            if not job.cancel():
                self.wasted += 1
                # A speculative fetch may fail (its blocks were freed meanwhile): unused.
                job.add_done_callback(lambda j: j.exception())
        jobs.clear()

    def stats(self) -> dict:
        """Depth, slices fetched, hits, hit ratio, waiting and fetching time, wasted fetches;
        for groups read ahead in part, the rows read ahead and those read late."""
        asked = self.hits + self.misses
        return {
            "depth": self.depth,
            "layers_fetched": asked,  # slices; the key keeps the name reports have used
            "hits": self.hits,
            "hit_ratio": self.hits / asked if asked else None,
            "wait_s": round(self.wait_s, 4),
            "fetch_s": round(self.fetch_s, 4),  # time the I/O threads spent fetching
            "fetches_wasted": self.wasted,
            "rows_ahead": self.rows_ahead,
            "rows_late": self.rows_late,
        }

    def close(self) -> None:
        """Drop pending fetches and stop the I/O threads."""
        self._drop(self._jobs)
        self._drop(self._next)
        self._last = None
        self._pool.shutdown(wait=True)


def _rows(ids: tuple[int, ...], rows: tuple[int, ...] | None) -> list[int]:
    """The block ids of `rows` of a group (all of them for None)."""
    return list(ids) if rows is None else [ids[r] for r in rows]


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new
