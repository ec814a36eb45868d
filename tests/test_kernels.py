"""The C kernel's build is never silent: each way it can fail shows as a PyTorch fallback with
its reason, in `kernels.status()` (what `unikv profile` prints) and in the memory report."""

import logging
import os

import pytest

from unikv.cli.main import _kernel_status, _memory_lines
from unikv.engine.report import MemoryReport
from unikv.kernels import native as kernels
from unikv.kvstrategies.kv import KVReport


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No kernel built in this process yet, and an empty cache directory."""
    monkeypatch.setattr(kernels, "_libs", {})
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.setattr(kernels, "KERNEL_ERROR", None)
    monkeypatch.setenv("UNIKV_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv("UNIKV_NO_KERNEL", raising=False)
    return tmp_path


def _fallback(caplog) -> str:
    with caplog.at_level(logging.WARNING, logger="unikv.kernels.native"):
        status = kernels.status(probe=True)
    assert status.startswith("PyTorch fallback (")
    assert f"attention kernel: {status}" in caplog.text  # logged, not silent
    return status


def test_no_compiler(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh / "no-such-cc"))
    assert "C compiler" in _fallback(caplog) and "cannot run" in kernels.KERNEL_ERROR


def test_unwritable_cache_directory(fresh, monkeypatch, caplog):
    blocker = fresh / "file"
    blocker.write_text("a file where the directory should be")
    monkeypatch.setenv("UNIKV_KERNEL_DIR", str(blocker / "kernels"))
    status = _fallback(caplog)
    assert "kernel cache directory" in status and "UNIKV_KERNEL_DIR" in status


def test_failed_build(fresh, monkeypatch, caplog):
    cc = fresh / "cc"
    cc.write_text("#!/bin/sh\necho 'error: something broke' >&2\nexit 1\n")
    os.chmod(cc, 0o755)
    monkeypatch.setenv("CC", str(cc))
    status = _fallback(caplog)
    assert "failed to build hybrid_attend.c" in status and "something broke" in status


def test_disabled_and_warned_once(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger="unikv.kernels.native"):
        for t in (16, 32):  # two shapes, one reason: one warning
            kernels.hybrid_kernel({**kernels.PROBE_SHAPE, "T": t})
    assert caplog.text.count("attention kernel: PyTorch fallback") == 1
    monkeypatch.setattr(kernels, "_libs", {})
    monkeypatch.setenv("UNIKV_NO_KERNEL", "1")
    assert kernels.status(probe=True) == "PyTorch fallback (disabled by UNIKV_NO_KERNEL=1)"


def test_the_memory_report_names_the_attention_path():
    def report(**fmt) -> MemoryReport:
        return MemoryReport(KVReport("hybrid_fp16_int4", 0, 0, format=fmt))

    assert _kernel_status(report(kernel="torch (no C compiler (cc/gcc) on PATH)")) == (
        "PyTorch fallback (no C compiler (cc/gcc) on PATH)"
    )
    assert _kernel_status(report()) == "PyTorch (this strategy has no C kernel)"
    assert "[attention kernel: PyTorch fallback (x)]" in _memory_lines(report(kernel="torch (x)"))


def _isas_here() -> list[str]:
    flags = set(kernels.cpu_flags().split())
    if not kernels._x86():
        return ["native", "portable"]
    return [i for i in ("avx512", "avx2", "portable") if flags >= set(kernels.ISA_NEEDS[i])]


@pytest.mark.skipif(kernels._compiler() is None, reason="no C compiler here")
@pytest.mark.parametrize("source", sorted(p.name for p in kernels.SOURCE.parent.glob("*.c")))
def test_every_shipped_kernel_builds_for_every_instruction_set_this_cpu_runs(source, monkeypatch):
    """A kernel that fails to build falls back to PyTorch, and its tests skip: without this
    check a broken C file would leave the suite green. Each source, built as the engine builds
    it (the attention kernel at the probe shape), for each ISA this CPU can run."""
    path = kernels.SOURCE.parent / source
    defines = [f"-DK{k}={v}" for k, v in sorted(kernels.PROBE_SHAPE.items())]
    for isa in _isas_here():
        monkeypatch.setenv("UNIKV_ISA", isa)
        lib = kernels.build(path, defines if path == kernels.SOURCE else ())
        assert lib.exists(), (source, isa)
