#!/usr/bin/env bash
# The CUDA tests on a lent GPU machine (the `device` tool), which has PyTorch with CUDA but no
# package registry and receives the repository only (64 MiB: not the 98 MB packaged model, so
# tests/test_cuda.py's real-model test is left out; its tiny-model tests cover the same paths).
#   here:  .ci/cuda.sh fetch    wheels of what the image lacks, for its Python 3.12, into
#                               .devwheels/ (ignored by git: `echo /.devwheels/ >> .git/info/exclude`)
#   there: .ci/cuda.sh run      (device run, carry [".devwheels"]) installs them and the project
#                               without dependencies, then runs every CUDA test
#   there: .ci/cuda.sh bench    the same install, then benchmarks/cuda_graphs.py (its options)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
fetch)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
        -d .devwheels "gguf>=0.16" "lmdb>=2.0" "aiofiles>=23.1" "jinja2>=3.1" markupsafe \
        "fastapi>=0.133" "starlette>=1.0.1" "uvicorn>=0.29" h11 click "pydantic>=2.11" \
        pydantic-core typing-inspection annotated-types annotated-doc "crc32c>=2.3" \
        "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1" \
        "protobuf>=7.35.1" "pytest-asyncio>=0.23" "tokenizers>=0.23.1" "safetensors>=0.8" \
        pyyaml "prometheus-client>=0.20" "tqdm>=4.66"
    ;;
run | bench)
    export PYTHONUNBUFFERED=1
    python3 -m pip install -q --no-index --no-deps .devwheels/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
    if [ "$1" = bench ]; then  # the CUDA graphs' figures (benchmarks/cuda_graphs.py)
        shift
        exec python3 benchmarks/cuda_graphs.py "$@"
    fi
    python3 -m pytest -q -p no:cacheprovider -rs -m cuda \
        --deselect tests/test_cuda.py::test_cuda_engine_matches_cpu_greedy \
        tests/test_cuda.py tests/test_operators.py tests/test_experts.py
    ;;
*) echo "usage: .ci/cuda.sh fetch | run | bench [cuda_graphs.py's options]" >&2; exit 2 ;;
esac
