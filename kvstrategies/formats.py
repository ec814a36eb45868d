"""The format axis: how a block's K/V bytes are laid out and attended.

A format is implemented by a `KVStrategy` class that stores and attends (`full.FullStrategy`:
dense K/V in one dtype, attended as views of the arena; `hybrid.HybridStrategy`: packed byte
records of fp16 and integer channels, attended on the packed form); a `KVFormat` entry names
that class and the options the format fixes, so `fp16` is the dense class with `dtype` fixed
and `int8` the packed class with every channel at 8 bits. What does not live here: where
blocks live (`placement`), which tokens keep KV (`selection`), the one composition
(`composed`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import KVStrategy


@dataclass(frozen=True, slots=True)
class KVFormat:
    """One format: the strategy class that stores and attends it, and what it fixes."""

    name: str
    help: str
    impl: str  # "dense" (full.py) or "packed" (hybrid.py)
    fixed: Mapping[str, Any] = field(default_factory=dict)  # options the format sets
    # What it needs recorded from the model (None: what its class needs); int8 has one
    # channel class, so the order a calibration gives changes nothing.
    needs: frozenset[str] | None = None
    # |attend - exact| the contract tests accept, and whether it is exact (None: the class's).
    tolerance: float | None = None
    lossless: bool | None = None

    @property
    def base(self) -> type[KVStrategy]:
        """The strategy class that lays out, writes and attends this format."""
        return load(_IMPLS[self.impl])


# NOTE: classes are named by path and imported on use, as the strategy registry does: the
# implementing modules import the registry, so importing them here would be a cycle.
_IMPLS = {
    "dense": "unikv.kvstrategies.full:FullStrategy",
    "packed": "unikv.kvstrategies.hybrid:HybridStrategy",
}


def load(path: str) -> Any:
    """The object `module:name` names, its module imported."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


# int8: every key channel at 8 bits over a block's tokens (per channel), every value at 8 bits
# per token; the hybrid record with one channel class and fp16 sinks.
_INT8 = {
    "fp16_share": 0.0, "bits": 8, "low_share": 0.0, "low_bits": 8, "v_fp16_share": 0.0,
    "v_low_share": 0.0, "scales": "fp16", "method": "score_error", "calibration": None,
    "calibration_text": None, "calibration_samples": 100, "calibration_window": 256,
    "recalibrate": False,
}  # fmt: skip

FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("fp32", "K and V as float32", "dense", {"dtype": "float32"}),
        # Rounded K and V on the contract's N(0, 1) data: attention within 2^-6 and 2^-8.
        KVFormat("bf16", "K and V as bfloat16", "dense", {"dtype": "bfloat16"},
                 tolerance=2**-6, lossless=False),
        KVFormat("fp16", "K and V as float16", "dense", {"dtype": "float16"},
                 tolerance=2**-8, lossless=False),
        KVFormat("int8", "int8 keys per channel, values per token (fp16 sinks)", "packed",
                 _INT8, needs=frozenset()),
        KVFormat("hybrid", "fp16 important channels + int4 (and int2) packed channels",
                 "packed"),
    )
}  # fmt: skip

# A chip profile's kv_precision -> the format it picks.
BY_PRECISION = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "int8": "int8",
                "fp16+int4": "hybrid"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class AxisEntry:
    """One placement or selection: name, help, and the mixin a composed strategy puts before
    its format's class (`module:Class`; None: the format's own behaviour)."""

    name: str
    help: str
    mixin_path: str | None = None

    @property
    def mixin(self) -> type | None:
        """The mixin class, imported on use; None for the format's own behaviour."""
        return None if self.mixin_path is None else load(self.mixin_path)


def lookup(kind: str, table: Mapping[str, Any], name: str) -> Any:
    """`table[name]`; a ValueError names the axis and lists its entries."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown KV {kind} {name!r}; {kind}s: {', '.join(table)}") from None


def get(name: str) -> KVFormat:
    """The format called `name`; a ValueError lists the formats."""
    return lookup("format", FORMATS, name)


def for_precision(precision: str) -> str:
    """The format a chip profile's `kv_precision` picks."""
    try:
        return BY_PRECISION[precision]
    except KeyError:
        raise ValueError(
            f"kv_precision {precision!r}: expected one of {', '.join(BY_PRECISION)}"
        ) from None
