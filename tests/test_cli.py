"""The `unikv` command line: help texts, one-line errors with exit code 2, and real runs."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from unikv import kvstrategies
from unikv.cli.main import main

from .conftest import make_english


@pytest.mark.parametrize(
    "argv",
    [[], ["run"], ["eval"], ["eval", "ppl"], ["eval", "passkey"], ["calibrate"], ["tune"]],
)
def test_help_explains_every_command(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: unikv" in out and "--help" in out


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "prose.txt"
    path.write_text(make_english(40, seed=3), encoding="utf-8")
    return path


def _error(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_user_mistakes_give_one_line_and_exit_2(tmp_path, text_file, capsys):
    assert "prompt is empty" in _error(["run", "--prompt", "  "], capsys)
    assert "not found" in _error(["eval", "ppl", "--text", str(tmp_path / "nope.txt")], capsys)
    assert "directory" in _error(["eval", "ppl", "--text", str(tmp_path)], capsys)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    assert "not UTF-8" in _error(["eval", "ppl", "--text", str(binary)], capsys)
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    assert "empty" in _error(["eval", "ppl", "--text", str(empty)], capsys)
    err = _error(
        ["eval", "ppl", "--text", str(text_file), "--prefill", "300", "--tokens", "300"], capsys
    )
    assert "--prefill (300)" in err
    assert "model not found" in _error(["run", "--prompt", "hi", "--model", "/no/m.gguf"], capsys)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"junk" * 100)
    assert "not a readable GGUF" in _error(["run", "--prompt", "hi", "--model", str(junk)], capsys)
    assert "temperature" in _error(["run", "--prompt", "hi", "--temperature", "-2"], capsys)
    assert "top_p" in _error(["run", "--prompt", "hi", "--top-p", "0"], capsys)
    assert "--stream-interval-ms" in _error(["serve", "--stream-interval-ms", "-5"], capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--prompt", "hi", "--max-new-tokens", "0"],
        ["run", "--prompt", "hi", "--dtype", "int3"],
        ["run", "--prompt", "hi", "--decode-steps", "0"],
        ["run", "--prompt", "hi", "--decode-steps", "65"],
        ["serve", "--decode-steps", "eight"],
        ["eval", "ppl", "--text", "x", "--tokens", "many"],
        ["frobnicate"],
    ],
)
def test_argument_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_strategy_flags_come_from_the_option_declarations(capsys):
    from unikv import kvstrategies
    from unikv.cli.args import kv_options
    from unikv.cli.main import build_parser

    parse = build_parser().parse_args
    base = ["eval", "ppl", "--text", "x"]
    assert kv_options(parse(base)) == {}  # flags left out keep the config file's values
    argv = [*base, "--fp16-share", "0.25", "--bits", "8", "--scales", "fp8", "--sink-tokens",
            "2", "--recalibrate", "--calibration", "c.pt", "--device-window", "32",
            "--no-persist-prefix", "--prefetch-depth", "3", "--kept-ratio", "0.3", "--scorer",
            "tova", "--prune-head", "h.pt", "--recent-window", "8"]  # fmt: skip
    assert kv_options(parse(argv)) == {
        "fp16_share": 0.25, "bits": 8, "scales": "fp8", "sink_tokens": 2, "recalibrate": True,
        "calibration": "c.pt", "device_window": 32, "persist_prefix": False,
        "prefetch_depth": 3, "kept_ratio": 0.3, "scorer": "tova", "head": "h.pt",
        "recent_window": 8,
    }  # fmt: skip
    # Every declared option has its flag on run and eval; tune takes hybrid_fp16_int4's only.
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    help_text = capsys.readouterr().out
    for name in kvstrategies.available():
        assert f"{name} options" in help_text
        for o in kvstrategies.get(name).options:
            assert o.flag_name in help_text, o.name
    tune = ["tune", "--kv_optimization=hybrid_fp16_int4", "--text", "t", "--out", "o"]
    assert kv_options(parse([*tune, "--bits", "2", "--low-bits", "2"])) == {
        "bits": 2,
        "low_bits": 2,
    }
    with pytest.raises(SystemExit):
        parse([*tune, "--kept-ratio", "0.5"])


@pytest.mark.parametrize(
    "argv",
    [["--scales", "fp4"], ["--scorer", "magic"], ["--granularity", "layer"], ["--bits", "x"]],
)
def test_strategy_flag_values_of_the_wrong_form_are_argument_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["eval", "ppl", "--text", "x", *argv])
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def _cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run(
        [sys.executable, "-m", "unikv.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.slow
def test_eval_ppl_json_matches_in_process(text_file, model, tokenizer, new_kv, capsys):
    from unikv.engine.evaluate import perplexity

    proc = _cli(
        "eval",
        "ppl",
        "--text",
        str(text_file),
        "--tokens",
        "320",
        "--json",
        "--strategy",
        "full",
        "--weights",
        "float32",  # the in-process model is the float32 one
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # stdout is exactly one JSON document (`| jq .ppl` works)
    assert "ppl" in proc.stderr  # the human line went to stderr
    for key in (
        "ppl",
        "tokens",
        "kv_bytes",
        "bits_per_element",
        "seconds",
        "strategy",
        "kept_ratio",
    ):
        assert key in result
    ids = tokenizer.encode(text_file.read_text())[:320]
    ref = perplexity(model, ids, new_kv())
    assert result["tokens"] == 320 and result["kept_ratio"] == 1.0
    assert result["ppl"] == pytest.approx(ref.ppl, rel=1e-6)
    assert result["kv_bytes"] == ref.kv_bytes
    # auto on a CPU is hybrid+resident+sparse (the cpu profile's fp16+int4, the low class's
    # selection): every token kept, packed; the pruned cache's flags reach it when asked for.
    base = ["eval", "ppl", "--text", str(text_file), "--tokens", "320", "--prefill", "64"]
    assert main([*base, "--json"]) == 0
    auto = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert auto["strategy"] == "hybrid+resident+sparse" and auto["kept_ratio"] == 1.0
    assert auto["kv_bytes"] < 0.3 * result["kv_bytes"]  # about 4.4 bits, and fp16 side buffers
    base += ["--strategy", "hybrid+resident+pruned"]
    assert main([*base, "--json"]) == 0
    pruned = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert 0.45 <= pruned["kept_ratio"] <= 0.55 and pruned["kv_bytes"] < auto["kv_bytes"]
    assert main([*base, "--kept-ratio", "0.75", "--scorer", "streaming", "--json"]) == 0
    assert 0.7 <= json.loads(capsys.readouterr().out.splitlines()[-1])["kept_ratio"] <= 0.8
    assert "option kept_ratio = 1.5" in _error([*base, "--kept-ratio", "1.5"], capsys)
    assert "pruning head file not found" in _error([*base, "--prune-head", "no.pt"], capsys)


@pytest.mark.slow
def test_run_streams_and_reports(capfd):
    proc = _cli(
        "run", "--prompt", "What is the capital of France?", "--chat", "--max-new-tokens", "12"
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tokens/s" in proc.stdout and "KV memory" in proc.stdout
    assert re.search(r"then \d+\.\d tokens/s decoding\]", proc.stdout)
    # auto on a CPU: hybrid+resident+sparse, attended on the packed blocks by the C kernel
    assert "[strategy: hybrid+resident+sparse" in proc.stdout
    assert "attention kernel: C (" in proc.stdout


@pytest.mark.slow
def test_run_json_is_one_document_on_stdout():
    proc = _cli("run", "--prompt", "The capital of France is", "--max-new-tokens", "6",
                "--strategy", "full", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["completion_tokens"] == 6 and out["finish_reason"] == "length"
    assert out["text"] and out["text"] in proc.stderr  # streamed to stderr as it came
    assert out["prompt_tokens"] > 0 and out["seconds"] > 0 and out["first_token_s"] >= 0
    assert out["decode_tokens_per_s"] > 0  # 5 tokens after the first
    assert out["memory"]["kv_bytes_peak"] > 0 and out["device"] == "cpu"
    assert "tokens/s" in proc.stderr and "tokens/s" not in proc.stdout


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"unikv {version('unikv')}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_device_without_the_hardware_is_one_line(text_file, capsys):
    assert "no CUDA device" in _error(["run", "--prompt", "hi", "--device", "cuda"], capsys)
    err = _error(["eval", "ppl", "--text", str(text_file), "--device", "cuda:1"], capsys)
    assert "--device cuda:1: no CUDA device" in err
    assert "not a torch device" in _error(["run", "--prompt", "hi", "--device", "gpu!"], capsys)
    assert "cpu and cuda" in _error(["eval", "passkey", "--device", "meta"], capsys)


def test_chip_flag_on_run_and_eval(text_file, capsys):
    err = _error(["run", "--prompt", "hi", "--chip", "nope"], capsys)
    assert "nope" in err and "kunpeng920" in err  # names the shipped profiles
    err = _error(["eval", "ppl", "--text", str(text_file), "--chip", "nope"], capsys)
    assert "kunpeng920" in err


def test_a_failing_disk_is_an_io_error_not_a_user_mistake(tmp_path, capsys, monkeypatch):
    import errno

    from unikv.storage.lmdb_store import LmdbBlockStore

    cfg = tmp_path / "pool.toml"
    store_dir = tmp_path / "kv"
    cfg.write_text(
        f'[tiers.device]\ncapacity = "8MiB"\n[tiers.ssd]\ncapacity = "8MiB"\npath = "{store_dir}"\n'
    )

    def fail(self):
        raise OSError(errno.EIO, "Input/output error", str(store_dir / "data.mdb"))

    monkeypatch.setattr(LmdbBlockStore, "verify", fail)
    code = main(["cache", "verify", "--config", str(cfg), "--json"])
    captured = capsys.readouterr()
    assert code == 74 and captured.out == ""
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("unikv: I/O error (EIO)") and str(store_dir / "data.mdb") in err


@pytest.mark.parametrize(
    ("chip", "cls"),
    [("ascend910b", "high"), ("hygon_dcu", "medium"), ("kunpeng920", "low"), ("cpu", "low")],
)
def test_profile_json(chip, cls, capsys):
    assert main(["profile", "--chip", chip, "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout is exactly one JSON document
    assert report["chip"] == chip and report["class"] == cls
    assert report["bandwidth_gbps"] > 0 and report["tiers"][0]["name"] == "device"
    axes = {"high": ("resident", "all"), "medium": ("tiered", "all"), "low": ("resident", "sparse")}
    assert tuple(report["axes"].values())[1:] == axes[cls]  # composed by the profile
    assert report["sparse"].startswith("selected" if cls == "low" else "opt-in for this class")
    assert kvstrategies.get(report["strategy"]).axes == tuple(report["axes"].values())
    assert set(report["parameters"]) >= {"kv_precision", "l2_prefetch_depth", "batch_size"}
    # The readable table goes to stderr, with the attention kernel's state.
    assert any(line.startswith("chip") for line in captured.err.splitlines())
    assert report["attention_kernel"].startswith(("C (", "PyTorch fallback ("))
    assert any(
        ln.startswith("attention kernel") and ln.endswith(report["attention_kernel"])
        for ln in captured.err.splitlines()
    )


def test_profile_and_strategy_errors_exit_2(tmp_path, capsys):
    assert "kunpeng920" in _error(["profile", "--chip", "nope"], capsys)
    assert "unknown strategy 'nope'" in _error(
        ["run", "--prompt", "hi", "--strategy", "nope"], capsys
    )
    bad = tmp_path / "bad.toml"
    bad.write_text("block_size = 16\nfrobnicate = 1\n")
    err = _error(["eval", "ppl", "--text", str(bad), "--config", str(bad)], capsys)
    assert str(bad) in err and "frobnicate" in err
    assert "not found" in _error(
        ["run", "--prompt", "hi", "--config", str(tmp_path / "no.toml")], capsys
    )


def test_cache_stats_verify_clear(tmp_path, capsys):
    from unikv.storage import create_store

    store_dir = tmp_path / "kv"
    cfg = tmp_path / "pool.toml"
    cfg.write_text(
        f'[tiers.device]\ncapacity = "8MiB"\n[tiers.ssd]\ncapacity = "8MiB"\npath = "{store_dir}"\n'
    )
    with create_store("lmdb", path=store_dir) as store:
        store.put_many([(b"a" * 8, b"x" * 5000), (b"b" * 8, b"y" * 5000)])
    assert main(["cache", "stats", "--config", str(cfg), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["entries"] == 2
    assert main(["cache", "verify", "--config", str(cfg), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["checked"] == 2 and report["corrupted"] == []
    from .test_storage import _lmdb_corrupt

    _lmdb_corrupt({"path": store_dir}, b"b" * 8)
    assert main(["cache", "verify", "--config", str(cfg)]) == 1  # corrupt: non-zero exit
    assert f"corrupt: {(b'b' * 8).hex()}" in capsys.readouterr().out
    assert "--repair goes with 'cache verify'" in _error(
        ["cache", "clear", "--config", str(cfg), "--repair"], capsys
    )
    assert main(["cache", "verify", "--config", str(cfg), "--repair", "--json"]) == 0
    captured = capsys.readouterr()
    repaired = json.loads(captured.out)  # the whole of stdout
    assert repaired["corrupted"] == [(b"b" * 8).hex()] and repaired["deleted"] == 1
    assert "deleted 1 corrupt blocks" in captured.err
    assert main(["cache", "verify", "--config", str(cfg), "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert after["checked"] == 1 and after["corrupted"] == []
    with create_store("lmdb", path=store_dir) as store:
        store.put(b"b" * 8, b"y" * 5000)
    assert main(["cache", "clear", "--config", str(cfg)]) == 0
    assert "removed 2 blocks" in capsys.readouterr().out
    with create_store("lmdb", path=store_dir) as store:
        assert len(store) == 0


def test_cache_needs_an_ssd_tier(tmp_path, capsys):
    cfg = tmp_path / "pool.toml"
    cfg.write_text('[tiers.device]\ncapacity = "8MiB"\n')
    assert "no [tiers.ssd]" in _error(["cache", "stats", "--config", str(cfg)], capsys)


def test_hybrid_option_errors_exit_2_before_the_model_loads(text_file, tmp_path, capsys):
    base = ["eval", "ppl", "--text", str(text_file), "--strategy", "hybrid_fp16_int4"]
    assert "option fp16_share = 2.0" in _error([*base, "--fp16-share", "2"], capsys)
    assert "option bits = 3; allowed: 2, 4, 8" in _error([*base, "--bits", "3"], capsys)
    assert "not found" in _error(["calibrate", "--text", str(tmp_path / "nope.txt")], capsys)


def test_calibrate_then_eval_with_the_hybrid_strategy(text_file, tmp_path, capsys):
    out = tmp_path / "cal.pt"
    argv = ["calibrate", "--text", str(text_file), "--samples", "2", "--window", "64"]
    assert main([*argv, "--out", str(out), "--json"]) == 0
    made = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert made["path"] == str(out) and out.exists() and made["samples"] == 2
    ppl = ["eval", "ppl", "--text", str(text_file), "--tokens", "320", "--prefill", "64"]
    hybrid = ["--strategy", "hybrid_fp16_int4", "--calibration", str(out), "--json"]
    assert main([*ppl, *hybrid]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["strategy"] == "hybrid_fp16_int4" and result["bits_per_element"] < 5
    # A calibration file made for another model is refused, naming what it was made for.
    stats = torch.load(out, weights_only=True)
    stats["identity"] = "some-other-model"
    torch.save(stats, out)
    assert main([*ppl, *hybrid]) == 2  # found once the model is loaded: after its progress bar
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("unikv: error: calibration file") and "'some-other-model'" in last


def test_offload_flags_errors_and_a_lossless_eval(text_file, tmp_path, capsys):
    cfg = tmp_path / "offload.toml"
    cfg.write_text(
        'strategy = "hierarchical_offload"\n[tiers.device]\ncapacity = "256MiB"\n'
        '[tiers.host]\ncapacity = "256MiB"\n'
        f'[tiers.ssd]\ncapacity = "1GiB"\npath = "{tmp_path / "store"}"\n'
    )
    base = ["eval", "ppl", "--text", str(text_file), "--config", str(cfg)]
    assert "device_window = 0; expected >= 1" in _error([*base, "--device-window", "0"], capsys)
    # at the default (native) weights: the kernels are a function of the machine and the
    # config (the breaker switches only on a failure), so a lossless cache equals full exactly
    ppl = [*base, "--tokens", "320", "--prefill", "64", "--json"]
    assert main([*ppl, "--strategy", "full"]) == 0
    full = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert main(ppl) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["ppl"] == full["ppl"]
    assert main([*ppl, "--device-window", "64", "--host-window", "64"]) == 0
    off = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert off["strategy"] == "hierarchical_offload"
    # Tiered, attention runs over each tier's pieces, merged by their log-sum-exp: the float
    # sums split at other tokens than full's (2e-5 here at native weights, where a last-bit
    # change can move an activation's int8 code; 4e-7 at float32)
    assert off["ppl"] == pytest.approx(full["ppl"], rel=1e-4)
    code = main(["cache", "verify", "--config", str(cfg)])
    assert code == 0, capsys.readouterr().err


def test_eval_passkey_json(capsys):
    assert "at least 128 tokens" in _error(["eval", "passkey", "--length", "50"], capsys)
    argv = ["eval", "passkey", "--length", "512", "--samples", "3", "--strategy", "full"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    # The full cache finds the key at every depth (the design: 1.00 at 512 tokens).
    assert out["accuracy"] == 1.0 and out["samples"] == 3 and out["strategy"] == "full"
    assert 480 <= out["length"] <= 512 and set(out["by_depth"]) == {"10%", "50%", "90%"}


def test_enforce_eager_turns_cuda_graphs_off_and_a_bad_switch_is_one_line(monkeypatch, capsys):
    """--enforce-eager (vLLM's flag) sets UNIKV_CUDA_GRAPHS=0 for the process before a model is
    built; a bad UNIKV_CUDA_GRAPHS is refused in one line, exit 2, before anything loads."""
    import argparse

    from unikv.cli.args import apply_enforce_eager
    from unikv.engine import graphs

    monkeypatch.setenv(graphs.OFF_ENV, "1")  # (recorded: put back as it was after the test)
    monkeypatch.delenv(graphs.OFF_ENV)
    apply_enforce_eager(argparse.Namespace(enforce_eager=False))
    assert graphs.OFF_ENV not in os.environ and graphs.enabled()
    apply_enforce_eager(argparse.Namespace(enforce_eager=True))
    assert os.environ[graphs.OFF_ENV] == "0" and not graphs.enabled()
    for cmd in (["run"], ["serve"], ["eval", "ppl"], ["eval", "passkey"]):
        with pytest.raises(SystemExit):
            main([*cmd, "--help"])
        assert "--enforce-eager" in capsys.readouterr().out
    monkeypatch.setenv(graphs.OFF_ENV, "off")
    err = _error(["run", "--prompt", "hi"], capsys)
    assert err == ("unikv: error: UNIKV_CUDA_GRAPHS='off': expected 0 (CUDA steps run eagerly) "
                   "or 1 (through CUDA graphs where they can, the default)")  # fmt: skip
