"""llama.cpp, the peer users would pick instead: find it, or build it from the
`llama-cpp-python` source package on PyPI, and convert the packaged GGUF for it.

    python benchmarks/llamacpp.py            # build (or find) and print the binaries' paths

Where it looks, in order: `$LLAMA_CPP_DIR` (a directory holding `llama-server` etc.), then the
build cache `~/.cache/unikv/llama.cpp/<version>/bin`. Otherwise it downloads the source
package (`pip download --no-binary :all: --no-deps llama-cpp-python`), configures
`vendor/llama.cpp` with cmake (CPU only, native instructions, no CURL) and builds the targets
`llama-server llama-quantize llama-bench llama-perplexity` (about 15 minutes on 2 cores).
Benchmarks call `find_or_build()`; tests never need llama.cpp.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

TARGETS = ("llama-server", "llama-quantize", "llama-bench", "llama-perplexity")
CACHE = Path(os.environ.get("UNIKV_CACHE_DIR", Path.home() / ".cache" / "unikv")) / "llama.cpp"


def _have(bin_dir: Path) -> bool:
    return all((bin_dir / t).is_file() for t in TARGETS)


def find_or_build(progress: bool = True) -> Path:
    """The directory holding llama.cpp's binaries (built here if none is found)."""
    given = os.environ.get("LLAMA_CPP_DIR")
    if given:
        if not _have(Path(given)):
            raise SystemExit(f"LLAMA_CPP_DIR={given} lacks one of {', '.join(TARGETS)}")
        return Path(given)
    for d in sorted(CACHE.glob("*/bin"), reverse=True):
        if _have(d):
            return d
    return _build(progress)


def _build(progress: bool) -> Path:
    if not shutil.which("cmake"):
        raise SystemExit("building llama.cpp needs cmake (apt-get install cmake)")
    work = Path(tempfile.mkdtemp(prefix="llamacpp-"))
    out = sys.stderr if progress else subprocess.DEVNULL
    print("llama.cpp: downloading the llama-cpp-python source package ...", file=sys.stderr)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-binary",
            ":all:",
            "--no-deps",
            "llama-cpp-python",
            "-d",
            str(work),
        ],
        check=True,
        stdout=out,
        stderr=out,
    )
    sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
    version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    src = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    build = work / "build"
    print(f"llama.cpp: building {version} (about 15 minutes on 2 cores) ...", file=sys.stderr)
    subprocess.run(
        [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_TOOLS=ON",
            "-DLLAMA_BUILD_SERVER=ON",
        ],
        check=True,
        stdout=out,
        stderr=out,
    )
    jobs = str(os.cpu_count() or 2)
    subprocess.run(
        ["cmake", "--build", str(build), "-j", jobs, "--target", *TARGETS],
        check=True,
        stdout=out,
        stderr=out,
    )
    dest = CACHE / version / "bin"
    dest.mkdir(parents=True, exist_ok=True)
    for t in TARGETS:
        shutil.copy2(build / "bin" / t, dest / t)
    shutil.rmtree(work, ignore_errors=True)
    return dest


def converted(gguf: Path, kind: str, bin_dir: Path) -> Path:
    """The packaged GGUF requantized to `kind` ("F32", "Q8_0", ...) with llama-quantize, cached
    beside the build (as shipped: the file itself)."""
    target = bin_dir.parent / f"{gguf.stem}.{kind}.gguf"
    if not target.exists():
        tmp = target.with_suffix(".tmp")
        subprocess.run(
            [str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(tmp), kind],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        tmp.rename(target)
    return target


if __name__ == "__main__":
    d = find_or_build()
    for t in TARGETS:
        print(d / t)
