"""Strategy options declared once: the `Option` declaration and the one check of an options dict.

What lives here: `Option` (name, type, default, allowed values, one-line help, CLI flag),
`validate` (an options dict checked against a strategy's declarations, merged over the
defaults) and `markdown` (option tables). What does not: the declarations themselves (each
strategy class lists its own in `options`), checks that relate two options (a strategy's
`check_combination`), the README's tables of the registered strategies (`kvstrategies.tables`,
which needs the registry) and the command line built from the declarations (`cli.main`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "string", Path: "path"}


@dataclass(frozen=True, slots=True)
class Option:
    """One option of a strategy: what it is called, holds, defaults to and allows.

    `type` is bool, int, float (any real number, stored as float), str, Path (a str or a
    Path, stored as given) or object (anything: `check` decides). `low`/`high` bound an int or
    float; `choices` lists the allowed values instead. `none` says what None means where None
    is allowed (None: it is not). `check(strategy, value)` is a further check of a set value
    that raises ValueError itself, for the few options a range cannot describe.
    """

    name: str
    type: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # (low, high]: low itself is not allowed
    choices: tuple[Any, ...] = ()
    none: str | None = None
    check: Callable[[str, Any], None] | None = None
    # What is allowed in words; derived from the range or choices when empty.
    allowed_text: str = ""
    # How an error introduces what is allowed ("expected ..." or "allowed: ..."): the
    # strategies' messages differed before they were declared here, and tests match them.
    wording: str = "expected"
    # The `unikv` flag: "" derives it from the name (--fp16-share; --no-NAME for a bool that
    # defaults to true), None gives the option no flag. Set where the derived one is taken.
    flag: str | None = ""

    def __post_init__(self) -> None:
        if self.type not in (*_TYPE_NAMES, object):
            raise TypeError(f"option {self.name}: unsupported type {self.type!r}")

    @property
    def flag_name(self) -> str | None:
        """The command-line flag that sets this option, or None."""
        if self.flag != "":
            return self.flag
        stem = self.name.replace("_", "-")
        return f"--no-{stem}" if self.type is bool and self.default is True else f"--{stem}"

    @property
    def allowed(self) -> str:
        """What a set value may be, in words ("an integer >= 0", "fp16, fp8", ...)."""
        if self.allowed_text:
            return self.allowed_text
        if self.choices:
            return ", ".join(map(str, self.choices))
        if self.type is bool:
            return "true or false"
        if self.type is Path:
            return "a path"
        if self.type in (int, float):
            kind = "an integer" if self.type is int else "a number"
            fmt = str if self.type is int else (lambda x: f"{x:g}")
            if self.low is not None and self.high is not None:
                opening = "(" if self.low_open else "["
                return f"{kind} in {opening}{fmt(self.low)}, {fmt(self.high)}]"
            if self.low is not None:
                return f"{kind} {'>' if self.low_open else '>='} {fmt(self.low)}"
            return kind
        return "a string" if self.type is str else "any value"

    @property
    def type_name(self) -> str:
        """The type in words, as the README's tables show it."""
        return _TYPE_NAMES.get(self.type, "any")

    def error(self, strategy: str, value: Any) -> ValueError:
        """The ValueError for a bad `value`: strategy, option, value and what is allowed."""
        intro = "allowed:" if self.choices else self.wording
        unset = f" or unset ({self.none})" if self.none is not None else ""
        return ValueError(
            f"strategy {strategy!r}: option {self.name} = {value!r}; {intro} {self.allowed}{unset}"
        )

    def validate(self, strategy: str, value: Any) -> Any:
        """`value` checked (and a float's stored as float); a ValueError says what is allowed."""
        if value is None:
            if self.none is None:
                raise self.error(strategy, value)
            return None
        if self.choices:
            # Membership by equality: an int option's 4.0 is its 4, stored as an int.
            if isinstance(value, bool) or value not in self.choices:
                raise self.error(strategy, value)
            if self.type in (int, float):
                value = self.type(value)
        elif not self._has_type(value) or not self._in_range(value):
            raise self.error(strategy, value)
        elif self.type is float:
            value = float(value)  # 0 and 0.0 must name the same setting in prefix hashes
        if self.check is not None:
            self.check(strategy, value)
        return value

    def _has_type(self, value: Any) -> bool:
        if self.type is object:
            return True
        if self.type is bool:
            return isinstance(value, bool)
        if isinstance(value, bool):
            return False
        if self.type is float:
            return isinstance(value, int | float)
        if self.type is Path:
            return isinstance(value, str | Path)
        return isinstance(value, self.type)

    def _in_range(self, value: Any) -> bool:
        if self.type not in (int, float):
            return True
        if math.isnan(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or value <= self.high


def validate(strategy: str, declared: Iterable[Option], options: Mapping | None) -> dict[str, Any]:
    """`options` checked against `declared` and merged over their defaults (declaration order).

    An unknown name is a ValueError listing the allowed names; a bad value one naming the
    strategy, the option, the value and what is allowed (defaults are checked too).
    """
    declared = tuple(declared)
    options = dict(options or {})
    names = [o.name for o in declared]
    unknown = sorted(set(options) - set(names))
    if unknown:
        allowed = ", ".join(sorted(names)) or "none"
        raise ValueError(
            f"strategy {strategy!r}: unknown option(s) {', '.join(unknown)}; allowed: {allowed}"
        )
    return {o.name: o.validate(strategy, options.get(o.name, o.default)) for o in declared}


def _default_text(o: Option) -> str:
    if o.default is None:
        return f"unset: {o.none}"
    if isinstance(o.default, bool | str):
        return f"`{json.dumps(o.default)}`"  # as written in a TOML file
    return f"`{o.default!r}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(strategies: Iterable[tuple[str, Iterable[Option]]]) -> str:
    """One Markdown table per (strategy name, declarations): option, type, default, allowed,
    meaning."""
    parts = []
    for name, declared in strategies:
        declared = tuple(declared)
        if not declared:
            continue
        rows = [
            f"**`{name}`**",
            "",
            "| option (`[strategy_options]` / flag) | type | default | allowed | meaning |",
            "|---|---|---|---|---|",
        ]
        for o in declared:
            flag = f" / `{o.flag_name}`" if o.flag_name else ""
            if o.none is None:
                allowed = o.allowed
            else:  # what unset means is in the default column when it is the default
                allowed = o.allowed + (" or unset" if o.default is None else f" or unset: {o.none}")
            cells = (f"`{o.name}`{flag}", o.type_name, _default_text(o), allowed, o.help)
            rows.append("| " + " | ".join(map(_cell, cells)) + " |")
        parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"
