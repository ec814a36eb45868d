"""The KV strategy plug point: `KVSpec` (the model's KV shape) and the `KVStrategy` ABC.

A strategy decides how each token's keys and values are stored in the unified memory pool's
blocks and how attention is computed over what is stored. It implements the engine's `KVCache`
seam (`begin_step`/`append`/`attend`/`end_step`/`free`), so the model never changes when the
strategy does. What does not live here: block allocation (the pool), on-disk formats (storage/).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, ClassVar

import torch

from unikv.memory.pool import BlockLayout, UnifiedMemoryPool

from .kv import KVCache, KVMemory, KVSpec, StepBatch
from .options import Option, validate


class KVStrategy(KVCache, KVMemory):
    """A way of storing KV in pool blocks and attending over it.

    Subclasses set `name`, `tolerance` (the largest absolute error of `attend` against exact
    attention that the contract tests accept) and `options` (their `Option` declarations, which
    give the defaults, the checks, the `unikv` flags and the README's tables), implement
    `layout`, `append` and `attend`, and register with `@register`.
    This base class keeps the per-step bookkeeping that all strategies share.
    """

    name: ClassVar[str]
    tolerance: ClassVar[float] = 1e-5
    lossless: ClassVar[bool] = True
    # Whether `_compact` quantizes the kept tokens again (each pass adds rounding error), so a
    # pruned cache of this format should compact seldom (`evict_slack`).
    compaction_requantizes: ClassVar[bool] = False
    # Evicts tokens: attention is exact over the tokens it keeps (what `read` returns), and
    # no prefix sharing (a compacted block no longer holds the tokens its position says).
    evicts: ClassVar[bool] = False
    options: ClassVar[tuple[Option, ...]] = ()
    # Bandwidth classes ("high", "medium", "low") whose "auto" choice this strategy is.
    default_for: ClassVar[tuple[str, ...]] = ()
    default_block_size: ClassVar[int] = 16  # tokens per pool block when the config sets none
    # Options that change the bytes a block holds (None: all of them); part of prefix hashes.
    content_options: ClassVar[tuple[str, ...] | None] = None
    # Options the contract tests run with (small sizes that exercise the whole strategy).
    contract_options: ClassVar[dict[str, Any]] = {}
    # Whether it stores latent (MLA) caches (`KVSpec.latent`): only the keys, attention values
    # read from their first channels. `create` refuses a latent spec for a strategy without.
    supports_latent: ClassVar[bool] = True
    # What the strategy needs recorded from the model before it is built; the engine records
    # it and completes the options (strategies never drive the model). Known: "channel_stats"
    # (a calibration file of per-channel statistics, named by option `calibration`).
    needs: ClassVar[frozenset[str]] = frozenset()
    # The three axes this strategy is (format, placement, selection; `kvstrategies.composed`)
    # and the options its format fixes (merged over the checked ones, never user-set).
    axes: ClassVar[tuple[str, str, str]] = ("", "resident", "all")
    fixed: ClassVar[dict[str, Any]] = {}
    # Where a tiered placement put this step's blocks (`kvstrategies.offload.TieredPlacement`):
    # per batch sequence its (tier, block ids) or ("staged", index) groups; None when resident.
    _groups: list | None = None

    def __init__(self, pool: UnifiedMemoryPool, spec: KVSpec, options: dict | None = None) -> None:
        self.pool, self.spec = pool, spec
        self.opts = self.check_options(options)
        self._batch: StepBatch | None = None
        self._past: list[int] = []  # stored tokens of each batch sequence before this step

    @classmethod
    def check_options(cls, options: dict | None) -> dict[str, Any]:
        """Options checked against the declarations and merged over their defaults; an unknown
        name or a bad value is a ValueError naming it and what is allowed."""
        options = dict(options or {})
        for key, value in cls.fixed.items():  # checked options passed again carry them
            if key in options and options.pop(key) != value:
                raise ValueError(
                    f"strategy {cls.name!r}: option {key} is fixed to {value!r} by its format "
                    f"{cls.axes[0]}"
                )
        opts = validate(cls.name, cls.options, options)
        opts.update(cls.fixed)
        cls.check_combination(opts)
        return opts

    @classmethod
    def check_combination(cls, opts: dict[str, Any]) -> None:
        """Checks between options that are each valid alone (e.g. one at most another); may
        complete an unset option from another. Default: none."""

    @classmethod
    @abstractmethod
    def layout(cls, spec: KVSpec, block_size: int, options: dict[str, Any]) -> BlockLayout:
        """What one pool block holds for this strategy (options already checked)."""

    @classmethod
    def from_profile(cls, profile, options: dict[str, Any]) -> dict[str, Any]:
        """Options completed from the chip profile (e.g. a prefetch depth); default: as given."""
        return options

    @classmethod
    def store_slices(cls, spec: KVSpec) -> int:
        """Values per block in a store tier: 1, or e.g. one per layer to read layers apart."""
        return 1

    def _empty_out(self, q: torch.Tensor) -> torch.Tensor:
        """The output of `attend` for queries q [N, Hq, D]: [N, Hq, Dv], Dv < D when latent."""
        return q.new_empty(*q.shape[:2], self.spec.v_dim)

    def read(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values as attention sees them, per batch sequence [Hkv, S, D] (values
        [Hkv, S, Dv]: a latent cache's are its keys' first channels), for `layer`.

        Used inside a step after `append` (by the transformers adapter and the contract tests);
        a lossy strategy returns its reconstruction, a pruning one only the kept tokens.
        """
        raise NotImplementedError(f"strategy {self.name!r} cannot read back its KV")

    # ---- shared bookkeeping ------------------------------------------------------------------

    def begin_step(self, batch: StepBatch) -> None:
        # NOTE: the scheduler reserved this room already; asking again costs a table lookup
        # when nothing changed, and is needed when it did: a strategy's own begin_step may have
        # compacted (learned_prune) or moved (hierarchical_offload) blocks since, and callers
        # outside a scheduler (evaluation loops, recorders) reserve nothing beforehand.
        for sid, n in zip(batch.seq_ids, batch.query_lens, strict=True):
            if not self.pool.reserve(sid, n):
                raise RuntimeError(
                    f"no room in the device tier for {n} tokens of sequence {sid}; "
                    "the scheduler must reserve before the step"
                )
        self._batch = batch
        self._past = [self.pool.num_tokens(sid) for sid in batch.seq_ids]
        self._prepare(batch)

    def _prepare(self, batch: StepBatch) -> None:
        """Per-step precomputation shared by all layers (e.g. slot indices)."""

    def end_step(self) -> None:
        for sid, n in zip(self._batch.seq_ids, self._batch.query_lens, strict=True):
            self.pool.commit(sid, n)
        self._batch = None
        self.pool.sample_usage()

    def abort_step(self) -> None:
        # Reserved blocks stay with their sequences and are reused by the retry.
        self._batch = None

    def free(self, seq_id: int) -> None:
        self.pool.free(seq_id)

    def stored_tokens(self, seq_id: int) -> int:
        return self.pool.num_tokens(seq_id)

    def reserve(self, seq_id: int, num_tokens: int) -> bool:
        return self.pool.reserve(seq_id, num_tokens)

    def can_admit(self, num_tokens: int) -> bool:
        return self.pool.can_admit(num_tokens)

    def capacity_tokens(self) -> int | None:
        return self.pool.capacity_tokens("device")

    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        if not self._can_attach(token_ids):
            return 0
        # Keep at least one token to compute, so the request gets logits for its next token.
        refs = self.pool.match_prefix(token_ids[:-1])
        n = self.pool.attach_prefix(seq_id, refs) if refs else 0
        if n:
            self._attached(seq_id, token_ids)
        return n

    def publish(self, seq_id: int, token_ids: list[int]) -> None:
        if self.pool.table(seq_id) is not None:
            self.pool.publish(seq_id, token_ids)
            self._published(seq_id, token_ids)

    # Prefix hooks of a format that keeps state beside its blocks (hybrid's fp16 sinks); a
    # placement that attaches blocks its own way (tiered: from disk too) calls them as well.
    def _can_attach(self, token_ids: list[int]) -> bool:
        """Whether a sequence starting with `token_ids` can be attended from shared blocks."""
        return True

    def _attached(self, seq_id: int, token_ids: list[int]) -> None:
        """`seq_id` was attached to shared blocks of `token_ids`."""

    def _published(self, seq_id: int, token_ids: list[int]) -> None:
        """`seq_id`'s blocks of `token_ids` were published for sharing."""

    def _prefix_state(self, token_ids: list[int]) -> bytes | None:
        """What this format keeps beside the published blocks of `token_ids` and a sequence
        attaching them needs (persisted beside block 0 by a tiered placement); None: nothing."""
        return None

    def _load_prefix_state(self, token_ids: list[int], data: bytes) -> bool:
        """Take `_prefix_state` bytes of `token_ids` read back (another process's); then
        `_can_attach(token_ids)` holds. False when they do not fit this strategy."""
        return False

    # Hooks a placement and a selection use to work on any format (`full` and `hybrid` define
    # them): the per-layer block views of an arena, how many of a sequence's leading blocks
    # attention reads from pool blocks, which tiers it reads in place, what the prefetcher
    # stages, a sequence's stored tokens, and compaction of its kept tokens.
    def _arena_layers(self, arena: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer views of a tier's arena, as this format indexes them."""
        raise NotImplementedError(f"strategy {self.name!r} has no tiered placement")

    def _pool_blocks(self, past: int, new: int) -> int:
        """Leading blocks of a sequence that attention reads from the pool's arenas."""
        return -(-(past + new) // self.pool.block_size)

    def _in_place(self, tier: str) -> bool:
        """Whether attention reads blocks of `tier` in place (else they are staged)."""
        return tier == "device"

    def _staged(self, layer: int, count: bool) -> list | None:
        """The prefetcher's staged groups of `layer` per batch sequence (tiered only)."""
        return None

    def _token_kv(self, seq_id: int, lo: int, hi: int) -> torch.Tensor:
        """Stored tokens [lo, hi) of `seq_id` as K and V: [L, 2, Hkv, hi - lo, D], model order."""
        raise NotImplementedError(f"strategy {self.name!r} cannot read tokens back")

    def _compact(self, seq_id: int, lo: int, n: int, rel: torch.Tensor) -> None:
        """Keep, in each (layer, KV head), tokens lo + rel[layer, head] of [lo, n), moved down
        to [lo, lo + rel.shape[-1]) (the caller truncates the pool's table)."""
        raise NotImplementedError(f"strategy {self.name!r} cannot compact its tokens")

    def prefix_digest(self, limit: int) -> tuple[int, str, list[bytes]] | None:
        pool = self.pool
        return pool.block_size, pool.identity, pool.prefixes.cache.newest(limit)

    def swap_out(self, seq_id: int) -> bool:
        # A sequence without blocks has nothing to swap: the caller drops it to recompute.
        has_blocks = self.pool.table(seq_id) is not None
        return has_blocks and "host" in self.pool.tiers and self.pool.swap_out(seq_id, "host")

    def swap_in(self, seq_id: int) -> bool:
        return self.pool.swap_in(seq_id)

    def record_preemption(self) -> None:
        self.pool.record_preemption()

    def bytes_reserved(self) -> int:
        used = sum(a.num_used for a in self.pool.allocators.values())
        return used * self.pool.layout.page_bytes

    def stats(self) -> dict:
        return {
            "strategy": self.name,
            "kv_bytes_used": self.bytes_used(),
            "kv_bytes_reserved": self.bytes_reserved(),
            "pool": self.pool.snapshot(),
        }
