"""Print pip constraints that pin every dependency pyproject.toml declares with a floor
(`name>=X`) to that floor (`name==X`, or the series `name==X.Y.*` when the floor names one),
for `make test-floors`: the suite then runs against the
oldest versions the metadata admits, so a floor that is too low fails here and not for a user.

torch is left to constraints.txt: its floor has no CPU wheel on the package index, and the
suite's CPU build is the pinned one. Usage: python .ci/floors.py [extra ...] > floors.txt
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

SKIP = {"torch"}


def floors(extras: list[str]) -> list[str]:
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    project = project["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    pins: dict[str, str] = {}
    for text in reqs:
        r = Requirement(text)
        lows = [s.version for s in r.specifier if s.operator == ">="]
        if r.name not in SKIP and lows:
            pins[r.name] = max(lows, key=lambda v: tuple(int(x) for x in v.split(".")))
    # A floor names a release series ("2.3": 2.3.0 may not exist); pin the series.
    return [f"{name}=={v}" + (".*" if v.count(".") < 2 else "") for name, v in sorted(pins.items())]


if __name__ == "__main__":
    print("\n".join(floors(sys.argv[1:])))
