"""The engine's memory report: what serving, the CLI and benchmarks read, by attribute.

What lives here: `ServedReport` (what a server reads of any report), `MemoryReport` (one
engine's report: the KV store's `KVReport` with the pool's `PoolReport` inside it, the model's
`ModelReport`, the scheduler's `RequestCounts` (`engine.scheduler`), the kernels in force and
their fallbacks), and `WeightFormat` (one stored weight format's layers, bytes and kernel).
Each has `as_dict()` for JSON (`unikv run --json`, the replicas' reports).

What does not: computing the readings (the pool, the strategy, the model and the scheduler
each report their own), the replicas' totals (`serving.replicas.ReplicasReport`, which
answers the same questions, `ServedReport`, that the server asks of this one).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from unikv.kvstrategies.kv import KVReport
from unikv.memory.stats import PoolReport, PrefixCounts

from .scheduler import RequestCounts


class ServedReport(Protocol):
    """What a server reads of any engine's report: one process's `MemoryReport`, or the
    replicas' totals (`serving.replicas.ReplicasReport`) behind the same attributes."""

    requests: RequestCounts
    operator_fallbacks: tuple[str, ...]

    @property
    def pool(self) -> PoolReport | None: ...  # None behind replicas (each has its own)

    @property
    def kv_bytes_used(self) -> int: ...

    @property
    def prefix(self) -> PrefixCounts: ...

    @property
    def ssd_writes_skipped(self) -> int: ...

    @property
    def replicas(self) -> dict[str, dict[str, Any]] | None: ...  # each replica's last report

    @property
    def router(self) -> dict[str, Any] | None: ...  # the replicas' router: its decisions

    def as_dict(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class WeightFormat:
    """One stored weight format: how many (fused) linear layers hold it, their bytes, and (a
    GGUF format) which kernel runs it packed or why it was decoded at load (`how`)."""

    layers: int = 0
    bytes: int = 0
    how: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ModelReport:
    """What a model class reports: its weights per format, the GGUF types decoded to float at
    load for want of a native kernel, how many weight bytes lie in huge pages; a latent-KV
    model its bytes per token against multi-head KV, an MoE model its routing and expert
    store."""

    weights: dict[str, WeightFormat] = field(default_factory=dict)
    dequantized: tuple[str, ...] = ()
    latent_kv: dict[str, Any] | None = None
    routing: dict[str, Any] | None = None
    experts: dict[str, Any] | None = None
    # how the process's weights lie in memory (memory.hugepages: one line, read at load)
    huge_pages: str = ""


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """One engine's memory report, as of the last turn of its loop."""

    kv: KVReport
    model: ModelReport = field(default_factory=ModelReport)
    requests: RequestCounts = field(default_factory=RequestCounts)
    kv_bytes_peak: int = 0
    # op -> the registry's choice (operators.report()), and a sentence per kernel on a
    # fallback (the health view shows them)
    kernels: dict[str, dict[str, Any]] = field(default_factory=dict)
    operator_fallbacks: tuple[str, ...] = ()

    # What the server asks of any engine's report (`serving.replicas.ReplicasReport` too).

    @property
    def pool(self) -> PoolReport | None:
        return self.kv.pool

    @property
    def kv_bytes_used(self) -> int:
        return self.kv.kv_bytes_used

    @property
    def prefix(self) -> PrefixCounts:
        return self.kv.pool.prefix if self.kv.pool is not None else PrefixCounts()

    @property
    def ssd_writes_skipped(self) -> int:
        """Blocks a full or failing SSD tier could not take (they miss later)."""
        return int(self.kv.placement.get("ssd_writes_skipped", 0))

    replicas = None  # one engine: no replicas, no router
    router = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return {
            "kv": self.kv.as_dict(),
            "model": asdict(self.model),
            "requests": asdict(self.requests),
            "kv_bytes_peak": self.kv_bytes_peak,
            "kernels": self.kernels,
            "operator_fallbacks": list(self.operator_fallbacks),
        }
