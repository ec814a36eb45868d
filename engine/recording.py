"""The engine runs the model for the strategies that learn from what a model writes.

Strategies never drive the model: a strategy declares what it needs (`KVStrategy.needs`), and
this module runs the model over text windows through the recording cache the strategy's package
provides, then hands over what was recorded:

- ``"channel_stats"`` (`hybrid_fp16_int4`): per-channel statistics of queries, keys and values
  (`kvstrategies.calibration.ChannelRecorder`), saved as the calibration file the strategy's
  option `calibration` names (`ensure_calibration`, `collect_channel_stats`);
- the pruning head of `learned_prune` is trained on the attention each token receives
  (`kvstrategies.prune_head.TargetRecorder`, then `prune_head.fit`): `train_prune_head`.

What does not live here: the statistics, the head and their files (`kvstrategies/`).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from unikv.kvstrategies.calibration import (
    DEFAULT_SAMPLES,
    DEFAULT_WINDOW,
    TUNED_FILE,
    WARMUP_TEXT,
    ChannelRecorder,
    ChannelStats,
    default_path,
    shipped_path,
)
from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch
from unikv.kvstrategies.prune_head import TargetRecorder, TrainResult, fit

from .evaluate import read_text
from .model import LlamaModel


def _window_starts(num_ids: int, windows: int, window: int) -> list[int]:
    """`windows` evenly spaced start offsets of `window`-token windows over `num_ids` tokens
    (overlapping when the text is short)."""
    span = num_ids - window
    return [round(i * span / max(windows - 1, 1)) for i in range(windows)]


def prefill_windows(
    model: LlamaModel,
    ids: list[int],
    starts: list[int],
    window: int,
    cache: Callable[[], ContiguousKVCache],
    desc: str,
    progress: bool = False,
) -> Iterator[ContiguousKVCache]:
    """Prefill each window of `ids` through the cache `cache()` returns (a new one per window
    or the same one), yielding the cache after each window; the window's KV is freed after."""
    for i, start in enumerate(tqdm(starts, desc=desc, unit="window", disable=not progress)):
        rec = cache()
        toks = torch.tensor(ids[start : start + window], device=model.device)
        pos = torch.arange(window, device=model.device)
        model.forward(toks, pos, rec, StepBatch([i], [window]), torch.tensor([window - 1]))
        yield rec
        rec.free(i)


def collect_channel_stats(
    model: LlamaModel,
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
    rec = ChannelRecorder(model.kv_spec(), block)
    starts = _window_starts(len(ids), samples, window)
    for _ in prefill_windows(model, ids, starts, window, lambda: rec, "calibrating", progress):
        pass
    return rec.to_stats(model.cfg.identity, _output_column_norms(model, rec))


def _output_column_norms(model: LlamaModel, rec: ChannelRecorder) -> torch.Tensor:
    """Per (layer, KV head, channel): the squared norm of the output projection's input column
    that value channel feeds, summed over the query heads that read the KV head. Zeros for a
    latent cache, which stores no values."""
    cfg = model.cfg
    hkv, d = rec.num_kv_heads, rec.head_dim  # the cache's shape (a latent one for MLA)
    g = cfg.num_heads // hkv
    wo_sq = torch.zeros(cfg.num_layers, hkv, d)
    if rec.value_dim is None:
        for li, layer in enumerate(model.layers):
            w = layer[2].to_dense()  # o_proj as [out, in = Hq * D], decoded if packed
            wo_sq[li] = w.square().sum(0).view(hkv, g, d).sum(1)  # [Hkv, D]
    return wo_sq


def _tuned_calibration(model: LlamaModel) -> Path | None:
    """`kv_calibration.pt` of the checkpoint directory the model came from, if it has one."""
    source = getattr(model, "source", None)
    if source is None:
        return None
    path = Path(source) / TUNED_FILE
    return path if path.is_file() else None


def ensure_calibration(model: LlamaModel, tokenizer, opts: dict, progress: bool = False) -> Path:
    """The calibration file the options name (or the model's default one), computed if missing
    or if `recalibrate` is set. An existing file for another model raises CalibrationMismatch."""
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
    samples = opts.get("calibration_samples", DEFAULT_SAMPLES)
    window = opts.get("calibration_window", DEFAULT_WINDOW)
    shipped = shipped_path(cfg.identity)
    defaults = not opts.get("calibration_text") and (samples, window) == (
        DEFAULT_SAMPLES, DEFAULT_WINDOW)  # fmt: skip
    if (
        shipped is not None
        and path == default_path(cfg.identity)
        and defaults
        and not opts.get("recalibrate")
    ):
        ChannelStats.load(shipped, cfg.identity, shape)
        return shipped  # the packaged model's, computed with these very settings
    text = read_text(str(opts.get("calibration_text") or WARMUP_TEXT))
    ids = tokenizer.encode(text)
    stats = collect_channel_stats(
        model, ids, samples=samples, window=min(window, len(ids)), progress=progress
    )
    stats.save(path)
    return path


def prepare_options(
    needs: frozenset[str], model: LlamaModel, tokenizer, options: dict[str, Any], progress: bool
) -> dict[str, Any]:
    """Options completed with what a strategy `needs` from the model (checked options in)."""
    unknown = needs - {"channel_stats"}
    if unknown:
        raise RuntimeError(f"a strategy needs {sorted(unknown)}, which the engine cannot record")
    if "channel_stats" in needs:
        path = ensure_calibration(model, tokenizer, options, progress=progress)
        options = {**options, "calibration": str(path), "recalibrate": False}
    return options


def train_prune_head(
    model: LlamaModel,
    ids: list[int],
    windows: int = 48,
    window: int = 512,
    per_window: int = 96,
    min_later: int = 64,
    gap: int = 0,
    epochs: int = 6,
    lr: float = 2e-3,
    batch: int = 4096,
    seed: int = 0,
    progress: bool = False,
    per_layer: bool = False,
) -> TrainResult:
    """Record attention targets over `windows` windows of `ids` through the frozen `model`,
    then train a pruning head on them (`kvstrategies.prune_head.fit`)."""
    if len(ids) < window:
        raise ValueError(f"the text has {len(ids)} tokens; training needs at least {window}")
    t0 = time.perf_counter()
    min_later = max(min_later, gap + 1)
    spec = model.kv_spec()
    rng = random.Random(seed)
    starts = _window_starts(len(ids), windows, window)
    xs, ls, ys = [], [], []
    for rec in prefill_windows(model, ids, starts, window, lambda: TargetRecorder(spec, gap),
                               "attention targets", progress):  # fmt: skip
        x, lay, y = rec.samples(rng, per_window, min_later)
        xs.append(x)
        ls.append(lay)
        ys.append(y)
    res = fit(torch.cat(xs), torch.cat(ls), torch.cat(ys), windows, spec.num_layers,
              spec.head_dim, epochs=epochs, lr=lr, batch=batch, seed=seed, progress=progress,
              per_layer=per_layer)  # fmt: skip
    return dataclasses.replace(res, seconds=time.perf_counter() - t0)
