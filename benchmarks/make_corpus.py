"""Assemble `benchmarks/corpus/varied.txt`, the varied training text of the shipped pruning head.

Pieces of about 2,400 characters from files any Debian-like machine with this project's
packages has: rendered manual pages of common commands (a user manual's register), the long
descriptions of the installed Python packages (Markdown / reST API documentation with code) and
modules of the Python standard library (code with docstrings), shuffled with a fixed seed.
Nothing of the development texts or their kin goes in: no GPL, no vim or Node.js documentation,
no Python language reference, and not this project's own description.

    python benchmarks/make_corpus.py [--out benchmarks/corpus/varied.txt]

The result depends on what is installed, so the file made for the shipped head is committed;
this script says how it was made. The head: `unikv tune --kv_optimization=learned_prune --text
benchmarks/corpus/varied.txt --out DIR`.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sysconfig
from pathlib import Path

PIECE = 2400
MANUALS = ["tar", "grep", "rsync", "find", "ssh", "curl", "sed", "git", "cron", "crontab", "ls",
           "chmod", "ps", "top", "make", "gzip"]  # fmt: skip
MODULES = ["argparse.py", "textwrap.py", "shutil.py", "pathlib.py", "logging/__init__.py",
           "csv.py", "heapq.py", "functools.py", "tarfile.py", "http/client.py",
           "email/message.py", "sqlite3/__init__.py", "unittest/case.py", "asyncio/queues.py",
           "datetime.py", "statistics.py"]  # fmt: skip
EXCLUDED = ("GNU GENERAL PUBLIC",)  # license text: the development set has two


def pieces(text: str, source: str, n: int, rng: random.Random) -> list[tuple[str, str]]:
    """Up to `n` pieces of `text`, each starting and ending at a line break."""
    text = re.sub(r"\n{3,}", "\n\n", text)
    if len(text) < PIECE:
        return []
    count = min(n, max(1, (len(text) - PIECE) // PIECE))
    out = []
    for start in sorted(rng.sample(range(len(text) - PIECE), count)):
        a = text.find("\n", start) + 1
        out.append((source, text[a : a + PIECE].rsplit("\n", 1)[0]))
    return out


def manual(page: str) -> str:
    env = dict(os.environ, MANWIDTH="80")
    r = subprocess.run(["man", "-P", "cat", page], capture_output=True, text=True, env=env)
    if r.returncode:
        return ""
    return subprocess.run(["col", "-b"], input=r.stdout, capture_output=True, text=True).stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "corpus" / "varied.txt")
    a = p.parse_args()
    rng = random.Random(0)
    got: list[tuple[str, str]] = []
    for page in MANUALS:
        got += pieces(manual(page), f"man {page}", 2, rng)
    site = Path(sysconfig.get_paths()["purelib"])
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        body = meta.read_text(errors="ignore").split("\n\n", 1)[-1]
        if (
            any(x in body for x in EXCLUDED)
            or len(body) < 6000
            or meta.parent.name.startswith("unikv")
        ):
            continue
        got += pieces(body, f"{meta.parent.name} description", 1, rng)
    lib = Path(sysconfig.get_paths()["stdlib"])
    for mod in MODULES:
        if (lib / mod).exists():
            got += pieces((lib / mod).read_text(errors="ignore"), f"stdlib {mod}", 2, rng)
    rng.shuffle(got)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n\n".join(t for _, t in got) + "\n")
    print(f"{len(got)} pieces from {len({s for s, _ in got})} sources, {a.out.stat().st_size:,} "
          f"bytes -> {a.out}")  # fmt: skip


if __name__ == "__main__":
    main()
