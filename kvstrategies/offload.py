"""The `hierarchical_offload` strategy: K/V by recency on the device, host and SSD tiers.

Layout and write path are `full`'s (uncompressed K/V, the model's dtype), so attention is exact
and the strategy is lossless. What differs is where a sequence's blocks live:

    oldest ................................................................ newest
    [ SSD tier (LMDB, one value per block and layer) | host tier | device tier ]
                                                       host_window  device_window

Before each step (`begin_step`) every sequence of the batch is rebalanced: blocks that fell out
of the device window move to host, those out of the host window to the SSD tier; blocks inside
a window that sit lower (an SSD prefix hit, a swapped-in sequence) are promoted. A full tier
keeps the block one level up instead (nothing is lost; a full disk is logged, not fatal).

Attention per layer is `attention_runs` over the pieces in token order: the device runs and
(on a CPU, where host memory is directly addressable) the host runs are views into the
arenas; SSD blocks (and host blocks on an accelerator, or with `host_access = "stage"`) are
fetched into staging tensors by a `Prefetcher` a few layers ahead, so reading layer L+depth
overlaps the compute of layer L; the last layers of a step start the next step's first ones.

Persistent prefix cache: full blocks written by a prefill step are written through to the SSD
tier under their content hash (blake2b chain over model identity, layout and tokens). A later
request, in this process or another, that starts with the same tokens attaches those blocks
without reading them (`match_prefix`), when that beats recomputing (`min_disk_hit_tokens`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from typing import Any

import numpy as np
import torch

from memory.pool import StoreTier, TensorTier

from .base import KVSpec
from .full import FullStrategy
from .kv import StepBatch, attention_runs
from .registry import register

log = logging.getLogger(__name__)

_HOST_ACCESS = ("auto", "stage")


@register
class HierarchicalOffloadStrategy(FullStrategy):
    """Uncompressed K/V whose blocks move device -> host -> SSD as they age; exact attention."""

    name = "hierarchical_offload"
    tolerance = 1e-5
    lossless = True
    options = {
        "dtype": None,  # as `full`: None is the model's compute dtype
        "device_window": 1024,  # newest tokens kept on the device tier
        "host_window": 2048,  # the next newest in host memory; older ones in the SSD tier
        "prefetch_depth": None,  # layers fetched ahead; None: the chip profile's (at least 1)
        "host_access": "auto",  # "stage": copy host blocks to the device even on a CPU
        "persist_prefix": True,  # write prompt blocks through to the SSD tier by content
        # Prefix hits shorter than this are recomputed instead of read from disk: below it,
        # reading costs more than computing (benchmarks/prefix_ttft.py measures the break-even).
        "min_disk_hit_tokens": 64,
        "io_threads": 2,  # threads reading the SSD tier (each runs one layer's fetch)
    }
    # Options that change what a block holds; the others (windows, prefetch) only move blocks,
    # so prefixes persisted under one setting are found under another.
    content_options = ("dtype",)
    # 64-token blocks: one SSD value per block and layer is then 96 KiB for SmolLM2 (fp32),
    # large enough that disk reads run near the device's bandwidth (16-token values of 24 KiB
    # spend most of a read on per-value overhead: measured 0.53 GB/s cold vs ... at 64).
    default_block_size = 64
    # What the contract tests run with: windows small enough that every tier is used.
    contract_options = {"device_window": 8, "host_window": 8, "min_disk_hit_tokens": 0}

    @classmethod
    def check_options(cls, options: dict | None) -> dict[str, Any]:
        opts = super().check_options(options)
        for key in ("device_window", "host_window", "min_disk_hit_tokens"):
            v = opts[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(
                    f"strategy {cls.name!r}: option {key} = {v!r}; expected an integer >= 0"
                )
        if opts["device_window"] < 1:
            raise ValueError(
                f"strategy {cls.name!r}: option device_window = {opts['device_window']}; "
                "expected >= 1 (the block being written is always on the device)"
            )
        for key, low in (("prefetch_depth", 1), ("io_threads", 1)):
            v = opts[key]
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(
                    f"strategy {cls.name!r}: option {key} = {v!r}; expected an integer >= {low}"
                    + (" or unset (the chip profile's)" if key == "prefetch_depth" else "")
                )
        if opts["host_access"] not in _HOST_ACCESS:
            raise ValueError(
                f"strategy {cls.name!r}: option host_access = {opts['host_access']!r}; "
                f"allowed: {', '.join(_HOST_ACCESS)}"
            )
        if not isinstance(opts["persist_prefix"], bool):
            raise ValueError(
                f"strategy {cls.name!r}: option persist_prefix = {opts['persist_prefix']!r}; "
                "expected true or false"
            )
        return opts

    @classmethod
    def store_parts(cls, spec: KVSpec) -> int:
        return spec.num_layers  # one value per (block, layer): layers are fetched one by one

    @classmethod
    def from_profile(cls, profile, options: dict[str, Any]) -> dict[str, Any]:
        if options.get("prefetch_depth") is None:
            options = {**options, "prefetch_depth": max(1, profile.tuned.l2_prefetch_depth)}
        return options

    def __init__(self, pool, spec: KVSpec, options: dict | None = None) -> None:
        super().__init__(pool, spec, options)
        o = self.opts
        bs = pool.block_size
        self.device_blocks = max(1, math.ceil(o["device_window"] / bs))
        self.host_blocks = math.ceil(o["host_window"] / bs)
        self.host = pool.tiers.get("host")
        ssd = pool.tiers.get("ssd")
        self.ssd = ssd if isinstance(ssd, StoreTier) else None
        if self.ssd is not None and self.ssd.parts != spec.num_layers:
            raise ValueError(
                f"strategy {self.name!r}: the SSD tier must store one value per layer "
                f"(parts = {spec.num_layers}), got parts = {self.ssd.parts}"
            )
        # Host blocks are attended in place when the compute device reads host memory.
        self.stage_host = o["host_access"] == "stage" or pool.device.type != "cpu"
        if self.host is not None:
            arena = pool.arena("kv", "host")
            nl, parts, heads, nb, bs_, d = arena.shape
            self._host_layers = [arena[i].view(parts, heads, nb * bs_, d) for i in range(nl)]
        depth = o["prefetch_depth"] or 1
        self.prefetcher = Prefetcher(self._fetch, spec.num_layers, depth, o["io_threads"])
        self.writer = Writer()
        self._pending_persist: set[int] = set()  # sequences whose last step was a prefill
        self.disk_hits = {"requests": 0, "blocks": 0, "skipped_short": 0, "skipped_slow": 0}
        # Measured rates for the disk-hit decision (EMA): prefill seconds per token, and SSD
        # read bytes per second; None until first seen.
        self.prefill_s_per_token: float | None = None
        self.read_bytes_per_s: float | None = None
        self._step_t0 = 0.0
        self.demotion_failures = 0

    # ---- the step ----------------------------------------------------------------------------

    def begin_step(self, batch: StepBatch) -> None:
        self._step_t0 = time.perf_counter()
        self.writer.wait_snapshots()  # blocks being persisted must not be reused before
        for sid in batch.seq_ids:
            if self.pool.table(sid) is not None:
                self.rebalance(sid)
        super().begin_step(batch)

    def _prepare(self, batch: StepBatch) -> None:
        pool, bs = self.pool, self.pool.block_size
        seqs = list(zip(batch.seq_ids, self._past, batch.query_lens, strict=True))
        self._new_slots = torch.cat([pool.slot_ids(sid, p, p + n) for sid, p, n in seqs])
        # Per sequence: its pieces in token order, ("device"|"host", runs) read in place or
        # ("staged", index) filled by the prefetcher; the plan lists what is to be staged.
        self._pieces, plan = [], []
        for sid, p, n in seqs:
            total = p + n
            refs = pool.table(sid).refs[: -(-total // bs)]
            pieces, staged = [], []
            for tier, ids in _segments(refs):
                if tier == "device" or (tier == "host" and not self.stage_host):
                    pieces.append((tier, _runs(ids, bs)))
                else:
                    pieces.append(("staged", len(staged)))
                    staged.append((tier, tuple(ids)))
            # The last block may be partly filled: trim the last run of the last piece.
            kind, runs = pieces[-1]
            assert kind == "device", "the block being written is always on the device"
            s, e = runs[-1]
            runs[-1] = (s, e - (-(-total // bs) * bs - total))
            self._pieces.append(pieces)
            plan.append((sid, tuple(staged)))
        self._plan = tuple(plan) if any(staged for _, staged in plan) else None
        self.prefetcher.start_step(self._plan)

    def _sequence_kv(self, layer: int, count: bool) -> list[list[torch.Tensor]]:
        """Per batch sequence, its [P, Hkv, S_r, D] pieces of `layer` in token order: views of
        the device (and, in place, host) arena runs, and the prefetched staged tensors."""
        staged = self.prefetcher.get(layer, count) if self._plan is not None else None
        arenas = {"device": self._layers[layer]}
        if self.host is not None:
            arenas["host"] = self._host_layers[layer]
        out = []
        for i, pieces in enumerate(self._pieces):
            kv = []
            for kind, what in pieces:
                if kind == "staged":
                    kv.append(staged[i][what])
                else:
                    kv.extend(arenas[kind][:, :, s:e] for s, e in what)
            out.append(kv)
        return out

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        out = self._empty_out(q)
        for i, kv in enumerate(self._sequence_kv(layer, count=True)):
            kv = [self._cast(x, q.dtype) for x in kv]
            rows = self._batch.rows(i)
            out[rows] = attention_runs(
                q[rows], [self._split(x) for x in kv], self._past[i], self.scale
            )
        return out

    def read(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        ks, vs = [], []
        for kv in self._sequence_kv(layer, count=False):
            k, v = self._split(torch.cat(kv, dim=2))
            ks.append(k)
            vs.append(v)
        return ks, vs

    def end_step(self) -> None:
        b = self._batch
        self._pending_persist = {
            sid for sid, n in zip(b.seq_ids, b.query_lens, strict=True) if n > 1
        }
        if b.num_tokens >= self.pool.block_size:  # a prefill chunk: what recomputing costs
            rate = (time.perf_counter() - self._step_t0) / b.num_tokens
            self.prefill_s_per_token = _ema(self.prefill_s_per_token, rate)
        super().end_step()

    def abort_step(self) -> None:
        self.prefetcher.start_step(None)
        super().abort_step()

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
        want = ["ssd"] * host_from + ["host"] * (device_from - host_from)
        want += ["device"] * (n - device_from)
        # Demote first (it frees device room), then promote.
        for dst in ("ssd", "host", "device"):
            todo = [i for i, r in enumerate(table.refs) if want[i] == dst and r.tier != dst]
            if todo:
                self._move(seq_id, todo, dst)

    def _move(self, seq_id: int, todo: list[int], dst: str) -> None:
        fallbacks = {"ssd": ("ssd", "host"), "host": ("host",), "device": ("device",)}[dst]
        for tier in fallbacks:
            if tier not in self.pool.tiers:
                continue
            try:
                if self.pool.move(seq_id, todo, tier, relocate_cache=True):
                    return
            except OSError as e:  # a full disk, an I/O error: keep the blocks where they are
                self.demotion_failures += 1
                log.warning("%s: blocks of sequence %s stay off the %s tier: %s",
                            self.name, seq_id, tier, e)  # fmt: skip

    # ---- what the prefetcher runs (on an I/O thread) -----------------------------------------

    def _fetch(self, layer: int, plan) -> list[list[torch.Tensor]]:
        """Staged [P, Hkv, S, D] tensors per sequence of `plan`, for `layer`."""
        ssd_ids = [b for _, staged in plan for tier, ids in staged if tier == "ssd" for b in ids]
        data = None
        if ssd_ids:
            t0 = time.perf_counter()
            data = self.ssd.read_part(ssd_ids, layer)["kv"]  # [P, H, nb, bs, D]
            rate = len(ssd_ids) * self.ssd.part_bytes / max(time.perf_counter() - t0, 1e-6)
            self.read_bytes_per_s = _ema(self.read_bytes_per_s, rate)
        out, at = [], 0
        for _, staged in plan:
            pieces = []
            for tier, ids in staged:
                if tier == "ssd":
                    x = data[:, :, at : at + len(ids)]
                    at += len(ids)
                else:
                    x = self._gather_host(layer, ids)
                parts, h, nb, bs, d = x.shape
                x = x.reshape(parts, h, nb * bs, d)
                if x.device != self.pool.device:
                    x = x.to(self.pool.device, non_blocking=True)
                pieces.append(x)
            out.append(pieces)
        return out

    def _gather_host(self, layer: int, ids: tuple[int, ...]) -> torch.Tensor:
        # numpy, not torch: a torch op on this thread would start a second OpenMP team and
        # slow every parallel region of the compute thread (see engine/compute.py).
        arena = self.pool.arena("kv", "host")[layer]  # [P, H, NB, bs, D]
        raw = arena.view(torch.uint8).numpy()
        return torch.from_numpy(np.take(raw, list(ids), axis=2)).view(arena.dtype)

    # ---- prefix sharing, in memory and on disk -----------------------------------------------

    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        pool = self.pool
        ids = token_ids[:-1]  # at least one token is computed, for the next token's logits
        refs = pool.match_prefix(ids)
        stored = []
        if self.ssd is not None and self.opts["persist_prefix"]:
            self.writer.wait_writes()  # content written through by this process counts
            stored = pool.stored_prefix(ids, refs)
            if stored and len(stored) * pool.block_size < self.opts["min_disk_hit_tokens"]:
                self.disk_hits["skipped_short"] += 1
                stored = []
            elif stored and not self._disk_beats_compute(len(stored)):
                self.disk_hits["skipped_slow"] += 1
                stored = []
        n = pool.attach_prefix(seq_id, refs) if refs else 0
        if stored:
            n = pool.attach_stored(seq_id, stored)
            self.disk_hits["requests"] += 1
            self.disk_hits["blocks"] += len(stored)
        return n

    def _disk_beats_compute(self, blocks: int) -> bool:
        """Whether reading `blocks` from the SSD tier is expected to be quicker than computing
        them again, by the rates measured in this process (True until both are known)."""
        if self.prefill_s_per_token is None or self.read_bytes_per_s is None:
            return True
        read_s = blocks * self.pool.layout.page_bytes / self.read_bytes_per_s
        return read_s < blocks * self.pool.block_size * self.prefill_s_per_token

    def publish(self, seq_id: int, token_ids: list[int]) -> None:
        table = self.pool.table(seq_id)
        if table is None:
            return
        before = len(self.pool.content_hashes(seq_id))
        self.pool.publish(seq_id, token_ids)
        if self.ssd is not None and self.opts["persist_prefix"] and seq_id in self._pending_persist:
            self._persist(seq_id, before)

    def _persist(self, seq_id: int, start: int) -> None:
        """Write blocks [start, published) of `seq_id` through to the SSD tier, by content."""
        hashes = self.pool.content_hashes(seq_id)
        refs = self.pool.table(seq_id).refs
        by_tier: dict[str, list[tuple[int, bytes]]] = {}
        for i in range(start, len(hashes)):
            if refs[i].tier in ("device", "host"):
                by_tier.setdefault(refs[i].tier, []).append((refs[i].block_id, hashes[i]))
        for tier, blocks in by_tier.items():
            t = self.pool.tiers[tier]
            assert isinstance(t, TensorTier)
            self.writer.submit(self.ssd, t.arenas["kv"], blocks)

    # ---- memory management hooks -------------------------------------------------------------

    def free(self, seq_id: int) -> None:
        self.writer.wait_snapshots()
        super().free(seq_id)

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
        on_device = [i for i, r in enumerate(table.refs) if r.tier == "device"]
        for dst in ("host", "ssd"):
            if dst in self.pool.tiers and self.pool.move(seq_id, on_device, dst, True):
                self.pool.record_preemption()
                return True
        return False

    def swap_in(self, seq_id: int) -> bool:
        self.rebalance(seq_id)
        table = self.pool.table(seq_id)
        return not table.num_free_slots or table[len(table) - 1].tier == "device"

    def close(self) -> None:
        """Finish pending writes, stop the I/O threads and close the SSD tier's store."""
        self.prefetcher.close()
        self.writer.close()
        if self.ssd is not None:
            self.ssd.store.close()

    def stats(self) -> dict:
        pool = self.pool
        tokens = {t: 0 for t in pool.tiers}
        for seq in list(pool._tables):
            table = pool.table(seq)
            for i, ref in enumerate(table.refs):
                tokens[ref.tier] += min(pool.block_size, table.num_tokens - i * pool.block_size)
        return super().stats() | {
            "tokens_by_tier": tokens,
            "prefetch": self.prefetcher.stats(),
            "disk_prefix_hits": dict(self.disk_hits),
            "blocks_written_through": self.writer.blocks_written,
            "demotion_failures": self.demotion_failures,
        }


def _ema(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def _segments(refs) -> list[tuple[str, list[int]]]:
    """Consecutive refs of one tier grouped: [(tier, [block ids])] in table order."""
    out: list[tuple[str, list[int]]] = []
    for r in refs:
        if out and out[-1][0] == r.tier:
            out[-1][1].append(r.block_id)
        else:
            out.append((r.tier, [r.block_id]))
    return out


def _runs(ids: list[int], bs: int) -> list[tuple[int, int]]:
    """Block ids as (start_slot, end_slot) runs of consecutive slots."""
    runs: list[list[int]] = []
    for b in ids:
        if runs and runs[-1][1] == b * bs:
            runs[-1][1] += bs
        else:
            runs.append([b * bs, (b + 1) * bs])
    return [(s, e) for s, e in runs]


class Prefetcher:
    """Runs `fetch(layer, plan)` on I/O threads `depth` layers ahead of `get(layer)`.

    A step's plan (what each sequence needs staged) is fixed by `start_step`. `get(layer)`
    first submits layer + depth (past the last layer: the next step's first layers, on the
    bet that its plan is this one; `start_step` drops them if not), then waits for `layer`.
    A hit is a layer whose data was ready when asked for.
    """

    def __init__(self, fetch, num_layers: int, depth: int, threads: int) -> None:
        self.fetch, self.num_layers, self.depth = fetch, num_layers, depth
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max(threads, 1), thread_name_prefix="unikv-prefetch"
        )
        self._plan = None
        self._jobs: dict[int, concurrent.futures.Future] = {}  # this step's layers
        self._next: dict[int, concurrent.futures.Future] = {}  # the next step's, speculative
        self._next_plan = None
        self.hits = self.misses = self.wasted = 0
        self.wait_s = self.fetch_s = 0.0

    def start_step(self, plan) -> None:
        """Fix this step's plan (None: nothing to stage) and start its first layers."""
        self._drop(self._jobs)
        if plan is not None and plan == self._next_plan:
            self._jobs = self._next
        else:
            self._drop(self._next)
            self._jobs = {}
        self._next, self._next_plan, self._plan = {}, None, plan
        if plan is not None:
            for layer in range(min(self.depth, self.num_layers)):
                self._submit(self._jobs, layer, plan)

    def get(self, layer: int, count: bool = True):
        """Layer `layer`'s staged data (waits for it), after starting the fetch `depth` ahead."""
        ahead = layer + self.depth
        if count:
            if ahead < self.num_layers:
                self._submit(self._jobs, ahead, self._plan)
            else:
                self._next_plan = self._plan
                self._submit(self._next, ahead - self.num_layers, self._plan)
        job = self._submit(self._jobs, layer, self._plan)
        if count:
            self._jobs.pop(layer)  # consumed (`read` may ask again within the step)
            if job.done():
                self.hits += 1
            else:
                self.misses += 1
        t0 = time.perf_counter()
        result = job.result()
        self.wait_s += time.perf_counter() - t0
        return result

    def _submit(self, jobs, layer: int, plan):
        job = jobs.get(layer)
        if job is None:
            job = jobs[layer] = self._pool.submit(self._timed, layer, plan)
        return job

    def _timed(self, layer: int, plan):
        t0 = time.perf_counter()
        try:
            return self.fetch(layer, plan)
        finally:
            self.fetch_s += time.perf_counter() - t0

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
        asked = self.hits + self.misses
        return {
            "depth": self.depth,
            "layers_fetched": asked,
            "hits": self.hits,
            "hit_ratio": self.hits / asked if asked else None,
            "wait_s": round(self.wait_s, 4),
            "fetch_s": round(self.fetch_s, 4),  # time the I/O threads spent fetching
            "fetches_wasted": self.wasted,
        }

    def close(self) -> None:
        self._drop(self._jobs)
        self._drop(self._next)
        self._pool.shutdown(wait=True)


class Writer:
    """Writes blocks through to a store tier by content, on one background thread.

    A job first copies the blocks out of their arena (a snapshot: numpy, so no second OpenMP
    team starts), then writes them in one transaction. `wait_snapshots` returns once every
    submitted block has been copied, so its memory may be reused; `wait_writes` once written.
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="unikv-write")
        self._snapshots: list[threading.Event] = []
        self._writes: list[concurrent.futures.Future] = []
        self.blocks_written = 0

    def submit(self, tier: StoreTier, arena: torch.Tensor, blocks: list[tuple[int, bytes]]):
        """Store blocks [(block id in `arena`, content hash)] of a [L, P, H, NB, bs, D] arena."""
        done = threading.Event()
        self._snapshots.append(done)
        self._writes.append(self._pool.submit(self._write, tier, arena, blocks, done))

    def _write(self, tier: StoreTier, arena: torch.Tensor, blocks, done: threading.Event):
        try:
            fresh = [(b, h) for b, h in blocks if not tier.has_content(h)]
            if arena.device.type == "cpu":
                raw = arena.view(torch.uint8).numpy()
                # [L, P, H, n, bs, D*size] -> [n, L, P, H, bs, D*size]: a value per (block, layer)
                picked = np.take(raw, [b for b, _ in fresh], 3)
                data = np.ascontiguousarray(np.moveaxis(picked, 3, 0))
            else:
                data = arena[:, :, :, [b for b, _ in fresh]].movedim(3, 0).contiguous()
                data = data.view(torch.uint8).cpu().numpy()
        finally:
            done.set()
        items = [
            (h + layer.to_bytes(2, "little"), memoryview(data[i, layer]).cast("B"))
            for i, (_, h) in enumerate(fresh)
            for layer in range(data.shape[1])
        ]
        if items:
            tier.store.put_many(items)
        self.blocks_written += len(fresh)

    def wait_snapshots(self) -> None:
        for e in self._snapshots:
            e.wait()
        self._snapshots.clear()

    def wait_writes(self) -> None:
        """Wait for every write; a failed one (a full disk) is logged: those blocks miss."""
        for job in self._writes:
            try:
                job.result()
            except OSError as e:
                log.warning("prefix blocks not written through: %s", e)
        self._writes.clear()
        self._snapshots.clear()

    def close(self) -> None:
        self.wait_writes()
        self._pool.shutdown(wait=True)
