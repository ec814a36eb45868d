"""The one composition: a strategy as format x placement x selection.

A composed strategy is named `FORMAT+PLACEMENT+SELECTION` (e.g. `hybrid+tiered+all`) and is a
`Recipe` of the three registered axis classes (`axes.FORMATS`, `PLACEMENTS`, `SELECTIONS`);
the presets (`registry.PRESETS`) are named triples of the same axes. An axis written `auto` is
chosen by the chip profile: the format by its `kv_precision`, the placement and selection by
its bandwidth class (those of the preset that is the class's default). Combinations that make
no sense are refused with the reason (`refusal`). What does not live here: the presets and the
resolution of "auto" by chip (`registry`), the mechanics of each axis (their modules).
"""

from __future__ import annotations

import functools

from .axes import FORMATS, PLACEMENTS, SELECTIONS
from .strategy import Recipe

SEP = "+"
AXES = ("format", "placement", "selection")
Axes = tuple[str, str, str]
_REGISTRIES = (FORMATS, PLACEMENTS, SELECTIONS)

# A chip profile's kv_precision -> the format it picks.
BY_PRECISION = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "int8": "int8",
                "fp16+int4": "hybrid"}  # fmt: skip


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
    for part, registry in zip(parts, _REGISTRIES, strict=True):
        if part != "auto":
            try:
                registry.get(part)
            except ValueError as e:
                raise ValueError(f"strategy {name!r}: {e}") from None
    return parts  # type: ignore[return-value]


def refusal(axes: Axes) -> str | None:
    """Why a combination makes no sense, or None when it is valid."""
    _, place, sel = axes
    if PLACEMENTS.get(place).name == "tiered" and SELECTIONS.get(sel).evicts:
        return (
            f"tiered placement with {sel} selection: pruning compacts a sequence's old blocks "
            "in place, and tiered placement has moved them off the device; prune to fit the "
            "device (resident) or tier without pruning (all)"
        )
    return None


def combinations() -> list[Axes]:
    """Every valid (format, placement, selection)."""
    return [
        (f, p, s)
        for f in FORMATS.names()
        for p in PLACEMENTS.names()
        for s in SELECTIONS.names()
        if refusal((f, p, s)) is None
    ]


def get(name: str) -> Recipe:
    """The recipe of a composed strategy name (no "auto" axes)."""
    axes = parse(name)
    if axes is None or "auto" in axes:
        raise ValueError(f"strategy {name!r}: not a composed strategy with every axis set")
    return compose(*axes)


@functools.cache
def compose(fmt: str, place: str, sel: str, name: str | None = None,
            default_for: tuple[str, ...] = ()) -> Recipe:  # fmt: skip
    """The recipe of a valid combination (named `name`, by default FORMAT+PLACEMENT+SELECTION);
    a ValueError (one line) names a refused one and why."""
    axes = (fmt, place, sel)
    why = refusal(axes)
    if why is not None:
        raise ValueError(f"strategy {name_of(axes)!r} is refused: {why}")
    return Recipe(name or name_of(axes), FORMATS.get(fmt), PLACEMENTS.get(place),
                  SELECTIONS.get(sel), default_for)  # fmt: skip


def for_precision(precision: str) -> str:
    """The format a chip profile's `kv_precision` picks."""
    try:
        return BY_PRECISION[precision]
    except KeyError:
        raise ValueError(
            f"kv_precision {precision!r}: expected one of {', '.join(BY_PRECISION)}"
        ) from None
