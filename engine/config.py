"""The model's hyper-parameters as every loader returns them and every model reads them:
`ModelConfig` (with `MLAConfig` and `MoEConfig` for DeepSeek) and `ModelLoadError`. What does not
live here: reading them from a file (`engine.gguf_loader`, `engine.hf_loader`)."""

from __future__ import annotations

from dataclasses import dataclass


class ModelLoadError(ValueError):
    """A model file is missing, unreadable, corrupt or of an unsupported kind."""


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank query/KV projections and a
    decoupled RoPE key part shared by all heads. The cache holds kv_lora_rank + qk_rope_head_dim
    values per token and layer."""

    q_lora_rank: int  # 0: a plain query projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # RoPE on (even, odd) channel pairs, as DeepSeek lays them out
    softmax_scale: float = 0.0  # qk_head_dim ** -0.5, times YaRN's mscale squared when set
    # YaRN (rope_type "yarn"): factor 1 means plain RoPE
    yarn_factor: float = 1.0
    yarn_original_context: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attention_factor: float = 1.0  # scales cos/sin

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """DeepSeekMoE: shared experts every token uses plus routed experts chosen per token."""

    num_experts: int  # routed
    num_shared: int
    top_k: int
    intermediate_size: int  # per expert
    first_dense: int  # the first layers use a dense MLP
    layer_freq: int = 1  # then every layer_freq-th layer is MoE
    scoring: str = "softmax"  # "softmax" (V2) | "sigmoid" (V3)
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy" (V2) | "noaux_tc" (V3)
    num_groups: int = 1
    topk_groups: int = 1
    norm_topk: bool = False
    routed_scaling: float = 1.0

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_dense and layer % self.layer_freq == 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder, as read from the model file."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    rope_scaling_type: str = "none"  # "none" | "linear"
    rope_scaling_factor: float = 1.0
    tie_embeddings: bool = True
    fingerprint: str = ""  # digest of the weights file: KV cached on disk is only reused for it
    # DeepSeek-style models: num_kv_heads is 1 and head_dim the latent width (what is cached)
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"head_count={self.num_heads} is not a multiple of "
                f"head_count_kv={self.num_kv_heads}"
            )
        if self.head_dim % 2 and self.mla is None:
            raise ModelLoadError(f"head dimension {self.head_dim} must be even for RoPE")

    @property
    def identity(self) -> str:
        """A short string naming the model's shape, used in cache keys."""
        shape = (
            f"{self.architecture}:{self.name}:L{self.num_layers}:H{self.num_heads}"
            f":KV{self.num_kv_heads}:D{self.head_dim}:V{self.vocab_size}"
        )
        return f"{shape}:W{self.fingerprint}" if self.fingerprint else shape
