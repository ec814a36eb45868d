"""The three axes a KV strategy is made of, as small interfaces, and their registries.

- A `Format` says how a block's K/V bytes are laid out: it writes the step's keys and values
  (`append`) and attends over the blocks the step reads (`attend`), reads tokens back and
  compacts them when a selection evicts. `full.py` (dense, in one dtype) and `hybrid.py`
  (packed fp16 + integer channels) define them.
- A `Placement` says where blocks live: which tier each block is in before a step, which of
  the step's blocks are read in place and which are staged, how prefixes are found and
  persisted. `placement.py` (resident) and `offload.py` (tiered) define them.
- A `Selection` says which tokens are kept or read, with its own state per sequence.
  `selection.py` (all) and `prune.py` (pruned) define them.

One `KVStrategy` (`strategy.py`) owns one object of each axis and implements the engine's
`KVCache` and `KVMemory` over the pool by delegating to them; the objects see each other only
through the hooks declared here and the `Step` they share. An axis is registered by importing
its module (each class carries `@FORMATS.register`, ...; the package imports them all), never
found by a string. What does not live here: the adapter (`strategy.py`), the table of presets
and the choice by chip (`registry.py`), the composition rules (`composed.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from unikv.memory.pool import BlockLayout, UnifiedMemoryPool
from unikv.memory.tiers import StoreTier

from .kv import (
    KVSpec,
    NativeChoice,
    NativeHook,
    NativeStep,
    StepBatch,
    attention_one,
    block_tokens,
    take_tokens,
)
from .options import Option

T = TypeVar("T")


class AxisRegistry(Generic[T]):
    """The classes of one axis by name, in the order their modules registered them."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: `cls` becomes this axis's entry `cls.name`."""
        name = cls.name  # type: ignore[attr-defined]
        if self._classes.get(name, cls) is not cls:
            raise RuntimeError(f"two KV {self.kind}s are named {name!r}")
        self._classes[name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove an entry (tests that register one of their own)."""
        self._classes.pop(name, None)

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._classes)

    def get(self, name: str) -> type[T]:
        """The class called `name`; a ValueError names the axis and lists its entries."""
        try:
            return self._classes[name]
        except KeyError:
            listed = ", ".join(self._classes)
            raise ValueError(f"unknown KV {self.kind} {name!r}; {self.kind}s: {listed}") from None


def _no_staging(layer: int, count: bool) -> list | None:
    return None


def _no_hint(seq_id: int) -> None:
    return None


@dataclass(slots=True)
class Step:
    """One forward step as the three axes share it, built by `KVStrategy.begin_step`."""

    batch: StepBatch
    past: list[int]  # stored tokens of each batch sequence before this step
    # Set by a placement that moves blocks (None: every block on the device): per batch
    # sequence, the blocks attention reads from the pool as groups in token order, (tier, block
    # ids) read in place or ("staged", index) filled by `staged(layer, count)`; `in_place` holds
    # per tier the format's per-layer views of the arenas read in place.
    groups: list[list[tuple[str, Any]]] | None = None
    staged: Callable[[int, bool], list | None] = _no_staging
    in_place: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    # The selection's guess, per sequence, of the blocks each layer reads (`Selection.likely`):
    # what a placement stages ahead.
    likely: Callable[[int], list[set[int] | None] | None] = _no_hint


class PrefixState:
    """What a format keeps beside its published blocks that a sequence attaching them needs
    (hybrid's fp16 sinks, which its block 0 leaves out). This default keeps nothing."""

    def can_attach(self, token_ids: list[int]) -> bool:
        """Whether a sequence starting with `token_ids` can be attended from shared blocks."""
        return True

    def attached(self, seq_id: int, token_ids: list[int]) -> None:
        """`seq_id` was attached to shared blocks of `token_ids`."""

    def published(self, seq_id: int, token_ids: list[int]) -> None:
        """`seq_id`'s blocks of `token_ids` were published for sharing."""

    def to_bytes(self, token_ids: list[int]) -> bytes | None:
        """The state of `token_ids` as bytes, persisted beside block 0; None: nothing kept."""
        return None

    def from_bytes(self, token_ids: list[int], data: bytes) -> bool:
        """Take `to_bytes` of `token_ids` read back (another process's); then `can_attach`
        holds. False when they do not fit this format."""
        return False


class Format(ABC):
    """How a block's K/V bytes are laid out, written and attended.

    Subclasses set `name`, `help` and `options` (their `Option` declarations), implement
    `layout`, `prepare`, `append`, `attend` and `bytes_used`, and register with
    `@FORMATS.register`. A variant of a format fixes some of its options (`fixed`).
    """

    name: ClassVar[str]
    help: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    fixed: ClassVar[dict[str, Any]] = {}  # options this variant sets (never user-set)
    tolerance: ClassVar[float] = 1e-5  # |attend - exact| the contract tests accept
    lossless: ClassVar[bool] = True
    # Whether `compact` quantizes the kept tokens again (each pass adds rounding error), so a
    # pruned cache of this format should compact seldom (`evict_slack`).
    compaction_requantizes: ClassVar[bool] = False
    default_block_size: ClassVar[int] = 16  # tokens per pool block when the config sets none
    contract_options: ClassVar[dict[str, Any]] = {}  # what the contract tests run with
    # Whether it stores latent (MLA) caches (`KVSpec.latent`): only the keys, attention values
    # read from their first channels.
    supports_latent: ClassVar[bool] = True
    # What it needs recorded from the model before it is built ("channel_stats": a calibration
    # file, named by option `calibration`); the engine records it and completes the options.
    needs: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, pool: UnifiedMemoryPool, spec: KVSpec, opts: dict[str, Any]) -> None:
        self.pool, self.spec, self.opts = pool, spec, opts
        self.prefix = PrefixState()
        self.step: Step | None = None

    @classmethod  # noqa: B027
    def check_combination(cls, strategy: str, opts: dict[str, Any]) -> None:
        """Checks between options that are each valid alone, for errors naming `strategy`;
        may complete an unset option from another. Default: none."""

    @classmethod
    @abstractmethod
    def layout(cls, spec: KVSpec, block_size: int, options: dict[str, Any]) -> BlockLayout:
        """What one pool block holds (options already checked)."""

    @abstractmethod
    def prepare(self, step: Step) -> None:
        """Per-step precomputation shared by all layers (slots, which blocks are read)."""

    @abstractmethod
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new keys/values of `layer` (k, v: [N, Hkv, D] packed)."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Causal attention of the step's queries q [N, Hq, D] over what is stored."""

    def read(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys [Hkv, S, D] and values [Hkv, S, Dv] per batch sequence, as attention sees them
        (a lossy format's reconstruction), for `layer`, inside a step after `append`."""
        raise NotImplementedError(f"format {self.name!r} cannot read back its KV")

    def finish(self) -> None:
        """The step's layers are done, before its tokens are committed."""
        self.step = None

    def abort(self) -> None:
        """Forget the step after a failure."""
        self.step = None

    def forget(self, seq_id: int) -> None:  # noqa: B027
        """Drop what the format keeps for `seq_id` beside the pool's blocks."""

    @abstractmethod
    def bytes_used(self) -> int:
        """Bytes of KV stored (all sequences, all layers)."""

    def side_bytes(self) -> int:
        """Bytes held beside the pool's blocks (side buffers)."""
        return 0

    def stats(self) -> dict:
        """What the memory report shows of this format."""
        return {}

    def native_step(self, step: Step) -> NativeStep | NativeHook | None:
        """`step` (prepared) as `KVCache.native_step` describes it, or None (this default): a
        format whose every layer is one plain float32 arena (`NativeStep`), or that has C code
        for a layer's store and attention (`NativeHook`), can say yes."""
        return None

    def sequential(self, past: int, steps: int) -> int:
        """How many (at most `steps`) decode steps of a sequence storing `past` tokens its
        `native_step` describes as one sequential step (`StepBatch.sequential`: row j of each
        sequence written and attended as its own decode step would, after the rows before
        it), 1 where none (this default)."""
        return 1

    def new_keys(self) -> torch.Tensor:
        """The keys the step wrote, [L, N, Hkv, D] float32 (after a native step, for a
        selection that summarizes them); only formats with a `native_step` have them."""
        raise NotImplementedError(f"format {self.name!r} takes no native step")

    def attend_tokens(self, layer: int, q: torch.Tensor, step: Step,
                      chosen: list[torch.Tensor | None]) -> torch.Tensor:  # fmt: skip
        """`attend` over the blocks a selection chose (`Selection.reads`): per batch sequence
        the block indices per KV head, [Hkv, B], or None for all. This default takes their
        tokens from what `read` gives (every stored token, decoded); a format that can gather
        only the chosen blocks overrides it."""
        ks, vs = self.read(layer)
        out = q.new_empty(*q.shape[:2], self.spec.v_dim)
        for i, blocks in enumerate(chosen):
            rows = step.batch.rows(i)
            k, v = ks[i], vs[i]
            if blocks is not None:
                idx = block_tokens(blocks, self.pool.block_size, k.shape[1])
                k = take_tokens(k, idx)
                v = k[..., : self.spec.v_dim] if self.spec.latent else take_tokens(v, idx)
            k, v = k.to(q.dtype), v.to(q.dtype)
            n = step.batch.query_lens[i]
            out[rows] = attention_one(q[rows], k, v, k.shape[1] - n, self.spec.scale)
        return out

    # ---- what a placement asks -----------------------------------------------------------------

    @abstractmethod
    def arena_layers(self, arena: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer views of a tier's arena, as this format indexes them."""

    def pool_blocks(self, past: int, new: int) -> int:
        """Leading blocks of a sequence that attention reads from the pool's arenas."""
        return -(-(past + new) // self.pool.block_size)

    @staticmethod
    def stage(data: dict[str, torch.Tensor]) -> torch.Tensor:
        """A staged group's arena slices as attention reads them (the prefetcher's thread)."""
        return data["kv"]

    # ---- what a selection asks -----------------------------------------------------------------

    def token_kv(self, seq_id: int, lo: int, hi: int) -> torch.Tensor:
        """Stored tokens [lo, hi) of `seq_id` as K and V: [L, 2, Hkv, hi - lo, D]."""
        raise NotImplementedError(f"format {self.name!r} cannot read tokens back")

    def compact(self, seq_id: int, lo: int, n: int, rel: torch.Tensor) -> None:
        """Keep, in each (layer, KV head), tokens lo + rel[layer, head] of [lo, n), moved down
        to [lo, lo + rel.shape[-1]) (the caller truncates the pool's table). `rel` may be on
        another device than the format's (a selection ranks tokens on the CPU)."""
        raise NotImplementedError(f"format {self.name!r} cannot compact its tokens")


class _Axis:
    """What placements and selections share: declarations, and the objects they work with."""

    name: ClassVar[str]
    help: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    contract_options: ClassVar[dict[str, Any]] = {}
    # Whether its per-layer hooks (a placement's `reading`, a selection's `appended`, `reads`
    # and `attended`) must run; False where they do nothing, so that a native decode graph may
    # run a step's layers without them (`KVCache.native_step`). A selection with hooks may
    # still take that path by describing its choice (`Selection.native_choice`).
    layer_hooks: ClassVar[bool] = True

    def __init__(self, pool: UnifiedMemoryPool, spec: KVSpec, opts: dict[str, Any],
                 fmt: Format, label: str) -> None:  # fmt: skip
        # `label`: the strategy's name, for log messages.
        self.pool, self.spec, self.opts, self.format, self.label = pool, spec, opts, fmt, label

    def stats(self) -> dict:
        """What the memory report shows of this axis."""
        return {}


# Prefix persistence options, which every placement declares (the pool's SSD tier writes
# prompt blocks through and finds them again whatever the placement).
PERSIST_OPTIONS = (
    Option("persist_prefix", bool, True, "write prompt blocks through to the SSD tier (and the "
           "remote tier) by content, and look prefixes up there"),
    # Below it, reading costs more than computing (benchmarks/prefix_ttft.py measures the
    # break-even).
    Option("min_disk_hit_tokens", int, 64, "shortest prefix hit read from disk (shorter ones "
           "are recomputed)", low=0),
)  # fmt: skip


class Placement(_Axis):
    """Where a strategy's blocks live, and the prefix sharing that follows from it: in memory
    through the pool's prefix cache, and across processes through the pool's persistence
    service (`pool.persistence`, with an SSD tier): a prefill's blocks are written through,
    and a later prompt's stored blocks attached (`_attach_stored` says how they are read)."""

    options: ClassVar[tuple[Option, ...]] = PERSIST_OPTIONS
    contract_options: ClassVar[dict[str, Any]] = {"min_disk_hit_tokens": 0}  # short prompts
    default_block_size: ClassVar[int] = 0  # at least this many tokens per block
    # Whether it moves blocks to the host and SSD tiers by itself (else an SSD tier serves
    # only prefix persistence, and is refused where that is off).
    offloads: ClassVar[bool] = False

    def __init__(self, pool: UnifiedMemoryPool, spec: KVSpec, opts: dict[str, Any],
                 fmt: Format, label: str) -> None:  # fmt: skip
        super().__init__(pool, spec, opts, fmt, label)
        # The pool's service (None without an SSD tier), unless this strategy turned it off.
        self.persistence = pool.persistence if opts.get("persist_prefix") else None
        self._pending_persist: set[int] = set()  # sequences whose last step was a prefill

    @classmethod
    def from_profile(cls, profile, options: dict[str, Any]) -> dict[str, Any]:
        """Options completed from the chip profile (e.g. a prefetch depth); default: as given."""
        return options

    @classmethod
    def store_slices(cls, spec: KVSpec) -> int:
        """Values per block in a store tier: 1, or one per layer to read layers apart."""
        return 1

    def before_step(self, batch: StepBatch) -> None:
        """Put the batch's blocks where the step needs them, before room is reserved."""
        if self.persistence is not None:
            self.persistence.wait_snapshots()  # blocks being persisted must not be reused

    def place(self, step: Step) -> None:
        """Say where the step's blocks are read (`Step.groups`); none: all on the device."""

    def stages(self, step: Step) -> bool:
        """Whether `step` (placed) has per-layer work here: blocks staged or read late
        (`reading`). Where it has none, a native decode graph may run the step's layers in one
        call (`KVCache.native_step`). By default: `layer_hooks`."""
        return self.layer_hooks

    def sequential(self, seq_id: int, steps: int) -> int:
        """How many (at most `steps`) of `seq_id`'s next decode steps may run as one sequential
        step (`StepBatch.sequential`): all of them where nothing moves per step (no layer
        hooks), else 1."""
        return 1 if self.layer_hooks else steps

    def reading(self, layer: int, step: Step, chosen: list[torch.Tensor | None] | None) -> None:
        """Attention of `layer` is about to read `chosen` (`Selection.reads`; None: every
        block): a placement that staged only the likely blocks reads the others now."""

    def after_step(self, step: Step) -> None:
        """The step's layers are done (before its tokens are committed)."""
        b = step.batch
        self._pending_persist = {  # a prefill's blocks
            sid for sid, n in zip(b.seq_ids, b.chunk_lens, strict=True) if n > 1
        }

    def abort(self) -> None:
        """Forget the step after a failure."""

    def forget(self, seq_id: int) -> None:
        """`seq_id` is about to be freed."""
        if self.persistence is not None:
            self.persistence.wait_snapshots()

    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """Attach cached blocks of a prefix of `token_ids` to `seq_id`: the pool's in-memory
        hits, then what the SSD and remote tiers hold; their tokens."""
        pool, store = self.pool, self.persistence
        # Keep at least one token to compute, so the request gets logits for its next token.
        ids = token_ids[:-1]
        prefix = self.format.prefix
        if not prefix.can_attach(token_ids) and not (store and self._load_side(ids, token_ids)):
            return 0
        refs = pool.sharing.match(ids)
        stored = store.find(ids, refs) if store is not None else []
        if stored and len(stored) * pool.block_size < self.opts["min_disk_hit_tokens"]:
            store.hits["skipped_short"] += 1
            stored = []
        elif stored and not self._reading_pays(len(stored)):
            store.hits["skipped_slow"] += 1
            stored = []
        n = pool.sharing.attach(seq_id, refs) if refs else 0
        if stored:
            n = self._attach_stored(seq_id, len(refs), stored)
        if n:
            prefix.attached(seq_id, token_ids)
        return n

    def _load_side(self, ids: list[int], token_ids: list[int]) -> bool:
        """The format's state beside block 0 of `ids` (hybrid's fp16 sinks) from the stores,
        given to the format; False when they do not hold it (the prefix is recomputed)."""
        data = self.persistence.read_side(ids)
        return data is not None and self.format.prefix.from_bytes(token_ids, data)

    def _reading_pays(self, blocks: int) -> bool:
        """Whether reading `blocks` stored blocks is expected to beat computing them again."""
        return True

    def _attach_stored(self, seq_id: int, first: int, hashes: list[bytes]) -> int:
        """Attach the stored blocks `hashes` after `seq_id`'s first `first` blocks; its
        tokens then. This default reads them in place (a placement that reads store tiers)."""
        n = self.pool.sharing.attach_stored(seq_id, hashes, self.persistence.tier)
        self.persistence.hits["requests"] += 1
        self.persistence.hits["blocks"] += len(hashes)
        return n

    def publish(self, seq_id: int, token_ids: list[int]) -> None:
        """Offer `seq_id`'s blocks of `token_ids` for sharing; a prefill's new blocks go
        through to the SSD (and remote) tier with what the format keeps beside block 0."""
        if self.pool.table(seq_id) is None:
            return
        before = len(self.pool.sharing.chain(seq_id))
        self.pool.sharing.publish(seq_id, token_ids)
        self.format.prefix.published(seq_id, token_ids)
        if self.persistence is not None and seq_id in self._pending_persist:
            side = self.format.prefix.to_bytes(token_ids) if before == 0 else None
            self.persistence.write_through(seq_id, before, side)

    def capacity_tokens(self) -> int | None:
        return self.pool.capacity_tokens("device")

    def can_admit(self, num_tokens: int) -> bool:
        return self.pool.can_admit(num_tokens)

    def swap_out(self, seq_id: int) -> bool:
        # A sequence without blocks has nothing to swap: the caller drops it to recompute.
        has_blocks = self.pool.table(seq_id) is not None
        return has_blocks and "host" in self.pool.tiers and self.pool.swap_out(seq_id, "host")

    def swap_in(self, seq_id: int) -> bool:
        return self.pool.swap_in(seq_id)

    def stats(self) -> dict:
        store = self.pool.persistence
        return store.stats() if store is not None else {}

    def close(self) -> None:
        """Finish pending writes and close the pool's store tiers; idempotent."""
        if self.pool.persistence is not None:
            self.pool.persistence.close()
        for tier in self.pool.tiers.values():
            if isinstance(tier, StoreTier):
                tier.close()


class Selection(_Axis):
    """Which of a sequence's tokens keep their KV (or are read), with its own state."""

    evicts: ClassVar[bool] = False  # drops tokens: no prefix sharing, not lossless
    wants_token_logprobs: bool = False  # see `KVCache.wants_token_logprobs`

    def before_step(self, batch: StepBatch) -> None:
        """Before the step's placement and reservation."""

    def prepare(self, step: Step) -> None:
        """After the format prepared the step."""

    def appended(self, layer: int, k: torch.Tensor) -> None:
        """The format stored the step's keys `k` [N, Hkv, D] of `layer`."""

    def reads(self, layer: int, q: torch.Tensor) -> list[torch.Tensor | None] | None:
        """Which blocks the step's queries `q` [N, Hq, D] of `layer` attend: per batch sequence
        the block indices (in the sequence's order) per KV head, [Hkv, B], in any order but
        its last block (with the step's own tokens) last; or None for all of them. None: every
        sequence reads everything (this default)."""
        return None

    def likely(self, seq_id: int) -> list[set[int] | None] | None:
        """Per layer, the block indices of `seq_id` its next step will probably read (None
        for a layer: all of them); None: all, at every layer (this default)."""
        return None

    def attended(self, layer: int, q: torch.Tensor) -> None:
        """The format attended the step's queries `q` [N, Hq, D] of `layer`."""

    def hooks(self, step: Step) -> bool:
        """Whether `step` (prepared) has per-layer work here (`appended`, `reads`, `attended`
        doing something). Where it has none, a native decode graph may run the step's layers
        in one call without them (`KVCache.native_step`). By default: `layer_hooks`."""
        return self.layer_hooks

    def sequential(self, seq_id: int, past: int, steps: int) -> int:
        """How many (at most `steps`) of `seq_id`'s next decode steps, from its `past` stored
        tokens on, may run as one sequential step (`StepBatch.sequential`), each choosing
        nothing: all of them where this selection never has per-layer work (no layer hooks),
        else 1 (this default)."""
        return 1 if self.layer_hooks else steps

    def native_choice(self, step: Step) -> NativeChoice | None:
        """`step`'s choice of blocks as a native step makes it at every layer (`NativeChoice`),
        or None (this default): the step then goes layer by layer through `appended`, `reads`
        and `attended`. A selection that says yes finds, at `after_step`, that none of those
        was called, and reads back what the step chose (`NativeChoice.out`) and wrote
        (`Format.new_keys`)."""
        return None

    def after_step(self, step: Step) -> None:
        """The step's tokens are committed."""

    def observe_logprobs(self, batch: StepBatch, tokens: torch.Tensor,
                         logprobs: torch.Tensor) -> None:  # fmt: skip
        """See `KVCache.observe_logprobs`."""

    def forget(self, seq_id: int) -> None:
        """`seq_id` is about to be freed."""


FORMATS: AxisRegistry[Format] = AxisRegistry("format")
PLACEMENTS: AxisRegistry[Placement] = AxisRegistry("placement")
SELECTIONS: AxisRegistry[Selection] = AxisRegistry("selection")
