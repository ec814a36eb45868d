"""Tests of settings.profiles: shipped chip profiles, bandwidth classes, strategy choice, report."""

import json
from pathlib import Path

import pytest

import unikv.settings.profiles as profiles
from unikv import kvstrategies
from unikv.cli.profile import format_report, profile_report
from unikv.engine.routing import choose_topk
from unikv.kvstrategies.registry import class_defaults
from unikv.settings.config import ConfigError, MoEOptions, PoolConfig
from unikv.settings.profiles import (
    SensorSpec,
    TunedParams,
    bandwidth_class,
    list_profiles,
    load_profile,
    measure_host_bandwidth,
    resolve_bandwidth,
)

ROOT = Path(__file__).resolve().parents[1]

# docs/configuration.md: class table and field-tuned parameters
# (batch, KV precision, window ms, throttle °C, L2 prefetch depth).
DESIGN = {
    "ascend910b": ("high", (64, "fp16+int4", 15, 88, 4)),
    "mlu370": ("high", (48, "fp16+int4", 20, 85, 3)),
    "hygon_dcu": ("medium", (32, "fp16+int4", 25, 82, 2)),
    "br100": ("medium", (24, "fp16", 30, 85, 3)),
    "mtt_s4000": ("medium", (16, "int8", 35, 80, 2)),  # not in the class table: 768 GB/s
    "phytium_s2500": ("low", (8, "fp16+int4", 40, 75, 1)),
    "kunpeng920": ("low", (32, "fp16+int4", 25, 82, 2)),
}


def test_shipped_profiles() -> None:
    assert set(list_profiles()) == set(DESIGN) | {"cpu", "cuda"}


@pytest.mark.parametrize("name", sorted(DESIGN))
def test_profile_class_and_tuned_match_design(name: str) -> None:
    p = load_profile(name)
    expected_class, tuned = DESIGN[name]
    assert (p.pinned_class or bandwidth_class(p.bandwidth_gbps)) == expected_class
    t = p.tuned
    assert (
        t.batch_size,
        t.kv_precision,
        t.batching_window_ms,
        t.thermal_throttle_c,
        t.l2_prefetch_depth,
    ) == tuned
    assert p.field_tuned and not p.measured
    assert profile_report(name, env={}, select=only({"full"}))["class"] == expected_class


def test_pins_only_where_the_figure_disagrees() -> None:
    for name in DESIGN:
        p = load_profile(name)
        if p.pinned_class is not None:
            assert bandwidth_class(p.bandwidth_gbps) != p.pinned_class, name


def test_cpu_profile_measures_host() -> None:
    p = load_profile("cpu")
    assert p.measured and p.measure_on == "host" and not p.field_tuned
    gbps, source = resolve_bandwidth(p)
    assert gbps > 0 and source == "measured"


def test_measure_host_bandwidth_is_positive_and_cached() -> None:
    first = measure_host_bandwidth()
    assert first > 0
    assert measure_host_bandwidth() == first
    assert measure_host_bandwidth.cache_info().hits >= 1


def test_cuda_profile_falls_back_to_declared(monkeypatch: pytest.MonkeyPatch) -> None:
    # Never import torch here: pretend no CUDA device, then pretend one was measured.
    p = load_profile("cuda")
    monkeypatch.setattr(profiles, "measure_cuda_bandwidth", lambda: None)
    assert resolve_bandwidth(p) == (900.0, "declared")
    monkeypatch.setattr(profiles, "measure_cuda_bandwidth", lambda: 4000.0)
    assert resolve_bandwidth(p) == (4000.0, "measured")


@pytest.mark.parametrize(
    ("gbps", "cls"),
    [
        (3350, "high"),
        (1000, "high"),
        (999.9, "medium"),
        (300, "medium"),
        (299.9, "low"),
        (1, "low"),
    ],
)
def test_bandwidth_class_thresholds(gbps: float, cls: str) -> None:
    assert bandwidth_class(gbps) == cls


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf"), "fast", True])
def test_bandwidth_class_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="bandwidth"):
        bandwidth_class(bad)  # type: ignore[arg-type]


# the class table of docs/configuration.md: the default strategy of each bandwidth class.
DESIGN_DEFAULTS = {
    "high": "hybrid_fp16_int4",
    "medium": "hierarchical_offload",
    "low": "sparse_attention",
}


def choose_strategy(cls: str, strategy: str, names: set[str]) -> tuple[str, str]:
    return kvstrategies.select(cls, PoolConfig(strategy=strategy), names)


def only(names: set[str]):
    """`kvstrategies.select` as if only `names` were available (profile_report's `select`)."""
    return lambda cls, config, precision=None: kvstrategies.select(cls, config, names, precision)


def test_choose_strategy() -> None:
    # The strategies declare the classes they are the default of; profiles name none.
    assert class_defaults() == DESIGN_DEFAULTS
    everything = set(DESIGN_DEFAULTS.values()) | {"full"}
    for cls, default in DESIGN_DEFAULTS.items():
        assert choose_strategy(cls, "auto", everything)[0] == default
        assert kvstrategies.select(cls, PoolConfig()) == (
            default,
            f"auto: default of the {cls} bandwidth class",
        )
    name, reason = choose_strategy("high", "auto", {"full"})
    assert name == "full" and "'hybrid_fp16_int4' is not available" in reason
    assert "falling back to 'full'" in reason
    assert choose_strategy("low", "full", {"full"}) == ("full", "configured strategy 'full'")
    with pytest.raises(ValueError, match="strategy 'quantum' is not available; available: full"):
        choose_strategy("low", "quantum", {"full"})
    with pytest.raises(ValueError, match="neither"):
        choose_strategy("low", "auto", set())
    with pytest.raises(ValueError, match="bandwidth class 'huge'"):
        choose_strategy("huge", "auto", {"full"})


def test_unknown_chip_lists_available() -> None:
    with pytest.raises(ConfigError, match="unknown chip 'tpu9'; available: ascend910b, br100"):
        load_profile("tpu9")


GOOD = """display_name = "X"
bandwidth = 500
[tuned]
batch_size = 4
kv_precision = "fp16"
batching_window_ms = 10
thermal_throttle_c = 80
l2_prefetch_depth = 1
"""


def test_profile_from_path_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "mychip.toml"
    path.write_text(GOOD)
    p = load_profile(path)
    assert p.name == "mychip" and p.bandwidth_gbps == 500.0 and not p.field_tuned
    cases = {
        GOOD.replace("bandwidth = 500", "bandwidth = -1"): "bandwidth = -1: expected GB/s > 0",
        GOOD.replace("bandwidth = 500", 'bandwidth = "measure"'): "needs measure_on: one of host",
        GOOD + "colour = 1\n": '[tuned] unknown key "colour"; allowed: batch_size',
        "speed = 1\n" + GOOD: 'unknown key "speed"; allowed: display_name, bandwidth',
        GOOD.replace('"fp16"', '"fp4"'): '[tuned] kv_precision = "fp4": expected one of fp32',
        GOOD.replace("batch_size = 4", "batch_size = 0"): "[tuned] batch_size = 0: expected",
        GOOD.replace("l2_prefetch_depth = 1\n", ""): '[tuned] missing key "l2_prefetch_depth"',
        "bandwidth_class = 'ultra'\n" + GOOD: 'bandwidth_class = "ultra": expected one of high',
        "display_name = [\n": "invalid TOML",
    }
    for text, fragment in cases.items():
        path.write_text(text)
        with pytest.raises(ConfigError) as exc:
            load_profile(path)
        assert str(exc.value).startswith(f"{path}: ") and fragment in str(exc.value), exc.value


def test_profile_report_cpu_and_format() -> None:
    report = profile_report(
        None, ROOT / "configs" / "small.toml", only({"full"}), env={}
    )  # small.toml: chip cpu, strategy full
    assert json.loads(json.dumps(report)) == report
    for key in ("chip", "bandwidth_gbps", "bandwidth_source", "class", "strategy", "tiers"):
        assert key in report
    assert report["chip"] == "cpu" and report["bandwidth_source"] == "measured"
    assert (
        report["strategy"] == "full" and report["strategy_reason"] == "configured strategy 'full'"
    )
    assert report["tiers"] == [
        {"name": "device", "capacity_bytes": 512 * 2**20, "path": None},
        {"name": "host", "capacity_bytes": 2**30, "path": None},
    ]
    text = format_report(report)
    assert "512.00 MiB" in text and "measured" in text and "batch size" in text


def test_profile_report_chip_override_pinned_class() -> None:
    report = profile_report("mlu370", None, only({"full", "hybrid_fp16_int4"}), env={})
    assert report["class"] == "high" and report["strategy"] == "hybrid_fp16_int4"
    assert report["bandwidth_source"] == "declared" and report["bandwidth_gbps"] == 614.4
    assert "pinned" in report["class_source"] and "would be medium" in report["class_source"]
    assert report["batch_size"] == 48
    assert "pinned by the profile" in format_report(report)


def test_profile_topk_keys(tmp_path: Path) -> None:
    path = tmp_path / "chip.toml"
    path.write_text(GOOD)
    assert load_profile(path).tuned.moe_topk == "exact"  # optional keys
    path.write_text(GOOD + 'moe_topk = "blockwise"\nmoe_topk_block = 8\n')
    assert choose_topk(load_profile(path), MoEOptions())[:2] == ("blockwise", 8)
    for extra, fragment in [
        ('moe_topk = "heap"\n', '[tuned] moe_topk = "heap": expected one of exact, blockwise'),
        ("moe_topk_block = 0\n", "[tuned] moe_topk_block = 0: expected an integer >= 2"),
    ]:
        path.write_text(GOOD + extra)
        with pytest.raises(ConfigError) as exc:
            load_profile(path)
        assert str(exc.value).startswith(f"{path}: ") and fragment in str(exc.value)
    with pytest.raises(ValueError, match="moe_topk = 'auto'"):
        TunedParams(4, "fp16", 10, 80, 1, moe_topk="auto")


SENSOR = """
[sensor]
command = ["vendor-smi", "-q"]
pattern = 'Temp: (\\d+) C'
"""


def test_profile_sensor_table(tmp_path: Path) -> None:
    path = tmp_path / "chip.toml"
    path.write_text(GOOD)
    assert load_profile(path).sensor is None
    path.write_text(GOOD + SENSOR)
    assert load_profile(path).sensor == SensorSpec(("vendor-smi", "-q"), r"Temp: (\d+) C")
    cases = {
        GOOD + SENSOR.replace('"-q"]', '"-q"]\ncolour = 1'): '[sensor] unknown key "colour"',
        GOOD + SENSOR.replace("pattern =", "#"): '[sensor] missing key "pattern"',
        GOOD + SENSOR.replace('["vendor-smi", "-q"]', "[]"): "[sensor] command = []: expected",
        GOOD + SENSOR.replace('["vendor-smi", "-q"]', '"vendor-smi -q"'): "non-empty list",
        GOOD + SENSOR.replace("(\\d+)", "\\d+"): "expected exactly one group",
        GOOD + SENSOR.replace("(\\d+)", "(\\d+)(C)"): "found 2",
        GOOD + SENSOR.replace("(\\d+)", "(\\d+"): "not a regular expression",
        GOOD.replace("[tuned]", "sensor = 'vendor-smi'\n[tuned]"): "expected a table [sensor]",
    }
    for text, fragment in cases.items():
        path.write_text(text)
        with pytest.raises(ConfigError) as exc:
            load_profile(path)
        assert str(exc.value).startswith(f"{path}: ") and fragment in str(exc.value), exc.value
    with pytest.raises(ValueError, match="SensorSpec: pattern"):
        SensorSpec(("x",), "no group")


def test_vendor_profiles_declare_a_sensor_and_the_report_shows_it() -> None:
    for name in ("ascend910b", "mlu370", "hygon_dcu", "mtt_s4000"):
        assert load_profile(name).sensor is not None, name
    report = profile_report("ascend910b", None, env={})
    assert report["sensor"]["command"][0] == "atlas-smi"
    assert json.loads(json.dumps(report)) == report
    line = next(ln for ln in format_report(report).splitlines() if ln.startswith("sensor"))
    assert "atlas-smi info -t temp" in line and "(pattern 'Temperature" in line
    cpu = format_report(profile_report("kunpeng920", None, env={}))
    assert "none declared (auto: hwmon/NVML)" in cpu
