"""Helpers shared by the benchmarks: timing with warm-up and medians, result printing."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

# (hidden, ffn, layers, heads, kv heads, vocab) of real models, for benchmarks of random weights
# (cuda_graphs.py; random_gguf.py, which takes SmolLM2's vocabulary instead)
MODEL_SHAPES = {
    "smollm2-135m": (576, 1536, 30, 9, 3, 49152),
    "llama-1b": (2048, 8192, 16, 32, 8, 128256),  # Llama 3.2 1B
}


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(cases: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict:
    """Run each case `warmup` times, then `repeats` rounds A,B,A,B...; return median seconds."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            samples[name].append(timed(fn))
    return {name: statistics.median(s) for name, s in samples.items()}


@contextlib.contextmanager
def env_set(name: str, value: str):
    """The environment variable `name` set to `value` inside the block, then as it was (a
    switch read when a model loads: two models of one process built each way)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def environment() -> dict:
    """What the numbers were measured on."""
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def named_options(text: str) -> tuple[str, dict]:
    """`NAME:key=value,...` (a strategy or scorer and options over its defaults) as the name
    and the options, each value an int, a float or else the string given."""
    name, _, extra = text.partition(":")
    opts = {}
    for item in filter(None, extra.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{text!r}: expected NAME:key=value,..., got {item!r}")
        for kind in (int, float, str):
            try:
                opts[key] = kind(value)
                break
            except ValueError:
                continue
    return name, opts


def report(name: str, rows: list[dict], columns: list[str], extra: dict | None = None) -> None:
    """Print a human table, then one JSON line with everything."""
    widths = [max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))
    print(json.dumps({"benchmark": name, "rows": rows, **(extra or {}), "env": environment()}))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
    return "" if v is None else str(v)
