"""The one place that assembles a running system from a config, and takes it apart again.

`assemble` loads the model, and `build_kv` builds what serves its KV: it resolves the strategy
for the config and chip (`kvstrategies.plan`), records what the strategy needs from the model
(`engine.recording`: hybrid_fp16_int4's channel statistics), opens the block stores of the
config's store tiers (`open_store`, and `open_remote_store` for `[tiers.remote] url`: no other
module opens one for the pool), builds strategy and pool (`kvstrategies.create`), and places an
MoE model's routed experts by the same config and chip. `Assembly.close` closes them in reverse
order: the strategy (pending write-through lands), then the stores, then the model's expert
cache.

What does not live here: choosing a strategy (`kvstrategies.registry`), the pool (`memory/`),
the stores (`storage/`), loading weights (`engine.loading`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unikv import kvstrategies
from unikv.kvstrategies import Built, KVSpec, KVStrategy
from unikv.kvstrategies.registry import content_identity
from unikv.memory.pool import StoreTier
from unikv.memory.remote import RemoteTier
from unikv.settings.config import PoolConfig, TierConfig, load_config
from unikv.settings.profiles import ChipProfile
from unikv.storage import BlockStore, create_store, open_url, url_store
from unikv.storage.registry import redact

from .loading import load_model
from .model import LlamaModel
from .recording import prepare_options

# The remote and shared-directory tiers' deployment secret (docs/serving.md, limits and trust).
SECRET_ENV = "UNIKV_STORE_SECRET"


def open_store(config: PoolConfig, tier: TierConfig) -> BlockStore:
    """The LMDB block store behind the config's `[tiers.<name>]` table; a bad path is one line
    naming the file and key."""
    # The map starts small and grows on demand up to the tier's capacity (plus LMDB overhead).
    limit = 2 * tier.capacity_bytes + (64 << 20)
    try:
        return create_store(
            "lmdb", path=tier.path, map_size=min(64 << 20, limit), max_map_size=limit
        )
    except ValueError as e:
        where = f"{config.source}: [tiers.{tier.name}] path = {tier.path!r}"
        raise ValueError(f"{where}: {e}") from None


def open_remote_store(config: PoolConfig, tier: TierConfig, namespace: str) -> BlockStore:
    """The block store the config's `[tiers.remote] url` names (Redis, Redis Cluster, a shared
    directory), keys under `namespace`; a bad URL or an unreachable server is one line naming
    the file, the key and the URL (its password hidden). A Redis server that does not answer
    yet is not an error: the tier starts with its breaker open (health yellow, lookups miss)
    and picks the server up once it answers."""
    # Short timeouts: a lookup waits at most about connect + read before it counts as a miss.
    args: dict = {"namespace": namespace}
    name, _ = _store_of(tier.path)
    if name in ("redis", "redis_cluster", "fs"):
        # The deployment's secret (an environment variable: a config file is often committed)
        args["secret"] = os.environ.get(SECRET_ENV) or None
    if name in ("redis", "redis_cluster"):
        args |= {"connect_timeout_s": 0.5, "timeout_s": 1.0}
    if name == "redis":  # a cache tier that is not up yet is no reason not to start
        args["wait_for_server"] = True
    elif name == "fs":
        args["max_bytes"] = tier.capacity_bytes
    try:
        return open_url(tier.path, **args)
    except ValueError as e:
        where = f"{config.source}: [tiers.remote] url = {redact(tier.path)!r}"
        raise ValueError(f"{where}: {e}") from None


def _store_of(url: str) -> tuple[str | None, dict]:
    """`storage.url_store`, or (None, {}) for a URL it refuses (`open_url` then says why)."""
    try:
        return url_store(url)
    except ValueError:
        return None, {}


def store_tiers(name: str, spec: KVSpec, config: PoolConfig, options: dict) -> dict:
    """Store-backed tiers for the config (its `[tiers.ssd]` and `[tiers.remote]`), each over
    its own store, laid out for strategy `name` with `options`."""
    cls = kvstrategies.get(name)
    opts = cls.check_options(options)
    layout = cls.layout(spec, config.block_size or cls.default_block_size, opts)
    slices = cls.store_slices(spec)
    tiers: dict = {}
    tc = config.tier("ssd")
    if tc is not None:
        store = open_store(config, tc)
        tiers["ssd"] = StoreTier("ssd", layout, tc.capacity_bytes // layout.page_bytes, store,
                                 slices=slices, bounded=True)  # fmt: skip
    rc = config.tier("remote")
    if rc is not None:
        # The namespace is the content identity (model and weights, dtype, strategy, layout)
        # and the value split: processes that can share blocks share it, no other ever does.
        identity = f"{content_identity(cls, spec, opts, layout)}|slices{slices}"
        namespace = hashlib.blake2b(identity.encode(), digest_size=12).hexdigest()
        try:
            store = open_remote_store(config, rc, namespace)
        except BaseException:
            for t in tiers.values():
                t.close()
            raise
        tiers["remote"] = RemoteTier("remote", layout, rc.capacity_bytes // layout.page_bytes,
                                     store, slices=slices)  # fmt: skip
    return tiers


def create_kv(
    name: str,
    spec: KVSpec,
    config: PoolConfig | None = None,
    options: dict | None = None,
    device: torch.device | str = "cpu",
) -> KVStrategy:
    """`kvstrategies.create` with the config's store tiers opened (and closed again if the
    build fails); the strategy's `close` closes them."""
    config = config if config is not None else load_config(None)
    opts = config.strategy_options if options is None else options
    stores = store_tiers(name, spec, config, opts)
    try:
        return kvstrategies.create(name, spec, config, opts, device, stores)
    except BaseException:
        for tier in stores.values():
            tier.close()
        raise


def build_kv(
    spec: KVSpec,
    strategy: str | None = None,
    config: str | Path | PoolConfig | None = None,
    chip: str | None = None,
    device: torch.device | str = "cpu",
    options: dict | None = None,
    stores: dict | None = None,
    model: LlamaModel | None = None,
    tokenizer=None,
    progress: bool = False,
) -> Built:
    """The strategy and pool for `spec` under a strategy name, config and chip, with the
    config's store tiers opened (unless `stores` are given). With a `model` and `tokenizer`,
    what the strategy `needs` is recorded from the model first; with a `model`, its routed
    experts are placed by the config (`Built.moe` says how)."""
    p = kvstrategies.plan(strategy, config, chip, options)
    cls = kvstrategies.get(p.name)
    opts = p.options
    if model is not None and tokenizer is not None and cls.needs:
        opts = {**opts, **prepare_options(cls.needs, model, tokenizer, cls.check_options(opts),
                                          progress)}  # fmt: skip
    opened = stores is None
    stores = store_tiers(p.name, spec, p.config, opts) if opened else stores
    try:
        kv = kvstrategies.create(p.name, spec, p.config, opts, device, stores)
        # Routed experts are pool residents too: the model places them by the same config and
        # chip as the KV blocks.
        moe = model.configure_moe(p.config, p.profile) if model is not None else None
    except BaseException:
        if opened:
            for tier in stores.values():
                tier.close()
        raise
    return Built(kv, p.name, p.reason, p.profile.name, p.bandwidth_class, p.bandwidth_gbps,
                 p.config, moe, p.profile)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Scheduling:
    """How the engine batches, from the config's [scheduler] table over the chip profile."""

    max_batch: int
    admission_window_ms: float
    priority_aging_s: float
    why: str
    step_target_ms: float = 0.0
    prompt_tokens_per_decode: int = 4

    @classmethod
    def of(cls, config: PoolConfig, profile: ChipProfile | None) -> Scheduling:
        """The config's values where it sets them, else the profile's `batch_size` and
        `batching_window_ms` (16 and 0 without a profile)."""
        opts = config.scheduler
        tuned = profile.tuned if profile is not None else None
        chip = f"chip {profile.name}" if profile is not None else "defaults"
        batch = opts.batch_size or (tuned.batch_size if tuned else 16)
        window = opts.batching_window_ms
        if window is None:
            window = float(tuned.batching_window_ms) if tuned else 0.0
        src_b = "config" if opts.batch_size else chip
        src_w = "config" if opts.batching_window_ms is not None else chip
        why = f"batch {batch} ({src_b}), admission window {window:g} ms ({src_w})"
        return cls(batch, window, opts.priority_aging_s, why, opts.step_target_ms,
                   opts.prompt_tokens_per_decode)  # fmt: skip


@dataclass(slots=True)
class Assembly:
    """A loaded model and what serves its KV, closed together in reverse order of building."""

    model: LlamaModel
    tokenizer: object
    kv: Built
    _closed: bool = field(default=False, repr=False)

    @property
    def choice(self) -> str:
        """Which strategy serves the KV, why, on which chip (and the MoE placement)."""
        b = self.kv
        text = f"{b.name} ({b.reason}; chip {b.chip})"
        return f"{text}; MoE {b.moe}" if b.moe else text

    @property
    def scheduling(self) -> Scheduling:
        """The batch size and admission window the engine should use."""
        return Scheduling.of(self.kv.config, self.kv.profile)

    def close(self) -> None:
        """Strategy (pending writes land), its stores, then the model's expert cache; idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.ExitStack() as stack:  # every step runs even if one before it raised
            experts = getattr(self.model, "experts", None)
            if experts is not None:
                stack.callback(experts.close)
            for tier in self.kv.strategy.pool.tiers.values():
                if isinstance(tier, StoreTier):
                    stack.callback(tier.close)
            stack.callback(self.kv.strategy.close)

    def __enter__(self) -> Assembly:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def assemble_for(
    model: LlamaModel,
    tokenizer=None,
    strategy: str | None = None,
    config: str | Path | PoolConfig | None = None,
    chip: str | None = None,
    options: dict | None = None,
    progress: bool = False,
) -> Assembly:
    """What serves a loaded model's KV (see `build_kv`), as an `Assembly` to close."""
    built = build_kv(model.kv_spec(), strategy, config, chip, model.device, options,
                     model=model, tokenizer=tokenizer, progress=progress)  # fmt: skip
    return Assembly(model, tokenizer, built)


def assemble(
    model: str = "smollm2",
    dtype: str | torch.dtype = "float32",
    device: torch.device | str = "cpu",
    strategy: str | None = None,
    config: str | Path | PoolConfig | None = None,
    chip: str | None = None,
    options: dict | None = None,
    progress: bool = False,
    weights: str = "float32",
) -> Assembly:
    """Load `model` (`weights`: native, float32 or bfloat16) and build what serves its KV
    (see `build_kv`)."""
    m, tok = load_model(model, dtype, device, progress, weights)
    return assemble_for(m, tok, strategy, config, chip, options, progress)
