"""Loading a model by name or path: weights, tokenizer and the right model class.

`load_model` is the one entry point (a packaged model name, a .gguf file, or a Hugging Face
checkpoint directory); it sits above every loader and model class so none of them imports
another's module to find its way back.
"""

from __future__ import annotations

import torch

from kvstrategies.kv import DTYPES

from .deepseek import DeepseekModel
from .gguf_loader import load_gguf, resolve_model_path
from .hf_loader import load_hf
from .model import LlamaModel
from .tokenizer import GGUFTokenizer, HFTokenizer


def load_weights(model: str = "smollm2", progress: bool = True):
    """(config, float32 tensors under the engine's names, tokenizer, checkpoint directory or
    None) of `model`: a packaged name, a .gguf path, or a Hugging Face checkpoint directory
    (config.json + safetensors + tokenizer files)."""
    path = resolve_model_path(model)
    if path.is_dir():
        cfg, tensors = load_hf(path, dtype=torch.float32, progress=progress)
        return cfg, tensors, HFTokenizer(path), path
    cfg, tensors, reader = load_gguf(path, dtype=torch.float32, progress=progress)
    return cfg, tensors, GGUFTokenizer(reader, str(path)), None


def load_model(
    model: str = "smollm2",
    dtype: str | torch.dtype = "float32",
    device: torch.device | str = "cpu",
    progress: bool = True,
):
    """Load weights and tokenizer for `model` (see `load_weights`). A checkpoint directory's
    model remembers it in `source` (a tuned one carries its KV calibration there)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(
                f"dtype {dtype!r} is not supported; choose one of: {', '.join(DTYPES)}"
            )
        dtype = DTYPES[dtype]
    cfg, tensors, tokenizer, source = load_weights(model, progress)
    if cfg.mla is not None:
        m = DeepseekModel(cfg, tensors, dtype=dtype, device=device)
    else:
        m = LlamaModel(cfg, tensors, dtype=dtype, device=device)
    m.source = source
    return m, tokenizer
