"""DeepSeek-V2/V3: multi-head latent attention (MLA) over a latent KV cache, and DeepSeekMoE.

The architecture as Hugging Face `transformers` defines it (`DeepseekV2ForCausalLM`,
`DeepseekV3ForCausalLM`), read from a checkpoint directory by `engine.hf_loader`.

MLA, absorbed. Each token's keys and values come from one compressed latent
c = RMSNorm(W_dkv h) (kv_lora_rank channels) and one RoPE key part k_pe shared by all heads.
Per head, k_nope = W_uk c and v = W_uv c. Instead of expanding the cache to per-head keys and
values, the up-projections are folded into the query and the output:

    q_nope . k_nope = (W_uk^T q_nope) . c        out = W_uv (sum_s p_s c_s)

so attention runs as multi-query attention over [c, k_pe] (kv_lora_rank + qk_rope_head_dim per
token and layer: 576 for V3, against 128 heads x (192 + 128) = 40960 for plain multi-head KV), and
the value is the latent itself, the first kv_lora_rank channels of the key. The cache stores that
and nothing else (`KVSpec.latent`); every strategy that supports latent specs serves it.

DeepSeekMoE. After `first_dense` dense layers, the MLP is shared experts (every token) plus the
top-k routed experts of a router (`engine.routing.route`: softmax or sigmoid scoring, the
score-correction bias, group-limited selection, normalized and scaled weights). Expert weights
live in a `memory.experts.ExpertCache`: all resident by default; with a config's [moe]
expert_cache < 1, the most used ones on the device tier (LRU) and the rest on host and SSD.

RoPE. DeepSeek lays the RoPE channels out in interleaved pairs (x0, x1), (x2, x3), ... The rows of
the projections that produce them are permuted at load time to [evens, odds], so the engine's one
rotate-half RoPE computes the same dot products (the permutation is applied to queries and keys
alike). YaRN (rope_type "yarn") scales the frequencies, the cos/sin (attention_factor) and the
softmax (mscale_all_dim) as transformers does.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from unikv.kvstrategies.kv import KVCache, KVSpec
from unikv.memory.experts import ExpertCache
from unikv.settings.config import PoolConfig

from .config import MLAConfig, ModelConfig, ModelLoadError, MoEConfig
from .model import LlamaModel, RotaryTable, SplitLinear, rms_norm
from .report import ModelReport
from .routing import HF_KEYS, check_moe, choose_topk, route

ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
# Router defaults when config.json does not say (transformers' V3 router is always sigmoid with
# the correction bias; V2's is softmax).
_ROUTER_DEFAULTS = {
    "deepseek_v2": ("softmax", "greedy"),
    "deepseek_v3": ("sigmoid", "noaux_tc"),
}


# ---- configuration -------------------------------------------------------------------------


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def read_config(raw: dict, file: Path, name: str) -> ModelConfig:
    """A DeepSeek-V2/V3 config.json as a `ModelConfig`, or a `ModelLoadError` naming the file and
    the keys that are missing or inconsistent."""
    arch = ARCHITECTURES[raw["architectures"][0]]

    def need(key: str):
        if raw.get(key) is None:
            raise ModelLoadError(f"{file}: missing key {key!r}")
        return raw[key]

    def bad(msg: str) -> ModelLoadError:
        return ModelLoadError(f"{file}: {msg}")

    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise bad(f"quantized checkpoints ({method}) are not supported; convert to bf16/fp32")
    if raw.get("hidden_act", "silu") != "silu":
        raise bad(f"hidden_act = {raw['hidden_act']!r}; supported: 'silu'")
    if raw.get("attention_bias", False):
        raise bad("attention_bias = true is not supported")
    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    q_rank = int(raw.get("q_lora_rank") or 0)
    rope_dim = int(need("qk_rope_head_dim"))
    mla_dims = {
        "kv_lora_rank": int(need("kv_lora_rank")),
        "qk_nope_head_dim": int(need("qk_nope_head_dim")),
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": int(need("v_head_dim")),
    }
    for key, v in (*mla_dims.items(), ("hidden_size", hidden), ("num_attention_heads", heads)):
        if v < 1:
            raise bad(f"{key} = {v} must be >= 1")
    if rope_dim % 2:
        raise bad(f"qk_rope_head_dim = {rope_dim} must be even for RoPE")

    scaling = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise bad(f"unsupported rope type {kind!r}; supported: default, yarn")
    theta = float(raw.get("rope_theta", scaling.get("rope_theta", 10000.0)))
    context = int(raw.get("max_position_embeddings", 4096))
    qk_head_dim = mla_dims["qk_nope_head_dim"] + rope_dim
    softmax_scale = qk_head_dim**-0.5
    yarn = {}
    if kind == "yarn":
        original = int(scaling.get("original_max_position_embeddings") or 0)
        if original < 1:
            raise bad("rope yarn needs original_max_position_embeddings")
        factor = float(scaling.get("factor") or context / original)
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        att = scaling.get("attention_factor")
        if att is None:
            att = (
                yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                if mscale and mscale_all
                else yarn_mscale(factor)
            )
        if mscale_all:
            softmax_scale *= yarn_mscale(factor, mscale_all) ** 2
        yarn = {
            "yarn_factor": factor,
            "yarn_original_context": original,
            "yarn_beta_fast": float(scaling.get("beta_fast") or 32),
            "yarn_beta_slow": float(scaling.get("beta_slow") or 1),
            "yarn_attention_factor": float(att),
        }
    mla = MLAConfig(
        q_lora_rank=q_rank,
        # V2 always interleaves (transformers' V2 has no switch); V3 has rope_interleave
        rope_interleave=arch == "deepseek_v2" or bool(raw.get("rope_interleave", True)),
        softmax_scale=softmax_scale,
        **mla_dims,
        **yarn,
    )
    moe = _read_moe(raw, arch, need, bad, int(need("num_hidden_layers")))
    return ModelConfig(
        name=name,
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=1,  # one latent "head" per token: what the cache holds
        head_dim=mla.kv_lora_rank + rope_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        context_length=context,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        mla=mla,
        moe=moe,
    )


def _read_moe(raw: dict, arch: str, need, bad, num_layers: int) -> MoEConfig | None:
    experts = int(raw.get("n_routed_experts") or 0)
    if experts == 0:
        return None  # a dense model
    scoring, method = _ROUTER_DEFAULTS[arch]
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    if first_dense > num_layers:
        raise bad(f"first_k_dense_replace = {first_dense} exceeds num_hidden_layers")
    moe = MoEConfig(
        num_experts=experts,
        num_shared=int(raw.get("n_shared_experts") or 0),
        top_k=int(raw.get("num_experts_per_tok") or 0),
        intermediate_size=int(need("moe_intermediate_size")),
        first_dense=first_dense,
        layer_freq=int(raw.get("moe_layer_freq") or 1),
        scoring=raw.get("scoring_func") or scoring,
        topk_method=raw.get("topk_method") or method,
        num_groups=int(raw.get("n_group") or 1),
        topk_groups=int(raw.get("topk_group") or 1),
        norm_topk=bool(raw.get("norm_topk_prob", False)),
        routed_scaling=float(raw.get("routed_scaling_factor", 1.0)),
    )
    try:
        check_moe(moe, HF_KEYS)  # the router's own checks, naming the config.json keys
    except ValueError as e:
        raise bad(str(e)) from None
    return moe


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a DeepSeek model needs (engine names) with its shape."""
    mla, moe, h = cfg.mla, cfg.moe, cfg.hidden_size
    nh, r = cfg.num_heads, mla.kv_lora_rank
    shapes = {"token_embd.weight": (cfg.vocab_size, h), "output_norm.weight": (h,)}
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        a = p + "self_attn."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            a + "kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, h),
            a + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
            a + "kv_b_proj.weight": (nh * (mla.qk_nope_head_dim + mla.v_head_dim), r),
            a + "o_proj.weight": (h, nh * mla.v_head_dim),
        }
        if mla.q_lora_rank:
            shapes |= {
                a + "q_a_proj.weight": (mla.q_lora_rank, h),
                a + "q_a_layernorm.weight": (mla.q_lora_rank,),
                a + "q_b_proj.weight": (nh * mla.qk_head_dim, mla.q_lora_rank),
            }
        else:
            shapes[a + "q_proj.weight"] = (nh * mla.qk_head_dim, h)
        if moe is not None and moe.is_moe_layer(i):
            m, inter = p + "mlp.", moe.intermediate_size
            shapes[m + "gate.weight"] = (moe.num_experts, h)
            if moe.topk_method == "noaux_tc":
                shapes[m + "gate.e_score_correction_bias"] = (moe.num_experts,)
            if moe.num_shared:
                shapes |= _mlp_shapes(m + "shared_experts.", h, inter * moe.num_shared)
            for e in range(moe.num_experts):
                shapes |= _mlp_shapes(f"{m}experts.{e}.", h, inter)
        else:
            shapes |= _mlp_shapes(p + "mlp.", h, cfg.intermediate_size)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {
        prefix + "gate_proj.weight": (inter, hidden),
        prefix + "up_proj.weight": (inter, hidden),
        prefix + "down_proj.weight": (hidden, inter),
    }


def kv_footprint(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Bytes per token of the latent cache against a plain multi-head cache of the same model
    (per-head keys of qk_head_dim and values of v_head_dim), over all layers."""
    mla = cfg.mla
    size = torch.empty((), dtype=dtype).element_size()
    latent = cfg.num_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * size
    mha = cfg.num_layers * cfg.num_heads * (mla.qk_head_dim + mla.v_head_dim) * size
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "latent_bytes_per_token": latent,
        "mha_bytes_per_token": mha,
        "ratio": mha / latent,
    }


def yarn_inv_freq(mla: MLAConfig, theta: float) -> torch.Tensor:
    """Inverse RoPE frequencies over the RoPE channels, YaRN-blended when configured (the
    formula of transformers' `_compute_yarn_parameters`, truncate=True)."""
    dim = mla.qk_rope_head_dim
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if mla.yarn_factor == 1.0 and not mla.yarn_original_context:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        ctx = mla.yarn_original_context
        return dim * math.log(ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(mla.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(mla.yarn_beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # as the reference: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    interpolated = 1.0 / (mla.yarn_factor * pos_freqs)
    return interpolated * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def deinterleave_rows(w: torch.Tensor, rope_dim: int, heads: int, head_width: int) -> torch.Tensor:
    """Permute the RoPE rows of a projection [heads * head_width, in] whose last `rope_dim` rows
    per head hold interleaved pairs, to [evens, odds] (rotate-half layout)."""
    w = w.view(heads, head_width, -1).clone()
    rope = w[:, head_width - rope_dim :]
    w[:, head_width - rope_dim :] = torch.cat((rope[:, 0::2], rope[:, 1::2]), dim=1)
    return w.view(heads * head_width, -1)


# ---- the model -----------------------------------------------------------------------------


class DeepseekModel(LlamaModel):
    """DeepSeek-V2/V3 weights and the packed forward pass over a latent KV cache."""

    def __init__(
        self,
        cfg: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if cfg.mla is None:
            raise ValueError(f"{cfg.name}: not a multi-head latent attention model")
        # (layer, expert) -> (gate_up [2I, H], down [H, I]); dropped once experts are tiered
        self.routed: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = {}
        self.topk, self.topk_block = "exact", 0  # final top-k of the router; see set_topk
        self.on_route = None  # if set, called with (layer, router logits, bias) (benchmarks)
        self._tensors = tensors  # for the router, kept in float32 whatever the compute dtype
        super().__init__(cfg, tensors, dtype, device)
        del self._tensors
        self.experts = None
        self.expert_placement = (1.0, 1.0)  # (expert_cache, expert_host) fractions
        if cfg.moe is not None:
            self.experts = ExpertCache(self.routed, self.device, device_capacity=len(self.routed))

    def set_topk(self, mode: str, block: int = 0) -> None:
        """The router's final top-k: "exact" (torch.topk) or "blockwise" (within blocks of
        `block` experts, then among the block winners)."""
        self.topk, self.topk_block = mode, block

    def kv_spec(self) -> KVSpec:
        """A latent KV shape: one head of latent + RoPE key channels; values are its first
        `kv_lora_rank` channels."""
        c = self.cfg
        return KVSpec(c.num_layers, 1, c.head_dim, self.dtype, c.identity, c.num_heads,
                      latent=True, value_dim=c.mla.kv_lora_rank,
                      softmax_scale=c.mla.softmax_scale)  # fmt: skip

    def configure_moe(self, config: PoolConfig, profile) -> str | None:
        """Apply a config's [moe] table on a chip: the router's top-k (the config's, else the
        chip profile's preference) and where routed experts live (`expert_cache` of them on
        the device tier, `expert_host` of the rest on host, the remainder on the config's SSD
        tier). Returns what was chosen and why."""
        if self.cfg.moe is None:
            return None
        mode, block, why = choose_topk(profile, config)
        self.set_topk(mode, block)
        opts = config.moe
        wanted = (opts.expert_cache, opts.expert_host if opts.expert_cache < 1 else 1.0)
        if wanted != self.expert_placement:
            if self.routed is None:
                raise ValueError(
                    f"{config.source}: [moe] experts were already placed at "
                    f"{self.expert_placement}; load the model again to place them at {wanted}"
                )
            ssd = config.tier("ssd")
            if wanted[1] < 1 and ssd is None:
                raise ValueError(
                    f"{config.source}: [moe] expert_host = {opts.expert_host} puts experts on "
                    "the SSD tier, but the config has no [tiers.ssd]"
                )
            cache = ExpertCache.from_fractions(
                self.routed, self.device, expert_cache=wanted[0], expert_host=wanted[1],
                ssd_path=ssd.path if ssd is not None and wanted[1] < 1 else None,
            )  # fmt: skip
            self.experts.close()
            self.experts, self.routed, self.expert_placement = cache, None, wanted
        self.experts.reset_stats()  # report what serving does, not a calibration run before
        cap = self.experts.device_capacity
        return (
            f"top-k {mode}{f' (blocks of {block})' if block else ''}: {why}; "
            f"{cap} of {len(self.experts)} routed experts on the device"
        )

    def memory_report(self) -> ModelReport:
        """The latent cache's bytes per token against plain multi-head KV, the router's top-k
        and the expert store's tiers and hit rate."""
        moe = self.cfg.moe is not None
        return ModelReport(
            latent_kv=kv_footprint(self.cfg, self.dtype),
            routing={"topk": self.topk, "block": self.topk_block} if moe else None,
            experts=self.experts.stats() if moe else None,
            huge_pages=self.huge_pages,
        )

    def _layer_ops(self) -> tuple:
        """None: MLA and MoE layers have their own forward (`_layer`), not Llama's two ops."""
        return None, None

    def _build_layer(self, i: int, w, lin) -> dict:
        cfg, mla, moe = self.cfg, self.cfg.mla, self.cfg.moe
        p, a = f"blk.{i}.", f"blk.{i}.self_attn."
        nh, nope, r = cfg.num_heads, mla.qk_nope_head_dim, mla.kv_lora_rank
        rope = mla.qk_rope_head_dim

        def fixed(name: str, heads: int, width: int) -> torch.Tensor:
            t = w(name)
            return deinterleave_rows(t, rope, heads, width) if mla.rope_interleave else t

        layer = {
            "attn_norm": w(p + "input_layernorm.weight"),
            "ffn_norm": w(p + "post_attention_layernorm.weight"),
            "kv_norm": w(a + "kv_a_layernorm.weight"),
            "o": SplitLinear(w(a + "o_proj.weight"), self._parts),
        }
        kv_a = fixed(a + "kv_a_proj_with_mqa.weight", 1, r + rope)
        if mla.q_lora_rank:
            # q_a and kv_a both read the normed hidden state: one fused matmul
            layer["a"] = SplitLinear(torch.cat([w(a + "q_a_proj.weight"), kv_a]), self._parts)
            layer["q_norm"] = w(a + "q_a_layernorm.weight")
            layer["q_b"] = SplitLinear(fixed(a + "q_b_proj.weight", nh, nope + rope), self._parts)
        else:
            q = fixed(a + "q_proj.weight", nh, nope + rope)
            layer["a"] = SplitLinear(torch.cat([q, kv_a]), self._parts)
        # kv_b: [nh * (nope + v), r] -> absorbed into the query (W_uk) and the output (W_uv)
        kv_b = w(a + "kv_b_proj.weight").view(nh, nope + mla.v_head_dim, r)
        layer["w_uk"] = kv_b[:, :nope].contiguous()  # [nh, nope, r]
        layer["w_uv_t"] = kv_b[:, nope:].transpose(1, 2).contiguous()  # [nh, r, v]
        if moe is not None and moe.is_moe_layer(i):
            m = p + "mlp."
            layer["router"] = self._f32(m + "gate.weight")
            bias = m + "gate.e_score_correction_bias"
            layer["bias"] = self._f32(bias) if moe.topk_method == "noaux_tc" else None
            if moe.num_shared:
                layer["shared"] = self._mlp(lin, m + "shared_experts.")
            for e in range(moe.num_experts):
                x = f"{m}experts.{e}."
                gate_up = torch.cat([w(x + "gate_proj.weight"), w(x + "up_proj.weight")])
                self.routed[i, e] = (gate_up, w(x + "down_proj.weight"))
        else:
            layer["mlp"] = self._mlp(lin, p + "mlp.")
        return layer

    @staticmethod
    def _mlp(lin, prefix: str) -> tuple[SplitLinear, SplitLinear]:
        return lin(prefix + "gate_proj.weight", prefix + "up_proj.weight"), lin(
            prefix + "down_proj.weight"
        )

    def _build_rope(self) -> RotaryTable:
        mla = self.cfg.mla
        inv_freq = yarn_inv_freq(mla, self.cfg.rope_theta)
        return RotaryTable(self.cfg, self.device, self.dtype, inv_freq, mla.yarn_attention_factor)

    def _f32(self, name: str) -> torch.Tensor:
        return self._tensors[name].to(device=self.device, dtype=torch.float32).contiguous()

    def _layer(
        self, li: int, x: torch.Tensor, positions: torch.Tensor, kv: KVCache
    ) -> torch.Tensor:
        cfg, mla = self.cfg, self.cfg.mla
        layer = self.layers[li]
        n, nh = x.shape[0], cfg.num_heads
        nope, rope, r = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        h = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
        a = layer["a"](h)
        if mla.q_lora_rank:
            q_lat, kv_a = a.split([mla.q_lora_rank, r + rope], dim=-1)
            q = layer["q_b"](rms_norm(q_lat, layer["q_norm"], cfg.rms_norm_eps))
        else:
            q, kv_a = a.split([nh * mla.qk_head_dim, r + rope], dim=-1)
        q = q.view(n, nh, nope + rope)
        c, k_pe = kv_a.split([r, rope], dim=-1)
        c = rms_norm(c, layer["kv_norm"], cfg.rms_norm_eps)
        k_pe = self.rope.apply(k_pe.view(n, 1, rope), positions)
        q_pe = self.rope.apply(q[..., nope:], positions)  # [N, nh, rope]
        # Absorb W_uk into the query: [nh, N, nope] @ [nh, nope, r] -> [N, nh, r]
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), layer["w_uk"]).transpose(0, 1)
        key = torch.cat([c.unsqueeze(1), k_pe], dim=-1)  # [N, 1, r + rope]: what is cached
        kv.append(li, key, key[..., :r])
        o_lat = kv.attend(li, torch.cat([q_lat, q_pe], dim=-1))  # [N, nh, r]
        o = torch.bmm(o_lat.transpose(0, 1), layer["w_uv_t"]).transpose(0, 1)  # [N, nh, v]
        x = x + layer["o"](o.reshape(n, nh * mla.v_head_dim))
        h = rms_norm(x, layer["ffn_norm"], cfg.rms_norm_eps)
        if "mlp" in layer:
            return x + _swiglu(h, *layer["mlp"])
        return x + self._moe(li, layer, h)

    def _moe(self, li: int, layer: dict, h: torch.Tensor) -> torch.Tensor:
        """Shared experts plus the routed experts of every row of h: [N, hidden]."""
        moe = self.cfg.moe
        logits = h.float() @ layer["router"].T  # [N, E], float32 as the reference
        if self.on_route is not None:
            self.on_route(li, logits, layer["bias"])
        weights, idx = route(logits, moe, layer["bias"], self.topk, self.topk_block)
        self.experts.observe(li, idx)
        out = _swiglu(h, *layer["shared"]) if "shared" in layer else torch.zeros_like(h)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
        used = [e for e, c in enumerate(counts) if c]
        rows_all = order // moe.top_k  # the token row of each (sorted) assignment
        w_all = weights.reshape(-1)[order]
        start = 0
        # A prefill may route to more experts than the device tier holds: ask for them in
        # groups that fit, so the cache never holds more than its budget.
        group = self.experts.device_capacity
        for g in range(0, len(used), group):
            batch = used[g : g + group]
            for e, (gate_up, down) in zip(batch, self.experts.get_many(li, batch), strict=True):
                end = start + counts[e]
                rows = rows_all[start:end]
                gate, up = (h[rows] @ gate_up.T).chunk(2, dim=-1)
                y = (F.silu(gate) * up) @ down.T
                out.index_add_(0, rows, (y * w_all[start:end, None]).to(out.dtype))
                start = end
        return out


def _swiglu(h: torch.Tensor, gate_up: SplitLinear, down: SplitLinear) -> torch.Tensor:
    gate, up = gate_up(h).chunk(2, dim=-1)
    return down(F.silu(gate) * up)
