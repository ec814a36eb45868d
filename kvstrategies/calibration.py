"""The channel-importance evaluator of `hybrid_fp16_int4`, and its calibration file.

Run once on warm-up text: the engine prefills `samples` windows of `window` tokens through a
recording cache (`ChannelRecorder`) that sees every layer's queries, keys and values, and keeps
per-channel sums (`engine.recording` drives the model; nothing here does).
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
engine recomputes it only when asked to (option `recalibrate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from unikv.settings import config

from .kv import ContiguousKVCache, KVSpec

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
        from unikv.storage.files import torch_save_atomic

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


class ChannelRecorder(ContiguousKVCache):
    """A plain cache that also accumulates the channel statistics of everything it sees.

    The engine prefills warm-up windows through it (`engine.recording`); `to_stats` then gives
    the `ChannelStats` a calibration file holds. The recorder never runs the model itself.
    """

    def __init__(self, spec: KVSpec, block: int) -> None:
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

    def to_stats(self, identity: str, wo_sq: torch.Tensor) -> ChannelStats:
        """The statistics gathered so far, with the output projection's column norms `wo_sq`
        [layers, kv_heads, head_dim] (zeros for a latent cache, which has no values)."""
        return ChannelStats(
            identity=identity,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            tokens=self.tokens,
            k_blocks=self.k_blocks,
            wo_sq=wo_sq,
            **self.sums,
        )


WARMUP_TEXT = Path(resources.files(__package__) / "data" / "warmup.txt")
# Calibrations shipped for the packaged models (computed with the defaults below on the warm-up
# text), so a first run does not spend 30-75 s on a 2-core CPU computing one.
SHIPPED_DIR = Path(resources.files(__package__) / "data")
DEFAULT_SAMPLES, DEFAULT_WINDOW = 100, 256


def shipped_path(identity: str) -> Path | None:
    """The calibration shipped with the package for model `identity`, if there is one."""
    path = SHIPPED_DIR / default_path(identity).name
    return path if path.is_file() else None


def default_path(identity: str) -> Path:
    """The per-model calibration file under unikv's cache root (`settings.config.cache_dir`)."""
    import hashlib

    root = config.cache_dir()
    slug = "".join(c if c.isalnum() else "-" for c in identity)[:60]
    digest = hashlib.blake2b(identity.encode(), digest_size=6).hexdigest()
    return root / "calibration" / f"{slug}-{digest}.pt"
