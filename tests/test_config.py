"""Tests of settings.config: TOML files, validation messages and UNIKV_ environment overrides."""

from pathlib import Path

import pytest

from unikv.settings.config import ConfigError, PoolConfig, TierConfig, load_config, parse_size

from .conftest import floor_folders

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
RAM = 64 * GiB


def write(tmp_path: Path, text: str, name: str = "x.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load(path: Path | None, env: dict[str, str] | None = None) -> PoolConfig:
    return load_config(path, env=env or {}, ram_bytes=RAM)


@pytest.mark.parametrize(
    "name",
    [
        "unikv.toml",
        "offload.toml",
        "small.toml",
        "hybrid.toml",
        "hybrid_tight.toml",
        "prune.toml",
        "composed.toml",
    ],  # fmt: skip
)
def test_shipped_configs_load(name: str) -> None:
    from unikv import kvstrategies

    cfg = load(ROOT / "configs" / name)
    assert cfg.tiers[0].name == "device" and cfg.block_size is None
    assert cfg.source.endswith(name)
    if cfg.strategy != "auto":  # the strategy accepts the file's options
        kvstrategies.get(cfg.strategy).check_options(cfg.strategy_options)


def test_default_and_offload_contents() -> None:
    cfg = load(ROOT / "configs" / "unikv.toml")
    assert cfg.tier("device") == TierConfig("device", RAM // 4, None, 0.01)
    off = load(ROOT / "configs" / "offload.toml")
    assert [t.name for t in off.tiers] == ["device", "host", "ssd"]
    assert off.tier("ssd") == TierConfig("ssd", 500 * 10**9, "/var/cache/unikv/blocks")
    assert off.strategy == "hierarchical_offload" and off.chip == "hygon_dcu"
    assert off.strategy_options["device_window"] == 1024
    assert off.tier("remote") is None


def test_no_file_gives_defaults() -> None:
    cfg = load(None)
    assert cfg == PoolConfig() and cfg.source == "<defaults>"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5 gib", int(1.5 * GiB)),
        ("100", 100),
        ("25%", RAM // 4),
        ("100%", RAM),
    ],
)
def test_capacity_forms(value: object, expected: int) -> None:
    assert parse_size(value, ram_bytes=RAM) == expected  # type: ignore[arg-type]


def test_capacity_error_message_names_file_key_value_and_allowed(tmp_path: Path) -> None:
    path = write(tmp_path, '[tiers.device]\ncapacity = "-3GB"\n')
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert str(exc.value) == (
        f'{path}: [tiers.device] capacity = "-3GB": expected bytes > 0, a size like "512MiB", '
        'or a fraction of RAM like "25%"'
    )


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[tiers.device]\ncapacity = 0", "capacity = 0: expected bytes > 0"),
        ("[tiers.device]\ncapacity = 0.25", "capacity = 0.25: expected bytes > 0"),
        ('[tiers.device]\ncapacity = "150%"', 'capacity = "150%": expected a percentage'),
        ('[tiers.device]\ncapacity = "lots"', 'capacity = "lots": expected bytes'),
        ("[tiers.device]\ncapacity = true", "capacity = true: expected bytes"),
        ("block_size = 0", "block_size = 0: expected an integer from 1 to 1024"),
        ("block_size = 2048", "block_size = 2048: expected an integer from 1 to 1024"),
        ('block_size = "16"', 'block_size = "16": expected an integer'),
        ("block_size = true", "block_size = true: expected an integer"),
        (
            'strategy = "Full-KV"',
            'strategy = "Full-KV": expected "auto", a strategy name or a [strategy] table',
        ),
        ('chip = "tpu9"', 'chip = "tpu9": expected one of ascend910b, br100, cpu, cuda'),
        ("strategy_options = 3", "strategy_options = 3: expected a table"),
        (
            '[tiers.device]\ncapacity = "1GiB"\nlow_watermark = 1.0',
            "[tiers.device] low_watermark = 1.0: expected a fraction in [0, 1)",
        ),
        (
            '[tiers.device]\ncapacity = "1GiB"\n[tiers.remote]\ncapacity = "1GiB"\nurl = "nope"',
            '[tiers.remote] url = "nope": expected a URL',
        ),
        (
            '[tiers.device]\ncapacity = "1GiB"\n[tiers.ssd]\ncapacity = "1GiB"\npath = ""',
            '[tiers.ssd] path = "": expected a non-empty directory path',
        ),
        (
            '[tiers.device]\ncapacity = "1GiB"\n[tiers.ssd]\ncapacity = "1GiB"',
            '[tiers.ssd] missing key "path"; keys of this tier: capacity, path, low_watermark',
        ),
        ('[tiers.host]\ncapacity = "1GiB"', "[tiers] has no device tier"),
        ("tiers = 5", "tiers = 5: expected a table of tiers"),
        ("[tiers.device]\nlow_watermark = 0.1", '[tiers.device] missing key "capacity"'),
    ],
)
def test_bad_values(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as exc:
        load(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: ") and fragment in msg, msg


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            "blocksize = 16",
            'unknown key "blocksize"; allowed: block_size, chip, strategy, strategy_options, tiers',
        ),
        (
            '[tiers.device]\ncapacity = "1GiB"\ncapcity = 1',
            '[tiers.device] unknown key "capcity"; allowed: capacity, low_watermark',
        ),
        (
            '[tiers.gpu]\ncapacity = "1GiB"',
            '[tiers] unknown tier "gpu"; allowed: device, host, ssd, remote',
        ),
        (
            '[tiers.device]\ncapacity = "1GiB"\npath = "/tmp"',
            '[tiers.device] unknown key "path"; allowed: capacity, low_watermark',
        ),
    ],
)
def test_unknown_keys(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="unknown") as exc:
        load(write(tmp_path, text + "\n"))
    assert fragment in str(exc.value)


def test_missing_unreadable_and_invalid_toml(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=f"{missing}: config file not found"):
        load(missing)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(tmp_path)  # a directory
    bad = write(tmp_path, "block_size = 16\n[tiers.device\ncapacity = 1\n")
    with pytest.raises(ConfigError, match=r"invalid TOML: .*line 2") as exc:
        load(bad)
    assert isinstance(exc.value, ValueError) and str(bad) in str(exc.value)


def test_env_overrides() -> None:
    env = {
        "UNIKV_BLOCK_SIZE": "32",
        "UNIKV_TIERS__DEVICE__CAPACITY": "1GiB",
        "UNIKV_STRATEGY": "full",
        "UNIKV_CHIP": "kunpeng920",
        "UNIKV_STRATEGY_OPTIONS__WINDOW": "128",
        "unikv_tiers__host__capacity": "2GiB",  # case-insensitive names
        "PATH": "/usr/bin",  # not ours: ignored
    }
    cfg = load(ROOT / "configs" / "unikv.toml", env)
    assert cfg.block_size == 32 and cfg.strategy == "full" and cfg.chip == "kunpeng920"
    assert cfg.tier("device") == TierConfig("device", GiB, None, 0.01)  # watermark kept
    assert cfg.tier("host") == TierConfig("host", 2 * GiB)
    assert cfg.strategy_options == {"window": 128}


def test_env_can_add_a_tier_and_errors_name_the_variable(tmp_path: Path) -> None:
    env = {"UNIKV_TIERS__SSD__CAPACITY": "10GB", "UNIKV_TIERS__SSD__PATH": str(tmp_path)}
    assert load(None, env).tier("ssd") == TierConfig("ssd", 10**10, str(tmp_path))
    with pytest.raises(ConfigError, match=r"missing key \"path\" \(the tier was set by UNIKV_"):
        load(None, {"UNIKV_TIERS__SSD__CAPACITY": "10GB"})
    with pytest.raises(ConfigError) as exc:
        load(None, {"UNIKV_BLOCK_SIZE": "0"})
    assert str(exc.value).startswith(
        "UNIKV_BLOCK_SIZE (environment override of <defaults>): block_size = 0: expected"
    )


@pytest.mark.parametrize(
    "var", ["UNIKV_BLOCKSIZE", "UNIKV_TIERS__DEVICE__SIZE", "UNIKV_TIERS__GPU__CAPACITY", "UNIKV_"]
)
def test_env_unknown_key_names_variable(var: str) -> None:
    with pytest.raises(ConfigError, match=f"environment variable {var}: names no configuration"):
        load(None, {var: "1"})


def test_dataclass_validation() -> None:
    with pytest.raises(ValueError, match="tier name 'gpu'"):
        TierConfig("gpu", 1)
    with pytest.raises(ValueError, match="capacity_bytes = 0"):
        TierConfig("device", 0)
    with pytest.raises(ValueError, match="path = None"):
        TierConfig("ssd", 1)
    with pytest.raises(ValueError, match="expected None"):
        TierConfig("host", 1, "/tmp")
    with pytest.raises(ValueError, match="block_size = 0"):
        PoolConfig(block_size=0)
    with pytest.raises(ValueError, match="a device tier is required"):
        PoolConfig(tiers=(TierConfig("host", 1),))
    with pytest.raises(ValueError, match="in the order"):
        PoolConfig(tiers=(TierConfig("host", 1), TierConfig("device", 1)))
    with pytest.raises(ValueError, match="size 'x'"):
        parse_size("x")


def test_env_settings_of_their_own_are_not_configuration_keys(tmp_path) -> None:
    """UNIKV_CACHE_DIR (calibration files) and the kernel variables are not config overrides."""
    env = {"UNIKV_CACHE_DIR": str(tmp_path), "UNIKV_NO_KERNEL": "1", "UNIKV_CHIP": "cpu",
           "UNIKV_ISA": "avx2", "UNIKV_API_KEY": "k"}  # fmt: skip
    assert load(None, env).chip == "cpu"


def test_the_step_target_is_a_scheduler_key(tmp_path: Path) -> None:
    """`[scheduler] step_target_ms` (default 100; 0 turns it off) and its override."""
    assert load(None).scheduler.step_target_ms == 100.0
    cfg = load(write(tmp_path, "[scheduler]\nstep_target_ms = 0\n"))
    assert cfg.scheduler.step_target_ms == 0.0
    env = {"UNIKV_SCHEDULER__STEP_TARGET_MS": "250"}
    assert load(None, env).scheduler.step_target_ms == 250.0
    with pytest.raises(ConfigError, match="step_target_ms.*0..60000"):
        load(write(tmp_path, "[scheduler]\nstep_target_ms = -5\n"))
    assert load(None).scheduler.prompt_tokens_per_decode == 4
    env = {"UNIKV_SCHEDULER__PROMPT_TOKENS_PER_DECODE": "0"}
    assert load(None, env).scheduler.prompt_tokens_per_decode == 0
    for bad in ("65", "2.5", "true"):
        with pytest.raises(ConfigError, match="prompt_tokens_per_decode.*0..64"):
            load(write(tmp_path, f"[scheduler]\nprompt_tokens_per_decode = {bad}\n"))


def test_every_unikv_variable_the_program_reads_passes_the_config_check() -> None:
    """Issue 33: `UNIKV_API_KEY=k unikv serve` (documented in --help) exited 2, "names no
    configuration key", and so did UNIKV_STORE_SECRET. Every UNIKV_ name the code reads is a
    configuration key or one of the program's own variables, which the check leaves alone."""
    import re

    names = set()
    for folder in floor_folders().values():
        for f in folder.rglob("*.py"):
            names |= set(re.findall(r'"(UNIKV_[A-Z_]+)"', f.read_text(encoding="utf-8")))
    assert {"UNIKV_API_KEY", "UNIKV_STORE_SECRET", "UNIKV_LOG_LEVEL"} <= names
    for name in sorted(names):
        value = {"UNIKV_BLOCK_SIZE": "32", "UNIKV_STRATEGY": "full", "UNIKV_CHIP": "cpu"}
        load(None, {name: value.get(name, "1")})  # raises ConfigError if refused


def test_cache_dir_follows_xdg_and_ram_follows_the_cgroup(tmp_path: Path, monkeypatch) -> None:
    """Issue 33: the cache ignored XDG_CACHE_HOME, and "25%" of RAM ignored a container's
    memory limit (cgroup v2 `memory.max`, v1 `limit_in_bytes`)."""
    from unikv.settings import config

    monkeypatch.delenv("UNIKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.cache_dir() == tmp_path / "xdg" / "unikv"
    monkeypatch.setenv("UNIKV_CACHE_DIR", str(tmp_path / "own"))
    assert config.cache_dir() == tmp_path / "own"
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    v2.write_text("max\n")
    assert config.cgroup_limit_bytes((str(v2), str(v1))) is None
    v2.write_text("4294967296\n")
    assert config.cgroup_limit_bytes((str(v2), str(v1))) == 4 * GiB
    v1.write_text("9223372036854771712\n")  # v1's "no limit"
    assert config.cgroup_limit_bytes((str(tmp_path / "none"), str(v1))) is None
    monkeypatch.setattr(config, "cgroup_limit_bytes", lambda: 2 * GiB)
    assert config.host_ram_bytes() == 2 * GiB
    assert (
        load_config(None, env={"UNIKV_TIERS__DEVICE__CAPACITY": "25%"}).tiers[0].capacity_bytes
        == GiB // 2
    )
