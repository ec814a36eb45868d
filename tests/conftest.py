"""Shared fixtures: the real model loaded once per session, its reference twin, and test text.

Tests never read the shared texts folder: `english_text` makes plain English prose itself.
"""

from __future__ import annotations

import os
import random
import tomllib
import zlib
from pathlib import Path

import pytest
import torch

# Two processes spinning OpenMP threads on two cores slow each other down by 10x; subprocesses
# started by tests inherit this and stay single-threaded while the parent waits for them.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One owner: a pool mutated from a thread other than its engine's compute thread raises (in
# this process and in the servers and writers the tests start).
os.environ["UNIKV_CHECK_OWNER"] = "1"
# Under pytest-xdist (`make test` runs a worker per core) the cores are shared: each worker, and
# the servers and subprocesses its tests start, computes on its share of them.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, os.cpu_count() or 1) // WORKERS)
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
torch.set_num_threads(THREADS)


# `make test` gives each test file whole to one of two workers (`--dist loadfile`) in the
# order collected (`--no-loadscope-reorder`; xdist's own order puts files with many tests
# first, which left the few long ones, Ray's replicas among them, to the last minutes on one
# worker while the other waited: 96 s of idle worker in an 18-minute run). The longest files
# go first; every file not named keeps its place after them. Seconds of one worker each in
# that run (2-core AMD EPYC, AVX2, 2026-12-05): 265, 149, 146, 139, 132, 115, 108, 98, 97,
# 95, 94, 92, 62, 48; the whole suite about 2,000.
HEAVY_FIRST = (
    "test_replicas.py", "test_prune.py", "test_cli.py", "test_hybrid.py", "test_offload.py",
    "test_tune.py", "test_clients.py", "test_parity.py", "test_engine_pool.py", "test_serve.py",
    "test_engine.py", "test_remote.py", "test_fuzz.py", "test_wheel.py",
)  # fmt: skip


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: others keep order


@pytest.fixture(autouse=True)
def _threads_restored():
    """A test that sets torch's thread count (to check a kernel on 1 and 2 threads) leaves the
    next test the worker's own."""
    yield
    torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def _unikv_logging_restored():
    """A test that runs the CLI in-process configures the `unikv` logger tree (its own stderr
    handler, no propagation); put it back so the next test's caplog sees unikv's records."""
    import logging

    root = logging.getLogger("unikv")
    saved = root.handlers[:], root.level, root.propagate
    yield
    root.handlers[:], root.level, root.propagate = saved


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test draws from torch's and Python's generators seeded by its own name, so what it
    draws does not depend on which tests ran before it (CI once failed a test that passed
    here, because an earlier test left the global generator elsewhere)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


_SUBJECTS = [
    "The old farmer",
    "A young teacher",
    "The river",
    "Our neighbour",
    "The committee",
    "A small child",
    "The ship's captain",
    "The library",
    "My grandmother",
    "The engineer",
]
_VERBS = [
    "walked slowly towards",
    "spoke at length about",
    "carefully repaired",
    "often visited",
    "wrote a long letter about",
    "quietly watched",
    "argued with the council about",
    "painted a picture of",
    "dreamed every night of",
    "forgot all about",
]
_OBJECTS = [
    "the bridge near the mill",
    "the price of bread",
    "an unusual winter storm",
    "the garden behind the school",
    "a broken clock",
    "the history of the town",
    "the harvest festival",
    "a letter from the capital",
    "the lighthouse on the hill",
    "the new railway station",
]
_TAILS = [
    "before the sun went down.",
    "because nobody else would.",
    "while the rain kept falling.",
    "and then went home for supper.",
    "as the bells rang in the distance.",
    "although it was already late.",
    "with great patience.",
    "for the third time that year.",
]


def floor_folders() -> dict[str, Path]:
    """{floor: its folder in the repository}, from pyproject.toml's package-dir; a floor it does not
    map lives where its import name says (`unikv.kernels` in unikv/kernels/)."""
    root = Path(__file__).resolve().parent.parent
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = setup["package-dir"]
    return {
        name.removeprefix("unikv."): root / dirs.get(name, name.replace(".", "/"))
        for name in setup["packages"]
        if name != "unikv"
    }


def make_english(n_sentences: int, seed: int = 0) -> str:
    """Plain English prose, deterministic for a seed."""
    rng = random.Random(seed)
    sentences = [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        for _ in range(n_sentences)
    ]
    paragraphs = [" ".join(sentences[i : i + 6]) for i in range(0, len(sentences), 6)]
    return "\n\n".join(paragraphs)


def cpu_isas() -> list[str]:
    """The kernel instruction sets this CPU runs (`kernels.ISA_NEEDS`), best first: on an
    AVX-512 machine avx512, avx2 and portable, so its tests prove the AVX2 machine's paths
    (only `$UNIKV_ISA` where that is set)."""
    from unikv.kernels import native as kernels

    if os.environ.get("UNIKV_ISA"):  # a run held to one instruction set (tests/test_isa.py)
        return [os.environ["UNIKV_ISA"]]
    if not kernels._x86():
        return ["native"]
    flags = set(kernels.cpu_flags().split())
    return [i for i, need in kernels.ISA_NEEDS.items() if flags >= set(need)]


@pytest.fixture(params=cpu_isas())
def isa(request, monkeypatch):
    """Each C kernel built for one instruction set (`UNIKV_ISA`), loaded afresh in this test."""
    from unikv.kernels import gemv, sparse

    monkeypatch.setenv("UNIKV_ISA", request.param)
    monkeypatch.setattr(gemv, "_state", {})
    monkeypatch.setattr(sparse, "_state", {})
    return request.param


@pytest.fixture(scope="session")
def english_text() -> str:
    """About 2,000 tokens of generated English."""
    return make_english(140, seed=1)


@pytest.fixture(scope="session")
def model_path():
    from unikv.engine.gguf_loader import resolve_model_path

    return resolve_model_path("smollm2")


@pytest.fixture(scope="session")
def loaded(model_path):
    """(config, fp32 tensors, tokenizer) of the real model, read once."""
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.tokenizer import GGUFTokenizer

    cfg, tensors, reader = load_gguf(model_path, progress=False)
    return cfg, tensors, GGUFTokenizer(reader, str(model_path))


@pytest.fixture(scope="session")
def model(loaded):
    """unikv's float32 model."""
    from unikv.engine.model import LlamaModel

    cfg, tensors, _ = loaded
    return LlamaModel(cfg, tensors)


@pytest.fixture(scope="session")
def tokenizer(loaded):
    return loaded[2]


@pytest.fixture(scope="session")
def native_model(model_path):
    """unikv's model on its native (packed GGUF) weights, as `make run` loads it."""
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.model import LlamaModel

    cfg, tensors, _ = load_gguf(model_path, progress=False, weights="native")
    return LlamaModel(cfg, tensors)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """The reference: transformers' LlamaForCausalLM loaded from the same GGUF file.

    transformers converts the GGUF in about 30 s; the converted model is kept in unikv's cache
    (keyed by the file's name, size and time and the transformers version) so that the other
    pytest-xdist workers and later runs load it in seconds. A lock makes a second worker wait
    for the first one's copy instead of converting too."""
    import fcntl
    import json
    import shutil

    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from unikv.settings import config

    def convert():
        return AutoModelForCausalLM.from_pretrained(
            str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
        )

    st = model_path.stat()
    key = f"{model_path.stem}-{st.st_size}-{st.st_mtime_ns}-{transformers.__version__}"
    root = config.cache_dir() / "hf-reference"
    kept = root / key
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{key}.lock", "w")  # noqa: SIM115 (held across the branches below)
    except OSError:  # no writable cache: convert here, as before
        return convert().eval()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if kept.is_dir():
            m = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(str(kept)), dtype=torch.float32
            )
            m.load_state_dict(torch.load(kept / "state.pt"), strict=True)
            return m.eval()
        m = convert()
        # transformers will not save_pretrained a model read from a GGUF ("quantized with
        # gguf"): its float32 weights and config are kept as they are (the same logits, bit
        # for bit, measured)
        part = root / f"{key}.part"
        try:
            shutil.rmtree(part, ignore_errors=True)
            part.mkdir()
            torch.save(m.state_dict(), part / "state.pt")
            cfg = json.loads(m.config.to_json_string(use_diff=False))
            cfg.pop("quantization_config", None)
            (part / "config.json").write_text(json.dumps(cfg))
            part.rename(kept)
        except OSError:  # a full disk: the next session converts again
            shutil.rmtree(part, ignore_errors=True)
    return m.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)


@pytest.fixture
def new_kv(model):
    """A factory of empty contiguous caches shaped for the model."""
    from unikv.kvstrategies.kv import ContiguousKVCache

    cfg = model.cfg

    def make():
        return ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)

    return make


@pytest.fixture(scope="session")
def calibration(model, tokenizer, tmp_path_factory):
    """A small hybrid_fp16_int4 calibration file for the real model (4 windows of 128 tokens)."""
    from unikv.engine.recording import collect_channel_stats

    ids = tokenizer.encode(make_english(60, seed=11))
    stats = collect_channel_stats(model, ids, samples=4, window=128, block=64)
    path = tmp_path_factory.mktemp("cal") / "smollm2.pt"
    stats.save(path)
    return path
