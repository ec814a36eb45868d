"""Chip profiles and bandwidth classes.

What lives here: `ChipProfile` / `TunedParams` (one TOML file per chip under settings/chips/,
package data), `load_profile`, `list_profiles`, `bandwidth_class`, `CLASSES` and the bandwidth
probes (`measure_host_bandwidth` with numpy, `measure_cuda_bandwidth` with torch, imported
lazily and only for the cuda profile; `resolve_bandwidth`).

What does not: the report `unikv profile` prints (`cli.profile`), the MoE router's top-k
policy (`engine.routing.choose_topk`), the strategies, their registry and which one each class
gets (each strategy declares the classes it is the default of; `kvstrategies.select` resolves
them), applying the tuned parameters (the scheduler and engine read them from the profile).

Bandwidth classes (docs/configuration.md): high >= 1000 GB/s, medium 300-1000 GB/s, low < 300 GB/s.
A profile may pin its class with `bandwidth_class` where the field table of docs/configuration.md
disagrees with the spec-sheet figure; the report then says the class came from the profile.

Profile file keys: display_name, bandwidth (GB/s, or "measure"), measure_on ("host" or
"cuda", with "measure"), declared_bandwidth (GB/s used when "cuda" cannot be measured),
bandwidth_class (optional pin), field_tuned, and a [tuned] table with batch_size,
kv_precision, batching_window_ms, thermal_throttle_c, l2_prefetch_depth, and optionally
moe_topk ("exact" | "blockwise", default "exact") and moe_topk_block (experts per block,
default DEFAULT_TOPK_BLOCK): which final top-k the MoE router should use on this chip
(`engine.routing.choose_topk` applies a config's [moe] override). An optional [sensor]
table names the vendor tool that reads the chip's temperature: `command` (the argv, a list of
strings, run without a shell) and `pattern` (a regular expression with exactly one group, the
degrees Celsius); parsed into `SensorSpec`, read by `serving.sensors.CommandSensor`.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unikv.settings.config import (
    PROFILE_DIR,
    ConfigError,
    list_profiles,
    read_toml,
    show_value,
)

HIGH_GBPS = 1000.0  # >= this: high class
MEDIUM_GBPS = 300.0  # >= this (and < HIGH_GBPS): medium class; below: low
CLASSES = ("high", "medium", "low")
KV_PRECISIONS = ("fp32", "bf16", "fp16", "int8", "fp16+int4")
MEASURE_TARGETS = ("host", "cuda")

_TOP_KEYS = (
    "display_name",
    "bandwidth",
    "measure_on",
    "declared_bandwidth",
    "bandwidth_class",
    "field_tuned",
    "tuned",
    "sensor",
)
_SENSOR_KEYS = ("command", "pattern")
_TUNED_KEYS = (
    "batch_size",
    "kv_precision",
    "batching_window_ms",
    "thermal_throttle_c",
    "l2_prefetch_depth",
)
TOPK_MODES = ("exact", "blockwise")  # the MoE router's final top-k (engine.routing)
# 16 fp32 scores = 64 bytes: one cache line, one 512-bit vector; see engine.routing.
DEFAULT_TOPK_BLOCK = 16
# Optional [tuned] keys (not in the field table of docs/configuration.md), with their defaults.
_TUNED_OPTIONAL = {"moe_topk": "exact", "moe_topk_block": DEFAULT_TOPK_BLOCK}


def bandwidth_class(gbps: float) -> str:
    """ "high" (>= 1000 GB/s), "medium" (300-1000) or "low" (< 300) for a bandwidth in GB/s."""
    if isinstance(gbps, bool) or not isinstance(gbps, int | float) or not gbps > 0:
        raise ValueError(f"bandwidth must be a positive number of GB/s, got {gbps!r}")
    if not math.isfinite(gbps):
        raise ValueError(f"bandwidth must be finite, got {gbps!r}")
    if gbps >= HIGH_GBPS:
        return "high"
    if gbps >= MEDIUM_GBPS:
        return "medium"
    return "low"


# -- profiles --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TunedParams:
    """Field-tuned runtime parameters of a chip (docs/configuration.md)."""

    batch_size: int
    kv_precision: str
    batching_window_ms: float
    thermal_throttle_c: float
    l2_prefetch_depth: int
    moe_topk: str = "exact"  # the MoE router's final top-k on this chip: "exact" | "blockwise"
    moe_topk_block: int = DEFAULT_TOPK_BLOCK  # experts per block for "blockwise"

    def __post_init__(self) -> None:
        problem = _tuned_problem({k: getattr(self, k) for k in (*_TUNED_KEYS, *_TUNED_OPTIONAL)})
        if problem is not None:
            key, expected = problem
            raise ValueError(f"TunedParams: {key} = {getattr(self, key)!r}: {expected}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _tuned_problem(t: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first (key, what is expected) that is wrong in tuned parameters, or None."""
    if not _is_int(t["batch_size"]) or t["batch_size"] < 1:
        return "batch_size", "expected an integer >= 1"
    if t["kv_precision"] not in KV_PRECISIONS:
        return "kv_precision", f"expected one of {', '.join(KV_PRECISIONS)}"
    if not _is_num(t["batching_window_ms"]) or t["batching_window_ms"] < 0:
        return "batching_window_ms", "expected a number of milliseconds >= 0"
    if not _is_num(t["thermal_throttle_c"]) or not 0 < t["thermal_throttle_c"] <= 125:
        return "thermal_throttle_c", "expected degrees Celsius in (0, 125]"
    if not _is_int(t["l2_prefetch_depth"]) or t["l2_prefetch_depth"] < 0:
        return "l2_prefetch_depth", "expected an integer >= 0"
    if t.get("moe_topk", _TUNED_OPTIONAL["moe_topk"]) not in TOPK_MODES:
        return "moe_topk", f"expected one of {', '.join(TOPK_MODES)}"
    block = t.get("moe_topk_block", _TUNED_OPTIONAL["moe_topk_block"])
    if not _is_int(block) or block < 2:
        return "moe_topk_block", "expected an integer >= 2 (experts per block)"
    return None


def _sensor_problem(t: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first (key, what is expected) that is wrong in a [sensor] table, or None."""
    command = t["command"]
    if (
        not isinstance(command, list | tuple)
        or not command
        or not all(isinstance(a, str) and a for a in command)
    ):
        return "command", "expected a non-empty list of non-empty strings (the tool, its arguments)"
    pattern = t["pattern"]
    if not isinstance(pattern, str) or not pattern:
        return "pattern", "expected a regular expression (a string) with one group"
    try:
        groups = re.compile(pattern).groups
    except re.error as exc:
        return "pattern", f"not a regular expression: {exc}"
    if groups != 1:
        return "pattern", f"expected exactly one group (the degrees Celsius), found {groups}"
    return None


@dataclass(frozen=True, slots=True)
class SensorSpec:
    """A chip's vendor temperature tool: argv (no shell) and the regex whose one group is the
    degrees Celsius (every match counts; the hottest wins). Runs in `serving.sensors`."""

    command: tuple[str, ...]
    pattern: str

    def __post_init__(self) -> None:
        if isinstance(self.command, list):  # a TOML array; kept as a tuple so the spec is frozen
            object.__setattr__(self, "command", tuple(self.command))
        problem = _sensor_problem({"command": self.command, "pattern": self.pattern})
        if problem is not None:
            key, expected = problem
            raise ValueError(f"SensorSpec: {key} = {getattr(self, key)!r}: {expected}")


@dataclass(frozen=True, slots=True)
class ChipProfile:
    """One chip: its device memory bandwidth (declared or measured) and tuned parameters."""

    name: str
    display_name: str
    bandwidth_gbps: float | None  # None: measured at run time on `measure_on`
    tuned: TunedParams
    field_tuned: bool = False
    measure_on: str | None = None
    declared_bandwidth_gbps: float | None = None  # fallback when measuring is impossible
    pinned_class: str | None = None  # overrides the class derived from the bandwidth
    sensor: SensorSpec | None = None  # the vendor temperature tool, when the profile names one
    source: str = ""

    def __post_init__(self) -> None:
        if self.bandwidth_gbps is None:
            if self.measure_on not in MEASURE_TARGETS:
                raise ValueError(
                    f"profile {self.name!r}: measure_on = {self.measure_on!r}: expected one of "
                    f"{', '.join(MEASURE_TARGETS)} when the bandwidth is measured"
                )
        elif not _is_num(self.bandwidth_gbps) or self.bandwidth_gbps <= 0:
            raise ValueError(
                f"profile {self.name!r}: bandwidth_gbps = {self.bandwidth_gbps!r}: "
                "expected a number of GB/s > 0"
            )
        if self.declared_bandwidth_gbps is not None and (
            not _is_num(self.declared_bandwidth_gbps) or self.declared_bandwidth_gbps <= 0
        ):
            raise ValueError(
                f"profile {self.name!r}: declared_bandwidth_gbps = "
                f"{self.declared_bandwidth_gbps!r}: expected a number of GB/s > 0"
            )
        if self.pinned_class is not None and self.pinned_class not in CLASSES:
            raise ValueError(
                f"profile {self.name!r}: pinned_class = {self.pinned_class!r}: expected one of "
                f"{', '.join(CLASSES)}"
            )
        if self.sensor is not None and not isinstance(self.sensor, SensorSpec):
            raise ValueError(
                f"profile {self.name!r}: sensor = {self.sensor!r}: expected a SensorSpec or None"
            )

    @property
    def measured(self) -> bool:
        """True when the bandwidth is measured at run time rather than declared."""
        return self.bandwidth_gbps is None


def load_profile(
    name_or_path: str | os.PathLike[str], profile_dir: str | os.PathLike[str] = PROFILE_DIR
) -> ChipProfile:
    """Load a chip profile by name ("kunpeng920") or from a .toml path."""
    text = os.fspath(name_or_path)
    if text.endswith(".toml") or os.sep in text:
        path = Path(text)
    else:
        available = list_profiles(profile_dir)
        if text not in available:
            raise ConfigError(f"unknown chip {text!r}; available: {', '.join(available)}")
        path = Path(profile_dir) / f"{text}.toml"
    return _build_profile(path.stem, read_toml(path, "profile file"), str(path))


def _build_profile(name: str, raw: dict[str, Any], src: str) -> ChipProfile:
    def bad(key: str, value: object, expected: str) -> ConfigError:
        return ConfigError(f"{src}: {key} = {show_value(value)}: {expected}")

    for key in raw:
        if key not in _TOP_KEYS:
            raise ConfigError(
                f"{src}: unknown key {show_value(key)}; allowed: {', '.join(_TOP_KEYS)}"
            )
    for key in ("display_name", "bandwidth", "tuned"):
        if key not in raw:
            raise ConfigError(f"{src}: missing key {show_value(key)}")
    display = raw["display_name"]
    if not isinstance(display, str) or not display:
        raise bad("display_name", display, "expected a non-empty string")
    bw = raw["bandwidth"]
    measure_on = raw.get("measure_on")
    if bw == "measure":
        bandwidth = None
        if measure_on is None:
            raise ConfigError(
                f'{src}: bandwidth = "measure" needs measure_on: one of '
                f"{', '.join(MEASURE_TARGETS)}"
            )
        if measure_on not in MEASURE_TARGETS:
            raise bad("measure_on", measure_on, f"expected one of {', '.join(MEASURE_TARGETS)}")
    else:
        if not _is_num(bw) or bw <= 0:
            raise bad("bandwidth", bw, 'expected GB/s > 0 (a number) or "measure"')
        if measure_on is not None:
            raise bad("measure_on", measure_on, 'only allowed with bandwidth = "measure"')
        bandwidth = float(bw)
    declared = raw.get("declared_bandwidth")
    if declared is not None and (not _is_num(declared) or declared <= 0):
        raise bad("declared_bandwidth", declared, "expected GB/s > 0 (a number)")
    pinned = raw.get("bandwidth_class")
    if pinned is not None and pinned not in CLASSES:
        raise bad("bandwidth_class", pinned, f"expected one of {', '.join(CLASSES)}")
    field_tuned = raw.get("field_tuned", False)
    if not isinstance(field_tuned, bool):
        raise bad("field_tuned", field_tuned, "expected true or false")
    tuned_raw = raw["tuned"]
    if not isinstance(tuned_raw, dict):
        raise bad("tuned", tuned_raw, "expected a table [tuned]")
    # Checked here too (not only in __post_init__) so the error names the file and TOML key.
    _check_table(tuned_raw, "tuned", _TUNED_KEYS, (*_TUNED_KEYS, *_TUNED_OPTIONAL),
                 _tuned_problem, src)  # fmt: skip
    return ChipProfile(
        name=name,
        display_name=display,
        bandwidth_gbps=bandwidth,
        tuned=TunedParams(**tuned_raw),
        field_tuned=field_tuned,
        measure_on=measure_on,
        declared_bandwidth_gbps=None if declared is None else float(declared),
        pinned_class=pinned,
        sensor=_build_sensor(raw.get("sensor"), src),
        source=src,
    )


def _build_sensor(raw: object, src: str) -> SensorSpec | None:
    """The profile's [sensor] table as a SensorSpec (None when absent); errors name the file."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: sensor = {show_value(raw)}: expected a table [sensor]")
    _check_table(raw, "sensor", _SENSOR_KEYS, _SENSOR_KEYS, _sensor_problem, src)
    return SensorSpec(raw["command"], raw["pattern"])


def _check_table(raw: dict, name: str, required, allowed, problem_of, src: str) -> None:
    """A profile table's keys (none unknown, none of `required` missing) and values
    (`problem_of` gives the first bad key and what is expected); errors name the file."""
    for key in raw:
        if key not in allowed:
            raise ConfigError(
                f"{src}: [{name}] unknown key {show_value(key)}; allowed: {', '.join(allowed)}"
            )
    for key in required:
        if key not in raw:
            raise ConfigError(f"{src}: [{name}] missing key {show_value(key)}")
    problem = problem_of(raw)
    if problem is not None:
        key, expected = problem
        raise ConfigError(f"{src}: [{name}] {key} = {show_value(raw[key])}: {expected}")


# -- bandwidth probes ------------------------------------------------------------------------


@functools.cache
def measure_host_bandwidth(size_mib: int = 64, repeats: int = 5) -> float:
    """Host memory bandwidth in GB/s (1e9 B/s) from a numpy copy; cached per process.

    Copies a `size_mib` float64 array `repeats` times after one warm-up copy (which faults
    the destination pages in) and keeps the fastest. A copy of N bytes counts 2N: N read
    plus N written. One thread, so it reports what one engine thread sees, not the peak
    of every memory channel. About 50-150 ms on a typical machine.
    """
    import numpy as np

    n = size_mib * 2**20 // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


@functools.cache
def measure_cuda_bandwidth(size_mib: int = 256, repeats: int = 5) -> float | None:
    """CUDA device memory bandwidth in GB/s from a device copy, or None without a device.

    Counts read + write bytes like `measure_host_bandwidth`. torch is imported only here.
    """
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    n = size_mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / best / 1e9


def resolve_bandwidth(profile: ChipProfile) -> tuple[float, str]:
    """(GB/s, "declared" | "measured") for a profile, measuring if it asks to."""
    if profile.bandwidth_gbps is not None:
        return profile.bandwidth_gbps, "declared"
    if profile.measure_on == "host":
        return measure_host_bandwidth(), "measured"
    measured = measure_cuda_bandwidth()
    if measured is not None:
        return measured, "measured"
    if profile.declared_bandwidth_gbps is None:
        raise ConfigError(
            f"{profile.source}: no CUDA device to measure and no declared_bandwidth to fall back on"
        )
    return profile.declared_bandwidth_gbps, "declared"
