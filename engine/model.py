"""The Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, tied embeddings.

Sequences of different lengths run together in one *packed* step (see `kvstrategies.kv`): every
linear layer works on all new tokens at once, and attention goes through the `KVCache` the caller
passes.
The model holds weights only; it never allocates KV memory.
"""

from __future__ import annotations

import torch

from unikv.kernels.operators import OperatorSet
from unikv.kvstrategies.kv import KVCache, KVSpec, StepBatch
from unikv.memory import hugepages

from . import (
    fused,  # (registers layer.qkv, layer.out and model.layers)
    graphs,  # noqa: F401 (registers model.layers' CUDA graphs)
    linear,
)
from .config import ModelConfig
from .linear import SplitLinear, build_linear, layer_parts, rms_norm
from .report import ModelReport, WeightFormat

__all__ = ["LlamaModel", "RotaryTable", "SplitLinear", "rms_norm"]  # re-exported for callers


class RotaryTable:
    """Precomputed cos/sin for every position up to the context length."""

    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        inv_freq: torch.Tensor | None = None,
        attention_factor: float = 1.0,
    ) -> None:
        """Plain or linearly scaled RoPE over cfg.head_dim; or the given `inv_freq` (e.g. YaRN's,
        over MLA's RoPE channels) with cos/sin scaled by `attention_factor`."""
        if inv_freq is None:
            d = cfg.head_dim
            exponent = torch.arange(0, d, 2, dtype=torch.int64).float() / d
            inv_freq = 1.0 / (cfg.rope_theta**exponent)
            if cfg.rope_scaling_type == "linear":
                inv_freq = inv_freq / cfg.rope_scaling_factor
        pos = torch.arange(cfg.context_length, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = (emb.cos() * attention_factor).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attention_factor).to(device=device, dtype=dtype)
        # rotate_half(x) = roll(x, D/2) with its first half negated: the sign goes into sin
        half = self.sin.shape[-1] // 2
        self._sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)
        self._last: tuple | None = None  # (positions, cos, signed sin) of the last call

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x: [N, H, D] by each row's position (rotate-half convention)."""
        last = self._last
        if last is None or last[0] is not positions:
            # Every layer of a step rotates by the same positions: gathered once per step. (The
            # tuple holds `positions`, so no later tensor can reuse its identity.)
            last = self._last = (positions, self.cos[positions].unsqueeze(1),
                                 self._sin_signed[positions].unsqueeze(1))  # fmt: skip
        # x * cos + rotate_half(x) * sin, with cos, sin: [N, 1, D]
        return torch.addcmul(x * last[1], x.roll(x.shape[-1] // 2, -1), last[2])


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
        self.source = None  # the checkpoint directory the weights came from, if any
        # GGUF types decoded once at load for want of a native kernel (gguf_loader.GGUFTensors)
        self.dequantized: list[str] = list(getattr(tensors, "dequantized", ()))

        def w(name: str) -> torch.Tensor:
            return tensors[name].to(device=self.device, dtype=dtype).contiguous()

        # One slice per core on CPU; accelerators run one plain matmul.
        self._parts = 4 if self.device.type == "cpu" else 1
        # Every matmul, norm and rope goes through the kernel registry (kernels.operators):
        # the first implementation this device offers, switched to the next if it fails.
        self.operators = OperatorSet(self.device, owner=self)
        self._rms, self._rope = self.operators["rmsnorm"], self.operators["rope"]
        self._qkv, self._out = self._layer_ops()
        # Every layer of a step: one native call for a decode step over a cache that describes
        # itself as plain arenas (engine.fused), else `_layer` one after the other.
        self._stack = self.operators["model.layers"]
        # A whole step, embedding to logits: one native call where `model.layers` would take
        # its one call and gemv.c describes the output layer too (engine.fused.step_native).
        self._step = self.operators["model.step"]

        def lin(*names: str, prepare: bool = True):
            # A weight in a format with a native kernel stays packed (engine.linear).
            return build_linear([tensors[n] for n in names], dtype, self.device, self._parts,
                                self.operators, prepare)  # fmt: skip

        self.lm_head = lin("output.weight" if not cfg.tie_embeddings else "token_embd.weight")
        # Tied embeddings read their rows out of the lm_head's slices: no second copy.
        self.embed = self.lm_head if cfg.tie_embeddings else lin("token_embd.weight", prepare=False)
        self.norm = w("output_norm.weight")
        self.layers = [self._build_layer(i, w, lin) for i in range(cfg.num_layers)]
        self.rope = self._build_rope()
        # where the weights just placed lie (memory.hugepages): read once, smaps is slow
        self.huge_pages = hugepages.report().line()

    def _build_layer(self, i: int, w, lin) -> tuple:
        """Layer i's weights: `w(name)` gives a tensor, `lin(*names)` one fused `Linear`."""
        p = f"blk.{i}."
        # Fusing Q/K/V and gate/up turns five matmuls into two: fewer passes over activations.
        return (w(p + "attn_norm.weight"),
                lin(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"),
                lin(p + "attn_output.weight"),
                w(p + "ffn_norm.weight"),
                lin(p + "ffn_gate.weight", p + "ffn_up.weight"),
                lin(p + "ffn_down.weight"))  # fmt: skip

    def _layer_ops(self) -> tuple:
        """The breakers of a layer's dense part before and after attention (engine.fused)."""
        return self.operators["layer.qkv"], self.operators["layer.out"]

    def _build_rope(self) -> RotaryTable:
        return RotaryTable(self.cfg, self.device, self.dtype)

    def _layer(
        self, li: int, x: torch.Tensor, positions: torch.Tensor, kv: KVCache
    ) -> torch.Tensor:
        """One decoder layer over the step's packed rows x: [N, hidden]. The dense part is two
        registry ops around the KV seam (`engine.fused`: native calls on CPU, else torch ops)."""
        q, k, v = self._qkv(self, li, x, positions)  # norm, QKV projection, RoPE
        kv.append(li, k, v)
        attn = kv.attend(li, q)  # [N, Hq, D]
        return self._out(self, li, x, attn)  # output projection, residual, norm, MLP, residual

    def kv_spec(self) -> KVSpec:
        """The KV shape this model writes, as strategies are told it."""
        c = self.cfg
        return KVSpec(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, c.identity,
                      c.num_heads // c.num_kv_heads)  # fmt: skip

    def configure_moe(self, config, profile) -> str | None:
        """Apply a config's [moe] settings (a dense model has none to apply)."""
        return None

    def memory_report(self) -> ModelReport:
        """The weights' formats (tensors and bytes per format); the kernels are reported by
        the engine from `operators` (every model class has them), and the GGUF types that were
        decoded to float at load for want of a native kernel ("dequantized")."""
        return ModelReport(weights=weight_formats(self), dequantized=tuple(self.dequantized),
                           huge_pages=self.huge_pages)  # fmt: skip

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCache,
        batch: StepBatch,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one packed step and return logits [M, V] for `logits_rows` (all rows if None).

        tokens, positions: [N] for the N new tokens of `batch`, packed in batch order. Runs in
        inference mode: a caller's loop that is in it already saves entering it each step (a
        few calls, each slow right after a step: docs/kernels.md, "Fixed costs of a step").
        """
        if torch.is_inference_mode_enabled():
            return self._forward(tokens, positions, kv, batch, logits_rows)
        with torch.inference_mode():
            return self._forward(tokens, positions, kv, batch, logits_rows)

    def decodes(self, n: int) -> bool:
        """Whether `decode` can run for n sequences on the model's side (a native step whose
        every sub-step reads its input rows from the packed embedding table), as far as the
        cache allows (`KVCache.sequential`)."""
        return fused.decodes(self, n)

    def decode(self, tokens: list[int], positions: list[int], kv: KVCache, seq_ids: list[int],
               steps: int, spec: torch.Tensor | None = None, draws: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """`steps` decode steps of the sequences `seq_ids` in one native call (multi-step
        decoding), `tokens` and `positions` their first step's (one per sequence): (tokens
        int64 [steps, N]: each step's argmax, torch.argmax's pick, or where `spec` float64
        [N, 4] (`engine.sampling.spec`) says a temperature above 0 its draw with the uniform
        numbers `draws` float64 [steps, N] (`engine.sampling.draw`'s), which the next step fed;
        logits float32 [steps, N, V]), every token's KV committed. None, with nothing
        changed, where it cannot run so (the cache's `KVCache.sequential` said fewer steps,
        the model's step is not the native one, or gemv.c refused): step by step instead. A
        cache that scores tokens by their surprisal (`wants_token_logprobs`) gets every row's
        log-probabilities after the commit, as its steps would have given them.

        Why: between two steps' native calls the caller's Python runs with cold caches,
        0.5-0.7 ms of a 4-5 ms SmolLM2 step on a 2-core CPU; here `steps` steps share it."""
        if steps < 2 or not self.decodes(len(seq_ids)):
            return None
        if any(kv.sequential(sid, steps) < steps for sid in seq_ids):
            return None
        pos = torch.tensor([p + j for p in positions for j in range(steps)], dtype=torch.long)
        batch = StepBatch(list(seq_ids), [steps] * len(seq_ids), sequential=True)
        with torch.inference_mode():
            kv.begin_step(batch)
            try:
                got = fused.decode_native(self, torch.tensor(tokens, dtype=torch.long), pos, kv,
                                          steps, spec, draws)  # fmt: skip
            except BaseException:
                kv.abort_step()
                raise
            if got is None:
                kv.abort_step()
                return None
            kv.end_step()
            if kv.wants_token_logprobs:  # every row's, as its steps would have given them
                out, logits = got
                fed = torch.cat([torch.tensor(tokens)[None], out[:-1]]).t().reshape(-1)
                rows = logits.transpose(0, 1).reshape(fed.shape[0], -1)  # sequence by sequence
                kv.observe_logprobs(batch, fed, torch.log_softmax(rows.float(), dim=-1))
        return got

    def _forward(self, tokens, positions, kv: KVCache, batch: StepBatch, logits_rows):
        kv.begin_step(batch)
        try:
            # The logits before the commit: a failure here rolls the step back too, so the
            # engine may run the requests again (nothing is appended twice). A cache that
            # scores tokens by their surprisal sees every row's next-token distribution (the
            # whole step's logits: one lm_head pass per prefill token).
            rows = None if kv.wants_token_logprobs else logits_rows
            logits = self._step(self, tokens, positions, kv, rows)
        except BaseException:
            kv.abort_step()
            raise
        kv.end_step()
        if kv.wants_token_logprobs:
            kv.observe_logprobs(batch, tokens, torch.log_softmax(logits.float(), dim=-1))
            return logits if logits_rows is None else logits[logits_rows]
        return logits


def weight_formats(model: LlamaModel) -> dict[str, WeightFormat]:
    """Per stored weight format: how many (fused) linear layers hold it, their bytes, and (a
    GGUF format) which kernel runs it packed, or why it was decoded at load ("how"). Kept on
    the model until a kernel builds another form of a packed weight (`linear.forms_built`)."""
    kept = model.__dict__.get("_weight_formats")
    if kept is not None and kept[0] == linear.forms_built:
        return kept[1]
    out = _weight_formats(model)
    model.__dict__["_weight_formats"] = (linear.forms_built, out)
    return out


def _bytes(lin) -> int:
    """The bytes a Linear's weight holds (every form of a packed one)."""
    w = lin.weight
    return w.nbytes if hasattr(w, "nbytes") else w.weight.numel() * w.weight.element_size()


def step_weight_bytes(model: LlamaModel) -> int:
    """The weight bytes a decode step reads: `weight_formats`' all but an untied embedding
    table, of which a step reads one row a token."""
    total = sum(w.bytes for w in weight_formats(model).values())
    return total - (_bytes(model.embed) if model.embed is not model.lm_head else 0)


def _weight_formats(model: LlamaModel) -> dict[str, WeightFormat]:
    out: dict[str, WeightFormat] = {}
    lins = [model.lm_head, *(x for layer in model.layers for x in layer[1:3] + layer[4:6])]
    if model.embed is not model.lm_head:
        lins.append(model.embed)
    for lin in (part for x in lins for part in layer_parts(x)):  # a stack's parts
        w = lin.weight
        nbytes = _bytes(lin)
        entry = out.setdefault(lin.fmt, WeightFormat())
        entry.layers += 1
        entry.bytes += nbytes
        note = getattr(lin, "note", "")
        if note and getattr(w, "rows16", None) is not None:
            note += ", rows interleaved by 16"
        if note and note not in entry.how:
            entry.how.append(note)
    return out
