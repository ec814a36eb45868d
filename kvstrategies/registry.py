"""The presets (named triples of the axes, in one table), construction of a strategy with its
pool, and selection by bandwidth class."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from unikv.memory.pool import UnifiedMemoryPool
from unikv.settings.config import PoolConfig, load_config

from . import composed
from .composed import Axes
from .strategy import Recipe

if TYPE_CHECKING:
    from unikv.settings.profiles import ChipProfile

    from .kv import KVSpec
    from .strategy import KVStrategy

log = logging.getLogger(__name__)

# The presets: name -> (format, placement, selection) and the bandwidth classes whose "auto"
# choice it is (docs/configuration.md: a high-bandwidth chip wants a smaller cache, a medium
# one spills to host and SSD, a low-bandwidth one wants to read fewer tokens per step: it keeps
# them all and reads the blocks each step needs, which measured faster than pruning half of
# them and lost less on every development text, BENCHMARKS.md).
PRESETS: dict[str, tuple[Axes, tuple[str, ...]]] = {
    "full": (("dense", "resident", "all"), ()),
    "hybrid_fp16_int4": (("hybrid", "resident", "all"), ("high",)),
    "hierarchical_offload": (("dense", "tiered", "all"), ("medium",)),
    "learned_prune": (("dense", "resident", "pruned"), ()),
    "sparse_attention": (("dense", "resident", "sparse"), ("low",)),
}


def register(name: str, axes: Axes, default_for: tuple[str, ...] = ()) -> None:
    """Add a preset: `name` for the combination `axes`."""
    composed.compose(*axes)  # a refused or unknown combination says why
    PRESETS[name] = (tuple(axes), default_for)  # type: ignore[assignment]


def available() -> list[str]:
    """The presets' names."""
    return sorted(PRESETS)


def get(name: str) -> Recipe:
    """The recipe of strategy `name`: a preset, or a composed FORMAT+PLACEMENT+SELECTION
    (`kvstrategies.composed`); a ValueError lists the presets and the axes."""
    if composed.SEP in name:
        return composed.get(name)
    if name not in PRESETS:
        raise ValueError(
            f"unknown strategy {name!r}; supported: {', '.join(available())}; or {_AXES_TEXT}"
        )
    axes, default_for = PRESETS[name]
    return composed.compose(*axes, name=name, default_for=default_for)


_AXES_TEXT = "FORMAT+PLACEMENT+SELECTION (e.g. hybrid+tiered+all)"


def preset_for(axes: tuple[str, str, str], names: Iterable[str] | None = None) -> str | None:
    """The preset that is exactly this combination, if one is (among `names`)."""
    for name in available() if names is None else names:
        if name in available() and get(name).axes == tuple(axes):
            return name
    return None


def resolve_axes(
    name: str, bandwidth_class: str, precision: str | None
) -> tuple[tuple[str, str, str], str]:
    """A composed name's "auto" axes ("auto": all three) filled from the chip: the format by
    `precision` (the profile's kv_precision; None: the class default's format), placement and
    selection as the class default preset's. Returns the axes and what was picked, in words."""
    axes = composed.parse(name) or ("auto", "auto", "auto")
    default = get(class_defaults()[bandwidth_class]).axes
    full, picked, by_class = [], [], []
    for i, axis in enumerate(axes):
        if axis != "auto":
            full.append(axis)
        elif i == 0 and precision is not None:
            full.append(composed.for_precision(precision))
            picked.append(f"format {full[-1]} (kv_precision {precision})")
        else:
            full.append(default[i])
            by_class.append(f"{composed.AXES[i]} {full[-1]}")
    if by_class:
        picked.append(f"{', '.join(by_class)} ({bandwidth_class} class)")
    return (full[0], full[1], full[2]), "; ".join(picked)


# What "auto" runs when the strategy that declares itself a class's default is not available.
FALLBACK = "full"


def class_defaults() -> dict[str, str]:
    """Bandwidth class -> the registered strategy that declares itself its default
    (`default_for`); every class has exactly one."""
    from unikv.settings.profiles import CLASSES

    found: dict[str, list[str]] = {c: [] for c in CLASSES}
    for name in available():
        for c in get(name).default_for:
            if c not in found:
                raise RuntimeError(
                    f"strategy {name!r}: default_for names bandwidth class {c!r}; "
                    f"expected one of {', '.join(CLASSES)}"
                )
            found[c].append(name)
    wrong = {c: names for c, names in found.items() if len(names) != 1}
    if wrong:
        raise RuntimeError(f"bandwidth classes without exactly one default strategy: {wrong}")
    return {c: names[0] for c, names in found.items()}


def select(
    bandwidth_class: str,
    config: PoolConfig,
    names: Iterable[str] | None = None,
    precision: str | None = None,
) -> tuple[str, str]:
    """The strategy for a chip class under a config, and why: the configured one, else the
    class default, else `FALLBACK`. `names` narrows the registered strategies to those
    available (default: all). With the chip's `precision` (its profile's kv_precision),
    "auto" is composed: the format it picks x the class default's placement and selection
    (the preset of that combination where one is); a composed name's "auto" axes likewise.

    Raises ValueError for an unknown class, a configured strategy that is not available or a
    refused combination, or "auto" when neither the class default nor the fallback is
    available.
    """
    from unikv.settings.profiles import CLASSES

    if bandwidth_class not in CLASSES:
        raise ValueError(
            f"bandwidth class {bandwidth_class!r}: expected one of {', '.join(CLASSES)}"
        )
    names = sorted(set(available() if names is None else names))
    listed = ", ".join(names) or "none"
    configured = config.strategy
    if composed.SEP in configured or (configured == "auto" and precision is not None):
        axes, why = resolve_axes(configured, bandwidth_class, precision)
        preset = preset_for(axes)
        if preset is None or preset in names:
            composed.compose(*axes)  # a refused combination says why
            name = preset or composed.name_of(axes)
            if configured == "auto":
                shown = f" = {composed.name_of(axes)}" if preset else ""
                return name, f"auto: {why}{shown}"
            return name, f"configured strategy {configured!r}" + (f" ({why})" if why else "")
        if configured != "auto":
            raise ValueError(
                f"strategy {preset!r} ({configured}) is not available; available: {listed}"
            )
        # "auto" whose preset is not available: the class default or the fallback, below
    if configured != "auto":
        if configured not in names:
            raise ValueError(
                f"strategy {configured!r} is not available; available: {listed} (or auto)"
            )
        return configured, f"configured strategy {configured!r}"
    default = class_defaults()[bandwidth_class]
    if default in names:
        return default, f"auto: default of the {bandwidth_class} bandwidth class"
    if FALLBACK in names:
        reason = (
            f"auto: the {bandwidth_class} class default {default!r} is not available "
            f"(available: {listed}); falling back to {FALLBACK!r}"
        )
        log.info(reason)
        return FALLBACK, reason
    raise ValueError(
        f"auto strategy: neither the {bandwidth_class} class default {default!r} nor "
        f"{FALLBACK!r} is available; available: {listed}"
    )


def create(
    name: str,
    spec: KVSpec,
    config: PoolConfig | None = None,
    options: dict | None = None,
    device: torch.device | str = "cpu",
    stores: dict | None = None,
) -> KVStrategy:
    """Build strategy `name` and the pool it stores into; `stores` holds the store-backed tiers
    the config names (opened by `engine.assembly`)."""
    recipe = get(name)
    if spec.latent and not recipe.supports_latent:
        raise ValueError(f"strategy {name!r} cannot store latent (MLA) caches")
    config = config or load_config(None)
    opts = recipe.check_options(config.strategy_options if options is None else options)
    block_size = config.block_size or recipe.default_block_size
    layout = recipe.layout(spec, block_size, opts)
    pool = UnifiedMemoryPool(
        config, layout, device=device, identity=content_identity(recipe, spec, opts, layout),
        stores=stores,
    )  # fmt: skip
    return recipe(pool, spec, opts)


def content_identity(recipe: Recipe, spec: KVSpec, opts: dict, layout) -> str:
    """What the bytes of a block depend on besides its tokens: model (with its weights
    fingerprint), compute dtype, strategy, the options that change stored bytes, and the block
    layout. Prefix hashes include it, so blocks persisted by one setting never serve another."""
    arenas = ";".join(f"{a.name}:{a.dtype}:{a.shape}" for a in layout.arenas)
    shown = [(k, opts[k]) for k in recipe.content_options]
    return f"{spec.identity}|{spec.dtype}|{recipe.name}|{shown}|bs{layout.block_size}|{arenas}"


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
    profile: ChipProfile | None = None  # the chip profile the choice was made on


@dataclass(slots=True)
class Plan:
    """What `plan` resolved before anything is built: the strategy, why, on which chip, and
    its options (the file's, then the caller's, completed from the chip profile)."""

    name: str
    reason: str
    profile: ChipProfile
    bandwidth_class: str
    bandwidth_gbps: float
    config: PoolConfig
    options: dict


def plan(
    strategy: str | None = None,
    config: str | Path | PoolConfig | None = None,
    chip: str | None = None,
    options: dict | None = None,
) -> Plan:
    """Resolve config file, chip profile, bandwidth class, strategy and its options.

    Precedence: an explicit `strategy`/`chip` argument, then the config file (and its UNIKV_
    environment overrides), then the defaults ("auto" on the `cpu` profile). `options` (e.g.
    from CLI flags) override the file's `[strategy_options]`.
    """
    cfg = config if isinstance(config, PoolConfig) else load_config(config)
    name, reason, profile, cls_name, gbps = choose(cfg, strategy, chip)
    # Options in the file belong to the strategy the file names (or to whichever "auto" picks).
    from_file = cfg.strategy_options if cfg.strategy in (name, "auto") else {}
    if "+" in cfg.strategy:  # a composed name with "auto" axes: its options are the file's
        from_file = cfg.strategy_options
    try:
        get(name).check_options(from_file)
    except ValueError as e:
        raise ValueError(f"{cfg.source}: [strategy_options] {e}") from None
    options = get(name).from_profile(profile, {**from_file, **(options or {})})
    return Plan(name, reason, profile, cls_name, gbps, cfg, options)


def build(
    spec: KVSpec,
    strategy: str | None = None,
    config: str | Path | PoolConfig | None = None,
    chip: str | None = None,
    device: torch.device | str = "cpu",
    stores: dict | None = None,
    options: dict | None = None,
) -> Built:
    """`plan`, then build the strategy and its pool (see `plan` for the precedence). A strategy
    that `needs` something recorded from a model gets it through `engine.assembly`, which
    records it first; built here, it runs without (hybrid_fp16_int4: channels in order)."""
    p = plan(strategy, config, chip, options)
    kv = create(p.name, spec, p.config, p.options, device, stores)
    return Built(kv, p.name, p.reason, p.profile.name, p.bandwidth_class, p.bandwidth_gbps,
                 p.config, profile=p.profile)  # fmt: skip


def choose(cfg: PoolConfig, strategy: str | None = None, chip: str | None = None):
    """(strategy name, why, chip profile, bandwidth class, GB/s) for a config, with an explicit
    `strategy`/`chip` taking precedence; resolves "auto" by the chip's bandwidth class (the
    `cpu` profile measures it: about 0.1 s). Builds nothing."""
    from unikv.settings.profiles import bandwidth_class, load_profile, resolve_bandwidth

    profile = load_profile(chip or cfg.chip)
    gbps, _ = resolve_bandwidth(profile)
    cls_name = profile.pinned_class or bandwidth_class(gbps)
    precision = profile.tuned.kv_precision
    name, reason = select(cls_name, _with_strategy(cfg, strategy), precision=precision)
    return name, reason, profile, cls_name, gbps


def _with_strategy(cfg: PoolConfig, strategy: str | None) -> PoolConfig:
    if strategy is None or strategy == cfg.strategy:
        return cfg
    return dataclasses.replace(cfg, strategy=strategy, strategy_options={})
