"""The Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, tied embeddings.

Sequences of different lengths run together in one *packed* step (see `engine.kv`): every linear
layer works on all new tokens at once, and attention goes through the `KVCache` the caller passes.
The model holds weights only; it never allocates KV memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gguf_loader import ModelConfig
from .kv import KVCache, StepBatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as the reference implementation does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RotaryTable:
    """Precomputed cos/sin for every position up to the context length."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        if cfg.rope_scaling_type == "linear":
            inv_freq = inv_freq / cfg.rope_scaling_factor
        pos = torch.arange(cfg.context_length, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x: [N, H, D] by each row's position (rotate-half convention)."""
        cos = self.cos[positions].unsqueeze(1)  # [N, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


class LlamaModel:
    """Weights plus a packed forward pass. Not an `nn.Module`: nothing here is trained."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)

        def w(name: str) -> torch.Tensor:
            return tensors[name].to(device=self.device, dtype=dtype).contiguous()

        self.embed = w("token_embd.weight")  # [V, H]
        self.lm_head = self.embed if cfg.tie_embeddings else w("output.weight")
        self.norm = w("output_norm.weight")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            # Fusing Q/K/V and gate/up turns five matmuls into two: fewer passes over activations.
            wqkv = torch.cat(
                [w(p + "attn_q.weight"), w(p + "attn_k.weight"), w(p + "attn_v.weight")]
            )
            wgu = torch.cat([w(p + "ffn_gate.weight"), w(p + "ffn_up.weight")])
            self.layers.append(
                (w(p + "attn_norm.weight"), wqkv, w(p + "attn_output.weight"),
                 w(p + "ffn_norm.weight"), wgu, w(p + "ffn_down.weight"))
            )  # fmt: skip
        self.rope = RotaryTable(cfg, self.device, dtype)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        batch: StepBatch,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one packed step and return logits [M, V] for `logits_rows` (all rows if None).

        tokens, positions: [N] for the N new tokens of `batch`, packed in batch order.
        """
        cfg = self.cfg
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        n = tokens.shape[0]
        x = self.embed[tokens]  # [N, H]
        kv.begin_step(batch)
        try:
            for li, (attn_norm, wqkv, wo, ffn_norm, wgu, wdown) in enumerate(self.layers):
                h = rms_norm(x, attn_norm, cfg.rms_norm_eps)
                qkv = F.linear(h, wqkv)  # [N, (Hq + 2 Hkv) D]
                q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
                q = self.rope.apply(q.view(n, hq, d), positions)  # [N, Hq, D]
                k = self.rope.apply(k.view(n, hkv, d), positions)  # [N, Hkv, D]
                kv.append(li, k, v.view(n, hkv, d))
                attn = kv.attend(li, q)  # [N, Hq, D]
                x = x + F.linear(attn.reshape(n, hq * d), wo)
                h = rms_norm(x, ffn_norm, cfg.rms_norm_eps)
                gate, up = F.linear(h, wgu).chunk(2, dim=-1)
                x = x + F.linear(F.silu(gate) * up, wdown)
        except BaseException:
            kv.abort_step()
            raise
        kv.end_step()
        if logits_rows is not None:
            x = x[logits_rows]
        return F.linear(rms_norm(x, self.norm, cfg.rms_norm_eps), self.lm_head)


def load_model(
    model: str = "smollm2",
    dtype: str | torch.dtype = "float32",
    device: torch.device | str = "cpu",
    progress: bool = True,
):
    """Load weights and tokenizer for `model` (a packaged name or a .gguf path)."""
    from .gguf_loader import DTYPES, load_gguf, resolve_model_path
    from .tokenizer import GGUFTokenizer

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(
                f"dtype {dtype!r} is not supported; choose one of: {', '.join(DTYPES)}"
            )
        dtype = DTYPES[dtype]
    path = resolve_model_path(model)
    cfg, tensors, reader = load_gguf(path, dtype=torch.float32, progress=progress)
    tokenizer = GGUFTokenizer(reader, str(path))
    return LlamaModel(cfg, tensors, dtype=dtype, device=device), tokenizer
