"""Writing files so that a crash or Ctrl-C mid-write never leaves a half file behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def torch_save_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    """`torch.save` to a temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
