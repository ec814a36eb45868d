"""Child process of the crash-safety test: writes numbered blocks until it is killed.

    python tests/_crash_writer.py STORE_DIR START

Opens the LMDB block store at STORE_DIR (a tiny initial map, so it also grows while being
killed) and puts block START, START+1, ... one commit each, printing each index after its put
returned (committed). The parent SIGKILLs it mid-stream and checks every printed index.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from unikv.storage.lmdb_store import LmdbBlockStore  # noqa: E402


def block_key(i: int) -> bytes:
    """The 32-byte key of block `i` (a content-hash-like key)."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def block_value(i: int) -> bytes:
    """Deterministic content of block `i`: 1..48 KiB, so small and overflow-page values mix."""
    seed = hashlib.blake2b(b"value" + i.to_bytes(8, "little")).digest()  # 64 bytes
    return (seed * 769)[: 1 + (i * 104729) % (48 * 1024)]


def main() -> None:
    path, start = sys.argv[1], int(sys.argv[2])
    store = LmdbBlockStore(path, map_size=64 * 1024)
    i = start
    while True:
        store.put(block_key(i), block_value(i))
        print(i, flush=True)
        i += 1


if __name__ == "__main__":
    main()
