"""Writing files so that a crash or Ctrl-C mid-write never leaves a half file behind.

Used for every small artefact unikv persists besides blocks (calibration files, pruning heads,
tuning checkpoints): write a temporary file beside the target, then rename it over the target.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


def torch_save_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    """`torch.save` to a temporary file beside `path`, then rename it over `path`."""
    import torch  # only callers that save tensors need it; the stores themselves do not

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
