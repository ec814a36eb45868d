"""The README's strategy option tables, made from the registered strategies' declarations.

`python -m kvstrategies.tables` prints them; the README holds that output between the markers
`<!-- strategy-options:begin -->` and `<!-- strategy-options:end -->` (a test compares them).
What does not live here: the declarations (each strategy's `options`) and the table format
(`kvstrategies.options.markdown`).
"""

from __future__ import annotations

from .options import markdown
from .registry import available, get

BEGIN = "<!-- strategy-options:begin -->"
END = "<!-- strategy-options:end -->"


def option_tables() -> str:
    """One Markdown table per registered strategy: option, type, default, allowed, meaning."""
    return markdown((name, get(name).options) for name in available())


if __name__ == "__main__":
    print(option_tables(), end="")
