"""Tests of serving.sensors: hwmon on a fake sysfs tree, real small commands, scripted
readings and files, open_sensor's kinds, and one contract over the SENSORS registry."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import unikv.serving.sensors as sensors
from unikv.serving.sensors import (
    KINDS,
    SENSORS,
    CommandSensor,
    HwmonSensor,
    NvmlSensor,
    ScriptedSensor,
    SensorSource,
    open_sensor,
)
from unikv.settings.config import SENSOR_KINDS
from unikv.settings.profiles import ChipProfile, SensorSpec, TunedParams, load_profile

pytestmark = pytest.mark.timeout(30)

PY = sys.executable


def fake_hwmon(root: Path, chips: dict[str, dict[str, str]]) -> Path:
    """A sysfs-like tree: root/hwmonN/{name, temp*_input} for each chip."""
    root.mkdir(parents=True, exist_ok=True)
    for i, (name, files) in enumerate(chips.items()):
        chip = root / f"hwmon{i}"
        chip.mkdir()
        (chip / "name").write_text(name + "\n")
        for file, text in files.items():
            (chip / file).write_text(text)
    return root


def printer(text: str) -> list[str]:
    return [PY, "-c", f"print({text!r})"]


def profile(sensor: SensorSpec | None = None, name: str = "testchip") -> ChipProfile:
    return ChipProfile(
        name=name,
        display_name="Test chip",
        bandwidth_gbps=500.0,
        tuned=TunedParams(4, "fp16", 10, 80, 1),
        sensor=sensor,
        source=f"/profiles/{name}.toml",
    )


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- hwmon ------------------------------------------------------------------------------------


def test_hwmon_reads_the_hottest_input(tmp_path: Path) -> None:
    root = fake_hwmon(tmp_path / "hwmon", {
        "coretemp": {"temp1_input": "45000\n", "temp2_input": "71500\n", "temp2_label": "x"},
        "nvme": {"temp1_input": "38000\n"},
        "acpitz": {"temp1_input": "garbage\n"},  # an unreadable input does not spoil the rest
    })  # fmt: skip
    assert HwmonSensor(root).read() == 71.5
    assert HwmonSensor(root, names=("nvme",)).read() == 38.0
    assert HwmonSensor(root, names=("nvme", "coretemp")).read() == 71.5
    assert "coretemp" in HwmonSensor(root, names=("coretemp",)).describe()
    assert HwmonSensor(root).describe() == f"hwmon {root} (all chips)"


def test_hwmon_missing_tree_reads_none_and_logs_once_per_state_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "hwmon"
    sensor = HwmonSensor(root)
    with caplog.at_level(logging.INFO, logger="unikv.sensors"):
        assert sensor.read() is None
        assert sensor.read() is None
        assert len(warnings_of(caplog)) == 1 and "no temp*_input" in warnings_of(caplog)[0]
        fake_hwmon(root, {"k10temp": {"temp1_input": "60000"}})
        assert sensor.read() == 60.0
        assert sensor.read() == 60.0
        again = [r for r in caplog.records if r.levelno == logging.INFO]
        assert len(again) == 1 and "reading again: 60.0" in again[0].getMessage()
        (root / "hwmon0" / "temp1_input").write_text("")
        assert sensor.read() is None  # failing again: a second warning
        assert len(warnings_of(caplog)) == 2 and "no readable" in warnings_of(caplog)[1]
    assert HwmonSensor(tmp_path, names=("nothing",)).read() is None


# -- command ----------------------------------------------------------------------------------


def test_command_reads_the_hottest_match() -> None:
    assert CommandSensor(printer("Temp: 71 C"), r"Temp: (\d+) C").read() == 71.0
    out = "GPU0 Temp: 64.5 C\\nGPU1 Temp: 77.25 C\\nfan 3000"
    argv = [PY, "-c", f"print('{out}')"]
    assert CommandSensor(argv, r"Temp: ([\d.]+) C").read() == 77.25


@pytest.mark.parametrize(
    ("argv", "pattern", "timeout_s", "why"),
    [
        ([PY, "-c", "import sys; print('Temp: 71 C'); sys.exit(3)"], r"Temp: (\d+)", 5.0,
         "exit status 3"),
        ([PY, "-c", "print('fan 3000 rpm')"], r"Temp: (\d+)", 5.0, "no temperature matching"),
        (["/nonexistent/atlas-smi", "info"], r"(\d+)", 5.0, "cannot run"),
        ([PY, "-c", "import time; time.sleep(10)"], r"(\d+)", 0.3, "no answer within 0.3 s"),
    ],
)  # fmt: skip
def test_command_failures_read_none_logged_once(
    argv: list[str], pattern: str, timeout_s: float, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    sensor = CommandSensor(argv, pattern, timeout_s=timeout_s)
    with caplog.at_level(logging.WARNING, logger="unikv.sensors"):
        assert sensor.read() is None
        assert sensor.read() is None
    messages = warnings_of(caplog)
    assert len(messages) == 1 and why in messages[0], messages


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"argv": printer("x"), "pattern": r"Temp: \d+"}, "has 0 groups; expected exactly one"),
        ({"argv": printer("x"), "pattern": r"(\w+): (\d+)"}, "has 2 groups"),
        ({"argv": printer("x"), "pattern": r"(\d+"}, "missing ), unterminated subpattern"),
        ({"argv": [], "pattern": r"(\d+)"}, "expected a non-empty list of strings"),
        ({"argv": "atlas-smi info", "pattern": r"(\d+)"}, "no shell"),
        ({"argv": printer("x"), "pattern": r"(\d+)", "timeout_s": 0}, "timeout_s = 0"),
    ],
)
def test_command_construction_errors(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match="CommandSensor") as exc:
        CommandSensor(**kwargs)
    assert fragment in str(exc.value)


# The documented output line of each vendor tool the shipped profiles name (see their comments:
# the patterns were not verified on the hardware here), read through the profile's pattern.
VENDOR_OUTPUT = {
    "ascend910b": ("NPU ID : 0\\nNPU Temperature (C)           : 67", 67.0),
    "mlu370": ("Temperature\\n  Board              : 41 C\\n  Cluster 0          : 58 C", 58.0),
    "hygon_dcu": (
        "GPU[0]          : Temperature (Sensor edge) (C): 51.0\\n"
        "GPU[0]          : Temperature (Sensor junction) (C): 63.0",
        63.0,
    ),
    "mtt_s4000": ("Temperature\\n    GPU Current Temp            : 72 C", 72.0),
}


@pytest.mark.parametrize("chip", sorted(VENDOR_OUTPUT))
def test_vendor_profiles_pattern_reads_their_tools_output(chip: str) -> None:
    spec = load_profile(chip).sensor
    assert spec is not None and "{index}" in spec.command
    text, expected = VENDOR_OUTPUT[chip]
    assert CommandSensor([PY, "-c", f"print('{text}')"], spec.pattern).read() == expected


# -- scripted ---------------------------------------------------------------------------------


def test_scripted_sequence_takes_the_next_and_repeats_the_last() -> None:
    sensor = ScriptedSensor([70, 75.5, None, 80])
    assert [sensor.read() for _ in range(6)] == [70.0, 75.5, None, 80.0, 80.0, 80.0]
    assert sensor.health is None and sensor.describe() == "scripted 4 readings"
    for bad in ([], [float("nan")], ["hot"], [True]):
        with pytest.raises(ValueError, match="ScriptedSensor"):
            ScriptedSensor(bad)


def test_scripted_file_is_reread_and_forces_health(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a.temp"
    sensor = ScriptedSensor(path)
    with caplog.at_level(logging.WARNING, logger="unikv.sensors"):
        assert sensor.read() is None and sensor.health is None  # missing file
        assert sensor.read() is None
    assert len(warnings_of(caplog)) == 1 and "cannot read" in warnings_of(caplog)[0]
    path.write_text("71.5\n")
    assert sensor.read() == 71.5 and sensor.health is None
    path.write_text(json.dumps({"temp_c": 84, "health": "red"}))
    assert sensor.read() == 84.0 and sensor.health == "red"
    path.write_text(json.dumps({"health": "yellow"}))  # a colour without a temperature
    assert sensor.read() is None and sensor.health == "yellow"
    path.write_text(json.dumps({"temp_c": 60}))
    assert sensor.read() == 60.0 and sensor.health is None
    for bad in ('{"temp_c": 60, "health": "blue"}', '{"temp": 60}', "hot", '{"temp_c": "60"}'):
        path.write_text(bad)
        assert sensor.read() is None and sensor.health is None, bad
    path.unlink()
    assert sensor.read() is None and sensor.health is None


# -- open_sensor --------------------------------------------------------------------------------

VENDOR = SensorSpec(("atlas-smi", "info", "-t", "temp", "-i", "{index}"), r"Temp: (\d+)")


def test_open_sensor_kinds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sensors, "HWMON_ROOT", fake_hwmon(tmp_path / "hw", {
        "coretemp": {"temp1_input": "50000"}}))  # fmt: skip
    assert open_sensor("none") is None
    hw = open_sensor("hwmon")
    assert isinstance(hw, HwmonSensor) and hw.read() == 50.0
    command = open_sensor("command", profile(VENDOR), device="npu:3")
    assert isinstance(command, CommandSensor) and command.argv[-1] == "3"  # {index}
    script = tmp_path / "t.json"
    script.write_text('{"temp_c": 66}')
    scripted = open_sensor(f"scripted:{script}")
    assert isinstance(scripted, ScriptedSensor) and scripted.read() == 66.0


def test_open_sensor_auto_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sensors, "HWMON_ROOT", tmp_path / "none")
    # The profile's command first, whatever the device.
    auto = open_sensor("auto", profile(VENDOR), device="cuda:1")
    assert isinstance(auto, CommandSensor) and auto.argv[-1] == "1"
    # No hwmon temp*_input, no CUDA: nothing to read.
    assert open_sensor("auto", profile(), device="cpu") is None
    assert open_sensor("auto") is None
    fake_hwmon(tmp_path / "none", {"k10temp": {"temp1_input": "40000"}})
    assert isinstance(open_sensor("auto", profile(), device="cpu"), HwmonSensor)
    if importlib.util.find_spec("pynvml") is None:  # CUDA without pynvml falls through to hwmon
        assert isinstance(open_sensor("auto", profile(), device="cuda"), HwmonSensor)
    else:
        assert isinstance(open_sensor("auto", profile(), device="cuda"), NvmlSensor)


def test_open_sensor_errors() -> None:
    with pytest.raises(ValueError, match="unknown sensor kind 'ipmi'; expected one of auto, none"):
        open_sensor("ipmi")
    with pytest.raises(ValueError, match="scripted:PATH"):
        open_sensor("thermometer")
    with pytest.raises(ValueError, match=r"profile 'testchip' declares no \[sensor\] command"):
        open_sensor("command", profile())
    with pytest.raises(ValueError, match="no chip profile given"):
        open_sensor("command")
    with pytest.raises(ValueError, match='needs a file: "scripted:PATH"'):
        open_sensor("scripted")
    with pytest.raises(ValueError, match="takes no argument"):
        open_sensor("hwmon:/sys")
    with pytest.raises(ValueError, match="KIND:INDEX"):
        open_sensor("command", profile(VENDOR), device="npu:first")


def test_every_config_kind_opens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """settings.config validates [thermal] sensor against its own list: keep the two in step."""
    monkeypatch.setattr(sensors, "HWMON_ROOT", tmp_path)
    for kind in SENSOR_KINDS:
        assert kind in KINDS
        if kind != "nvml" or importlib.util.find_spec("pynvml") is not None:
            open_sensor(kind, profile(VENDOR))


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="pynvml is installed")
def test_nvml_without_pynvml_names_the_package() -> None:
    with pytest.raises(ImportError, match="pip install nvidia-ml-py"):
        NvmlSensor()
    with pytest.raises(ImportError, match="nvidia-ml-py"):
        open_sensor("nvml", device="cuda")


class FakeNvml:
    """pynvml's few calls NvmlSensor makes, for its logic without a GPU."""

    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self, temps: list[float]) -> None:
        self.temps, self.inits, self.driver_up = temps, 0, True

    def nvmlInit(self) -> None:
        if not self.driver_up:
            raise self.NVMLError("Driver Not Loaded")
        self.inits += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index >= len(self.temps):
            raise self.NVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        if not self.driver_up:
            raise self.NVMLError("GPU is lost")
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self.temps[handle]


def test_nvml_logic_with_a_fake_pynvml(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNvml([41, 66])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert NvmlSensor(1).read() == 66.0 and fake.inits == 1
    sensor = open_sensor("nvml", device="cuda:0")
    assert isinstance(sensor, NvmlSensor) and sensor.describe() == "nvml GPU 0"
    assert sensor.read() == 41.0 and sensor.read() == 41.0 and fake.inits == 2  # init once
    fake.driver_up = False
    with caplog.at_level(logging.INFO, logger="unikv.sensors"):
        assert sensor.read() is None and sensor.read() is None
        fake.driver_up = True
        assert sensor.read() == 41.0 and fake.inits == 3  # re-initialised after the loss
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]
    assert "GPU is lost" in caplog.records[0].getMessage()
    assert NvmlSensor(5).read() is None  # no such GPU


def _nvml_gpus() -> int:
    if importlib.util.find_spec("pynvml") is None:
        return 0
    import pynvml

    try:
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError:
        return 0


@pytest.mark.cuda
@pytest.mark.skipif(_nvml_gpus() == 0, reason="needs pynvml (nvidia-ml-py) and an NVIDIA GPU")
def test_nvml_reads_a_gpu() -> None:
    temp = NvmlSensor(0).read()
    assert temp is not None and 0 < temp < 125
    assert NvmlSensor(_nvml_gpus()).read() is None  # no such GPU: None, not an exception


# -- the contract, over the registry ------------------------------------------------------------


def _working(kind: str, tmp_path: Path) -> SensorSource:
    factories: dict[str, Callable[[], SensorSource]] = {
        "hwmon": lambda: HwmonSensor(fake_hwmon(tmp_path / "hw", {"c": {"temp1_input": "42000"}})),
        "nvml": lambda: NvmlSensor(0),
        "command": lambda: CommandSensor(printer("Temp: 42 C"), r"Temp: (\d+)"),
        "scripted": lambda: ScriptedSensor([42.0]),
    }
    return factories[kind]()


def _failing(kind: str, tmp_path: Path) -> SensorSource:
    factories: dict[str, Callable[[], SensorSource]] = {
        "hwmon": lambda: HwmonSensor(tmp_path / "missing"),
        "nvml": lambda: NvmlSensor(10_000),
        "command": lambda: CommandSensor(["/nonexistent/tool"], r"(\d+)"),
        "scripted": lambda: ScriptedSensor(tmp_path / "missing.json"),
    }
    return factories[kind]()


@pytest.mark.parametrize("kind", sorted(SENSORS))
def test_contract(kind: str, tmp_path: Path) -> None:
    if kind == "nvml" and _nvml_gpus() == 0:
        pytest.skip("needs pynvml (nvidia-ml-py) and an NVIDIA GPU")
    working, failing = _working(kind, tmp_path), _failing(kind, tmp_path)
    assert isinstance(working, SENSORS[kind]) and working.name == kind
    temp = working.read()
    assert isinstance(temp, float) and 0 < temp < 125
    for sensor in (working, failing):
        text = sensor.describe()
        assert isinstance(text, str) and text and "\n" not in text
    assert failing.read() is None and failing.read() is None  # never raises
    assert failing.health is None  # only a scripted file forces a colour
