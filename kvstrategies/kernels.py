"""Build and load the small C kernel `hybrid_attend.c` on first use.

Compiled with the system C compiler (`cc -O3 -march=native -fopenmp`) into a cache directory
(`$UNIKV_KERNEL_DIR`, default `~/.cache/unikv/kernels`), keyed by a hash of the source, the
flags and the CPU, and loaded with `ctypes`. It links the same `libgomp.so.1` that torch has
already loaded, so its OpenMP threads are torch's: no second thread pool spinning on the cores.

The kernel is compiled once per record shape (block size, head dim, channel classes, widths,
whether the cache is latent and its value width: `-DKT=64 -DKD=64 ...`), so that its loops have
constant trip counts. `hybrid_kernel(shape)`
returns None (and the strategy uses its PyTorch path) when there is no
compiler, the build fails, or `UNIKV_NO_KERNEL=1` is set; the reason is kept in `KERNEL_ERROR`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("hybrid_attend.c")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
KERNEL_ERROR: str | None = None
_libs: dict[tuple, ctypes.CDLL | None] = {}


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build(defines: list[str]) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    src = SOURCE.read_bytes()
    flags = [*FLAGS, *defines]
    key = hashlib.blake2b(src + " ".join(flags).encode() + _cpu_key().encode(), digest_size=8)
    root = Path(os.environ.get("UNIKV_KERNEL_DIR", Path.home() / ".cache" / "unikv" / "kernels"))
    lib = root / f"hybrid_attend-{key.hexdigest()}.so"
    if lib.exists():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True
        )
        if proc.returncode:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, lib)  # atomic: concurrent builders never load a half-written file
    finally:
        Path(tmp).unlink(missing_ok=True)
    return lib


def hybrid_kernel(shape: dict[str, int]) -> ctypes.CDLL | None:
    """The kernel compiled for `shape` (keys T, D, NF, NM, NL, VF, VM, VL, B, LB, G, SF, LAT,
    DV), or None when it is unavailable (see `KERNEL_ERROR`)."""
    global KERNEL_ERROR
    key = tuple(sorted(shape.items()))
    if key in _libs:
        return _libs[key]
    _libs[key] = None
    if os.environ.get("UNIKV_NO_KERNEL") == "1":
        KERNEL_ERROR = "disabled by UNIKV_NO_KERNEL=1"
        return None
    if shape["T"] % 16 or shape["D"] % 16:
        KERNEL_ERROR = f"block size {shape['T']} or head dim {shape['D']} not a multiple of 16"
        return None
    try:
        lib = ctypes.CDLL(str(_build([f"-DK{k}={v}" for k, v in key])))
    except (OSError, RuntimeError) as e:
        KERNEL_ERROR = str(e)
        return None
    fn = lib.hybrid_attend
    i, lng, p, f = ctypes.c_int, ctypes.c_long, ctypes.c_void_p, ctypes.c_float
    fn.argtypes = [p, p, i, i, lng, p, i, i, i, p, p, p, f, p, p, i, lng, p, p, lng, i, p, p, p]
    fn.restype = None
    _libs[key] = lib
    return lib


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data address for ctypes (None for None)."""
    return None if t is None else t.data_ptr()
