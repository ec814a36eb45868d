"""Quantization-aware tuning: `unikv tune --kv_optimization=hybrid_fp16_int4`.

What is tuned: the key and value projections of every layer (a delta per weight, zero at the
start: 6.6M parameters for SmolLM2-135M); everything else stays frozen. They are what writes the
cache, and changing them can move information out of the channels the int2/int4 grid hurts.

The loss, per window of `seq_len` tokens (a fresh sequence from position 0, as `eval ppl` runs):

    KL(base, full cache || tuned, hybrid cache) + anchor * KL(base, full cache || tuned, full cache)
      + lambda * q_error

- "tuned, hybrid cache": the model reads its cache as `hybrid_fp16_int4` would store it
  (`FakeQuant`: the strategy's own quantizer, channel plan and block layout; earlier blocks
  quantized, the own block and the sinks at full precision), gradients straight through the
  rounding.
- The target is the *base* model's distribution with a full-precision cache: a language-model
  loss against soft labels. It pulls the quantized model toward what the model did before, not
  toward the tuning text.
- The anchor term keeps the tuned model's full-precision behaviour where it was. Without it the
  full-precision path drifts (measured: its PPL moved by 1.5% while the hybrid one approached
  the base model's), and the gap between the two caches is what the tuning is for.
- `q_error`: the int4/int2 quantization error of keys and values (relative mean square),
  pushing them toward values the grid represents.

Runs are resumable: a checkpoint (tuned deltas, optimizer, schedule, step) is written every
`checkpoint_every` steps and at the end, atomically, so Ctrl-C leaves the last one usable, and
batch windows are a function of (seed, step) so a resumed run draws the same ones. The result is
a Hugging Face checkpoint directory (`--model DIR`) plus `kv_calibration.pt`, the channel plan
the model was tuned for, under the tuned model's identity.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from unikv.storage.files import torch_save_atomic

from .config import ModelConfig
from .model import RotaryTable, rms_norm

CHECKPOINT = "checkpoint.pt"
TUNED = ("attn_k", "attn_v")  # the weights the tuning changes: the cache's writers
FORMAT = 1


class TunableLlama(nn.Module):
    """The engine's Llama decoder as a differentiable batch forward over windows [B, T], with
    frozen weights and tunable K/V projection deltas."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], device="cpu") -> None:
        super().__init__()
        self.cfg, self.device = cfg, torch.device(device)

        def w(name: str) -> torch.Tensor:
            return tensors[name].to(self.device, torch.float32)

        self.embed = w("token_embd.weight")
        self.lm_head = self.embed if cfg.tie_embeddings else w("output.weight")
        self.norm = w("output_norm.weight")
        self.frozen = [
            {n: w(f"blk.{i}.{n}.weight") for n in ("attn_norm", "attn_q", "attn_k", "attn_v",
             "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
            for i in range(cfg.num_layers)
        ]  # fmt: skip
        # One delta per tuned weight, zero at the start: the tuned model begins as the base.
        self.delta = nn.ParameterDict(
            {f"{n}_{i}": nn.Parameter(torch.zeros_like(p[n]))
             for i, p in enumerate(self.frozen) for n in TUNED}
        )  # fmt: skip
        self.rope = RotaryTable(cfg, self.device, torch.float32)

    def forward(self, tokens: torch.Tensor, quant=None, base: bool = False):
        """Logits [B, T, V] and the mean quantization error (0 without `quant`).

        quant: a `FakeQuant` (the cache as hybrid_fp16_int4 stores it) or None (full precision).
        base: ignore the deltas (the model as loaded)."""
        from unikv.kvstrategies.hybrid_qat import read_mask

        cfg = self.cfg
        b, t = tokens.shape
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pos = torch.arange(t, device=self.device)

        def rope(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [B, H, T, D]
            return self.rope.apply(x, pos).transpose(1, 2)

        mask = None if quant is None else read_mask(t, quant.block, quant.sinks, self.device)
        errors = []
        x = F.embedding(tokens, self.embed)
        for i, p in enumerate(self.frozen):
            h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            wk, wv = (self._weight(p, i, n, base) for n in TUNED)
            q = rope((h @ p["attn_q"].T).view(b, t, hq, d))
            k = rope((h @ wk.T).view(b, t, hkv, d))
            v = (h @ wv.T).view(b, t, hkv, d).transpose(1, 2)
            if quant is None:
                k, v = _groups(k, hq), _groups(v, hq)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                kq, vq, err = quant(i, k, v)
                errors.append(err)
                k = _groups(torch.cat([kq, k], 2), hq)  # keys [quantized | full precision]
                v = _groups(torch.cat([vq, v], 2), hq)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + o.transpose(1, 2).reshape(b, t, hq * d) @ p["attn_output"].T
            h = rms_norm(x, p["ffn_norm"], cfg.rms_norm_eps)
            x = x + (F.silu(h @ p["ffn_gate"].T) * (h @ p["ffn_up"].T)) @ p["ffn_down"].T
        logits = rms_norm(x, self.norm, cfg.rms_norm_eps) @ self.lm_head.T
        err = torch.stack(errors).mean() if errors else logits.new_zeros(())
        return logits, err

    def _weight(self, p: dict[str, torch.Tensor], layer: int, name: str, base: bool):
        if base:
            return p[name]
        return p[name] + self.delta[f"{name}_{layer}"]

    def merged(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` with the tuned weights folded in."""
        out = dict(tensors)
        for i in range(self.cfg.num_layers):
            for name in TUNED:
                key = f"blk.{i}.{name}.weight"
                out[key] = (
                    tensors[key].float() + self.delta[f"{name}_{i}"].detach().cpu()
                ).contiguous()
        return out


def check_tunable(cfg, kv_optimization: str) -> None:
    """`unikv tune` trains on Llama-family caches (separate per-head keys and values)."""
    if cfg.mla is not None:
        raise ValueError(
            f"unikv tune --kv_optimization={kv_optimization} supports Llama-family models; "
            f"{cfg.name} ({cfg.architecture}) has a latent (MLA) cache, not supported yet"
        )


def _check_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: torch sees no CUDA device here")
    return dev


def _kl(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean KL(target || softmax(logits)) per token; target as log-probabilities."""
    logp = F.log_softmax(logits, -1)
    return F.kl_div(logp, target, log_target=True, reduction="none").sum(-1).mean()


def _groups(x: torch.Tensor, hq: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hq, S, D]: each KV head repeated for its query heads."""
    return x.repeat_interleave(hq // x.shape[1], dim=1)


@dataclass(frozen=True)
class TuneSettings:
    """Everything that decides a run's result: a resumed run must match it."""

    steps: int = 45
    lr: float = 3e-5
    seq_len: int = 512
    batch: int = 2
    lam: float = 1.0  # weight of the quantization-error term
    anchor: float = 1.0  # weight of KL(base, full cache || tuned, full cache)
    clip: float = 1.0  # gradient norm clipping
    seed: int = 0
    warmup: int = 5  # linear warm-up steps, then cosine decay to zero

    def check(self) -> None:
        for name in ("steps", "seq_len", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        for flag, value in (("--lambda", self.lam), ("--anchor", self.anchor)):
            if not value >= 0 or not math.isfinite(value):
                raise ValueError(f"{flag} must be a number >= 0, got {value}")


@dataclass(slots=True)
class TuneResult:
    out: Path
    steps: int
    seconds: float  # this invocation's training time
    tokens_per_s: float
    kl: float  # means over the last tenth of the steps: hybrid cache vs the base model
    kl_full: float  # full cache vs the base model
    q_error: float
    identity: str


def batch_windows(n_ids: int, settings: TuneSettings, step: int) -> list[int]:
    """Window starts of `step`: a function of (seed, step) only, so a resumed run draws the same."""
    g = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    return torch.randint(0, n_ids - settings.seq_len + 1, (settings.batch,), generator=g).tolist()


def _lr_factor(step: int, s: TuneSettings) -> float:
    if step < s.warmup:
        return (step + 1) / s.warmup
    return 0.5 * (1 + math.cos(math.pi * (step - s.warmup) / max(1, s.steps - s.warmup)))


def tune_hybrid(
    model: str,
    text: str,
    out: str | os.PathLike[str],
    settings: TuneSettings,
    options: dict[str, Any] | None = None,
    resume: bool = False,
    checkpoint_every: int = 10,
    device: str | torch.device = "cpu",
    progress: bool = True,
    on_step: Callable[[int], None] | None = None,
) -> TuneResult:
    """Tune `model` (a name, .gguf path or checkpoint directory) on `text` for the
    hybrid_fp16_int4 setting `options`; write the tuned checkpoint directory `out`.

    `on_step(step)` is called after each step's checkpoint decision (tests interrupt there)."""
    from unikv import kvstrategies
    from unikv.kvstrategies.hybrid_qat import FakeQuant
    from unikv.kvstrategies.packed import channel_plan

    from .loading import load_weights
    from .model import LlamaModel
    from .recording import ensure_calibration

    settings.check()
    device = _check_device(device)
    hybrid = kvstrategies.get("hybrid_fp16_int4")
    block = hybrid.default_block_size
    if settings.seq_len % block:
        raise ValueError(f"--seq-len must be a multiple of the block size {block}")
    out = Path(out)
    ckpt_path = _checkpoint_path(out, resume)
    opts = hybrid.check_options(options)
    cfg, tensors, tokenizer, source = load_weights(model, progress=progress)
    check_tunable(cfg, "hybrid_fp16_int4")
    ids = tokenizer.encode(text)
    need = settings.batch * settings.seq_len
    _check_text(len(ids), need, settings.seq_len, cfg.context_length)
    # The channel plan the tuning targets: the base model's calibration (computed if missing).
    base = LlamaModel(cfg, tensors)
    base.source = source  # a tuned model keeps its own plan
    cal = ensure_calibration(base, tokenizer, opts, progress=progress)
    del base
    spec = kvstrategies.KVSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                               identity=cfg.identity)  # fmt: skip
    opts = {**opts, "calibration": str(cal)}
    plan = channel_plan(spec, opts)
    quant = FakeQuant(spec, opts, plan, block, device)

    net = TunableLlama(cfg, tensors, device)
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, settings))
    run = {"model": cfg.identity, "text": _digest(ids), "settings": dataclasses.asdict(settings),
           "options": {k: opts[k] for k in _QUANT_KEYS}}  # fmt: skip
    step, history = 0, []
    if resume:
        step, history = _resume(ckpt_path, device, run, net, opt, sched)
    out.mkdir(parents=True, exist_ok=True)

    def checkpoint() -> None:
        torch_save_atomic({"format": FORMAT, "run": run, "step": step, "history": history,
                      "params": net.state_dict(), "optimizer": opt.state_dict(),
                      "scheduler": sched.state_dict()}, ckpt_path)  # fmt: skip

    t0, first = time.perf_counter(), step
    bar = tqdm(total=settings.steps, initial=step, desc="tuning K/V projections", unit="step",
               disable=not progress)  # fmt: skip
    try:
        while step < settings.steps:
            starts = batch_windows(len(ids), settings, step)
            toks = torch.tensor([ids[s : s + settings.seq_len] for s in starts], device=device)
            kl, kl_full, qerr = _train_step(net, quant, opt, params, toks, settings)
            sched.step()
            step += 1
            history.append((kl.item(), kl_full.item(), qerr.item()))
            if step % checkpoint_every == 0 or step == settings.steps:
                checkpoint()
            rate = (step - first) * need / (time.perf_counter() - t0)
            bar.update(1)
            bar.set_postfix(kl=f"{kl.item():.4f}", kl_full=f"{kl_full.item():.4f}",
                            q_err=f"{qerr.item():.4f}", tok_s=f"{rate:.0f}")  # fmt: skip
            if on_step is not None:
                on_step(step)
    except KeyboardInterrupt:
        bar.close()
        done = torch.load(ckpt_path, weights_only=True)["step"] if ckpt_path.exists() else 0
        print(f"interrupted: {ckpt_path} holds step {done} of {settings.steps}; "
              "continue with --resume")  # fmt: skip
        raise
    bar.close()
    seconds = time.perf_counter() - t0

    tuned_cfg = _save_tuned(out, cfg, net.merged(tensors), tokenizer, cal)
    return _result(out, cfg, tuned_cfg, run, history, step, first, seconds, need)


def _save_tuned(out: Path, cfg, tensors, tokenizer, calibration: Path):
    """The tuned model as an HF checkpoint directory, then the base model's calibration under
    the tuned model's identity; the tuned model's config."""
    from unikv.kvstrategies.calibration import TUNED_FILE, ChannelStats

    from .hf_loader import checkpoint_config, save_hf

    save_hf(cfg, tensors, tokenizer, out)
    tuned_cfg, _ = checkpoint_config(out)
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    stats = ChannelStats.load(calibration, cfg.identity, shape)
    stats.identity = tuned_cfg.identity
    stats.save(out / TUNED_FILE)
    return tuned_cfg


def _checkpoint_path(out: Path, resume: bool) -> Path:
    """Where the run's checkpoint lives; a ValueError for a resume with none, or a new run
    into a directory that holds something."""
    ckpt_path = out / CHECKPOINT
    if resume and not ckpt_path.exists():
        raise ValueError(f"nothing to resume: {ckpt_path} does not exist")
    if not resume and out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; pass --resume to continue a run there")
    return ckpt_path


def _check_text(n_ids: int, need: int, seq_len: int, context: int) -> None:
    """A ValueError when the text cannot fill one batch or a window exceeds the context."""
    if n_ids < need:
        raise ValueError(
            f"the text has {n_ids} tokens; one batch needs --batch x --seq-len = {need}"
        )
    if seq_len > context:
        raise ValueError(f"--seq-len {seq_len} exceeds the context of {context}")


def _resume(ckpt_path: Path, device, run: dict, net, opt, sched) -> tuple[int, list]:
    """Load a tuning checkpoint into the network, optimizer and schedule: (step, history). A
    checkpoint of another run (model, text, settings, options) is refused, naming what
    differs."""
    ck = torch.load(ckpt_path, map_location=device, weights_only=True)
    if ck.get("format") != FORMAT:
        raise ValueError(f"{ckpt_path}: not a unikv tuning checkpoint of format {FORMAT}")
    for key, value in run.items():
        if ck["run"].get(key) != value:
            raise ValueError(
                f"--resume: {key} differs from the checkpoint's ({ck['run'].get(key)!r} "
                f"there, {value!r} now); resume with the same arguments"
            )
    net.load_state_dict(ck["params"])
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    return ck["step"], ck["history"]


def _train_step(net, quant, opt, params, toks, settings: TuneSettings):
    """One optimizer step on the windows `toks`: KL of the quantized-KV model to the base
    model, plus `anchor` x the unquantized model's KL and `lam` x the quantization error.
    Returns (kl, kl_full, q_err) as tensors."""
    with torch.no_grad():
        target = F.log_softmax(net(toks, base=True)[0], -1)
    opt.zero_grad(set_to_none=True)
    # One graph at a time: the two passes' gradients add up.
    kl_full = torch.zeros(())
    if settings.anchor:
        kl_full = _kl(target, net(toks)[0])
        (settings.anchor * kl_full).backward()
    logits, qerr = net(toks, quant)
    kl = _kl(target, logits)
    (kl + settings.lam * qerr).backward()
    del logits
    torch.nn.utils.clip_grad_norm_(params, settings.clip)
    opt.step()
    return kl, kl_full, qerr


def _result(out: Path, cfg, tuned_cfg, run: dict, history: list, step: int, first: int,
            seconds: float, need: int) -> TuneResult:  # fmt: skip
    """The run's result, its record written to `out/unikv_tune.json`."""
    tail = history[-max(1, len(history) // 10) :]
    res = TuneResult(out, step, seconds, (step - first) * need / max(seconds, 1e-9),
                     *(sum(h[i] for h in tail) / len(tail) for i in range(3)),
                     tuned_cfg.identity)  # fmt: skip
    meta = {"base_model": cfg.identity, "tuned_model": tuned_cfg.identity, "run": run,
            "history": history, "seconds_last_invocation": seconds}  # fmt: skip
    (out / "unikv_tune.json").write_text(json.dumps(meta, indent=1, default=str))
    return res


# The options that decide what the cache stores (and so what the tuning adapts to).
_QUANT_KEYS = ("fp16_share", "bits", "low_share", "low_bits", "v_fp16_share", "v_low_share",
               "scales", "sink_tokens", "method")  # fmt: skip


def _digest(ids: list[int]) -> str:
    """A short digest of the tuning tokens: a resumed run must read the same text."""
    return hashlib.blake2b(torch.tensor(ids).numpy().tobytes(), digest_size=8).hexdigest()
