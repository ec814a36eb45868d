"""A KV strategy: one format, one placement and one selection over the unified memory pool.

`Recipe` is a strategy before it is built: its name, the classes of its three axes
(`axes.py`) and what follows from them (the merged option declarations, the block layout,
tolerance, ...). Calling it with a pool builds a `KVStrategy`, the one adapter that implements
the engine's `KVCache` (the model's side of a step) and `KVMemory` (the scheduler's side
between steps) by delegating to its three objects. What lives here is only the order in which
they are asked and the pool's bookkeeping that every strategy shares (reserve, commit, free).

One decode step, in order:

    reserve(seq, n)            pool: room for the step's tokens -> a Reservation the step uses
    begin_step(batch)          selection.before_step, placement.before_step (moves blocks),
                               Step(batch, past), placement.place (which blocks are read where),
                               format.prepare, selection.prepare
    append(layer, k, v)        format.append, selection.appended
    attend(layer, q)           selection.reads, format.attend (or attend_tokens: the tokens
                               the selection chose), selection.attended
    end_step()                 format.finish, placement.after_step, pool.commit,
                               selection.after_step (evicts)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch

from unikv.memory.pool import BlockLayout, Reservation, UnifiedMemoryPool

from .axes import PERSIST_OPTIONS, Format, Placement, Selection, Step
from .kv import KVCache, KVMemory, KVReport, KVSpec, NativeHook, NativeStep, StepBatch
from .options import Option, validate


@dataclass(frozen=True)
class Recipe:
    """A strategy's name and the classes of its axes; calling it builds the strategy."""

    name: str
    format: type[Format]
    placement: type[Placement]
    selection: type[Selection]
    default_for: tuple[str, ...] = ()  # bandwidth classes whose "auto" choice this is

    @property
    def axes(self) -> tuple[str, str, str]:
        return (self.format.name, self.placement.name, self.selection.name)

    @property
    def fixed(self) -> dict[str, Any]:
        return dict(self.format.fixed)

    @functools.cached_property
    def options(self) -> tuple[Option, ...]:
        """The declarations of the three axes, a name declared twice kept once (the format's:
        `sink_tokens` of a pruned hybrid cache is both its fp16 sinks and the never-pruned
        ones); the options the format fixes are not among them."""
        seen: dict[str, Option] = {}
        # A selection that evicts shares and persists nothing: no persistence options.
        skip = {o.name for o in PERSIST_OPTIONS} if self.selection.evicts else set()
        for group in (self.format.options, self.selection.options, self.placement.options):
            for o in group:
                if o.name not in self.format.fixed and o.name not in skip:
                    seen.setdefault(o.name, o)
        return tuple(seen.values())

    @property
    def tolerance(self) -> float:
        return self.format.tolerance

    @property
    def evicts(self) -> bool:
        return self.selection.evicts

    @property
    def lossless(self) -> bool:
        return self.format.lossless and not self.evicts

    @property
    def default_block_size(self) -> int:
        return max(self.format.default_block_size, self.placement.default_block_size)

    @property
    def content_options(self) -> tuple[str, ...]:
        """Options that change the bytes a block holds (the format's; windows move blocks):
        part of prefix hashes."""
        return tuple(o.name for o in self.format.options)

    @property
    def contract_options(self) -> dict[str, Any]:
        merged = {**self.format.contract_options, **self.selection.contract_options,
                  **self.placement.contract_options}  # fmt: skip
        declared = {o.name for o in self.options}
        return {k: v for k, v in merged.items() if k in declared}

    @property
    def needs(self) -> frozenset[str]:
        return self.format.needs

    @property
    def supports_latent(self) -> bool:
        return self.format.supports_latent

    def check_options(self, options: dict | None) -> dict[str, Any]:
        """Options checked against the declarations and merged over their defaults; an unknown
        name or a bad value is a ValueError naming it and what is allowed."""
        options = dict(options or {})
        for key, value in self.format.fixed.items():  # checked options passed again carry them
            if key in options and options.pop(key) != value:
                raise ValueError(
                    f"strategy {self.name!r}: option {key} is fixed to {value!r} by its format "
                    f"{self.format.name}"
                )
        opts = validate(self.name, self.options, options)
        opts.update(self.format.fixed)
        self.format.check_combination(self.name, opts)
        return opts

    def layout(self, spec: KVSpec, block_size: int, options: dict[str, Any]) -> BlockLayout:
        return self.format.layout(spec, block_size, options)

    def from_profile(self, profile, options: dict[str, Any]) -> dict[str, Any]:
        return self.placement.from_profile(profile, options)

    def store_slices(self, spec: KVSpec) -> int:
        return self.placement.store_slices(spec)

    def __call__(self, pool: UnifiedMemoryPool, spec: KVSpec, opts: dict) -> KVStrategy:
        return KVStrategy(self, pool, spec, opts)


class KVStrategy(KVCache, KVMemory):
    """The engine's KV seam over the pool, delegating to a format, a placement and a selection.

    Attributes: `recipe`, `name`, `pool`, `spec`, `opts` (checked), and the three objects
    `format`, `placement`, `selection`.
    """

    def __init__(self, recipe: Recipe, pool: UnifiedMemoryPool, spec: KVSpec,
                 options: dict | None = None) -> None:  # fmt: skip
        self.recipe, self.name, self.pool, self.spec = recipe, recipe.name, pool, spec
        self.opts = recipe.check_options(options)
        _check_tiers(recipe, pool, self.opts)
        self.format = recipe.format(pool, spec, self.opts)
        self.placement = recipe.placement(pool, spec, self.opts, self.format, self.name)
        self.selection = recipe.selection(pool, spec, self.opts, self.format, self.name)
        self.wants_token_logprobs = self.selection.wants_token_logprobs
        self._step: Step | None = None
        self._reserved: dict[int, Reservation] = {}  # room the scheduler reserved, per sequence

    # ---- KVCache: one step -------------------------------------------------------------------

    def begin_step(self, batch: StepBatch) -> None:
        self.selection.before_step(batch)
        self.placement.before_step(batch)
        for sid, n in zip(batch.seq_ids, batch.query_lens, strict=True):
            # The scheduler reserved the step's room (`reserve`); a caller outside a scheduler
            # (evaluation loops, recorders) has not, and gets it here.
            held = self._reserved.pop(sid, None)
            if held is None or not held.covers(n):
                held = self.pool.reserve(sid, n)
            if not held:
                raise RuntimeError(
                    f"no room in the device tier for {n} tokens of sequence {sid}; "
                    "the scheduler must reserve before the step"
                )
        step = Step(batch, [self.pool.num_tokens(sid) for sid in batch.seq_ids])
        step.likely = self.selection.likely
        self.placement.place(step)
        self.format.prepare(step)
        self.selection.prepare(step)
        self._step = step

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._step.batch.sequential:  # (its rows are steps one after another: not a chunk)
            raise RuntimeError("a sequential step runs as one native call, not layer by layer")
        self.format.append(layer, k, v)
        self.selection.appended(layer, k)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        chosen = self.selection.reads(layer, q)
        self.placement.reading(layer, self._step, chosen)
        if chosen is None:
            out = self.format.attend(layer, q)
        else:
            out = self.format.attend_tokens(layer, q, self._step, chosen)
        self.selection.attended(layer, q)
        return out

    def native_step(self) -> NativeStep | NativeHook | None:
        # The format describes its arenas; the placement must have nothing to do per layer in
        # this step, and the selection either nothing (`Selection.hooks`) or a choice it
        # describes (`Selection.native_choice`).
        if self._step is None or self.placement.stages(self._step):
            return None
        plan = self.format.native_step(self._step)
        if plan is None or not self.selection.hooks(self._step):
            return plan
        choice = self.selection.native_choice(self._step)
        return None if choice is None else dataclasses.replace(plan, choice=choice)

    def sequential(self, seq_id: int, steps: int) -> int:
        # What all three axes allow: the format's rows up to a block's end, a placement that
        # moves nothing per step, a selection that chooses nothing in them.
        past = self.pool.num_tokens(seq_id)
        steps = self.format.sequential(past, steps)
        steps = self.placement.sequential(seq_id, steps) if steps > 1 else 1
        return self.selection.sequential(seq_id, past, steps) if steps > 1 else 1

    def read(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values as attention sees them, per batch sequence (`Format.read`)."""
        return self.format.read(layer)

    def end_step(self) -> None:
        step = self._step
        self.format.finish()
        self.placement.after_step(step)
        for sid, n in zip(step.batch.seq_ids, step.batch.query_lens, strict=True):
            self.pool.commit(sid, n)
        self._step = None
        self.pool.sample_usage()
        self.selection.after_step(step)

    def abort_step(self) -> None:
        # Reserved blocks stay with their sequences and are reused by the retry.
        self.placement.abort()
        self.format.abort()
        self._step = None

    def observe_logprobs(self, batch: StepBatch, tokens: torch.Tensor,
                         logprobs: torch.Tensor) -> None:  # fmt: skip
        self.selection.observe_logprobs(batch, tokens, logprobs)

    # ---- KVMemory: between steps ---------------------------------------------------------------

    def reserve(self, seq_id: int, num_tokens: int) -> Reservation | None:
        """Room for `num_tokens` more tokens of `seq_id` (the step that follows uses it), or
        None, changing nothing, when the device tier has no room."""
        held = self.pool.reserve(seq_id, num_tokens)
        if held:
            self._reserved[seq_id] = held
        return held

    def free(self, seq_id: int) -> None:
        self._reserved.pop(seq_id, None)
        self.selection.forget(seq_id)
        self.placement.forget(seq_id)
        self.format.forget(seq_id)
        self.pool.free(seq_id)

    def stored_tokens(self, seq_id: int) -> int:
        return self.pool.num_tokens(seq_id)

    def can_admit(self, num_tokens: int) -> bool:
        return self.placement.can_admit(num_tokens)

    def capacity_tokens(self) -> int | None:
        return self.placement.capacity_tokens()

    def match_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        if self.selection.evicts:  # compacted blocks do not hold the tokens their place says
            return 0
        return self.placement.match_prefix(seq_id, token_ids)

    def publish(self, seq_id: int, token_ids: list[int]) -> None:
        if not self.selection.evicts:
            self.placement.publish(seq_id, token_ids)

    def prefix_digest(self, limit: int) -> tuple[int, str, list[bytes]] | None:
        pool = self.pool
        return pool.block_size, pool.identity, pool.prefixes.cache.newest(limit)

    def swap_out(self, seq_id: int) -> bool:
        self._reserved.pop(seq_id, None)
        return self.placement.swap_out(seq_id)

    def swap_in(self, seq_id: int) -> bool:
        return self.placement.swap_in(seq_id)

    def record_preemption(self) -> None:
        self.pool.record_preemption()

    def close(self) -> None:
        self.placement.close()

    def bytes_used(self) -> int:
        return self.format.bytes_used()

    def bytes_reserved(self) -> int:
        used = sum(a.num_used for a in self.pool.allocators.values())
        return used * self.pool.layout.page_bytes + self.format.side_bytes()

    def stats(self) -> KVReport:
        return KVReport(
            strategy=self.name,
            kv_bytes_used=self.bytes_used(),
            kv_bytes_reserved=self.bytes_reserved(),
            pool=self.pool.snapshot(),
            format=self.format.stats(),
            placement=self.placement.stats(),
            selection=self.selection.stats(),
        )


def _check_tiers(recipe: Recipe, pool: UnifiedMemoryPool, opts: dict) -> None:
    """Refuse, with the reason, a store tier this strategy could not use (never ignore it)."""
    tiers, name = pool.tiers, recipe.name
    if "remote" in tiers and "ssd" not in tiers and recipe.placement.offloads:
        raise ValueError(
            f"strategy {name!r}: [tiers.remote] needs an [tiers.ssd] tier under the "
            f"{recipe.placement.name} placement, which reads stored blocks where they are: remote "
            "hits are copied into the SSD tier first; add one (or choose placement resident)"
        )
    stores = [t for t in ("ssd", "remote") if t in tiers]
    if stores and recipe.selection.evicts:
        raise ValueError(
            f"strategy {name!r} evicts tokens ({recipe.selection.name} selection): its blocks "
            f"are never shared or persisted, so {', '.join(f'[tiers.{t}]' for t in stores)} "
            "would be unused; remove the table, or choose selection all"
        )
    if stores and not recipe.placement.offloads and not opts.get("persist_prefix"):
        raise ValueError(
            f"strategy {name!r}: with persist_prefix = false the {recipe.placement.name} "
            f"placement leaves {', '.join(f'[tiers.{t}]' for t in stores)} unused; remove the "
            "table, set persist_prefix = true, or choose placement tiered"
        )
