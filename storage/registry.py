"""The block-store registry and `create_store` (the generic `Registry` is `unikv.registry`).

What does not live here: the stores themselves (one module each, listed below so importing
the registry stays cheap until a store is asked for).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from unikv.registry import Registry

if TYPE_CHECKING:
    from .base import BlockStore

# A new backend is one file plus a line here.
_stores: Registry[BlockStore] = Registry(
    "block store",
    ("unikv.storage.lmdb_store", "unikv.storage.redis_store", "unikv.storage.fs_store"),
)
register = _stores.register
available = _stores.available
get = _stores.get


def create_store(name: str, **kwargs: Any) -> BlockStore:
    """A new store of kind `name` built with `kwargs` (e.g. `create_store("lmdb", path=...)`)."""
    return get(name)(**kwargs)


# URL scheme -> store name. The Redis URL itself goes to redis-py (host, port, db, password,
# TLS); `file://` names a directory.
URL_SCHEMES = {
    "redis": "redis",
    "rediss": "redis",
    "redis+cluster": "redis_cluster",
    "rediss+cluster": "redis_cluster",
    "file": "fs",
}
# Query parameters a URL may carry for the store (the rest of the URL is the server's).
_URL_OPTIONS = {
    "ttl": ("ttl_s", float),
    "timeout": ("timeout_s", float),
    "connect_timeout": ("connect_timeout_s", float),
    "max_bytes": ("max_bytes", int),
    "namespace": ("namespace", str),
}


def url_store(url: str) -> tuple[str, dict[str, Any]]:
    """The store name and constructor arguments a URL names; a ValueError naming the URL (its
    password hidden) and the accepted schemes otherwise."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    shown = _redacted(url)
    supported = ", ".join(f"{s}://" for s in URL_SCHEMES)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a bad port raises here
    except ValueError as e:
        raise ValueError(f"block store URL {shown!r}: {e}; expected {supported}") from None
    name = URL_SCHEMES.get(parts.scheme)
    if name is None:
        raise ValueError(
            f"block store URL {shown!r}: unknown scheme {parts.scheme!r}; supported: {supported}"
        )
    kwargs: dict[str, Any] = {}
    passed: list[tuple[str, str]] = []  # TLS options go on to redis-py with the URL
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k.startswith("ssl_") and name != "fs":
            passed.append((k, v))
            continue
        if k not in _URL_OPTIONS:
            allowed = ", ".join(_URL_OPTIONS)
            raise ValueError(f"block store URL {shown!r}: unknown option {k!r}; allowed: {allowed}")
        arg, kind = _URL_OPTIONS[k]
        try:
            kwargs[arg] = kind(v)
        except ValueError:
            raise ValueError(
                f"block store URL {shown!r}: {k}={v!r} is not {kind.__name__}"
            ) from None
    rest = urlunsplit(parts._replace(query=urlencode(passed)))
    if name == "fs":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ValueError(
                f"block store URL {shown!r}: expected file:///absolute/directory (no host)"
            )
        kwargs["path"] = parts.path
    else:
        if not parts.hostname:
            raise ValueError(
                f"block store URL {shown!r}: no host; expected {parts.scheme}://host:port"
            )
        kwargs["url"] = rest
    return name, kwargs


def open_url(url: str, **kwargs: Any) -> BlockStore:
    """The store a URL names (`redis://`, `rediss://`, `redis+cluster://`, `file://`), opened
    with the URL's options and `kwargs` (e.g. `namespace`, `password`)."""
    name, args = url_store(url)
    return create_store(name, **{**kwargs, **args})


def _redacted(url: str) -> str:
    try:
        return redact(url)
    except ValueError:
        return "<unparsable URL>"


def redact(url: str) -> str:
    """`url` with any password replaced by ``***`` (for messages and logs)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
