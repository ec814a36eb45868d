"""A normal install works (issue 33): the wheel, installed without `-e` into a fresh virtual
environment, carries everything the code reads at run time (chip profiles, C sources, the
shipped calibration and pruning head, the dashboard), imports as `unikv.*`, and the `unikv`
command profiles, generates and serves from a directory that is not the repository.

The fresh environment borrows the project environment's third-party packages through a path
file (torch is 1 GB; installing it twice would cost minutes and test pip, not unikv); unikv
itself comes only from the wheel: the editable install's finder is not loaded there, and the
test checks where every unikv module was imported from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.test_serve import free_port, wait_serving

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(900)

# What the code opens at run time, as paths inside the wheel.
PACKAGE_DATA = (
    "unikv/settings/chips/cpu.toml",
    "unikv/settings/chips/kunpeng920.toml",
    "unikv/kernels/gemv.c",
    "unikv/kernels/hybrid_attend.c",
    "unikv/kernels/sparse.c",
    "unikv/kvstrategies/data/prune_head.pt",
    "unikv/kvstrategies/data/warmup.txt",
    "unikv/serving/dashboard.html",
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """Build the wheel, install it (no -e, no dependencies) into a fresh venv."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
        check=True, timeout=600, cwd=tmp,
    )  # fmt: skip
    (whl,) = dist.glob("unikv-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
         str(whl)],
        check=True, timeout=300, cwd=tmp,
    )  # fmt: skip
    site = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    # Third-party packages from the project's environment; a plain path line, so the .pth files
    # there (the editable install's finder among them) are not run.
    (site / "zz_project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="2", PATH=f"{env_dir / 'bin'}:{env['PATH']}")
    return {"whl": whl, "py": py, "bin": env_dir / "bin", "site": site, "cwd": work, "env": env}


def _run(installed: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args), cwd=installed["cwd"], env=installed["env"], capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_the_wheel_carries_the_run_time_files_and_only_the_package(installed):
    names = set(zipfile.ZipFile(installed["whl"]).namelist())
    missing = [p for p in PACKAGE_DATA if p not in names]
    assert not missing, missing
    assert any(n.endswith(".pt") and "/data/llama-" in n for n in names)  # shipped calibration
    assert any(n.endswith("licenses/LICENSE") for n in names)
    tops = {n.split("/")[0] for n in names}
    assert tops == {"unikv", installed["whl"].name.split("-py3")[0] + ".dist-info"}, tops


def test_every_unikv_module_comes_from_the_install_not_the_repository(installed):
    code = (
        "import json, sys, unikv.serving.app, unikv.engine.engine, unikv.storage.registry\n"
        "print(json.dumps({n: getattr(m, '__file__', '') for n, m in sys.modules.items()\n"
        "                  if n.split('.')[0] in ('unikv', 'memory', 'engine', 'storage',\n"
        "                                         'kvstrategies', 'serving', 'kernels', 'cli',\n"
        "                                         'settings')}))"
    )
    proc = _run(installed, str(installed["py"]), "-c", code)
    assert proc.returncode == 0, proc.stderr
    files = json.loads(proc.stdout)
    assert "unikv.memory.pool" in files
    assert all(n.startswith("unikv") for n in files), sorted(files)  # no bare `memory` etc.
    outside = {n: f for n, f in files.items() if not f.startswith(str(installed["site"]))}
    assert not outside, outside


def test_unikv_profile_from_another_directory(installed):
    proc = _run(installed, str(installed["bin"] / "unikv"), "profile", "--chip", "kunpeng920")
    assert proc.returncode == 0, proc.stderr
    assert "Kunpeng" in proc.stdout


def test_unikv_run_from_another_directory_streams_the_answer_on_stdout(installed):
    proc = _run(
        installed, str(installed["bin"] / "unikv"), "run", "--prompt", "The capital of France is",
        "--max-new-tokens", "6", "--temperature", "0", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["completion_tokens"] == 6
    assert "Paris" in report["text"]


def test_unikv_serve_from_another_directory_answers_a_completion(installed):
    port = free_port()
    proc = subprocess.Popen(
        [str(installed["bin"] / "unikv"), "serve", "--port", str(port), "--strategy", "full"],
        cwd=installed["cwd"], env=installed["env"], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, url, proc.stdout.read, path="/ready")
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["choices"][0]["text"]
        assert httpx.get(url + "/dashboard", timeout=10).status_code == 200  # package data
    finally:
        proc.terminate()
        proc.wait(60)
