"""Hugging Face checkpoint directories: config.json + safetensors (one file or shards) + tokenizer.

`load_hf` reads a Llama-family checkpoint in the layout `transformers`' `save_pretrained` writes
and returns what `load_gguf` returns: a `ModelConfig` and the tensors under the engine's (GGUF)
names, so one forward pass serves both formats. Q/K need no RoPE permutation here: the HF layout
is the one the engine computes in. The tokenizer (`HFTokenizer`) reads tokenizer.json and
tokenizer_config.json (special tokens, BOS, chat template).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from . import deepseek
from .config import ModelConfig, ModelLoadError
from .gguf_loader import check_layer_count, check_shapes, file_fingerprint

ARCHITECTURES = ("LlamaForCausalLM", *deepseek.ARCHITECTURES)
# HF name (per layer after "model.layers.{i}.") -> the engine's name (after "blk.{i}.")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def engine_name(hf_name: str, cfg: ModelConfig | None = None) -> str | None:
    """The engine's name for an HF tensor name (None: not a weight the engine uses). A DeepSeek
    model's layer tensors keep their HF names under "blk.{i}."."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, i, rest
    if len(parts) != 4 or parts[:2] != ["model", "layers"]:
        return None
    if cfg is not None and cfg.mla is not None:
        return f"blk.{parts[2]}.{parts[3]}"
    if parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    return None


def hf_name(engine: str) -> str:
    """The HF name of an engine tensor name (for error messages)."""
    for hf, eng in _TOP_NAMES.items():
        if eng == engine:
            return hf
    _, i, rest = engine.split(".", 2)
    hf = next((hf for hf, e in _LAYER_NAMES.items() if e == rest), rest)
    return f"model.layers.{i}.{hf}"


def read_hf_config(path: Path) -> ModelConfig:
    """Hyper-parameters from config.json, or fail naming the file and key."""
    file = path / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{file}: not readable JSON ({e})") from None
    arch = (raw.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{file}: unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    if arch in deepseek.ARCHITECTURES:
        return deepseek.read_config(raw, file, path.name)

    def need(key: str):
        if key not in raw:
            raise ModelLoadError(f"{file}: missing key {key!r}")
        return raw[key]

    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    for key, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(key, allowed) != allowed:
            raise ModelLoadError(f"{file}: {key} = {raw[key]!r}; supported: {allowed!r}")
    # transformers 5 writes `rope_parameters` (with rope_theta inside); 4.x `rope_scaling`.
    scaling = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear"):
        raise ModelLoadError(f"{file}: unsupported rope type {kind!r}; supported: linear")
    theta = raw.get("rope_theta", scaling.get("rope_theta", 10000.0))
    return ModelConfig(
        name=path.name,
        architecture="llama",
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        context_length=int(raw.get("max_position_embeddings", 2048)),
        rope_scaling_type="linear" if kind == "linear" else "none",
        rope_scaling_factor=float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards (each must exist), or the one
    model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({e})") from None
        for n in names:
            if not (path / n).is_file():
                raise ModelLoadError(f"{index}: shard {n} is missing from {path}")
        return [path / n for n in names]
    single = path / "model.safetensors"
    if not single.is_file():
        raise ModelLoadError(f"{path}: no model.safetensors nor model.safetensors.index.json")
    return [single]


def load_hf(
    path: Path, dtype: torch.dtype = torch.float32, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and tensors (under the engine's names) of an HF Llama checkpoint directory."""
    from safetensors import SafetensorError, safe_open

    cfg, files = checkpoint_config(path)
    if cfg.mla is not None:  # the layers are listed below: first bound them by the tensors
        count = 0
        for f in files:
            try:
                with safe_open(f, framework="pt") as st:
                    count += len(st.keys())
            except (SafetensorError, OSError) as e:
                raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
        check_layer_count(cfg, count, path)
    # DeepSeek checkpoints hold more than the engine runs (e.g. multi-token-prediction layers)
    wanted = deepseek.expected_shapes(cfg) if cfg.mla is not None else None
    tensors: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc="loading weights", unit="shard", disable=not progress):
        try:
            with safe_open(f, framework="pt") as st:
                for key in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    name = engine_name(key, cfg)
                    if name is not None and (wanted is None or name in wanted):
                        tensors[name] = st.get_tensor(key).to(dtype)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
    if cfg.tie_embeddings:
        tensors.pop("output.weight", None)
    elif "output.weight" not in tensors:
        raise ModelLoadError(f"{path}: missing tensor lm_head.weight (tie_word_embeddings false)")
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise ModelLoadError(f"{path}: tensor {hf_name(name)} holds non-finite values")
    check_shapes(cfg, {k: tuple(t.shape) for k, t in tensors.items()}, path, hf_name, wanted)
    return cfg, tensors


def checkpoint_config(path: Path) -> tuple[ModelConfig, list[Path]]:
    """The config of a checkpoint directory with its weights fingerprint (a digest of the
    shards' bytes: part of the identity), and its shard files."""
    cfg = read_hf_config(path)  # a bad config is reported before missing shards
    files = shard_files(path)
    digest = hashlib.blake2b(digest_size=16)
    for f in files:
        digest.update(file_fingerprint(f).encode())
    return dataclasses.replace(cfg, fingerprint=digest.hexdigest()), files


def save_hf(cfg: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer, path: Path) -> None:
    """Write a checkpoint directory `transformers` and `load_hf` both read: config.json,
    model.safetensors (HF names, float32) and the tokenizer files. For the engine's own
    checkpoints (a GGUF model re-saved, a tuned model)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.context_length,
        "rope_scaling": (
            {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
            if cfg.rope_scaling_type == "linear"
            else None
        ),
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    out = {}
    for name, t in tensors.items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        out[hf_name(name)] = t.detach().to(torch.float32).contiguous()
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    save_tokenizer(tokenizer, path)


def save_tokenizer(tokenizer, path: Path) -> None:
    """tokenizer.json and tokenizer_config.json of a unikv tokenizer, as `HFTokenizer` and
    transformers read them."""
    tokenizer._tk.save(str(path / "tokenizer.json"))
    conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos,
        "add_eos_token": tokenizer.add_eos,
        "chat_template": tokenizer.chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(conf, indent=2))
