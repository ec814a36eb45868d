"""What `unikv profile` shows: the chip's profile, its bandwidth (measured or declared) and
class, the strategy the class picks and why, the tuned parameters and what each one changes,
the memory tiers of the config (`profile_report`, a JSON-serializable dict) and its text form
(`format_report`).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from unikv.engine.routing import choose_topk
from unikv.settings.config import PoolConfig, load_config
from unikv.settings.profiles import ChipProfile, bandwidth_class, load_profile, resolve_bandwidth

# -- report ----------------------------------------------------------------------------------


def profile_report(
    chip: str | None = None,
    config_path: str | os.PathLike[str] | None = None,
    select: Callable[..., tuple[str, str]] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    axes_of: Callable[[str], tuple[str, str, str]] | None = None,
) -> dict[str, Any]:
    """Everything `unikv profile` shows, as a JSON-serializable dict.

    `chip` overrides the config's chip; without `config_path` the defaults (plus UNIKV_
    environment overrides) are used. `select(bandwidth class, config, precision=...)` gives
    the strategy and why (`kvstrategies.select`); without it the report names none.
    `axes_of(strategy)` gives its (format, placement, selection) (`kvstrategies.get(name).axes`)
    for the report's `parameters`: what each profile parameter sets in the running system.
    """
    config = load_config(config_path, env=env)
    profile = load_profile(chip if chip is not None else config.chip)
    gbps, bw_source = resolve_bandwidth(profile)
    derived = bandwidth_class(gbps)
    cls = profile.pinned_class or derived
    if profile.pinned_class is None:
        class_source = "from the bandwidth"
    elif profile.pinned_class == derived:
        class_source = "pinned by the profile, agrees with the bandwidth"
    else:
        class_source = (
            f"pinned by the profile (the field table of docs/configuration.md); {gbps:g} GB/s "
            f"alone would be {derived}"
        )
    t = profile.tuned
    strategy, reason = (None, "")
    if select is not None:
        strategy, reason = select(cls, config, precision=t.kv_precision)
    axes = axes_of(strategy) if axes_of is not None and strategy is not None else None
    topk, topk_block, topk_reason = choose_topk(profile, config)
    return {
        "chip": profile.name,
        "display_name": profile.display_name,
        "bandwidth_gbps": round(gbps, 1),
        "bandwidth_source": bw_source,
        "class": cls,
        "class_source": class_source,
        "strategy": strategy,
        "strategy_reason": reason,
        "sparse": SPARSE_WHY if axes is None or axes[2] != "sparse" else SPARSE_SELECTED,
        "config": config.source,
        "block_size": config.block_size,
        "tiers": [
            {"name": tc.name, "capacity_bytes": tc.capacity_bytes, "path": tc.path}
            for tc in config.tiers
        ],
        "field_tuned": profile.field_tuned,
        "batch_size": t.batch_size,
        "kv_precision": t.kv_precision,
        "batching_window_ms": t.batching_window_ms,
        "thermal_throttle_c": t.thermal_throttle_c,
        "l2_prefetch_depth": t.l2_prefetch_depth,
        "moe_topk": topk,
        "moe_topk_block": topk_block,
        "moe_topk_reason": topk_reason,
        "expert_cache": config.moe.expert_cache,
        "expert_host": config.moe.expert_host,
        "sensor": None
        if profile.sensor is None
        else {"command": list(profile.sensor.command), "pattern": profile.sensor.pattern},
        "axes": None
        if axes is None
        else dict(zip(("format", "placement", "selection"), axes, strict=True)),
        "parameters": parameter_effects(profile, config, cls, axes),
    }


def parameter_effects(
    profile: ChipProfile, config: PoolConfig, cls: str, axes: tuple[str, str, str] | None
) -> dict[str, str]:
    """Per profile parameter, what it sets in the running system (or what overrides it):
    kv_precision the format, the bandwidth class placement and selection, l2_prefetch_depth
    the tiered prefetcher, batch_size and batching_window_ms the scheduler, thermal_throttle_c
    the replicas' cooling rule. `axes`: the strategy's (format, placement, selection)."""
    t, sched, thermal = profile.tuned, config.scheduler, config.thermal
    # Which axes the chip chooses: all for "auto", the "auto" ones of FORMAT+PLACEMENT+SELECTION.
    written = config.strategy.split("+") if "+" in config.strategy else [config.strategy] * 3
    by_chip = [config.strategy == "auto" or w == "auto" for w in written]
    fmt, place, sel = axes if axes is not None else ("?", "?", "?")
    fixed = f"unused: the configured strategy {config.strategy!r} sets"
    out = {
        "kv_precision": f"{t.kv_precision}: "
        + (f"picks format {fmt}" if by_chip[0] else f"{fixed} format {fmt}"),
        "bandwidth_class": f"{cls}: "
        + (f"picks placement {place}, selection {sel}" if any(by_chip[1:])
           else f"{fixed} placement {place}, selection {sel}"),
    }  # fmt: skip
    depth = config.strategy_options.get("prefetch_depth")
    out["l2_prefetch_depth"] = f"{t.l2_prefetch_depth}: " + (
        f"overridden by [strategy_options] prefetch_depth = {depth}"
        if depth is not None
        else f"the tiered prefetcher reads {max(1, t.l2_prefetch_depth)} layers ahead"
        + ("" if place in ("tiered", "?") else " (unused by this resident placement)")
    )
    batch = f"config [scheduler] batch_size = {sched.batch_size}" if sched.batch_size else None
    out["batch_size"] = f"{t.batch_size}: " + (
        f"overridden by {batch}" if batch else "the scheduler's batch limit"
    )
    window = sched.batching_window_ms
    out["batching_window_ms"] = f"{t.batching_window_ms:g}: " + (
        f"overridden by config [scheduler] batching_window_ms = {window:g}"
        if window is not None
        else "the scheduler's admission window"
    )
    out["thermal_throttle_c"] = (
        f"{t.thermal_throttle_c:g}: the replicas' cooling rule enters at "
        f"{t.thermal_throttle_c - thermal.margin_c:g} °C for {thermal.readings} readings, "
        f"leaves below {t.thermal_throttle_c - thermal.hysteresis_c:g} °C"
    )
    return out


def _human_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _experts_line(cache: float, host: float) -> str:
    if cache >= 1:
        return "all routed experts on the device"
    return (
        f"{cache:.0%} of routed experts on the device; of the rest {host:.0%} on host, "
        f"{1 - host:.0%} on SSD"
    )


def _sensor_line(sensor: Mapping[str, Any] | None) -> str:
    if sensor is None:
        return "none declared (auto: hwmon/NVML)"
    # The pattern as written in the TOML literal string: repr() would double every backslash.
    return f"{shlex.join(sensor['command'])} (pattern '{sensor['pattern']}')"


# What the report says of the `sparse` selection: why the low class selects it, and why the
# other classes do not (issue 35's figures: BENCHMARKS.md, docs/strategies.md).
SPARSE_SELECTED = (
    "selected (the low class's default): every token is kept and each decode step reads the "
    "blocks its queries need, 1/8 of the stored tokens but at least 1,024; at 8K tokens on a "
    "CPU, hybrid+resident+sparse decoded 1.2-1.5x faster than the pruned hybrid cache that was "
    "the default and lost less PPL on every development text (worst +1.7% against +5.3%), "
    "storing about 2.8x its bytes (BENCHMARKS.md)"
)
SPARSE_WHY = (
    "opt-in for this class (--kv-selection sparse): the low class's default, whose steps are "
    "bound by reading; it keeps every token, adds summaries of the keys (half a packed cache's "
    "bytes) and saves reads only past about 1K tokens, where the high class's smaller cache and "
    "the medium class's tiered cache attend to every token, losslessly (tiered at 8K on a CPU, "
    "sparse stepped 2.06x faster for up to +0.9% PPL at a 1/8 budget; BENCHMARKS.md)"
)


def format_report(report: Mapping[str, Any]) -> str:
    """A readable table of a `profile_report` dict."""
    tuned = "field-tuned" if report["field_tuned"] else "defaults, not field-tuned"
    rows = [
        ("chip", f"{report['chip']} ({report['display_name']})"),
        ("bandwidth", f"{report['bandwidth_gbps']:g} GB/s ({report['bandwidth_source']})"),
        ("class", f"{report['class']} ({report['class_source']})"),
        *(
            [("strategy", f"{report['strategy']} ({report['strategy_reason']})")]
            if report["strategy"] is not None
            else []
        ),
        *(
            [("composed", " x ".join(f"{k} {v}" for k, v in report["axes"].items()))]
            if report.get("axes")
            else []
        ),
        *([("sparse selection", report["sparse"])] if report.get("sparse") else []),
        ("config", str(report["config"])),
        ("block size", f"{report['block_size']} tokens"),
        ("batch size", f"{report['batch_size']} ({tuned})"),
        ("KV precision", str(report["kv_precision"])),
        ("batching window", f"{report['batching_window_ms']:g} ms"),
        ("thermal throttle", f"{report['thermal_throttle_c']:g} °C"),
        ("L2 prefetch depth", str(report["l2_prefetch_depth"])),
        ("MoE top-k", f"{report['moe_topk']} ({report['moe_topk_reason']})"),
        ("MoE experts", _experts_line(report["expert_cache"], report["expert_host"])),
        ("sensor", _sensor_line(report.get("sensor"))),
        # Added by the caller that can build it (`unikv profile`: kernels.native.status).
        *([("attention kernel", report["attention_kernel"])] if "attention_kernel" in report
          else []),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if report.get("parameters"):
        lines.append("profile parameters (what each sets)")
        pw = max(len(k) for k in report["parameters"])
        lines.extend(f"  {k:<{pw}}  {v}" for k, v in report["parameters"].items())
    lines.append("tiers")
    lines.append(f"  {'name':<8}{'capacity':>12}  path")
    for tier in report["tiers"]:
        cap = _human_bytes(tier["capacity_bytes"])
        lines.append(f"  {tier['name']:<8}{cap:>12}  {tier['path'] or '-'}")
    return "\n".join(lines)
