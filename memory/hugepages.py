"""Long-lived host tensors in transparent huge pages: the weights a decode step streams.

What lives here: `place` (a CPU tensor copied into 2 MiB-aligned anonymous memory advised
`MADV_HUGEPAGE`, or the tensor itself where that cannot help), `empty` (such memory, for a
producer to fill), `mode` (the kernel's THP setting), `enabled` (that and the
`UNIKV_HUGE_PAGES` switch) and `report` (how many of the placed bytes the kernel actually
backs by huge pages, read from /proc/self/smaps).

What does not: which tensors are placed (the engine's loader decides: packed and float weights),
and the KV arenas (`memory.tiers`, allocated lazily in 4 KiB pages: in huge pages a `full`
cache at 8K context stepped 0.95x the time but took twice the resident memory its blocks
count, docs/kernels.md).

Why: a decode step reads every weight once, front to back. In 4 KiB pages a thread's stream
walks the page table every 4 KiB, and under a VM's nested paging each walk is long. On the
AMD EPYC (Zen 4) VM a 1 GiB float32 sum read 56 GB/s in 4 KiB pages and 68 GB/s in 2 MiB pages
(2 threads; 28 against 35 on one), the interleaved int8 kernel over SmolLM2-sized matrices
1.04-1.12x more, and the packaged Q4_1 model's decode step ran 1.07-1.15x as fast
(`benchmarks/kernel_ab.py --pages`).

Where THP is `madvise` (this VM's setting, and many distributions') memory from malloc stays
in 4 KiB pages unless someone asks; PyTorch's own switch
(`THP_MEM_ALLOC_ENABLE`) asks only for allocations of 2 MiB and more, which leaves most of a
small model's matrices out. So the weights are copied, one after another, into chunks of at
least `CHUNK` bytes: each chunk is one mapping, 2 MiB-aligned, advised before it is touched.

A chunk is freed when the last tensor placed in it is (each tensor holds its chunk's mapping);
a chunk's unused tail (at most `CHUNK`) is the cost. Fork shares the chunks copy-on-write, as
it does malloc's memory. Where the host's THP defrag setting is `madvise` (the default), the
first touch of a chunk may compact memory to find free 2 MiB pages: on a fragmented host the
load takes longer, and pages it cannot find stay 4 KiB (the report counts what it got).

Where THP is `never`, the platform has no `madvise` (not Linux), or `UNIKV_HUGE_PAGES=0`,
`place` returns its tensor unchanged.
"""

from __future__ import annotations

import math
import mmap
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from unikv.settings.config import env_switch

ENV = "UNIKV_HUGE_PAGES"  # "0": never place (the A/B baseline; a host where THP misbehaves)
HUGE = 2 << 20  # the x86-64 huge page
CHUNK = 32 << 20  # the least a chunk maps: a SmolLM2 Q8_0 step's 92 MiB in three
SMALLEST = 64 << 10  # tensors below this stay where they are (norm weights, biases)
ALIGN = 64  # each placed tensor starts on a cache line
_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mode() -> str:
    """The kernel's THP setting: "always", "madvise", "never", or "unavailable" (no such file:
    not Linux, or a kernel without THP)."""
    try:
        text = _MODE_FILE.read_text()
    except OSError:
        return "unavailable"
    chosen = next((w[1:-1] for w in text.split() if w.startswith("[")), "")
    return chosen or "unavailable"


def enabled() -> bool:
    """Whether `place` copies tensors into huge-page chunks here: THP `always` or `madvise`,
    `madvise(2)` in this Python, and `UNIKV_HUGE_PAGES` not "0" (ValueError for a value
    other than 0 or 1)."""
    on = env_switch(ENV, "weights in 4 KiB pages", "in huge pages where the kernel has them")
    return on and mode() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


class _Chunk:
    """One mapping: `base` (from its first 2 MiB-aligned byte, a uint8 tensor over the mapping)
    and how much of it is taken. The tensors taken from it hold the mapping, not the chunk."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.map.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the faults take 2 MiB
        whole = torch.frombuffer(self.map, dtype=torch.uint8)  # holds the mapping alive
        skip = -whole.data_ptr() % HUGE
        self.base = whole[skip : skip + nbytes]
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.base.numel():
            return None
        self.used = start + nbytes
        return self.base[start : start + nbytes]


_lock = threading.Lock()
_current: _Chunk | None = None
# every mapping still held (by a placed tensor), with its span, for `report`
_spans: weakref.WeakKeyDictionary[mmap.mmap, tuple[int, int]] = weakref.WeakKeyDictionary()
_placed = [0]  # bytes placed by this process so far


def place(t: torch.Tensor) -> torch.Tensor:
    """`t` (a CPU tensor) copied into a huge-page chunk, same shape, dtype and values; `t`
    itself where placing cannot help (not enabled, not on the CPU, under `SMALLEST` bytes)."""
    if t.device.type != "cpu":
        return t
    out = empty(tuple(t.shape), t.dtype)
    if out is None:
        return t
    return out.copy_(t)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An uninitialized CPU tensor in a huge-page chunk (what `place` copies into), for a
    producer to write in place (`torch.cat(..., out=)`: no second copy of a weight at load);
    None where placing cannot help (not enabled, under `SMALLEST` bytes)."""
    global _current
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < SMALLEST or not enabled():
        return None
    with _lock:
        raw = _current.take(nbytes) if _current is not None else None
        if raw is None:
            chunk = _Chunk(max(CHUNK, -(-nbytes // HUGE) * HUGE))
            _spans[chunk.map] = (chunk.base.data_ptr(), chunk.base.data_ptr() + chunk.base.numel())
            raw = chunk.take(nbytes)
            if nbytes < CHUNK:  # a tensor of a chunk or more has its own (freed with it)
                _current = chunk
        _placed[0] += nbytes
    return raw.view(dtype).view(shape)  # [*shape]


@dataclass(frozen=True, slots=True)
class HugePageReport:
    """What `place` did in this process: its THP `mode`, the bytes `placed` so far, the bytes
    `mapped` by the chunks still alive and how many of those the kernel backs by huge pages
    (`huge`; None where /proc/self/smaps cannot be read)."""

    mode: str
    enabled: bool
    placed: int
    mapped: int
    huge: int | None

    def line(self) -> str:
        """One line for a memory report."""
        if not self.enabled:
            why = "off (UNIKV_HUGE_PAGES=0)" if self.mode in ("always", "madvise") else "off"
            return f"weights in huge pages: {why}, THP {self.mode}"
        huge = "unknown" if self.huge is None else f"{self.huge / 2**20:.0f} MiB"
        return (f"weights in huge pages: {huge} of {self.mapped / 2**20:.0f} MiB mapped "
                f"(THP {self.mode})")  # fmt: skip


def report() -> HugePageReport:
    """How the chunks stand now (`HugePageReport`)."""
    with _lock:
        spans = list(_spans.values())
        placed = _placed[0]
    try:
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        smaps = None
    huge = None if smaps is None else huge_bytes(spans, smaps)
    return HugePageReport(mode(), enabled(), placed, sum(b - a for a, b in spans), huge)


def huge_bytes(spans: list[tuple[int, int]], smaps: str) -> int:
    """The AnonHugePages of the mappings in `smaps` (/proc/PID/smaps's text) that overlap
    `spans` ([start, end) addresses), at most the spans' bytes."""
    total, inside = 0, False
    for line in smaps.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's header: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = any(lo < b and a < hi for a, b in spans)
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return min(total, sum(b - a for a, b in spans))  # (a mapping's unaligned head is outside)
