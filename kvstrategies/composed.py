"""The one composition: a strategy as format x placement x selection.

`compose(format, placement, selection)` builds the strategy class from the format's class
(`formats`: what stores and attends), the placement's mixin (`placement`: tiered moves
blocks) and the selection's mixin (`selection`: pruned evicts tokens), bases in that order
(selection, placement, format), options merged from the three (a name two declare is the
format's: `sink_tokens` of a pruned hybrid is both the fp16 sinks and the never-pruned
ones). A composed strategy is named `FORMAT+PLACEMENT+SELECTION` (e.g. `hybrid+tiered+all`);
the four presets (`full`, `hybrid_fp16_int4`, `hierarchical_offload`, `learned_prune`) are
registered classes built from the same parts that declare their `axes`.

An axis written `auto` is chosen by the chip profile: the format by its `kv_precision`, the
placement and selection by its bandwidth class (those of the preset that declares itself the
class's default). Combinations that make no sense are refused with the reason (`refusal`).
What does not live here: the registry of presets and the resolution of "auto" by chip
(`registry`), the mechanics of each axis (full.py, hybrid.py, offload.py, prune.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from . import formats, placement, selection
from .options import Option

if TYPE_CHECKING:
    from .base import KVStrategy

SEP = "+"
AXES = ("format", "placement", "selection")
Axes = tuple[str, str, str]


def name_of(axes: Axes) -> str:
    """The composed strategy name of three axis names."""
    return SEP.join(axes)


def parse(name: str) -> Axes | None:
    """(format, placement, selection) of a composed name (axes may be "auto"); None for a
    name that is not composed; a ValueError for a malformed one."""
    if SEP not in name:
        return None
    parts = tuple(name.split(SEP))
    if len(parts) != 3:
        raise ValueError(
            f"strategy {name!r}: a composed strategy is FORMAT+PLACEMENT+SELECTION "
            "(e.g. hybrid+tiered+all)"
        )
    for part, get in zip(parts, (formats.get, placement.get, selection.get), strict=True):
        if part != "auto":
            try:
                get(part)
            except ValueError as e:
                raise ValueError(f"strategy {name!r}: {e}") from None
    return parts  # type: ignore[return-value]


def refusal(axes: Axes) -> str | None:
    """Why a combination makes no sense, or None when it is valid."""
    _, place, sel = axes
    if place == "tiered" and sel == "pruned":
        return (
            "tiered placement with pruned selection: pruning compacts a sequence's old blocks "
            "in place, and tiered placement has moved them off the device; prune to fit the "
            "device (resident) or tier without pruning (all)"
        )
    return None


def combinations() -> list[Axes]:
    """Every valid (format, placement, selection)."""
    return [
        (f, p, s)
        for f in formats.FORMATS
        for p in placement.PLACEMENTS
        for s in selection.SELECTIONS
        if refusal((f, p, s)) is None
    ]


def get(name: str) -> type[KVStrategy]:
    """The class of a composed strategy name (no "auto" axes)."""
    axes = parse(name)
    if axes is None or "auto" in axes:
        raise ValueError(f"strategy {name!r}: not a composed strategy with every axis set")
    return compose(*axes)


@functools.cache
def compose(fmt: str, place: str, sel: str) -> type[KVStrategy]:
    """The strategy class of a valid combination; a ValueError (one line) names a refused
    one and why."""
    axes = (fmt, place, sel)
    why = refusal(axes)
    if why is not None:
        raise ValueError(f"strategy {name_of(axes)!r} is refused: {why}")
    f, p, s = formats.get(fmt), placement.get(place), selection.get(sel)
    base = f.base
    mixins = tuple(m for m in (s.mixin, p.mixin) if m is not None)
    own = tuple(o for o in base.options if o.name not in f.fixed)
    options = _merge(own, *(m.options for m in mixins))
    declared = {o.name for o in options}
    contract = {**base.contract_options}
    for m in mixins:
        contract |= m.contract_options
    attrs = {
        "__doc__": f"{f.help}; {p.help}; {s.help}.",
        "__module__": __name__,
        "name": name_of(axes),
        "axes": axes,
        "fixed": dict(f.fixed),
        "options": options,
        "tolerance": base.tolerance if f.tolerance is None else f.tolerance,
        "lossless": (base.lossless if f.lossless is None else f.lossless) and s.mixin is None,
        "evicts": s.mixin is not None and s.mixin.evicts,
        "default_for": (),
        # Tiered: 64-token blocks, so one SSD value per block and layer reads near bandwidth.
        "default_block_size": max(base.default_block_size, 64 if p.mixin else 0),
        # What a block holds depends on the format's options only (windows move blocks).
        "content_options": tuple(o.name for o in base.options),
        "contract_options": {k: v for k, v in contract.items() if k in declared},
        "needs": base.needs if f.needs is None else f.needs,
    }
    title = "".join(x.capitalize() for x in axes)
    return type(f"{title}Strategy", (*mixins, base), attrs)


def _merge(*groups: tuple[Option, ...]) -> tuple[Option, ...]:
    """Declarations in order, a name declared twice kept once (the first)."""
    seen: dict[str, Option] = {}
    for group in groups:
        for o in group:
            seen.setdefault(o.name, o)
    return tuple(seen.values())
