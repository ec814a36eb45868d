"""Block stores: the `BlockStore` ABC, its asyncio facade, the registry; LMDB, Redis, files.

What lives here: re-exports of `storage.base` (ABC, errors, frame) and `storage.registry`. What
does not: anything about tokens or tiers (`memory/`, `kvstrategies/`). Backends are imported by
the registry when first asked for, so `import storage` does not open LMDB.
"""

from .base import (
    AsyncBlockStore,
    BlockStore,
    ChecksumError,
    StoreFullError,
    StoreUnavailableError,
    VerifyReport,
    decode_frame,
    encode_frame,
)
from .registry import available, create_store, get, open_url, register, url_store

__all__ = [
    "AsyncBlockStore",
    "BlockStore",
    "ChecksumError",
    "StoreFullError",
    "StoreUnavailableError",
    "VerifyReport",
    "available",
    "create_store",
    "decode_frame",
    "encode_frame",
    "get",
    "open_url",
    "register",
    "url_store",
]
