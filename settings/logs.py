"""One `unikv` logger tree, configured once per process: `configure_logging` (stderr, text or JSON
lines, the level from the command line, else `$UNIKV_LOG_LEVEL`, else INFO). Every module logs
to `logging.getLogger(__name__)`, under `unikv.`.
"""

from __future__ import annotations

import json
import logging
import os
import sys

LOG_ENV = "UNIKV_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": self.formatTime(record), "level": record.levelname,
                "logger": record.name, "message": record.getMessage()}  # fmt: skip
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(level: str | None = None, fmt: str = "text") -> str:
    """Send the `unikv` logger tree to stderr, once per process (stdout is the answer or the
    JSON document): `level`, else $UNIKV_LOG_LEVEL, else INFO. Returns the level."""
    level = (level or os.environ.get(LOG_ENV) or "INFO").upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"${LOG_ENV} = {level!r}; expected one of {', '.join(LOG_LEVELS)}")
    root = logging.getLogger("unikv")
    for h in [h for h in root.handlers if getattr(h, "unikv", False)]:
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.unikv = True  # type: ignore[attr-defined]  (ours: replaced, never duplicated)
    handler.setFormatter(
        _JsonLines() if fmt == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )  # fmt: skip
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False  # the lines go out once, not again through the root's handlers
    return level
