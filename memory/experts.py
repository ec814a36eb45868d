"""Routed-expert weights as residents of the pool's tiers: device (LRU), host, SSD.

What lives here: `ExpertCache` (every routed expert of an MoE model held in exactly one tier,
promoted to the device on use and demoted by recency and measured routing frequency) and
`ExpertLoadError`. What does not: routing, gating and the expert FFN (`engine/`), shared
experts and dense weights (always on the device: they are used by every token), KV blocks
(`memory.pool`), the byte store itself (`storage/`).

Placement. Tiers are exclusive: an expert's weights are on the device, or in host memory, or
only in the SSD tier's store, never counted twice, so `device_capacity` and `host_capacity`
are memory budgets (experts x bytes per expert). An inclusive device cache would keep a host
copy of every device resident, spending device_capacity experts' worth of host memory twice,
and host memory is exactly what runs out when an SSD tier is needed. The price: evicting a
device resident copies it down (device to host; on an accelerator that overlaps the host to
device copy of the expert coming up, the link is full duplex).

- device: an LRU over all layers (the least recently used expert of any layer leaves first),
  `device_capacity` experts. It must hold at least one step's working set (MoE layers x top-k
  for one token) or it thrashes.
- host: `host_capacity` experts (None: every expert not on the device), pinned when the device
  is an accelerator so host-to-device copies are asynchronous DMA.
- SSD: the rest, in an LMDB block store (`storage`, name "lmdb") in a fresh subdirectory of
  `ssd_path` (experts-<pid>-<random>), removed on `close`; those of processes that died without
  closing are removed when the next cache starts there.

Moves. `get` of an expert not on the device promotes it (a copy from host, a checksummed read
from SSD); the device's least recently used expert then goes down: to host while host has room
(a promotion from host frees a slot), else to host only if it was routed more often than the
coldest host resident, which then drops to SSD; else to SSD. `observe` counts routing
decisions; `rebalance` (also run every `rebalance_every` observations) re-ranks host vs SSD
residents by those counts, hottest on host, then decays the counts so placement follows a
changing workload. With `device_capacity` >= the number of experts, `get` is one dictionary
lookup and a counter. The cache never writes into a tensor it returned: an evicted expert's
device copy lives on until the caller lets go of it, so a step that asks for more experts than
the device holds (a long prefill can touch every expert of a layer) overshoots the device
budget by the excess; ask in chunks of at most `device_capacity` there.

SSD format. One store value per expert, key b"x" + layer + expert (u32 little-endian each),
value the expert's tensors' raw bytes in order (shapes and dtypes stay in memory: the store
only keeps bytes); the store's frame adds a CRC-32, and reads go straight into (pinned) buffers.
Weights never change, so a value is written at most once per session and stays valid after its
expert is promoted: demoting it again writes nothing. The store is scratch (rebuilt from the
model file on every start, deleted on close), hence `sync=False`.

Failure. Every read or write happens before the tiers change: a failed SSD read raises
`ExpertLoadError` naming the experts and the store file (from `get`, `get_many`, `rebalance`,
or `observe` when it rebalances), a failed write (a full disk) raises the store's error, and
either way each expert is still where it was. Not thread-safe: one compute thread calls it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unikv.memory.tiers import BlockLostError
from unikv.storage import BlockStore, create_store

Key = tuple[int, int]  # (layer, routed expert index)
Weights = tuple[torch.Tensor, ...]

DEVICE, HOST, SSD = "device", "host", "ssd"
TIERS = (DEVICE, HOST, SSD)
_WRITE_BATCH_BYTES = 256 << 20  # initial SSD placement is written in batches of about this


class ExpertLoadError(BlockLostError):
    """Routed experts could not be read back from the SSD tier (missing or corrupt)."""

    def __init__(self, keys: Sequence[Key], path: Path) -> None:
        names = ", ".join(f"(layer {layer}, expert {e})" for layer, e in keys)
        super().__init__(
            f"routed expert(s) {names} missing or corrupt in the SSD tier's store {path} "
            "(value absent, or its checksum failed); they cannot be served"
        )
        self.keys, self.path = list(keys), path


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    observations: int = 0
    rebalances: int = 0
    ssd_writes: int = 0
    ssd_bytes_written: int = 0
    moves: dict[str, int] = field(default_factory=dict)  # "src->dst" -> experts
    # "src->dst" -> bytes copied; a move to SSD copies nothing when the store holds the expert
    bytes_moved: dict[str, int] = field(default_factory=dict)

    def move(self, src: str, dst: str, nbytes: int) -> None:
        name = f"{src}->{dst}"
        self.moves[name] = self.moves.get(name, 0) + 1
        self.bytes_moved[name] = self.bytes_moved.get(name, 0) + nbytes


class ExpertCache:
    """Every routed expert of a model in one tier; `get` returns it on the compute device."""

    def __init__(
        self,
        weights: Mapping[Key, Sequence[torch.Tensor]],
        device: torch.device | str = "cpu",
        *,
        device_capacity: int,
        host_capacity: int | None = None,
        ssd_path: str | os.PathLike[str] | None = None,
        frequencies: Mapping[Key, float] | None = None,
        rebalance_every: int | None = 1024,
        decay: float = 0.5,
    ) -> None:
        """Place `weights` ((layer, expert) -> tensors, each read once) in the tiers.

        Tensors already where their tier keeps them (on a CPU device: all of those placed on
        the device and host tiers) are kept without a copy; the cache never writes into a
        tensor. Drop the mapping afterwards: the SSD tier saves only memory the caller lets go.

        `frequencies` (initial routing counts) choose who starts where: the most frequent on
        the device, then host, then SSD; without them each layer's lowest-numbered experts go
        first, so every layer gets its share. `rebalance_every` observations (None: never)
        trigger `rebalance`, which multiplies the counts by `decay` afterwards.
        """
        keys = _checked_keys(weights)
        num = len(keys)
        device_capacity = _count("device_capacity", device_capacity, low=1)
        if host_capacity is None:
            host_capacity = max(0, num - device_capacity)
        host_capacity = _count("host_capacity", host_capacity, low=0)
        if rebalance_every is not None:
            rebalance_every = _count("rebalance_every", rebalance_every, low=1)
        if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        n_dev = min(num, device_capacity)
        n_host = min(num - n_dev, host_capacity)
        on_ssd = num - n_dev - n_host
        if on_ssd and ssd_path is None:
            raise ValueError(
                f"{on_ssd} of {num} routed experts fit neither the device (device_capacity="
                f"{device_capacity}) nor host (host_capacity={host_capacity}); give ssd_path "
                "for the SSD tier, or larger capacities"
            )
        self.device = torch.device(device)
        self.device_capacity, self.host_capacity = device_capacity, host_capacity
        self.rebalance_every, self.decay = rebalance_every, float(decay)
        # Pinned host memory lets host-to-device copies run as DMA; a CPU "device" needs none.
        self._pin = self.device.type != "cpu"
        self._lru = device_capacity < num  # False: everything is resident, get is a lookup

        # Routing counts per layer: float64 (they decay), numpy views for scalar reads.
        self._counts = _routing_counts(keys, frequencies or {})
        self._counts_np = {layer: c.numpy() for layer, c in self._counts.items()}

        self._n = _Counters()
        self._device: OrderedDict[Key, Weights] = OrderedDict()  # LRU order: oldest first
        self._host: dict[Key, Weights] = {}
        self._ssd: set[Key] = set()  # residents whose only copy is the store
        self._stored: set[Key] = set()  # keys with a (valid) value in the store
        self._spec: dict[Key, tuple[tuple[torch.Size, torch.dtype], ...]] = {}
        self._nbytes: dict[Key, int] = {}
        self._cold: list[Key] = []  # host residents, hottest first (see _coldest_host)
        self._since_rebalance = 0
        self._closed = False
        self.store: BlockStore | None = None
        self.ssd_dir: Path | None = None
        self._scratch = _Scratch()
        # Deletes the SSD tier's files at close, or when the cache is collected unclosed.
        self._finalizer = weakref.finalize(self, self._scratch.release)

        # Hottest first; ties by expert index, then layer: every layer gets its low experts.
        order = sorted(keys, key=lambda k: (-self._freq(k), k[1], k[0]))
        try:
            self._place(weights, order, n_dev, n_host, ssd_path)
        except BaseException:
            self.close()
            raise
        self._ssd = set(order[n_dev + n_host :])
        self._n.ssd_writes = self._n.ssd_bytes_written = 0  # the initial placement is no traffic
        self._cold = sorted(self._host, key=self._freq, reverse=True)

    def _place(self, weights, order: list[Key], n_dev: int, n_host: int, ssd_path) -> None:
        """The initial placement: `order`'s first `n_dev` on the device, the next `n_host` on
        host, the rest written to a fresh SSD store under `ssd_path`."""
        if len(order) > n_dev + n_host:
            assert ssd_path is not None
            _remove_stale(Path(ssd_path))
            self.ssd_dir = Path(ssd_path) / f"experts-{os.getpid()}-{secrets.token_hex(4)}"
            self.ssd_dir.mkdir(parents=True)
            self._scratch.directory = self.ssd_dir
            # The map starts at 1 GiB of address space and doubles as the store fills.
            self.store = create_store("lmdb", path=self.ssd_dir, max_map_size=1 << 44, sync=False)
            self._scratch.store = self.store
        # The device's LRU order starts coldest first, so the coldest leaves first.
        for k in reversed(order[:n_dev]):
            self._device[k] = self._adopt(k, weights[k], self.device)
        for k in order[n_dev : n_dev + n_host]:
            self._host[k] = self._adopt(k, weights[k], None)
        batch: dict[Key, Weights] = {}
        size = 0
        for k in order[n_dev + n_host :]:
            batch[k] = self._adopt(k, weights[k], torch.device("cpu"))
            size += self._nbytes[k]
            if size >= _WRITE_BATCH_BYTES:
                self._write(batch)
                batch, size = {}, 0
        self._write(batch)

    @classmethod
    def from_fractions(
        cls,
        weights: Mapping[Key, Sequence[torch.Tensor]],
        device: torch.device | str = "cpu",
        *,
        expert_cache: float,
        expert_host: float = 1.0,
        ssd_path: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> ExpertCache:
        """A cache holding `expert_cache` of the routed experts on the device (1.0: all) and
        `expert_host` of the rest on host (1.0: no SSD tier); capacities are rounded."""
        num = len(weights)
        _fraction("expert_cache", expert_cache, open_low=True)
        _fraction("expert_host", expert_host, open_low=False)
        device_capacity = round(expert_cache * num)
        if device_capacity < 1:
            raise ValueError(
                f"expert_cache={expert_cache!r} of {num} routed experts holds none on the device; "
                f"give at least {1 / num:.3g}"
            )
        host_capacity = round(expert_host * (num - device_capacity))
        return cls(
            weights,
            device,
            device_capacity=device_capacity,
            host_capacity=host_capacity,
            ssd_path=ssd_path,
            **kwargs,
        )

    # ---- the compute path ---------------------------------------------------------------------

    def get(self, layer: int, expert: int) -> Weights:
        """The expert's weights on the compute device (a hit, or a promotion evicting the LRU)."""
        key = (layer, expert)
        w = self._device.get(key)
        if w is not None:
            self._n.hits += 1
            if self._lru:
                self._device.move_to_end(key)
            return w
        return self._load([key])[key]

    def get_many(self, layer: int, experts: Iterable[int]) -> list[Weights]:
        """`get` for every expert of one MoE step; the SSD misses are read in one batch."""
        keys = [(layer, int(e)) for e in experts]
        found: dict[Key, Weights] = {}
        missing: list[Key] = []
        for k in dict.fromkeys(keys):
            w = self._device.get(k)
            if w is None:
                missing.append(k)
            else:
                self._n.hits += 1
                if self._lru:
                    self._device.move_to_end(k)
                found[k] = w
        if missing:
            found.update(self._load(missing))
        return [found[k] for k in keys]

    def observe(self, layer: int, indices: torch.Tensor) -> None:
        """Count one MoE step's routing decisions of `layer` (`indices`: expert ids, any shape)."""
        counts = self._counts.get(layer)
        if counts is None:
            raise ValueError(f"layer {layer} has no routed experts in this cache")
        # [tokens, top_k] -> [tokens * top_k]: one count per routing decision.
        idx = indices.detach().reshape(-1).to("cpu", torch.long)
        if idx.numel():
            if int(idx.min()) < 0 or int(idx.max()) >= counts.numel():
                raise ValueError(
                    f"layer {layer}: expert indices must be in [0, {counts.numel()}), got "
                    f"{int(idx.min())}..{int(idx.max())}"
                )
            counts += torch.bincount(idx, minlength=counts.numel())
        self._n.observations += 1
        self._since_rebalance += 1
        if self.rebalance_every is not None and self._since_rebalance >= self.rebalance_every:
            self.rebalance()

    # ---- placement ----------------------------------------------------------------------------

    def rebalance(self) -> int:
        """Re-rank host vs SSD residents by routing count (hottest on host), then decay the
        counts; return how many experts changed tier."""
        _check_open(self)
        self._since_rebalance = 0
        moved, lost = 0, []
        if self._ssd and self.host_capacity:
            # Residents win ties, so equal counts never swap back and forth.
            ranked = sorted(
                [*self._host, *self._ssd], key=lambda k: (-self._freq(k), k not in self._host)
            )
            want = set(ranked[: self.host_capacity])
            enter = [k for k in ranked[: self.host_capacity] if k in self._ssd]
            leave = [k for k in reversed(ranked) if k in self._host and k not in want]
            # Leaving experts are written (if never stored) before they leave host memory; then
            # the entering ones are read. A failed read leaves those entering ones on SSD.
            written = {k: self._host[k] for k in leave if k not in self._stored}
            self._write(written)
            for k in leave:
                del self._host[k]
                self._ssd.add(k)
                self._n.move(HOST, SSD, self._nbytes[k] if k in written else 0)
            loaded, lost = self._read(enter)
            for k, w in loaded.items():
                self._ssd.remove(k)
                self._host[k] = w
                self._n.move(SSD, HOST, self._nbytes[k])
            moved = len(leave) + len(loaded)
        self._cold = sorted(self._host, key=self._freq, reverse=True)
        if self.decay != 1.0:
            for c in self._counts.values():
                c.mul_(self.decay)
        self._n.rebalances += 1
        if lost:
            raise ExpertLoadError(lost, self.ssd_dir / "data.mdb")
        return moved

    def tier_of(self, layer: int, expert: int) -> str:
        """Where the expert lives now: "device", "host" or "ssd"."""
        key = (layer, expert)
        if key in self._device:
            return DEVICE
        if key in self._host:
            return HOST
        if key in self._ssd:
            return SSD
        raise ValueError(f"no routed expert (layer {layer}, expert {expert}) in this cache")

    def frequency(self, layer: int, expert: int) -> float:
        """The expert's (decayed) routing count."""
        self.tier_of(layer, expert)
        return self._freq((layer, expert))

    # ---- statistics and lifetime --------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Hits, misses, moves and bytes per tier pair, residents and capacities (JSON-ready)."""
        n = self._n
        lookups = n.hits + n.misses
        return {
            "experts": len(self._spec),
            "capacity": {DEVICE: self.device_capacity, HOST: self.host_capacity},
            "residents": {DEVICE: len(self._device), HOST: len(self._host), SSD: len(self._ssd)},
            "resident_bytes": {
                DEVICE: sum(self._nbytes[k] for k in self._device),
                HOST: sum(self._nbytes[k] for k in self._host),
                SSD: sum(self._nbytes[k] for k in self._ssd),
            },
            "hits": n.hits,
            "misses": n.misses,
            "hit_rate": n.hits / lookups if lookups else 0.0,
            "promotions": {
                HOST: n.moves.get("host->device", 0),
                SSD: n.moves.get("ssd->device", 0),
            },
            "moves": dict(sorted(n.moves.items())),
            "bytes_moved": dict(sorted(n.bytes_moved.items())),
            "ssd_writes": n.ssd_writes,
            "ssd_bytes_written": n.ssd_bytes_written,
            "observations": n.observations,
            "rebalances": n.rebalances,
            "ssd_path": str(self.ssd_dir) if self.ssd_dir is not None else None,
        }

    def reset_stats(self) -> None:
        """Count hits, misses and moves afresh (e.g. after a calibration ran the model);
        placement and routing frequencies stay."""
        self._n = _Counters()

    def close(self) -> None:
        """Drop every tier and delete the SSD tier's files; closing twice is harmless."""
        self._closed = True
        self._device.clear()
        self._host.clear()
        self._ssd.clear()
        self._stored.clear()
        self._finalizer()
        self.store = None

    def __enter__(self) -> ExpertCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self._spec)

    # ---- internals ----------------------------------------------------------------------------

    def _freq(self, key: Key) -> float:
        return float(self._counts_np[key[0]][key[1]])

    def _adopt(
        self, key: Key, tensors: Sequence[torch.Tensor], device: torch.device | None
    ) -> Weights:
        """Record the expert's layout; its tensors on `device` (None: host memory)."""
        if isinstance(tensors, torch.Tensor) or not tensors:
            raise ValueError(f"expert {key}: weights must be a non-empty tuple of tensors")
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError(f"expert {key}: weights must be tensors")
        self._spec[key] = tuple((t.shape, t.dtype) for t in tensors)
        self._nbytes[key] = sum(t.numel() * t.element_size() for t in tensors)
        if device is None:
            return tuple(self._host_copy(t) if self._pin else t.cpu().contiguous() for t in tensors)
        # Tensors already where they belong are kept, not copied: the cache never writes
        # into a tensor, so sharing the caller's is safe.
        return tuple(t.to(device).contiguous() for t in tensors)

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A (pinned, on an accelerator) host copy of `t`; blocking, so it can be read next."""
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin)
        return out.copy_(t)

    def _device_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of host tensor `t` on the device: asynchronous from pinned memory; a real
        copy on a CPU "device" too, so that a promotion costs what it moves."""
        return torch.empty(t.shape, dtype=t.dtype, device=self.device).copy_(t, non_blocking=True)

    def _load(self, keys: list[Key]) -> dict[Key, Weights]:
        """Promote `keys` (none on the device) to the device, reading the SSD ones in one batch."""
        _check_open(self)
        for k in keys:
            if k not in self._host and k not in self._ssd:
                raise ValueError(f"no routed expert (layer {k[0]}, expert {k[1]}) in this cache")
        staged, lost = self._read([k for k in keys if k in self._ssd])
        if lost:
            raise ExpertLoadError(lost, self.ssd_dir / "data.mdb")
        out: dict[Key, Weights] = {}
        pending = set(keys)  # not pushed from host to SSD while they wait for their turn
        for k in keys:
            pending.discard(k)
            if k in self._host:
                w = tuple(self._device_copy(t) for t in self._host[k])
                self._admit(k, w, HOST, pending)
            else:
                s = staged.pop(k)
                w = s if self.device.type == "cpu" else tuple(self._device_copy(t) for t in s)
                self._admit(k, w, SSD, pending)
            out[k] = w
        return out

    def _admit(self, key: Key, w: Weights, src: str, keep: set[Key]) -> None:
        """Make `key` (now in `src`, its device copy `w`) a device resident, demoting the LRU;
        host residents in `keep` stay on host."""
        victim = displaced = None
        victim_host: Weights | None = None
        todo: dict[Key, Weights] = {}
        if len(self._device) >= self.device_capacity:
            victim = next(iter(self._device))
            dst, displaced = self._demotion(victim, src, keep)
            # Every copy and write before the tiers change: a failure leaves them as they were.
            if dst == SSD and victim not in self._stored:
                todo[victim] = self._device[victim]
            if displaced is not None and displaced not in self._stored:
                todo[displaced] = self._host[displaced]
            self._write(todo)
            if dst == HOST:
                victim_host = tuple(self._host_copy(t) for t in self._device[victim])
        if src == HOST:
            del self._host[key]
        else:
            self._ssd.remove(key)
        self._device[key] = w
        self._n.misses += 1
        self._n.move(src, DEVICE, self._nbytes[key])
        if victim is not None:
            del self._device[victim]
            if victim_host is not None:
                self._host[victim] = victim_host
                self._n.move(DEVICE, HOST, self._nbytes[victim])
            else:
                self._ssd.add(victim)
                self._n.move(DEVICE, SSD, self._nbytes[victim] if victim in todo else 0)
        if displaced is not None:
            del self._host[displaced]
            self._ssd.add(displaced)
            self._n.move(HOST, SSD, self._nbytes[displaced] if displaced in todo else 0)

    def _demotion(self, victim: Key, src: str, keep: set[Key]) -> tuple[str, Key | None]:
        """Where the device's LRU `victim` goes when an expert comes up from `src`, and which
        host resident (if any, not one in `keep`) it pushes down to SSD."""
        room = self.host_capacity - len(self._host) + (src == HOST)  # a host promotion frees one
        if room > 0:
            return HOST, None
        if self.host_capacity == 0:
            return SSD, None
        coldest = self._coldest_host(keep)
        if coldest is not None and self._freq(victim) > self._freq(coldest):
            return HOST, coldest
        return SSD, None

    def _coldest_host(self, keep: set[Key]) -> Key | None:
        """The host resident not in `keep` with the lowest count as of the last rebalance
        (lazy: the list is sorted then; experts that left host since are dropped from its end,
        newcomers are not in it until it runs out and is sorted again)."""
        for attempt in range(2):
            cold = self._cold
            while cold and cold[-1] not in self._host:
                cold.pop()
            for k in reversed(cold):  # the last one, unless the current batch holds it
                if k in self._host and k not in keep:
                    return k
            if attempt == 0:
                self._cold = sorted(self._host, key=self._freq, reverse=True)
        return None

    def _write(self, items: Mapping[Key, Weights]) -> None:
        """Store the experts' bytes (one atomic store write); they are then `_stored`."""
        if not items:
            return
        assert self.store is not None, "an SSD write without an SSD tier"
        values = []
        for k, w in items.items():
            # Each tensor flattened to its raw bytes, in order: [numel] -> [numel * itemsize].
            raw = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy() for t in w]
            values.append((_store_key(k), b"".join(r.tobytes() for r in raw)))
        self.store.put_many(values)
        self._stored.update(items)
        self._n.ssd_writes += len(items)
        self._n.ssd_bytes_written += sum(self._nbytes[k] for k in items)

    def _read(self, keys: list[Key]) -> tuple[dict[Key, Weights], list[Key]]:
        """The stored experts read into fresh (pinned) host tensors, and the keys that failed."""
        if not keys:
            return {}, []
        assert self.store is not None, "an SSD read without an SSD tier"
        out = {
            k: tuple(torch.empty(s, dtype=d, pin_memory=self._pin) for s, d in self._spec[k])
            for k in keys
        }
        targets = [[t.reshape(-1).view(torch.uint8).numpy() for t in out[k]] for k in keys]
        found = self.store.read_into([_store_key(k) for k in keys], targets)
        lost = [k for k, ok in zip(keys, found, strict=True) if not ok]
        for k in lost:
            del out[k]
        return out, lost


def _store_key(key: Key) -> bytes:
    return b"x" + key[0].to_bytes(4, "little") + key[1].to_bytes(4, "little")


@dataclass(slots=True)
class _Scratch:
    """What the SSD tier leaves on disk: its store and the directory the cache made."""

    store: BlockStore | None = None
    directory: Path | None = None

    def release(self) -> None:
        """Close the store and delete the directory."""
        if self.store is not None:
            self.store.close()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def _check_open(cache: ExpertCache) -> None:
    if cache._closed:
        raise ValueError("the expert cache is closed")


def _checked_keys(weights: Mapping[Key, object]) -> list[Key]:
    """The (layer, expert) keys of `weights`; a ValueError for none or a malformed one."""
    keys = list(weights.keys())
    if not keys:
        raise ValueError("weights holds no routed expert")
    for k in keys:
        if not (
            isinstance(k, tuple)
            and len(k) == 2
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in k)
        ):
            raise ValueError(f"expert keys must be (layer, expert) pairs of ints >= 0, got {k!r}")
    return keys


def _routing_counts(keys: list[Key], frequencies: Mapping[Key, float]) -> dict[int, torch.Tensor]:
    """Per layer, float64 routing counts of its experts, from the initial `frequencies`."""
    per_layer: dict[int, int] = {}
    for layer, e in keys:
        per_layer[layer] = max(per_layer.get(layer, 0), e + 1)
    counts = {layer: torch.zeros(n, dtype=torch.float64) for layer, n in per_layer.items()}
    known = set(keys)
    for k, f in frequencies.items():
        if k not in known:
            raise ValueError(f"frequencies names {k!r}, which is not a routed expert here")
        if isinstance(f, bool) or not isinstance(f, int | float) or not f >= 0:
            raise ValueError(f"frequency of {k!r} must be a number >= 0, got {f!r}")
        counts[k[0]][k[1]] = f
    return counts


def _remove_stale(root: Path) -> None:
    """Delete the SSD tiers that processes which are gone left in `root` (a crash skips
    `close`, and a left-over tier can hold most of a model's weights)."""
    if not root.is_dir():
        return
    for d in root.glob("experts-*-*"):
        pid = d.name.split("-")[1]
        if not (d.is_dir() and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (PermissionError, OverflowError):
            pass  # alive under another user (or not a pid at all): not ours to judge


def _count(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def _fraction(name: str, value: object, open_low: bool) -> float:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and (0 < value <= 1 if open_low else 0 <= value <= 1)
    )
    if not ok:
        bounds = "(0, 1]" if open_low else "[0, 1]"
        raise ValueError(f"{name} must be a fraction in {bounds}, got {value!r}")
    return float(value)
