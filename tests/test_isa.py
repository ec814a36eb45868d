"""The suite's kernel and model numerics under the AVX2 machine's settings, on any machine that
has AVX2: the C kernels built with AVX-512 hidden (`UNIKV_ISA=avx2`) and PyTorch's own
dispatch held to AVX2 (`ATEN_CPU_CAPABILITY=avx2`, read once at torch's import: hence a
subprocess). An AVX-512 machine's CI thereby also proves the AVX2 one; the in-process tests
already run each C kernel under every instruction set this CPU has (the `isa` fixture).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import cpu_isas

ROOT = Path(__file__).resolve().parent.parent


def test_pytorch_dispatch_follows_the_environment():
    """In the AVX2 subprocess below, torch runs its AVX2 kernels (and elsewhere its best)."""
    want = os.environ.get("ATEN_CPU_CAPABILITY")
    if want is None:
        pytest.skip("runs inside the AVX2 subprocess (ATEN_CPU_CAPABILITY set)")
    assert torch.backends.cpu.get_cpu_capability() == want.upper()


@pytest.mark.slow
@pytest.mark.skipif(
    "avx2" not in cpu_isas() or os.environ.get("UNIKV_ISA") is not None,
    reason="needs a CPU with AVX2, and a run not already held to one instruction set",
)
@pytest.mark.skipif(
    "avx512" not in cpu_isas(),
    reason="this CPU's best is AVX2: the whole suite ran those paths already (C and PyTorch)",
)
def test_the_model_holds_its_tolerance_on_the_avx2_paths(tmp_path):
    """The packaged model at native weights within 0.1% PPL of float32, its decode through
    both C kernels, the lossless cache equal to full, and every kernel's contract, with AVX-512
    hidden from the C kernels and from PyTorch."""
    env = {**os.environ, "UNIKV_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2"}
    env["UNIKV_KERNEL_DIR"] = os.environ.get("UNIKV_KERNEL_DIR", str(tmp_path / "kernels"))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "tests/test_isa.py::test_pytorch_dispatch_follows_the_environment",
         "tests/test_linear.py", "tests/test_operators.py",
         "tests/test_cli.py::test_offload_flags_errors_and_a_lossless_eval",
         "tests/test_cli.py::test_run_streams_and_reports"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "failed" not in proc.stdout.splitlines()[-1], tail
