"""Name -> strategy class registry, construction of a strategy with its pool, and selection
by bandwidth class."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from memory.config import PoolConfig, load_config
from memory.pool import UnifiedMemoryPool
from storage.registry import Registry

if TYPE_CHECKING:
    from .base import KVSpec, KVStrategy

# Modules that register strategies when imported; a new strategy is one file plus a line here.
_strategies: Registry[KVStrategy] = Registry(
    "strategy",
    ("kvstrategies.full", "kvstrategies.hybrid", "kvstrategies.offload", "kvstrategies.prune"),
)
register = _strategies.register
available = _strategies.available
get = _strategies.get


def select(bandwidth_class: str, config: PoolConfig) -> tuple[str, str]:
    """The strategy for a chip class under a config: (name, why it was chosen)."""
    from memory.profiles import choose_strategy

    return choose_strategy(bandwidth_class, config.strategy, set(available()))


def create(
    name: str,
    spec: KVSpec,
    config: PoolConfig | None = None,
    options: dict | None = None,
    device: torch.device | str = "cpu",
    stores: dict | None = None,
) -> KVStrategy:
    """Build strategy `name` and the pool it stores into."""
    cls = get(name)
    if spec.latent and not cls.supports_latent:
        raise ValueError(f"strategy {name!r} cannot store latent (MLA) caches")
    config = config or load_config(None)
    opts = cls.check_options(config.strategy_options if options is None else options)
    block_size = config.block_size or cls.default_block_size
    layout = cls.layout(spec, block_size, opts)
    if stores is None:
        stores = _ssd_stores(cls, spec, config, opts)
    pool = UnifiedMemoryPool(
        config, layout, device=device, identity=content_identity(cls, spec, opts, layout),
        stores=stores,
    )  # fmt: skip
    return cls(pool, spec, opts)


def content_identity(cls: type[KVStrategy], spec: KVSpec, opts: dict, layout) -> str:
    """What the bytes of a block depend on besides its tokens: model (with its weights
    fingerprint), compute dtype, strategy, the options that change stored bytes, and the block
    layout. Prefix hashes include it, so blocks persisted by one setting never serve another."""
    keys = sorted(opts) if cls.content_options is None else cls.content_options
    arenas = ";".join(f"{a.name}:{a.dtype}:{a.shape}" for a in layout.arenas)
    shown = [(k, opts[k]) for k in keys]
    return f"{spec.identity}|{spec.dtype}|{cls.name}|{shown}|bs{layout.block_size}|{arenas}"


@dataclass(slots=True)
class Built:
    """A strategy with its pool, and how it was chosen."""

    strategy: KVStrategy
    name: str
    reason: str
    chip: str
    bandwidth_class: str
    bandwidth_gbps: float
    config: PoolConfig
    moe: str | None = None  # an MoE model: its router's top-k and expert placement, and why


def build(
    spec: KVSpec,
    strategy: str | None = None,
    config: str | Path | PoolConfig | None = None,
    chip: str | None = None,
    device: torch.device | str = "cpu",
    stores: dict | None = None,
    options: dict | None = None,
    model=None,
    tokenizer=None,
    progress: bool = False,
) -> Built:
    """Resolve config file, chip profile, bandwidth class and strategy; build strategy and pool.

    Precedence: an explicit `strategy`/`chip` argument, then the config file (and its UNIKV_
    environment overrides), then the defaults ("auto" on the `cpu` profile). `options` (e.g.
    from CLI flags) override the file's `[strategy_options]`. With a `model` (and its
    `tokenizer`), the strategy prepares itself for it first (hybrid_fp16_int4: calibration).
    """
    cfg = config if isinstance(config, PoolConfig) else load_config(config)
    name, reason, profile, cls_name, gbps = choose(cfg, strategy, chip)
    # Options in the file belong to the strategy the file names (or to whichever "auto" picks).
    from_file = cfg.strategy_options if cfg.strategy in (name, "auto") else {}
    try:
        get(name).check_options(from_file)
    except ValueError as e:
        raise ValueError(f"{cfg.source}: [strategy_options] {e}") from None
    options = {**from_file, **(options or {})}
    options = get(name).from_profile(profile, options)
    if model is not None:
        options = get(name).prepare(model, tokenizer, options, progress)
    built = create(name, spec, cfg, options, device, stores)
    # Routed experts are pool residents too: the model places them by the same config and chip.
    moe = model.configure_moe(cfg, profile) if model is not None else None
    return Built(built, name, reason, profile.name, cls_name, gbps, cfg, moe)


def choose(cfg: PoolConfig, strategy: str | None = None, chip: str | None = None):
    """(strategy name, why, chip profile, bandwidth class, GB/s) for a config, with an explicit
    `strategy`/`chip` taking precedence; resolves "auto" by the chip's bandwidth class (the
    `cpu` profile measures it: about 0.1 s). Builds nothing."""
    from memory.profiles import bandwidth_class, load_profile, resolve_bandwidth

    profile = load_profile(chip or cfg.chip)
    gbps, _ = resolve_bandwidth(profile)
    cls_name = profile.pinned_class or bandwidth_class(gbps)
    name, reason = select(cls_name, _with_strategy(cfg, strategy))
    return name, reason, profile, cls_name, gbps


def _with_strategy(cfg: PoolConfig, strategy: str | None) -> PoolConfig:
    if strategy is None or strategy == cfg.strategy:
        return cfg
    return dataclasses.replace(cfg, strategy=strategy, strategy_options={})


def _ssd_stores(cls: type[KVStrategy], spec: KVSpec, cfg: PoolConfig, options: dict) -> dict:
    """An LMDB-backed tier for the config's `[tiers.ssd]`, if it has one."""
    tc = cfg.tier("ssd")
    if tc is None:
        return {}
    from memory.pool import StoreTier
    from storage import create_store

    layout = cls.layout(spec, cfg.block_size or cls.default_block_size, cls.check_options(options))
    num_blocks = tc.capacity_bytes // layout.page_bytes
    # The map starts small and grows on demand up to the tier's capacity (plus LMDB overhead).
    limit = 2 * tc.capacity_bytes + (64 << 20)
    try:
        store = create_store(
            "lmdb", path=tc.path, map_size=min(64 << 20, limit), max_map_size=limit
        )
    except ValueError as e:
        raise ValueError(f"{cfg.source}: [tiers.ssd] path = {tc.path!r}: {e}") from None
    return {"ssd": StoreTier("ssd", layout, num_blocks, store, slices=cls.store_parts(spec))}
