"""The memory-tier configuration: dataclasses, the TOML loader and environment overrides.

What lives here: `TierConfig`, `MoEOptions`, `SchedulerOptions`, `ThermalOptions` and
`PoolConfig` (validated on construction), `parse_size`, `load_config` and `ConfigError`. What
does not: chip profiles and bandwidth classes (`settings.profiles`), checking a strategy name
against the strategy registry (`kvstrategies`), and building the pool from a config (the pool).

File format (TOML, see configs/unikv.toml)::

    block_size = 16            # tokens per block, 1..1024 (default: the strategy's own)
    chip = "cpu"               # a shipped profile name (settings/chips/) or a .toml path
    strategy = "auto"          # "auto" (by the chip), a preset name, or FORMAT+PLACEMENT+SELECTION
                               # (or a [strategy] table: format, placement, selection; a
                               # missing axis is "auto")
    [strategy_options]         # free-form, passed to the strategy, which validates it
    [tiers.device]             # required
    capacity = "25%"           # bytes (int), "512MiB" / "2GB", or a percentage of host RAM
    low_watermark = 0.01       # fraction kept free for running sequences (see TierAllocator)
    [tiers.host]               # optional: capacity, low_watermark
    [tiers.ssd]                # optional: capacity, path (directory), low_watermark
    [tiers.remote]             # optional: capacity, url ("redis://..."), low_watermark
    [scheduler]                # optional (see SchedulerOptions); unset: the chip profile's
    batch_size = 8             # requests running at once, 1..4096
    batching_window_ms = 40    # admission window, 0..10000 ms
    priority_aging_s = 1.0     # starvation guard: priority improves by 1 per this many s
    step_target_ms = 100       # prompt chunks sized so a step takes about this long (0: off)
    prompt_tokens_per_decode = 4  # with it, waiting prompts' least tokens a step per decode
    [thermal]                  # optional (see ThermalOptions): replicas' cooling windows
    sensor = "auto"            # auto, hwmon, nvml, command (the profile's), none, scripted:PATH
    margin_c = 3.0             # readings this close to the chip's thermal_throttle_c count
    readings = 3               # consecutive such readings start a cooling window
    hysteresis_c = 5.0         # cooling ends below thermal_throttle_c - hysteresis_c
    interval_s = 1.0           # seconds between readings
    [moe]                      # optional, DeepSeekMoE models (see MoEOptions)
    topk = "auto"              # router's final top-k: "auto" (chip's), "exact", "blockwise"
    topk_block = 16            # experts per block for "blockwise" (>= 2; unset: the profile's)
    expert_cache = 1.0         # fraction 0 < f <= 1 of routed experts on the device tier
    expert_host = 1.0          # fraction 0 <= f <= 1 of the rest on host; the remainder on SSD

Capacity: an integer is bytes; a string is a number with a unit, decimal (B, KB, MB, GB, TB:
powers of 1000) or binary (KiB, MiB, GiB, TiB: powers of 1024), units case-insensitive; a
string ending in "%" is that percentage of the host's physical RAM, resolved when the file is
loaded. (A bare float such as 0.25 is refused: it is unclear whether it means bytes or a
fraction.) On an accelerator give the device tier in bytes: the percentage is of host RAM.

Environment overrides: every variable named ``UNIKV_<KEY>`` overrides one key after the file is
read. Nested keys are joined with a double underscore, names are case-insensitive:
``UNIKV_BLOCK_SIZE=32``, ``UNIKV_CHIP=kunpeng920``, ``UNIKV_STRATEGY=full``,
``UNIKV_TIERS__DEVICE__CAPACITY=1GiB``, ``UNIKV_TIERS__SSD__PATH=/var/cache/unikv``,
``UNIKV_STRATEGY_OPTIONS__WINDOW=128``, ``UNIKV_MOE__TOPK=exact``. The value is read as a
TOML scalar where it parses as one (``32`` is an integer, ``true`` a boolean, ``0.5`` a
float) and as a plain string otherwise (``1GiB``). A variable that names no known key is an
error naming the variable, so every ``UNIKV_`` variable is reserved for configuration.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

# The shipped chip profiles: package data (a directory, since unikv installs unzipped).
PROFILE_DIR = Path(resources.files(__package__) / "chips")


def list_profiles(profile_dir: str | os.PathLike[str] = PROFILE_DIR) -> list[str]:
    """Names of the shipped chip profiles, sorted."""
    return sorted(p.stem for p in Path(profile_dir).glob("*.toml"))


TIER_ORDER = ("device", "host", "ssd", "remote")
ENV_PREFIX = "UNIKV_"
# UNIKV_ variables that are settings of their own, not configuration keys: left alone here.
OTHER_ENV = frozenset(
    {
        "UNIKV_CACHE_DIR",
        "UNIKV_KERNEL_DIR",
        "UNIKV_NO_KERNEL",
        "UNIKV_ISA",
        "UNIKV_API_KEY",
        "UNIKV_CHECK_OWNER",
        "UNIKV_HUGE_PAGES",
        "UNIKV_CUDA_GRAPHS",
        "UNIKV_LOG_LEVEL",
        "UNIKV_STORE_SECRET",
    }  # fmt: skip
)


def env_switch(name: str, off: str, on: str) -> bool:
    """A program setting of its own that is 0 or 1 (`OTHER_ENV`): unset, "" or "1" True, "0"
    False; any other value a ValueError naming it and what each value does (`off`, `on`)."""
    switch = os.environ.get(name, "1").strip()
    if switch not in ("0", "1", ""):
        raise ValueError(f"{name}={switch!r}: expected 0 ({off}) or 1 ({on}, the default)")
    return switch != "0"


def cache_dir() -> Path:
    """unikv's cache root (built kernels, calibrations): `$UNIKV_CACHE_DIR`, else
    `$XDG_CACHE_HOME/unikv`, else ~/.cache/unikv."""
    if os.environ.get("UNIKV_CACHE_DIR"):
        return Path(os.environ["UNIKV_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "unikv"


MAX_BLOCK_SIZE = 1024
DEFAULT_DEVICE_BYTES = 1 << 30  # used when a config has no [tiers] table

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_URL_RE = re.compile(r"^[a-z][a-z0-9+.-]*://\S+$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

SIZE_EXPECTED = 'expected bytes > 0, a size like "512MiB", or a fraction of RAM like "25%"'
_TOP_KEYS = (
    "block_size",
    "chip",
    "strategy",
    "strategy_options",
    "tiers",
    "moe",
    "scheduler",
    "thermal",
)
MOE_TOPK = ("auto", "exact", "blockwise")
_MOE_KEYS = ("topk", "topk_block", "expert_cache", "expert_host")
_SCHEDULER_KEYS = ("batch_size", "batching_window_ms", "priority_aging_s", "step_target_ms",
                   "prompt_tokens_per_decode")  # fmt: skip
_THERMAL_KEYS = ("sensor", "margin_c", "readings", "hysteresis_c", "interval_s")
SENSOR_KINDS = ("auto", "hwmon", "nvml", "command", "none")
_TIER_KEYS = {
    "device": ("capacity", "low_watermark"),
    "host": ("capacity", "low_watermark"),
    "ssd": ("capacity", "path", "low_watermark"),
    "remote": ("capacity", "url", "low_watermark"),
}


class ConfigError(ValueError):
    """A configuration file or override is missing, unreadable, malformed or invalid."""


class _Invalid(Exception):
    """A value was refused; `expected` says what is allowed (turned into a located error)."""

    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_ram_bytes() -> int:
    """RAM this process may use, in bytes: the machine's physical RAM, or the memory limit of
    its cgroup (a container's) when that is lower."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_limit_bytes()
    return min(ram, limit) if limit else ram


def cgroup_limit_bytes(paths: tuple[str, ...] = CGROUP_LIMITS) -> int | None:
    """The memory limit of this process's cgroup (v2 `memory.max`, v1 `limit_in_bytes`), or
    None where there is none ("max", an absurd v1 value, no such file)."""
    for path in paths:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < 1 << 60:  # v1 says "no limit" with ~2**63
            return int(text)
        return None
    return None


def _size(value: object, ram_bytes: int | None) -> int:
    if isinstance(value, bool):
        raise _Invalid(SIZE_EXPECTED)
    if isinstance(value, int):
        if value <= 0:
            raise _Invalid(SIZE_EXPECTED)
        return value
    if not isinstance(value, str):
        raise _Invalid(SIZE_EXPECTED)
    m = _PERCENT_RE.match(value)
    if m:
        pct = float(m.group(1))
        if not 0.0 < pct <= 100.0:
            raise _Invalid("expected a percentage of RAM in (0%, 100%]")
        ram = host_ram_bytes() if ram_bytes is None else ram_bytes
        return max(1, int(ram * pct / 100.0))
    m = _SIZE_RE.match(value)
    if not m:
        raise _Invalid(SIZE_EXPECTED)
    n = int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])
    if n <= 0:
        raise _Invalid(SIZE_EXPECTED)
    return n


def parse_size(value: int | str, *, ram_bytes: int | None = None) -> int:
    """Bytes from an int, a size string ("512MiB", "2GB") or a percentage of RAM ("25%")."""
    try:
        return _size(value, ram_bytes)
    except _Invalid as exc:
        raise ValueError(f"size {value!r}: {exc.expected}") from None


def _block_size(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BLOCK_SIZE:
        raise _Invalid(f"expected an integer from 1 to {MAX_BLOCK_SIZE} (tokens per block)")
    return value


def _name(value: object, what: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise _Invalid(f"expected {what}: lower-case letters, digits and '_', starting a letter")
    return value


# The three axes of a composed strategy, as a `[strategy]` table writes them (kvstrategies
# checks the names: this module only knows their shape).
STRATEGY_AXES = ("format", "placement", "selection")


def _strategy(value: object) -> str:
    """A strategy name, or a composed FORMAT+PLACEMENT+SELECTION (axes may be "auto"); a
    `[strategy]` table of the axes becomes the latter (a missing axis: "auto")."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(STRATEGY_AXES))
        if unknown:
            raise _Invalid(f"unknown key(s) {', '.join(unknown)}; allowed: "
                           f"{', '.join(STRATEGY_AXES)}")  # fmt: skip
        parts = [_name(value.get(a, "auto"), f"a {a} name") for a in STRATEGY_AXES]
        return "+".join(parts)
    if isinstance(value, str) and value.count("+") == 2:
        for part in value.split("+"):
            _name(part, 'FORMAT+PLACEMENT+SELECTION, each "auto" or a name')
        return value
    return _name(value, '"auto", a strategy name or a [strategy] table of format, placement, '
                 "selection")  # fmt: skip


def _watermark(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise _Invalid("expected a fraction in [0, 1) such as 0.01")
    return float(value)


def _path(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Invalid("expected a non-empty directory path")
    return value


def _url(value: object) -> str:
    if not isinstance(value, str) or not _URL_RE.match(value):
        raise _Invalid('expected a URL like "redis://host:6379/0"')
    return value


def _options(value: object) -> dict[str, Any]:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _Invalid("expected a table of options")
    return dict(value)


def _topk(value: object) -> str:
    if value not in MOE_TOPK:
        raise _Invalid(f"expected one of {', '.join(MOE_TOPK)}")
    return value  # type: ignore[return-value]


def _topk_block(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise _Invalid("expected an integer >= 2 (routed experts per block)")
    return value


def _expert_cache(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise _Invalid("expected a fraction 0 < f <= 1 of the routed experts (1.0: all)")
    return float(value)


def _expert_host(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise _Invalid("expected a fraction 0 <= f <= 1 of the experts not on the device")
    return float(value)


_MOE_CHECKS = {
    "topk": _topk,
    "topk_block": _topk_block,
    "expert_cache": _expert_cache,
    "expert_host": _expert_host,
}


def _batch_size(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise _Invalid("expected an integer 1..4096 (unset: the chip profile's)")
    return value


def _window_ms(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 10_000:
        raise _Invalid("expected milliseconds 0..10000 (unset: the chip profile's)")
    return float(value)


def _aging(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
        raise _Invalid("expected seconds > 0 and <= 3600")
    return float(value)


def _step_target(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 60_000:
        raise _Invalid("expected milliseconds 0..60000 (0: off)")
    return float(value)


def _per_decode(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 64:
        raise _Invalid("expected an integer 0..64")
    return value


_SCHEDULER_CHECKS = {
    "batch_size": _batch_size,
    "batching_window_ms": _window_ms,
    "priority_aging_s": _aging,
    "step_target_ms": _step_target,
    "prompt_tokens_per_decode": _per_decode,
}


def _sensor(value: object) -> str:
    scripted = isinstance(value, str) and value.startswith("scripted:") and len(value) > 9
    if value not in SENSOR_KINDS and not scripted:
        raise _Invalid(f"expected one of {', '.join(SENSOR_KINDS)} or scripted:PATH")
    return str(value)


def _degrees(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 50:
        raise _Invalid("expected degrees Celsius 0..50")
    return float(value)


def _readings(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise _Invalid("expected an integer 1..100 (consecutive readings)")
    return value


def _interval(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 600:
        raise _Invalid("expected seconds > 0 and <= 600")
    return float(value)


_THERMAL_CHECKS = {
    "sensor": _sensor,
    "margin_c": _degrees,
    "readings": _readings,
    "hysteresis_c": _degrees,
    "interval_s": _interval,
}


def _raise_field(owner: str, name: str, value: object, exc: _Invalid) -> None:
    raise ValueError(f"{owner}: {name} = {value!r}: {exc.expected}") from None


@dataclass(frozen=True, slots=True)
class TierConfig:
    """One memory tier: its name, capacity and (ssd, remote) location.

    `path` is the SSD directory for "ssd" and the URL for "remote"; None otherwise.
    """

    name: str
    capacity_bytes: int
    path: str | None = None
    low_watermark: float = 0.0

    def __post_init__(self) -> None:
        owner = f"tier {self.name!r}"
        if self.name not in TIER_ORDER:
            raise ValueError(f"tier name {self.name!r}: expected one of {', '.join(TIER_ORDER)}")
        cap = self.capacity_bytes
        if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
            raise ValueError(f"{owner}: capacity_bytes = {cap!r}: expected an integer > 0")
        checks = [("low_watermark", self.low_watermark, _watermark)]
        if self.name == "ssd":
            checks.append(("path", self.path, _path))
        elif self.name == "remote":
            checks.append(("path", self.path, _url))
        elif self.path is not None:
            raise ValueError(
                f"{owner}: path = {self.path!r}: expected None (this tier has no path)"
            )
        for name, value, check in checks:
            try:
                check(value)
            except _Invalid as exc:
                _raise_field(owner, name, value, exc)


DEFAULT_TIERS = (TierConfig("device", DEFAULT_DEVICE_BYTES),)


@dataclass(frozen=True, slots=True)
class MoEOptions:
    """DeepSeekMoE settings: the router's final top-k and where the routed experts live.

    `topk` "auto" takes the chip profile's preference (`engine.routing.choose_topk`);
    `topk_block` None takes the profile's block size. `expert_cache` is the fraction of routed
    experts kept on the device tier (1.0: all resident); of the rest, `expert_host` is the
    fraction kept in host memory, the remainder on the SSD tier.
    """

    topk: str = "auto"
    topk_block: int | None = None
    expert_cache: float = 1.0
    expert_host: float = 1.0

    def __post_init__(self) -> None:
        for name, check in _MOE_CHECKS.items():
            value = getattr(self, name)
            try:
                check(value)
            except _Invalid as exc:
                _raise_field("MoEOptions", name, value, exc)


@dataclass(frozen=True, slots=True)
class SchedulerOptions:
    """How the engine batches requests; unset values come from the chip profile.

    `batch_size` caps the running batch; `batching_window_ms` is the admission window
    (requests arriving within it are admitted and prefilled together); `priority_aging_s` is
    the starvation guard (a waiting request's priority improves by one per that many seconds);
    `step_target_ms` sizes prompt chunks by the machine's measured speed so that a step takes
    about that long (an urgent request that arrives waits at most one such step; 0: chunks of
    the engine's token budget alone); with it, `prompt_tokens_per_decode` is the fewest prompt
    tokens a step carries per decoding request while prompts wait (the queue drains as the
    streams grow, at a longer step).
    """

    batch_size: int | None = None
    batching_window_ms: float | None = None
    priority_aging_s: float = 1.0
    step_target_ms: float = 100.0
    prompt_tokens_per_decode: int = 4

    def __post_init__(self) -> None:
        for name, check in _SCHEDULER_CHECKS.items():
            try:
                check(getattr(self, name))
            except _Invalid as exc:
                _raise_field("SchedulerOptions", name, getattr(self, name), exc)


@dataclass(frozen=True, slots=True)
class ThermalOptions:
    """How a replica watches its temperature (`serving.cooling`): which sensor, and the
    cooling rule around the chip profile's `thermal_throttle_c`.

    `readings` consecutive readings at or above `thermal_throttle_c - margin_c` start a cooling
    window (no new requests; the queue finishes at half the batch size); it ends at the first
    reading below `thermal_throttle_c - hysteresis_c`. `hysteresis_c` must be at least
    `margin_c`, or a replica could leave and re-enter cooling at the same temperature.
    """

    sensor: str = "auto"
    margin_c: float = 3.0
    readings: int = 3
    hysteresis_c: float = 5.0
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        for name, check in _THERMAL_CHECKS.items():
            try:
                check(getattr(self, name))
            except _Invalid as exc:
                _raise_field("ThermalOptions", name, getattr(self, name), exc)
        if self.hysteresis_c < self.margin_c:
            raise ValueError(
                f"ThermalOptions: hysteresis_c = {self.hysteresis_c:g} is below margin_c = "
                f"{self.margin_c:g}: a replica would flap in and out of cooling"
            )


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The memory pool's configuration: block size, tiers, chip, strategy choice, MoE options."""

    block_size: int | None = None  # None: the strategy's default block size
    tiers: tuple[TierConfig, ...] = DEFAULT_TIERS
    chip: str = "cpu"
    strategy: str = "auto"
    strategy_options: dict[str, Any] = field(default_factory=dict)
    moe: MoEOptions = MoEOptions()
    scheduler: SchedulerOptions = SchedulerOptions()
    thermal: ThermalOptions = ThermalOptions()
    source: str = field(default="<defaults>", compare=False)  # where it was loaded from

    def __post_init__(self) -> None:
        checks = [
            ("block_size", self.block_size, _block_size),
            ("chip", self.chip, lambda v: _name(v, "a chip profile name")),
            ("strategy", self.strategy, _strategy),
            ("strategy_options", self.strategy_options, _options),
        ]
        for name, value, check in checks:
            try:
                check(value)
            except _Invalid as exc:
                _raise_field("PoolConfig", name, value, exc)
        if not isinstance(self.moe, MoEOptions):
            raise ValueError(f"PoolConfig: moe = {self.moe!r}: expected MoEOptions")
        if not isinstance(self.scheduler, SchedulerOptions):
            raise ValueError(
                f"PoolConfig: scheduler = {self.scheduler!r}: expected SchedulerOptions"
            )
        if not isinstance(self.thermal, ThermalOptions):
            raise ValueError(f"PoolConfig: thermal = {self.thermal!r}: expected ThermalOptions")
        names = [t.name for t in self.tiers if isinstance(t, TierConfig)]
        if len(names) != len(self.tiers):
            raise ValueError(f"PoolConfig: tiers = {self.tiers!r}: expected TierConfig items")
        if "device" not in names:
            raise ValueError(f"PoolConfig: tiers {names}: a device tier is required")
        if names != sorted(set(names), key=TIER_ORDER.index):
            raise ValueError(
                f"PoolConfig: tiers {names}: expected each tier once, in the order "
                f"{', '.join(TIER_ORDER)}"
            )

    def tier(self, name: str) -> TierConfig | None:
        """The tier called `name`, or None if it is not configured."""
        return next((t for t in self.tiers if t.name == name), None)


# -- loading -------------------------------------------------------------------------------


def show_value(value: object) -> str:
    """A value as it would be written in TOML (strings in double quotes), for error messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return json.dumps(value)
    return repr(value)


class _Locator:
    """Builds error messages naming the file or environment variable and the key."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.env_origin: dict[tuple[str, ...], str] = {}

    def key(self, path: tuple[str, ...]) -> str:
        if len(path) == 1:
            return path[0]
        return f"[{'.'.join(path[:-1])}] {path[-1]}"

    def where(self, path: tuple[str, ...]) -> str:
        var = self.env_origin.get(path)
        if var is not None:
            return f"{var} (environment override of {self.source})"
        return self.source

    def bad(self, path: tuple[str, ...], value: object, expected: str) -> ConfigError:
        return ConfigError(
            f"{self.where(path)}: {self.key(path)} = {show_value(value)}: {expected}"
        )

    def unknown(self, path: tuple[str, ...], allowed: tuple[str, ...]) -> ConfigError:
        parent = f"[{'.'.join(path[:-1])}] " if len(path) > 1 else ""
        what = "tier" if path[:-1] == ("tiers",) else "key"
        return ConfigError(
            f"{self.where(path)}: {parent}unknown {what} {show_value(path[-1])}; "
            f"allowed: {', '.join(allowed)}"
        )


def _parse_env_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _env_path(var: str) -> tuple[str, ...]:
    parts = tuple(p.lower() for p in var[len(ENV_PREFIX) :].split("__"))
    if len(parts) == 1 and parts[0] in ("block_size", "chip", "strategy"):
        return parts
    if len(parts) == 2 and parts[0] == "strategy_options" and _NAME_RE.match(parts[1]):
        return parts
    if len(parts) == 3 and parts[0] == "tiers" and parts[2] in _TIER_KEYS.get(parts[1], ()):
        return parts
    if len(parts) == 2 and parts[0] == "moe" and parts[1] in _MOE_KEYS:
        return parts
    if len(parts) == 2 and parts[0] == "scheduler" and parts[1] in _SCHEDULER_KEYS:
        return parts
    if len(parts) == 2 and parts[0] == "thermal" and parts[1] in _THERMAL_KEYS:
        return parts
    allowed = (
        ["UNIKV_BLOCK_SIZE", "UNIKV_CHIP", "UNIKV_STRATEGY", "UNIKV_STRATEGY_OPTIONS__<NAME>"]
        + [f"UNIKV_TIERS__{t.upper()}__{k.upper()}" for t in TIER_ORDER for k in _TIER_KEYS[t]]
        + [f"UNIKV_MOE__{k.upper()}" for k in _MOE_KEYS]
        + [f"UNIKV_SCHEDULER__{k.upper()}" for k in _SCHEDULER_KEYS]
        + [f"UNIKV_THERMAL__{k.upper()}" for k in _THERMAL_KEYS]
    )
    raise ConfigError(
        f"environment variable {var}: names no configuration key; allowed: {', '.join(allowed)}"
    )


def _apply_env(raw: dict[str, Any], env: Mapping[str, str], loc: _Locator) -> None:
    for var in sorted(env):
        if not var.upper().startswith(ENV_PREFIX) or var.upper() in OTHER_ENV:
            continue
        path = _env_path(var.upper())
        node = raw
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise loc.bad(path[: i + 1], child, "expected a table")
            node = child
        node[path[-1]] = _parse_env_value(env[var])
        loc.env_origin[path] = var


def _check(loc: _Locator, path: tuple[str, ...], value: object, fn: Any) -> Any:
    try:
        return fn(value)
    except _Invalid as exc:
        raise loc.bad(path, value, exc.expected) from None


def _build(raw: dict[str, Any], loc: _Locator, ram_bytes: int | None) -> PoolConfig:
    for key in raw:
        if key not in _TOP_KEYS:
            raise loc.unknown((key,), _TOP_KEYS)
    kwargs: dict[str, Any] = {}
    if "block_size" in raw:
        kwargs["block_size"] = _check(loc, ("block_size",), raw["block_size"], _block_size)
    if "strategy" in raw:
        kwargs["strategy"] = _check(loc, ("strategy",), raw["strategy"], _strategy)
    if "strategy_options" in raw:
        opts = raw["strategy_options"]
        kwargs["strategy_options"] = _check(loc, ("strategy_options",), opts, _options)
    if "chip" in raw:
        chip = _check(loc, ("chip",), raw["chip"], lambda v: _name(v, "a chip profile name"))
        available = list_profiles()
        if chip not in available:
            raise loc.bad(("chip",), chip, f"expected one of {', '.join(available)}")
        kwargs["chip"] = chip
    if "tiers" in raw:
        kwargs["tiers"] = _build_tiers(raw["tiers"], loc, ram_bytes)
    if "moe" in raw:
        kwargs["moe"] = _build_moe(raw["moe"], loc)
    if "scheduler" in raw:
        kwargs["scheduler"] = _build_table(raw["scheduler"], loc, "scheduler", _SCHEDULER_CHECKS,
                                           SchedulerOptions)  # fmt: skip
    try:
        if "thermal" in raw:
            kwargs["thermal"] = _build_table(raw["thermal"], loc, "thermal", _THERMAL_CHECKS,
                                             ThermalOptions)  # fmt: skip
        return PoolConfig(**kwargs, source=loc.source)
    except ValueError as exc:
        raise ConfigError(f"{loc.source}: {exc}") from None


def _build_tiers(tables: object, loc: _Locator, ram_bytes: int | None) -> tuple[TierConfig, ...]:
    if not isinstance(tables, dict):
        raise loc.bad(("tiers",), tables, "expected a table of tiers like [tiers.device]")
    for name in tables:
        if name not in TIER_ORDER:
            raise loc.unknown(("tiers", name), TIER_ORDER)
    if "device" not in tables:
        raise ConfigError(f"{loc.source}: [tiers] has no device tier; add [tiers.device]")
    tiers = []
    for name in (n for n in TIER_ORDER if n in tables):
        table = tables[name]
        if not isinstance(table, dict):
            raise loc.bad(("tiers", name), table, f"expected a table [tiers.{name}]")
        allowed = _TIER_KEYS[name]
        for key in table:
            if key not in allowed:
                raise loc.unknown(("tiers", name, key), allowed)
        required = {"ssd": ("capacity", "path"), "remote": ("capacity", "url")}
        for key in required.get(name, ("capacity",)):
            if key not in table:
                via = [v for p, v in loc.env_origin.items() if p[:2] == ("tiers", name)]
                hint = f" (the tier was set by {', '.join(via)})" if via else ""
                raise ConfigError(
                    f"{loc.source}: [tiers.{name}] missing key {show_value(key)}{hint}; "
                    f"keys of this tier: {', '.join(_TIER_KEYS[name])}"
                )
        capacity = _check(
            loc, ("tiers", name, "capacity"), table["capacity"], lambda v: _size(v, ram_bytes)
        )
        watermark = _check(
            loc, ("tiers", name, "low_watermark"), table.get("low_watermark", 0.0), _watermark
        )
        location = None
        if name == "ssd":
            location = _check(loc, ("tiers", name, "path"), table["path"], _path)
        elif name == "remote":
            location = _check(loc, ("tiers", name, "url"), table["url"], _url)
        tiers.append(TierConfig(name, capacity, location, watermark))
    return tuple(tiers)


def _build_moe(table: object, loc: _Locator) -> MoEOptions:
    return _build_table(table, loc, "moe", _MOE_CHECKS, MoEOptions)


def _build_table(table: object, loc: _Locator, name: str, checks: dict, cls: type) -> Any:
    """One options table (`[moe]`, `[scheduler]`): known keys, each value checked."""
    if not isinstance(table, dict):
        raise loc.bad((name,), table, f"expected a table [{name}]")
    for key in table:
        if key not in checks:
            raise loc.unknown((name, key), tuple(checks))
    return cls(**{key: _check(loc, (name, key), table[key], checks[key]) for key in table})


def read_toml(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """Parse a TOML file; a missing, unreadable or invalid one is a ConfigError naming it."""
    source = str(path)
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{source}: {what} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read {what}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        # The parser's message carries the line and column.
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    ram_bytes: int | None = None,
) -> PoolConfig:
    """Read a TOML config (or the defaults when `path` is None) and apply UNIKV_ overrides.

    `env` defaults to `os.environ`; `ram_bytes` (for percentages) to this machine's RAM.
    """
    source = "<defaults>" if path is None else str(path)
    raw: dict[str, Any] = {} if path is None else read_toml(path, "config file")
    # A file without [tiers] gets the default device tier, so an override that adds, say,
    # an SSD tier does not leave the pool without a device tier.
    raw.setdefault("tiers", {"device": {"capacity": DEFAULT_DEVICE_BYTES}})
    loc = _Locator(source)
    _apply_env(raw, os.environ if env is None else env, loc)
    return _build(raw, loc, ram_bytes)
