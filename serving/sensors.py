"""Temperature sensors a replica reads for its cooling window (`serving.cooling`).

What lives here: the `SensorSource` ABC, its sources (`HwmonSensor` for Linux hwmon,
`NvmlSensor` for NVIDIA GPUs through `pynvml`, `CommandSensor` for the vendor tool a chip
profile's `[sensor]` table names, `ScriptedSensor` for tests and benchmarks), the `SENSORS`
registry and `open_sensor`, which turns a `[thermal] sensor` setting into a source. What does
not: the cooling rule (`serving.cooling`), the profile's `[sensor]` table (`settings.profiles`),
routing and the replicas themselves.

Every source reads degrees Celsius, the hottest of what it watches, and never raises once
built: a missing device, a failed read or a tool that prints nothing useful is `None`, logged
once when the source starts failing and once when it works again. `read()` blocks (a file
read, an NVML call, a subprocess of at most `timeout_s`): call it from a thread in async code
(`asyncio.to_thread`).

Adding a source: subclass `SensorSource` (`read`, `describe`, and `from_kind` when it needs
the profile or the device), add it to `SENSORS`, and to `AUTO_ORDER` if "auto" should try it
(then give it `available`). tests/test_sensors.py runs the contract over the registry.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import shlex
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unikv.serving.health import SHARES

if TYPE_CHECKING:
    from unikv.settings.profiles import ChipProfile

log = logging.getLogger("unikv.sensors")

HWMON_ROOT = Path("/sys/class/hwmon")
INDEX_PLACEHOLDER = "{index}"  # in a profile's command: the replica's device index


class SensorSource(ABC):
    """One temperature source: `read()` is degrees Celsius now, or None when none can be had."""

    name: str = "sensor"  # the kind, as in SENSORS
    # The health colour this source forces on its replica; only ScriptedSensor sets it (the
    # simulation hook), real sensors leave it None.
    health: str | None = None
    _failing: bool = False  # class default, so a subclass need not call super().__init__

    @abstractmethod
    def read(self) -> float | None:
        """Degrees Celsius now (the hottest of what this source watches), or None. Never raises."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the log and `/health`: what is read, and from where."""

    @classmethod
    def from_kind(cls, arg: str, profile: ChipProfile | None, device: str) -> SensorSource:
        """Build for `open_sensor`; `arg` is what follows "kind:" ("" when nothing does)."""
        cls._no_argument(arg)
        return cls()

    @classmethod
    def _no_argument(cls, arg: str) -> None:
        if arg:
            raise ValueError(f"sensor kind {cls.name!r} takes no argument, got {arg!r}")

    @classmethod
    def available(cls, profile: ChipProfile | None, device: str) -> bool:
        """Whether "auto" should pick this source for `profile` on `device`."""
        return False

    def _fail(self, reason: str) -> None:
        """Note a failed read (logged once per failing spell); returns None for `return`."""
        if not self._failing:
            self._failing = True
            log.warning("sensor %s: no reading: %s (further failures not logged)",
                        self.describe(), reason)  # fmt: skip
        return None

    def _ok(self, celsius: float) -> float:
        """Note a good reading (logged when it ends a failing spell); returns `celsius`."""
        if self._failing:
            self._failing = False
            log.info("sensor %s: reading again: %.1f °C", self.describe(), celsius)
        return celsius


def _device_index(device: str) -> int:
    """The index in "cuda:1" / "npu:3" (0 when none is given)."""
    _, _, index = device.partition(":")
    if not index:
        return 0
    if not index.isdigit():
        raise ValueError(f"device {device!r}: expected KIND or KIND:INDEX, e.g. cuda:1")
    return int(index)


class HwmonSensor(SensorSource):
    """Linux hwmon: the hottest `temp*_input` (millidegrees) of every chip under `root`, or of
    the chips whose `name` file is in `names`."""

    name = "hwmon"

    def __init__(self, root: str | Path = HWMON_ROOT, names: tuple[str, ...] = ()) -> None:
        self.root = Path(root)
        self.names = tuple(names)

    def _chips(self) -> list[Path]:
        try:
            chips = sorted(p for p in self.root.iterdir() if p.is_dir())
        except OSError:
            return []
        if not self.names:
            return chips
        return [c for c in chips if _read_text(c / "name") in self.names]

    def read(self) -> float | None:
        """The hottest temp*_input of the watched chips in °C, or None."""
        values = []
        inputs = [f for chip in self._chips() for f in sorted(chip.glob("temp*_input"))]
        for f in inputs:
            # NOTE: some chips answer EIO/ENODATA for one input (a sensor that is absent or
            # asleep); the others still count.
            text = _read_text(f)
            try:
                milli = int(text) if text is not None else None
            except ValueError:
                milli = None
            if milli is not None:
                values.append(milli / 1000)
        if not values:
            what = "no readable temp*_input" if inputs else "no temp*_input"
            return self._fail(f"{what} under {self.root}")
        return self._ok(max(values))

    def describe(self) -> str:
        """'hwmon /sys/class/hwmon (all chips)' or with the chip names watched."""
        chips = ", ".join(self.names) if self.names else "all chips"
        return f"hwmon {self.root} ({chips})"

    @classmethod
    def from_kind(cls, arg: str, profile: ChipProfile | None, device: str) -> SensorSource:
        """The hwmon tree at `HWMON_ROOT`, every chip."""
        cls._no_argument(arg)
        return cls(HWMON_ROOT)

    @classmethod
    def available(cls, profile: ChipProfile | None, device: str) -> bool:
        """True when any hwmon chip has a temp*_input."""
        return hwmon_present(HWMON_ROOT)


def hwmon_present(root: str | Path = HWMON_ROOT) -> bool:
    """Whether any chip under `root` has a `temp*_input`."""
    try:
        return any(any(chip.glob("temp*_input")) for chip in Path(root).iterdir())
    except OSError:
        return False


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


class NvmlSensor(SensorSource):
    """NVIDIA GPU `index` through NVML (`pynvml`, PyPI `nvidia-ml-py`; not a dependency)."""

    name = "nvml"

    def __init__(self, index: int = 0) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise ImportError(
                "NvmlSensor needs pynvml: pip install nvidia-ml-py (or choose another sensor)"
            ) from exc
        self._nvml: Any = pynvml
        self.index = index
        self._handle: Any = None  # NVML is initialised at the first read, so a missing driver
        # is a None reading like any other failure, not an error at start-up.

    def read(self) -> float | None:
        """The GPU's core temperature in °C, or None."""
        nvml = self._nvml
        try:
            if self._handle is None:
                nvml.nvmlInit()
                self._handle = nvml.nvmlDeviceGetHandleByIndex(self.index)
            celsius = nvml.nvmlDeviceGetTemperature(self._handle, nvml.NVML_TEMPERATURE_GPU)
        except (nvml.NVMLError, OSError) as exc:
            self._handle = None  # re-initialise next time: the driver may have been reloaded
            return self._fail(f"NVML: {exc}")
        return self._ok(float(celsius))

    def describe(self) -> str:
        """'nvml GPU 0'."""
        return f"nvml GPU {self.index}"

    @classmethod
    def from_kind(cls, arg: str, profile: ChipProfile | None, device: str) -> SensorSource:
        """The GPU `device` names ("cuda:1" → 1; "cuda" → 0)."""
        cls._no_argument(arg)
        return cls(_device_index(device))

    @classmethod
    def available(cls, profile: ChipProfile | None, device: str) -> bool:
        """True on a CUDA device with pynvml importable."""
        return device.startswith("cuda") and importlib.util.find_spec("pynvml") is not None


class CommandSensor(SensorSource):
    """A vendor tool (`argv`, run without a shell): the hottest match of `pattern`'s one group
    in its stdout. A missing tool, a non-zero exit, a timeout or no match reads None."""

    name = "command"

    def __init__(self, argv: Sequence[str], pattern: str, timeout_s: float = 2.0) -> None:
        if isinstance(argv, str) or not argv or not all(isinstance(a, str) and a for a in argv):
            raise ValueError(
                f"CommandSensor: argv = {argv!r}: expected a non-empty list of strings "
                "(the tool and its arguments; no shell)"
            )
        try:
            self.regex = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"CommandSensor: pattern {pattern!r}: {exc}") from None
        if self.regex.groups != 1:
            raise ValueError(
                f"CommandSensor: pattern {pattern!r} has {self.regex.groups} groups; expected "
                "exactly one (the degrees Celsius)"
            )
        if isinstance(timeout_s, bool) or not timeout_s > 0 or not math.isfinite(timeout_s):
            raise ValueError(f"CommandSensor: timeout_s = {timeout_s!r}: expected seconds > 0")
        self.argv = tuple(argv)
        self.timeout_s = float(timeout_s)

    def read(self) -> float | None:
        """The hottest temperature the tool prints, in °C, or None."""
        try:
            proc = subprocess.run(self.argv, capture_output=True, text=True, errors="replace",
                                  timeout=self.timeout_s, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return self._fail(f"no answer within {self.timeout_s:g} s")
        except OSError as exc:  # not installed, not executable
            return self._fail(f"cannot run {self.argv[0]!r}: {exc.strerror or exc}")
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["no stderr"]
            return self._fail(f"exit status {proc.returncode}: {tail[0][:200]}")
        values = []
        for text in self.regex.findall(proc.stdout):
            try:
                values.append(float(text))
            except ValueError:
                continue
        values = [v for v in values if math.isfinite(v)]
        if not values:
            return self._fail(f"no temperature matching {self.regex.pattern!r} in its output")
        return self._ok(max(values))

    def describe(self) -> str:
        """'command atlas-smi info ... (pattern '...', timeout 2 s)'."""
        return (
            f"command {shlex.join(self.argv)} (pattern '{self.regex.pattern}', "
            f"timeout {self.timeout_s:g} s)"
        )

    @classmethod
    def from_kind(cls, arg: str, profile: ChipProfile | None, device: str) -> SensorSource:
        """The profile's [sensor] command, "{index}" replaced by `device`'s index."""
        cls._no_argument(arg)
        if profile is None or profile.sensor is None:
            which = "no chip profile given" if profile is None else f"profile {profile.name!r}"
            raise ValueError(
                f'sensor "command": {which} declares no [sensor] command '
                f"({profile.source if profile is not None else 'pass the chip profile'}); "
                'use sensor = "auto", "hwmon", "nvml" or "none"'
            )
        index = str(_device_index(device))
        argv = [a.replace(INDEX_PLACEHOLDER, index) for a in profile.sensor.command]
        return cls(argv, profile.sensor.pattern)

    @classmethod
    def available(cls, profile: ChipProfile | None, device: str) -> bool:
        """True when the profile declares a [sensor] command (whether it runs is read time's)."""
        return profile is not None and profile.sensor is not None


class ScriptedSensor(SensorSource):
    """Readings for tests and benchmarks: a sequence (each read takes the next; the last one
    repeats; None items are failed reads), or a file re-read at every `read()` holding a number
    or a JSON object `{"temp_c": 71.5, "health": "red"}`.

    `health` is the simulation hook: the colour the file forces on its replica ("green",
    "yellow", "red"), None when the file gives none (or for a sequence). A missing or
    unreadable file reads None and forces no colour.
    """

    name = "scripted"

    def __init__(self, source: Sequence[float | None] | str | os.PathLike[str]) -> None:
        self.health = None
        if isinstance(source, str | os.PathLike):
            self.path: Path | None = Path(source)
            self._values: tuple[float | None, ...] = ()
        else:
            values = tuple(source)
            if not values:
                raise ValueError("ScriptedSensor: an empty sequence of readings")
            for v in values:
                if v is not None and (
                    isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
                ):
                    raise ValueError(f"ScriptedSensor: reading {v!r}: expected °C or None")
            self.path = None
            self._values = tuple(None if v is None else float(v) for v in values)
        self._next = 0

    def read(self) -> float | None:
        """The next scripted reading, or the file's temperature now; updates `health`."""
        if self.path is None:
            value = self._values[min(self._next, len(self._values) - 1)]
            self._next += 1
            return self._fail("scripted failed read") if value is None else self._ok(value)
        text = _read_text(self.path)
        if text is None:
            self.health = None
            return self._fail(f"cannot read {self.path}")
        try:
            celsius, health = _parse_scripted(text)
        except ValueError as exc:
            self.health = None
            return self._fail(f"{self.path}: {exc}")
        self.health = health
        # A file that forces only a colour ({"health": "red"}) is a deliberate "no reading".
        return None if celsius is None else self._ok(celsius)

    def describe(self) -> str:
        """'scripted FILE' or 'scripted N readings'."""
        if self.path is not None:
            return f"scripted {self.path}"
        return f"scripted {len(self._values)} readings"

    @classmethod
    def from_kind(cls, arg: str, profile: ChipProfile | None, device: str) -> SensorSource:
        """The file named after "scripted:"."""
        if not arg:
            raise ValueError('sensor "scripted" needs a file: "scripted:PATH"')
        return cls(arg)


def _parse_scripted(text: str) -> tuple[float | None, str | None]:
    """(°C or None, health or None) from a scripted file's text: a number or a JSON object."""
    try:
        return _celsius(float(text)), None
    except ValueError:
        pass
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError('expected a number or {"temp_c": ..., "health": ...}') from None
    if not isinstance(data, dict) or not set(data) <= {"temp_c", "health"}:
        raise ValueError(f'expected a number or an object with "temp_c", "health"; got {text!r}')
    temp, health = data.get("temp_c"), data.get("health")
    if temp is not None and (isinstance(temp, bool) or not isinstance(temp, int | float)):
        raise ValueError(f"temp_c = {temp!r}: expected °C (a number) or null")
    if health is not None and health not in SHARES:
        raise ValueError(f"health = {health!r}: expected one of {', '.join(SHARES)}")
    return (None if temp is None else _celsius(float(temp))), health


def _celsius(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{value!r}: expected a finite number of °C")
    return value


SENSORS: dict[str, type[SensorSource]] = {
    "hwmon": HwmonSensor,
    "nvml": NvmlSensor,
    "command": CommandSensor,
    "scripted": ScriptedSensor,
}
# What "auto" tries, in order: the profile's own tool knows the chip best; NVML reads the GPU
# itself; hwmon is the host's sensors (on a CPU-only host: the CPU package).
AUTO_ORDER = ("command", "nvml", "hwmon")
KINDS = ("auto", "none", *(k for k in SENSORS if k != "scripted"), "scripted:PATH")


def open_sensor(
    kind: str, profile: ChipProfile | None = None, device: str = "cpu"
) -> SensorSource | None:
    """The sensor a `[thermal] sensor` setting names for `profile` on `device`; None for "none"
    (or "auto" when nothing can be read). Unknown kinds are a ValueError listing the kinds."""
    if kind == "none":
        return None
    if kind == "auto":
        for name in AUTO_ORDER:
            if SENSORS[name].available(profile, device):
                return SENSORS[name].from_kind("", profile, device)
        return None
    base, _, arg = kind.partition(":")
    if base not in SENSORS:
        raise ValueError(f"unknown sensor kind {kind!r}; expected one of {', '.join(KINDS)}")
    return SENSORS[base].from_kind(arg, profile, device)
