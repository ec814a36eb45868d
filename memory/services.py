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
from typing import Any

import torch

from unikv.memory.tiers import StoreTier, TensorTier, Tier

log = logging.getLogger(__name__)

Group = tuple[str, tuple[int, ...]]  # (tier name, block ids) read as one piece
# Per sequence, its groups in order. The sequence ids belong to the plan, so a next step's
# speculative fetch is used only for the same sequences.
StagePlan = tuple[tuple[Hashable, tuple[Group, ...]], ...]


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
    its plan is this one; `start_step` drops them if not), then waits for slice i. A hit is a
    slice whose data was ready when asked for.

    What `get` returns, per sequence and group: `stage(data)` (default: `data`), where `data`
    maps each arena to the group's slice (block axis at the tier's `block_dims`), moved to
    `device`. `stage` runs on the I/O thread: a strategy reshapes there into what it attends.
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
        self._jobs: dict[int, concurrent.futures.Future] = {}  # this step's slices
        self._next: dict[int, concurrent.futures.Future] = {}  # the next step's, speculative
        self._next_plan: StagePlan | None = None
        self.hits = self.misses = self.wasted = 0
        self.wait_s = self.fetch_s = 0.0
        # Measured read rate of store tiers (EMA over reads), None until first seen.
        self.read_bytes_per_s: float | None = None

    def start_step(self, plan: StagePlan | None) -> None:
        """Fix this step's plan (None: nothing to stage) and start its first slices."""
        self._drop(self._jobs)
        if plan is not None and plan == self._next_plan:
            self._jobs = self._next
        else:
            self._drop(self._next)
            self._jobs = {}
        self._next, self._next_plan, self._plan = {}, None, plan
        if plan is not None:
            for index in range(min(self.depth, self.num_slices)):
                self._submit(self._jobs, index, plan)

    def get(self, index: int, count: bool = True) -> list[list[Any]]:
        """Slice `index`'s staged data (waits for it), after starting the fetch `depth` ahead."""
        ahead = index + self.depth
        if count:
            if ahead < self.num_slices:
                self._submit(self._jobs, ahead, self._plan)
            else:
                self._next_plan = self._plan
                self._submit(self._next, ahead - self.num_slices, self._plan)
        job = self._submit(self._jobs, index, self._plan)
        if count:
            self._jobs.pop(index)  # consumed (a second read may ask again within the step)
            if job.done():
                self.hits += 1
            else:
                self.misses += 1
        t0 = time.perf_counter()
        result = job.result()
        self.wait_s += time.perf_counter() - t0
        return result

    def _submit(self, jobs, index: int, plan: StagePlan | None):
        job = jobs.get(index)
        if job is None:
            job = jobs[index] = self._pool.submit(self._timed, index, plan)
        return job

    def _timed(self, index: int, plan: StagePlan):
        t0 = time.perf_counter()
        try:
            return self._fetch(index, plan)
        finally:
            self.fetch_s += time.perf_counter() - t0

    def _fetch(self, index: int, plan: StagePlan) -> list[list[Any]]:
        """Slice `index` of every group of `plan`, per sequence (runs on an I/O thread)."""
        # Each store tier is read once for all its groups: one transaction, values in order.
        wanted: dict[str, list[int]] = {}
        for _, groups in plan:
            for tier, ids in groups:
                if isinstance(self.tiers[tier], StoreTier):
                    wanted.setdefault(tier, []).extend(ids)
        read: dict[str, dict[str, torch.Tensor]] = {}
        for tier, ids in wanted.items():
            t = self.tiers[tier]
            t0 = time.perf_counter()
            read[tier] = t.read_slice(ids, index)
            rate = len(ids) * t.slice_bytes / max(time.perf_counter() - t0, 1e-6)
            self.read_bytes_per_s = _ema(self.read_bytes_per_s, rate)
        out, at = [], dict.fromkeys(read, 0)
        for _, groups in plan:
            pieces = []
            for tier, ids in groups:
                t = self.tiers[tier]
                if tier in read:
                    dims = t.block_dims
                    data = {n: x.narrow(dims[n], at[tier], len(ids)) for n, x in read[tier].items()}
                    at[tier] += len(ids)
                else:
                    data = t.read_slice(ids, index)
                pieces.append(self._to_device(self.stage(data) if self.stage else data))
            out.append(pieces)
        return out

    def _to_device(self, x):
        if isinstance(x, torch.Tensor):
            return x if x.device == self.device else x.to(self.device, non_blocking=True)
        return {n: self._to_device(t) for n, t in x.items()}

    def drain(self) -> None:
        """Wait until every fetch submitted so far has finished."""
        for job in [*self._jobs.values(), *self._next.values()]:
            concurrent.futures.wait([job])

    def _drop(self, jobs) -> None:
        for job in jobs.values():
            if not job.cancel():
                self.wasted += 1
                # A speculative fetch may fail (its blocks were freed meanwhile): unused.
                job.add_done_callback(lambda j: j.exception())
        jobs.clear()

    def stats(self) -> dict:
        """Depth, slices fetched, hits, hit ratio, waiting and fetching time, wasted fetches."""
        asked = self.hits + self.misses
        return {
            "depth": self.depth,
            "layers_fetched": asked,  # slices; the key keeps the name reports have used
            "hits": self.hits,
            "hit_ratio": self.hits / asked if asked else None,
            "wait_s": round(self.wait_s, 4),
            "fetch_s": round(self.fetch_s, 4),  # time the I/O threads spent fetching
            "fetches_wasted": self.wasted,
        }

    def close(self) -> None:
        """Drop pending fetches and stop the I/O threads."""
        self._drop(self._jobs)
        self._drop(self._next)
        self._pool.shutdown(wait=True)


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new
