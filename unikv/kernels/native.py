"""Build and load the small C kernels on first use: `hybrid_attend.c` here, and the engine's own
(`unikv/kernels/gemv.c`, through `build`).

Compiled with the system C compiler (`cc -O3 -fopenmp` and the flags of the instruction set
`isa()` chooses) into a cache directory (`$UNIKV_KERNEL_DIR`, default `~/.cache/unikv/kernels`),
keyed by a hash of the source, the flags and the CPU, and loaded with `ctypes`.

The instruction set: the best this CPU runs (`avx512` where /proc/cpuinfo lists avx512f and
avx512bw, else `avx2` with fma and f16c, else `portable`; on a CPU other than x86-64, `native`:
`-mcpu=native`, which targets NEON on aarch64), or the one `$UNIKV_ISA` names. `UNIKV_ISA=avx2`
on an AVX-512 machine builds with `-march=native -mno-avx512f` (every AVX-512 extension
hidden from the compiler), so an AVX-512 machine's tests also prove the AVX2 paths; with
`ATEN_CPU_CAPABILITY=avx2` PyTorch's own kernels follow (docs/kernels.md).

It links the same `libgomp.so.1` that torch has already loaded, so its OpenMP threads are
torch's: no second thread pool spinning on the cores.

The kernel is compiled once per record shape (block size, head dim, channel classes, widths,
whether the cache is latent and its value width: `-DKT=64 -DKD=64 ...`), so that its loops have
constant trip counts. `hybrid_kernel(shape)`
returns None (and the strategy uses its PyTorch path) when there is no
compiler, the cache directory cannot be written, the build fails, or `UNIKV_NO_KERNEL=1` is
set; the reason is kept in `KERNEL_ERROR`, logged once, and shown by `status()` (what
`unikv profile` and the memory report print: "attention kernel: PyTorch fallback (reason)").

Not built at install time: every record shape is its own build (the shapes come from the model
and the strategy options, known only at run time), and `-march=native` must target the CPU the
engine runs on, not the one a wheel was built on. A build is a second or two, once per shape
and machine, and then cached.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import torch

from unikv.settings import config

SOURCE = Path(resources.files(__package__) / "hybrid_attend.c")
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
ISAS = ("avx512", "avx2", "portable", "native")
# What each x86-64 instruction set needs in /proc/cpuinfo, and its compiler flags.
ISA_NEEDS = {"avx512": ("avx512f", "avx512bw"), "avx2": ("avx2", "fma", "f16c"), "portable": ()}
ISA_FLAGS = {
    "avx512": ("-march=native",),
    "avx2": ("-march=native", "-mno-avx512f"),  # AVX-512 hidden: the AVX2 paths
    "portable": ("-march=x86-64", "-mtune=native"),  # baseline SSE2: the plain C paths
    "native": ("-mcpu=native",),  # aarch64 (NEON) and other targets: what gcc finds
}
KERNEL_ERROR: str | None = None
_libs: dict[tuple, ctypes.CDLL | None] = {}
_warned: set[str] = set()
log = logging.getLogger(__name__)
# A small shape `status(probe=True)` builds to see whether this machine can build the kernel
# at all (compiler, OpenMP, a writable cache directory); the engine builds its own shapes.
PROBE_SHAPE = {"T": 16, "D": 64, "NF": 8, "NM": 48, "NL": 8, "VF": 8, "VM": 48, "VL": 8,
               "B": 4, "LB": 2, "G": 3, "SF": 0, "LAT": 0, "DV": 64}  # fmt: skip


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them ("" where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def isa() -> str:
    """The instruction set the kernels are built for: `$UNIKV_ISA` if set, else the best this
    CPU runs. Raises RuntimeError (a kernel's reason to be unavailable) for an unknown name or
    one this CPU cannot run."""
    want = os.environ.get("UNIKV_ISA", "").strip().lower()
    flags = set(cpu_flags().split())
    if not _x86():
        if want not in ("", "native", "portable"):
            raise RuntimeError(f"UNIKV_ISA={want} is an x86-64 instruction set; this CPU is "
                               f"{platform.machine()} (use native or portable)")  # fmt: skip
        return "native"
    if not want:
        return next(i for i in ("avx512", "avx2", "portable") if flags >= set(ISA_NEEDS[i]))
    if want not in ISA_NEEDS:
        raise RuntimeError(f"UNIKV_ISA={want} is unknown; choose one of: avx512, avx2, portable")
    missing = [f for f in ISA_NEEDS[want] if f not in flags]
    if missing:
        raise RuntimeError(f"UNIKV_ISA={want}, but this CPU has no {' / '.join(missing)}")
    return want


def isa_flags() -> tuple[str, ...]:
    """The compiler flags of `isa()`."""
    return ISA_FLAGS[isa()]


def _cpu_key() -> str:
    return platform.machine() + cpu_flags()


def cache_dir() -> Path:
    """Where built kernels are kept: `$UNIKV_KERNEL_DIR`, else `kernels` in unikv's cache
    root (`settings.config.cache_dir`: $UNIKV_CACHE_DIR, $XDG_CACHE_HOME/unikv, ~/.cache/unikv)."""
    if os.environ.get("UNIKV_KERNEL_DIR"):
        return Path(os.environ["UNIKV_KERNEL_DIR"])
    return config.cache_dir() / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(source: Path, defines: Sequence[str] = ()) -> Path:
    """The shared library of the C file `source` compiled with `FLAGS`, the flags of `isa()`
    and `defines`: found in `cache_dir()` (keyed by the source, the flags and the CPU) or built
    there now. Raises RuntimeError saying why it cannot be built (no compiler, an unwritable
    directory, an instruction set this CPU lacks, the compiler's error)."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH; set CC or install gcc")
    src = source.read_bytes()
    flags = [*FLAGS, *isa_flags(), *defines]
    key = hashlib.blake2b(src + " ".join(flags).encode() + _cpu_key().encode(), digest_size=8)
    root = cache_dir()
    lib = root / f"{source.stem}-{key.hexdigest()}.so"
    if lib.exists():
        return lib
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, suffix=".so")
    except OSError as e:
        raise RuntimeError(
            f"kernel cache directory {root} is not writable ({e.strerror}); set "
            "UNIKV_KERNEL_DIR to a writable directory"
        ) from None
    os.close(fd)
    try:
        try:
            proc = subprocess.run(
                [cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True
            )
        except OSError as e:  # $CC names no program, or one that cannot run
            raise RuntimeError(f"C compiler {cc} cannot run ({e.strerror})") from None
        if proc.returncode:
            raise RuntimeError(f"{cc} failed to build {source.name}: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, lib)  # atomic: concurrent builders never load a half-written file
    finally:
        Path(tmp).unlink(missing_ok=True)
    return lib


def open_library(
    source: Path, state: dict, label: str, defines: Sequence[str] = ()
) -> ctypes.CDLL | None:
    """The C file `source` built (`build`, with `defines`) and loaded, or None with the reason
    kept in `state["error"]` (`UNIKV_NO_KERNEL=1`, no compiler, a failed build; logged once as
    "`label`: PyTorch fallback (reason)"). The caller declares the library's functions and
    keeps it in `state["lib"]`."""
    if os.environ.get("UNIKV_NO_KERNEL") == "1":
        state["error"] = "disabled by UNIKV_NO_KERNEL=1"
        return None
    try:
        return ctypes.CDLL(str(build(source, defines)))
    except (OSError, RuntimeError) as e:
        state["error"] = str(e)
        log.warning("%s: PyTorch fallback (%s)", label, e)
        return None


def hybrid_kernel(shape: dict[str, int]) -> ctypes.CDLL | None:
    """The kernel compiled for `shape` (keys T, D, NF, NM, NL, VF, VM, VL, B, LB, G, SF, LAT,
    DV), or None when it is unavailable (see `KERNEL_ERROR`)."""
    global KERNEL_ERROR
    defines = [f"-DK{k}={v}" for k, v in sorted(shape.items())]
    key = (os.environ.get("UNIKV_ISA", ""), *defines)  # a build per shape and instruction set
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
        lib = ctypes.CDLL(str(build(SOURCE, defines)))
    except (OSError, RuntimeError) as e:
        KERNEL_ERROR = str(e)
        if KERNEL_ERROR not in _warned:  # once per reason, not once per strategy built
            _warned.add(KERNEL_ERROR)
            log.warning("attention kernel: PyTorch fallback (%s)", KERNEL_ERROR)
        return None
    fn = lib.hybrid_attend
    i, lng, p, f = ctypes.c_int, ctypes.c_long, ctypes.c_void_p, ctypes.c_float
    i64 = ctypes.c_int64
    fn.argtypes = [p, p, lng, i64, i, i, lng, p, i, i, i, p, p, p, f, p, p, i, lng, p, p, lng, i,
                   p, p, p]  # fmt: skip
    fn.restype = None
    if lib.hybrid_step_size() != ctypes.sizeof(HybridStep):
        KERNEL_ERROR = "hybrid_step_t and HybridStep disagree"
        return None
    _libs[key] = lib
    return lib


class HybridStep(ctypes.Structure):
    """hybrid_attend.c's hybrid_step_t: a packed format's decode step for gemv.c's one-call
    step, whose every layer calls `hybrid_layer` on it (`PackedFormat.native_step`)."""

    _fields_ = [("arena", ctypes.c_void_p), ("arena_layer", ctypes.c_int64),
                ("rec", ctypes.c_long), ("off", ctypes.c_void_p), ("H", ctypes.c_int),
                ("G", ctypes.c_int), ("nseq", ctypes.c_int), ("scale", ctypes.c_float),
                ("korder", ctypes.c_void_p), ("vorder", ctypes.c_void_p),
                ("rows", ctypes.c_void_p), ("blocks", ctypes.c_void_p), ("nb", ctypes.c_void_p),
                ("mask0", ctypes.c_void_p), ("dense", ctypes.c_void_p), ("span", ctypes.c_int64),
                ("lo", ctypes.c_void_p), ("na", ctypes.c_void_p), ("tail", ctypes.c_void_p),
                ("sink", ctypes.c_void_p), ("keys", ctypes.c_void_p),
                ("values", ctypes.c_void_p)]  # fmt: skip


def int64s(values, keep: list) -> int:
    """The address of a new C int64 array of `values` (appended to `keep`, which holds it)."""
    keep.append((ctypes.c_int64 * max(len(values), 1))(*values))
    return ctypes.addressof(keep[-1])


def address(lib: ctypes.CDLL, name: str) -> int:
    """The address of C function `name` in `lib` (for a native step to call)."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value  # type: ignore[return-value]


def status(probe: bool = False) -> str:
    """ "C (...)" or "PyTorch fallback (reason)": whether the C kernel is in use, for reports.

    Without `probe`, what the builds of this process found (None of them yet: "not built yet").
    With it, a small kernel (`PROBE_SHAPE`) is built (or found in the cache) to find out.
    """
    if probe and not any(lib is not None for lib in _libs.values()):
        hybrid_kernel(PROBE_SHAPE)
    if any(lib is not None for lib in _libs.values()):
        return f"C ({SOURCE.name}, {isa()}, cached in {cache_dir()})"
    if KERNEL_ERROR is not None:
        return f"PyTorch fallback ({KERNEL_ERROR})"
    return "not built yet (built on first use by hybrid_fp16_int4 on a CPU)"


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data address for ctypes (None for None)."""
    return None if t is None else t.data_ptr()
