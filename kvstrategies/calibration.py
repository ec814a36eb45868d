"""The channel-importance evaluator of `hybrid_fp16_int4`, and its calibration file.

Run once on warm-up text: the model prefills `samples` windows of `window` tokens through a
recording cache that sees every layer's queries, keys and values, and keeps per-channel sums.
From them each method ranks the channels of each (layer, KV head), separately for keys and
values (higher = keep more precision):

- ``magnitude``: mean |x| of the channel.
- ``outlier``: max |x| of the channel.
- ``score_error`` (the default, it won the comparison in `benchmarks/kv_quality.py`): the error
  the channel's quantization puts into what the model reads. Keys are quantized per channel over
  a block of tokens, so a key channel's error in the attention score q·k is about
  |q_c| * range_c: the score is E[q_c^2] * E[range_c^2] over the blocks. Values are quantized
  per token across channels, so an outlier channel widens every token's range; its cost is
  E[v_c^2] weighted by how much the output projection amplifies channel c (the squared norm of
  its input column, summed over the query heads that read this KV head).

A latent (MLA) cache stores keys only, its values being the keys' first channels: its channels
are ranked as keys (the value statistics stay zero and the value order is the key order).

The calibration file (`.pt`, a dict of tensors and strings) is keyed by the model identity and
the KV shape: loading it for another model or layout raises `CalibrationMismatch`, and the
strategy recomputes it only when asked to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .kv import ContiguousKVCache, StepBatch

METHODS = ("score_error", "magnitude", "outlier")
TUNED_FILE = "kv_calibration.pt"  # in a checkpoint directory written by `unikv tune`
FORMAT = 1


class CalibrationMismatch(ValueError):
    """A calibration file made for another model or KV layout."""


@dataclass(slots=True)
class ChannelStats:
    """Per-channel sums over the warm-up text, each [layers, kv_heads, head_dim]."""

    identity: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens: int
    k_abs: torch.Tensor  # sum |k|
    k_max: torch.Tensor  # max |k|
    k_range2: torch.Tensor  # sum over token blocks of (max - min)^2
    k_blocks: int
    q_sq: torch.Tensor  # sum q^2 over tokens and the query heads of the group
    v_abs: torch.Tensor
    v_max: torch.Tensor
    v_sq: torch.Tensor
    wo_sq: torch.Tensor  # squared norm of the o_proj input column read by each V channel

    def scores(self, method: str = "score_error") -> tuple[torch.Tensor, torch.Tensor]:
        """(key scores, value scores) for `method`; higher = more important."""
        n = max(self.tokens, 1)
        if method == "magnitude":
            return self.k_abs / n, self.v_abs / n
        if method == "outlier":
            return self.k_max, self.v_max
        if method == "score_error":
            k = (self.q_sq / n) * (self.k_range2 / max(self.k_blocks, 1))
            return k, (self.v_sq / n) * self.wo_sq
        raise ValueError(f"unknown importance method {method!r}; allowed: {', '.join(METHODS)}")

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__slots__} | {"format": FORMAT}

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash mid-write never leaves a half file behind."""
        from storage.files import torch_save_atomic

        torch_save_atomic(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path, identity: str, shape: tuple[int, int, int]) -> ChannelStats:
        """Read a calibration file made for `identity` and (layers, kv_heads, head_dim)."""
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise CalibrationMismatch(f"calibration file {path} is not readable: {e}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise CalibrationMismatch(f"calibration file {path} is not a unikv calibration file")
        got = (raw["num_layers"], raw["num_kv_heads"], raw["head_dim"])
        if raw["identity"] != identity or got != tuple(shape):
            raise CalibrationMismatch(
                f"calibration file {path} was made for model {raw['identity']!r} with KV shape "
                f"(layers, kv_heads, head_dim) = {got}, not for {identity!r} with {tuple(shape)}; "
                "recompute it with `unikv calibrate` (or option recalibrate = true)"
            )
        raw.pop("format")
        return cls(**raw)


class _Recorder(ContiguousKVCache):
    """A plain cache that also accumulates the channel statistics of everything it sees."""

    def __init__(self, model, block: int) -> None:
        spec = model.kv_spec()
        value_dim = spec.v_dim if spec.latent else None
        super().__init__(spec.num_layers, spec.num_kv_heads, spec.head_dim, torch.float32,
                         scale=spec.scale, value_dim=value_dim)  # fmt: skip
        shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
        self.block = block
        self.sums = {n: torch.zeros(shape) for n in ("k_abs", "k_max", "k_range2", "q_sq")}
        self.sums |= {n: torch.zeros(shape) for n in ("v_abs", "v_max", "v_sq")}
        self.tokens = 0
        self.k_blocks = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        super().append(layer, k, v)
        s = self.sums
        k, v = k.float(), v.float()  # [N, Hkv, D]
        s["k_abs"][layer] += k.abs().sum(0)
        s["k_max"][layer] = torch.maximum(s["k_max"][layer], k.abs().amax(0))
        if self.value_dim is None:  # a latent cache's values are its keys
            s["v_abs"][layer] += v.abs().sum(0)
            s["v_max"][layer] = torch.maximum(s["v_max"][layer], v.abs().amax(0))
            s["v_sq"][layer] += v.square().sum(0)
        n = k.shape[0] // self.block * self.block
        if n:
            blocks = k[:n].view(n // self.block, self.block, *k.shape[1:])  # [B, T, Hkv, D]
            rng = blocks.amax(1) - blocks.amin(1)
            s["k_range2"][layer] += rng.square().sum(0)
            if layer == 0:
                self.k_blocks += n // self.block
        if layer == 0:
            self.tokens += k.shape[0]

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        hkv = self.num_kv_heads
        t, hq, d = q.shape
        # q: [N, Hq, D] -> [N, Hkv, G, D]: the query heads that read each KV head
        self.sums["q_sq"][layer] += q.float().view(t, hkv, hq // hkv, d).square().sum((0, 2))
        return super().attend(layer, q)


def collect(
    model,
    ids: list[int],
    samples: int = 100,
    window: int = 256,
    block: int = 64,
    progress: bool = False,
) -> ChannelStats:
    """Prefill `samples` windows of `window` tokens of `ids` and gather channel statistics.

    The windows start at evenly spaced offsets, overlapping when the text is short; a text
    shorter than one window is a ValueError.
    """
    if samples < 1 or window < 2:
        raise ValueError(f"calibration needs samples >= 1 and window >= 2, got {samples}, {window}")
    if len(ids) < window:
        raise ValueError(
            f"calibration text has {len(ids)} tokens; it needs at least one window of {window}"
        )
    cfg = model.cfg
    rec = _Recorder(model, block)
    span = len(ids) - window
    starts = [round(i * span / max(samples - 1, 1)) for i in range(samples)]
    for i, start in enumerate(
        tqdm(starts, desc="calibrating", unit="window", disable=not progress)
    ):
        toks = torch.tensor(ids[start : start + window], device=model.device)
        pos = torch.arange(window, device=model.device)
        model.forward(toks, pos, rec, StepBatch([i], [window]), torch.tensor([window - 1]))
        rec.free(i)
    hkv, d = rec.num_kv_heads, rec.head_dim  # the cache's shape (a latent one for MLA)
    g = cfg.num_heads // hkv
    wo_sq = torch.zeros(cfg.num_layers, hkv, d)  # stays zero for a latent cache: no values
    if rec.value_dim is None:
        for li, layer in enumerate(model.layers):
            w = layer[2].weight.float()  # o_proj as [P, in = Hq * D, out / P]
            wo_sq[li] = w.square().sum((0, 2)).view(hkv, g, d).sum(1)  # [Hkv, D]
    return ChannelStats(
        identity=model.cfg.identity,
        num_layers=cfg.num_layers,
        num_kv_heads=hkv,
        head_dim=d,
        tokens=rec.tokens,
        k_blocks=rec.k_blocks,
        wo_sq=wo_sq,
        **rec.sums,
    )


WARMUP_TEXT = Path(__file__).with_name("data") / "warmup.txt"


def default_path(identity: str) -> Path:
    """The per-model calibration file under `$UNIKV_CACHE_DIR` (default ~/.cache/unikv)."""
    import hashlib

    root = Path(os.environ.get("UNIKV_CACHE_DIR", Path.home() / ".cache" / "unikv"))
    slug = "".join(c if c.isalnum() else "-" for c in identity)[:60]
    digest = hashlib.blake2b(identity.encode(), digest_size=6).hexdigest()
    return root / "calibration" / f"{slug}-{digest}.pt"


def _tuned_calibration(model) -> Path | None:
    """`kv_calibration.pt` of the checkpoint directory the model came from, if it has one."""
    source = getattr(model, "source", None)
    if source is None:
        return None
    path = Path(source) / TUNED_FILE
    return path if path.is_file() else None


def ensure_calibration(model, tokenizer, opts: dict, progress: bool = False) -> Path:
    """The calibration file the options name (or the model's default one), computed if missing
    or if `recalibrate` is set. An existing file for another model raises CalibrationMismatch."""
    from engine.evaluate import read_text

    cfg = model.cfg
    spec = model.kv_spec()
    shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    if opts.get("calibration"):
        path = Path(opts["calibration"])
    elif (tuned := _tuned_calibration(model)) is not None:
        path = tuned  # a tuned checkpoint's own plan (engine.tune): the one it was tuned for
    else:
        path = default_path(cfg.identity)
    if path.exists() and not opts.get("recalibrate"):
        ChannelStats.load(path, cfg.identity, shape)  # refuses another model's file
        return path
    text = read_text(str(opts.get("calibration_text") or WARMUP_TEXT))
    ids = tokenizer.encode(text)
    stats = collect(
        model,
        ids,
        samples=opts.get("calibration_samples", 100),
        window=min(opts.get("calibration_window", 256), len(ids)),
        progress=progress,
    )
    stats.save(path)
    return path
