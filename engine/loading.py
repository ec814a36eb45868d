"""Loading a model by name or path: weights, tokenizer and the right model class.

`load_model` is the one entry point (a packaged model name, a .gguf file, or a Hugging Face
checkpoint directory); it sits above every loader and model class so none of them imports
another's module to find its way back.
"""

from __future__ import annotations

import torch

from unikv.kernels.dtypes import DTYPES

from .deepseek import DeepseekModel
from .gguf_loader import check_weights, load_gguf, resolve_model_path
from .hf_loader import load_hf
from .model import LlamaModel
from .tokenizer import GGUFTokenizer, HFTokenizer


def load_weights(model: str = "smollm2", progress: bool = True, weights: str = "float32"):
    """(config, tensors under the engine's names, tokenizer, checkpoint directory or None) of
    `model`: a packaged name, a .gguf path, or a Hugging Face checkpoint directory
    (config.json + safetensors + tokenizer files). `weights` (see `load_gguf`): "float32"
    decodes everything; "bfloat16" keeps 2-D weights in bf16; "native" keeps a GGUF's Q8_0 /
    Q4_0 / Q4_1 tensors packed (a checkpoint's float weights are already native)."""
    check_weights(weights)
    path = resolve_model_path(model)
    if path.is_dir():
        cfg, tensors = load_hf(path, dtype=torch.float32, progress=progress)
        if weights == "bfloat16":
            tensors = {k: t.bfloat16() if t.dim() == 2 else t for k, t in tensors.items()}
        return cfg, tensors, HFTokenizer(path), path
    cfg, tensors, reader = load_gguf(path, dtype=torch.float32, progress=progress,
                                     weights=weights)  # fmt: skip
    return cfg, tensors, GGUFTokenizer(reader, str(path)), None


def load_model(
    model: str = "smollm2",
    dtype: str | torch.dtype = "float32",
    device: torch.device | str = "cpu",
    progress: bool = True,
    weights: str = "float32",
):
    """Load weights and tokenizer for `model` (see `load_weights`; `weights` native, float32
    or bfloat16). A checkpoint directory's model remembers it in `source` (a tuned one carries
    its KV calibration there)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(
                f"dtype {dtype!r} is not supported; choose one of: {', '.join(DTYPES)}"
            )
        dtype = DTYPES[dtype]
    cfg, tensors, tokenizer, source = load_weights(model, progress, weights)
    if cfg.mla is not None:
        m = DeepseekModel(cfg, tensors, dtype=dtype, device=device)
    else:
        m = LlamaModel(cfg, tensors, dtype=dtype, device=device)
    m.source = source
    return m, tokenizer


def load_tokenizer(model: str = "smollm2"):
    """The tokenizer of `model` alone, without its weights (what a front end that routes to
    replicas needs)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return HFTokenizer(path)
    from .gguf_loader import open_gguf

    return GGUFTokenizer(open_gguf(path), str(path))
