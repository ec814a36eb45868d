"""`RedisBlockStore` and `RedisClusterBlockStore`: blocks in Redis (one server, or a cluster).

What lives here: the two stores (redis-py clients), the key namespace, the translation of
redis-py's failures into the storage errors, and URL redaction (a password never reaches a log
or an error message). What does not: the value frame and its checksum (`storage.base`: the same
frame as the LMDB store), choosing a store from a URL (`storage.registry.open_url`), and what to
do when the server is slow or gone (the remote tier's circuit breaker, `memory.remote`).

Keys: ``unikv:<namespace>:<key bytes>``. The namespace names the model + layout identity (the
caller derives it), so processes with other weights or another layout never read each other's
values, and `keys`, `len` and `clear` touch this namespace only. Eviction is the server's
(`maxmemory-policy allkeys-lru`, see docs/configuration.md); an optional TTL bounds how long a
value lives.

Atomicity: on one server a batch is one MSET (with a TTL, one MULTI/EXEC transaction of SETs).
A cluster cannot run one transaction over keys in different slots (and spreading keys over the
slots is the point), so a cluster batch that fails part-way deletes what it wrote, best effort:
values are keyed by content, so a leftover value is still correct data, never a wrong answer.
"""

from __future__ import annotations

import logging
import os
import threading
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import RedisCluster
    from redis.retry import Retry
except ImportError as e:  # optional: only the remote tier speaks Redis
    raise ImportError(
        "the Redis block store (a redis:// remote tier) needs redis-py: pip install 'unikv[remote]'"
    ) from e

from .base import (
    Accounting,
    BlockStore,
    Buffer,
    ChecksumError,
    StoreCounters,
    StoreFullError,
    StoreUnavailableError,
    VerifyReport,
    check_namespace,
    decode_frame,
    secret_bytes,
)
from .registry import redact, register

logger = logging.getLogger(__name__)

MAX_KEY_BYTES = 1024
PASSWORD_ENV = "REDISCLI_AUTH"  # the variable redis-cli itself reads
_CHUNK = 256  # keys per MGET / pipeline chunk: bounds one reply's size
_GLOB = str.maketrans({c: "\\" + c for c in "*?[]\\"})


@register
class RedisBlockStore(BlockStore):
    """Blocks as values on one Redis server (redis-py; thread-safe through its connection pool).

    - `url`: ``redis://[:password@]host[:port][/db]`` or ``rediss://`` for TLS.
    - `namespace`: the model + layout identity the keys are grouped under.
    - `password`: wins over one in the URL, which wins over the environment's REDISCLI_AUTH.
    - `ttl_s`: expire each value this long after it was written (None: the server evicts).
    - `connect_timeout_s`, `timeout_s`: bound every connection attempt and every reply, so a
      slow or vanished server costs at most that long per call; redis-py does not retry (the
      caller decides: the remote tier's circuit breaker backs off).
    The server is pinged on open: a bad URL, a refused connection or a wrong password is a
    `ValueError` naming the (redacted) URL. With `wait_for_server`, a server that does not
    answer yet (refused, timed out) is no error: the store opens, `unreachable_at_open` says
    why, and every call tries the server again (the remote tier's breaker spaces the tries);
    a bad URL or a refused password still is. `secret`: sign every value written and refuse
    every value read that is not signed with it (`storage.base`: HMAC-SHA256 over key, header
    and payload), so that who can write to the server cannot plant KV without the secret.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        namespace: str = "default",
        password: str | None = None,
        ttl_s: float | None = None,
        connect_timeout_s: float = 1.0,
        timeout_s: float = 2.0,
        max_connections: int = 32,
        wait_for_server: bool = False,
        secret: str | bytes | None = None,
    ) -> None:
        self.url = redact(url)
        self._secret = secret_bytes(secret)
        self.unreachable_at_open: str | None = None
        self.namespace = check_namespace(namespace)
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 seconds or None, got {ttl_s!r}")
        for label, t in (("connect_timeout_s", connect_timeout_s), ("timeout_s", timeout_s)):
            if not t > 0:
                raise ValueError(f"{label} must be > 0 seconds, got {t!r}")
        self.ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._prefix = f"unikv:{self.namespace}:".encode()
        self._acct = Accounting(self.url, StoreCounters())
        self._lock = threading.Lock()
        self._closed = True
        options: dict[str, Any] = {
            "socket_connect_timeout": connect_timeout_s,
            "socket_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "decode_responses": False,
            # Replies carry whole blocks: read them in 1 MiB pieces, not redis-py's 64 KiB.
            "socket_read_size": 1 << 20,
        }
        password = password or urllib.parse.urlsplit(url).password or os.environ.get(PASSWORD_ENV)
        if password:
            options["password"] = password
        try:
            self._client = self._connect(url, options, max_connections)
        except ValueError as e:  # redis-py's own complaint about the URL
            raise ValueError(f"block store URL {self.url}: {e}") from None
        try:
            self._client.ping()
        except redis.AuthenticationError:
            self._client.close()
            raise ValueError(
                f"block store {self.url}: authentication failed (wrong or missing password; "
                f"give it in the URL, the config or {PASSWORD_ENV})"
            ) from None
        except redis.ResponseError as e:
            self._client.close()
            if "NOAUTH" in str(e) or "AUTH" in str(e):
                raise ValueError(
                    f"block store {self.url}: the server needs a password (give it in the URL, "
                    f"the config or {PASSWORD_ENV})"
                ) from None
            raise ValueError(f"block store {self.url}: {e}") from None
        except (redis.RedisError, OSError) as e:
            if not wait_for_server:
                self._client.close()
                raise ValueError(f"cannot reach block store {self.url}: {_why(e)}") from None
            self.unreachable_at_open = _why(e)
            logger.warning(
                "block store %s not reachable yet (%s): starting without it; it is tried "
                "again as the service runs", self.url, self.unreachable_at_open,
            )  # fmt: skip
        self._closed = False
        self._max_key = MAX_KEY_BYTES

    def _connect(self, url: str, options: dict[str, Any], max_connections: int):
        return redis.Redis.from_url(url, max_connections=max_connections, **options)

    # -- keys ------------------------------------------------------------------------------

    def _k(self, key: bytes) -> bytes:
        return self._prefix + key

    # -- reading ---------------------------------------------------------------------------

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        """The value of each key in order; None where absent or corrupt (a corrupt one is
        deleted: the next reader recomputes instead of meeting it again)."""
        keys = [self._check(k) for k in keys]
        self._check_open()
        frames: list[bytes | None] = []
        with self._errors("read"):
            for i in range(0, len(keys), _CHUNK):
                frames += self._mget([self._k(k) for k in keys[i : i + _CHUNK]])
        out: list[bytes | None] = []
        corrupt: list[bytes] = []
        nbytes = 0
        for key, frame in zip(keys, frames, strict=True):
            if frame is None:
                out.append(None)
                continue
            try:
                out.append(decode_frame(key, frame, self._secret))
                nbytes += len(frame)
            except ChecksumError as e:
                self._report_corrupt(e)
                corrupt.append(key)
                out.append(None)
        if corrupt:
            self._drop_corrupt(corrupt)
        hits = sum(v is not None for v in out)
        self._acct.read(len(keys), hits, nbytes)
        return out

    def _mget(self, names: list[bytes]) -> list[bytes | None]:
        return self._client.mget(names)

    def contains(self, key: bytes) -> bool:
        """Whether `key` is stored (its value is not read or checked)."""
        key = self._check(key)
        self._check_open()
        with self._errors("read"):
            return bool(self._client.exists(self._k(key)))

    def contains_many(self, keys: Iterable[bytes]) -> list[bool]:
        """Whether each key is stored, in one round trip per chunk."""
        keys = [self._check(k) for k in keys]
        self._check_open()
        out: list[bool] = []
        with self._errors("read"):
            for i in range(0, len(keys), _CHUNK):
                pipe = self._client.pipeline(transaction=False)
                for k in keys[i : i + _CHUNK]:
                    pipe.exists(self._k(k))
                out += [bool(x) for x in pipe.execute()]
        return out

    def keys(self) -> Iterator[bytes]:
        """Every key of this namespace (SCAN: safe to write while iterating)."""
        self._check_open()
        pattern = self._prefix.decode().translate(_GLOB).encode() + b"*"
        n = len(self._prefix)
        with self._errors("read"):
            # Listed first: a generator left open would hold a connection of the pool.
            found = [bytes(k)[n:] for k in self._client.scan_iter(match=pattern, count=1000)]
        return iter(dict.fromkeys(found))  # a cluster rehash may list a key twice

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def stats(self) -> dict[str, Any]:
        """Counters since open, entries and bytes of this namespace, the server's memory."""
        keys = list(self.keys())
        nbytes = 0
        with self._errors("read"):
            for i in range(0, len(keys), _CHUNK):
                pipe = self._client.pipeline(transaction=False)
                for k in keys[i : i + _CHUNK]:
                    pipe.strlen(self._k(k))
                nbytes += sum(pipe.execute())
            memory = self._memory_info()
        counters = self._acct.snapshot()
        limit = memory.get("maxmemory") or memory.get("total_system_memory") or 0
        return {
            "backend": self.name,
            "url": self.url,
            "namespace": self.namespace,
            "entries": len(keys),
            "bytes": nbytes,
            # The most the store can hold: the server's maxmemory (else the machine's RAM).
            "map_size": int(limit),
            "used_memory": int(memory.get("used_memory", 0)),
            "maxmemory_policy": memory.get("maxmemory_policy"),
            "ttl_s": None if self.ttl_ms is None else self.ttl_ms / 1000,
            **counters,
        }

    def _memory_info(self) -> dict[str, Any]:
        info = self._client.info("memory")
        return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in info.items()}

    def verify(self) -> VerifyReport:
        """Check every stored value's checksum; list (and log) the corrupt keys."""
        keys = list(self.keys())

        def stored() -> Iterator[tuple[bytes, bytes | None]]:
            for i in range(0, len(keys), _CHUNK):
                chunk = keys[i : i + _CHUNK]
                with self._errors("read"):
                    frames = self._mget([self._k(k) for k in chunk])
                yield from zip(chunk, frames, strict=True)  # None: deleted or expired since

        return self._verify_frames(stored())

    # -- writing ---------------------------------------------------------------------------

    def put_many(self, items: Mapping[bytes, Buffer] | Iterable[tuple[bytes, Buffer]]) -> None:
        """Store every (key, value) pair: one MULTI/EXEC transaction, all of them or none."""
        frames = self._frame_batch(items)
        self._check_open()
        if not frames:
            return
        with self._errors("write"):
            self._write(frames)
        self._acct.wrote(len(frames), sum(len(f) for f in frames.values()))

    def _write(self, frames: dict[bytes, bytes]) -> None:
        if self.ttl_ms is not None:  # SET ... PX per key, in one MULTI/EXEC transaction
            pipe = self._client.pipeline(transaction=True)
            for key, frame in frames.items():
                pipe.set(self._k(key), frame, px=self.ttl_ms)
            pipe.execute()
            return
        # One MSET (atomic on one server), packed here into one buffer: redis-py sends each
        # large argument with a system call of its own, which measured 1.5x slower for 98 KB
        # values than this one send (the copy into the buffer costs ~1/30 of the CRC).
        parts = [b"*%d\r\n$4\r\nMSET\r\n" % (1 + 2 * len(frames))]
        for key, frame in frames.items():
            name = self._k(key)
            parts += (b"$%d\r\n%s\r\n$%d\r\n" % (len(name), name, len(frame)), frame, b"\r\n")
        self._send_packed(b"".join(parts))

    def _send_packed(self, command: bytes) -> None:
        """Send one command already in the wire format and read its reply (an error reply
        raises, as redis-py's own calls do)."""
        pool = self._client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command([command])
            conn.read_response()
        except BaseException:
            conn.disconnect()  # a command sent part-way leaves the connection unusable
            raise
        finally:
            pool.release(conn)

    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove the keys (one command on a server); how many were present."""
        unique = list(dict.fromkeys(self._check(k) for k in keys))
        self._check_open()
        if not unique:
            return 0
        with self._errors("write"):
            removed = self._delete([self._k(k) for k in unique])
        self._acct.add("deletes", removed)
        return removed

    def _delete(self, names: list[bytes]) -> int:
        return int(self._client.delete(*names))

    def clear(self) -> None:
        """Remove every entry of this namespace (other namespaces are left alone)."""
        keys = list(self.keys())
        with self._errors("write"):
            for i in range(0, len(keys), _CHUNK):
                self._delete([self._k(k) for k in keys[i : i + _CHUNK]])

    def close(self) -> None:
        """Close the client's connections; closing twice is harmless."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._client.close()

    # -- internals ---------------------------------------------------------------------------

    def _drop_corrupt(self, keys: list[bytes]) -> None:
        try:
            self._delete([self._k(k) for k in keys])
        except (redis.RedisError, OSError) as e:
            # Deleting is a courtesy to the next reader; the read already was a miss.
            logger.warning("block store %s: corrupt entries not deleted: %s", self.url, _why(e))

    def _errors(self, what: str) -> _Translate:
        return _Translate(self.url, what)


@register
class RedisClusterBlockStore(RedisBlockStore):
    """Blocks on a Redis Cluster: the same client API, keys spread over the hash slots.

    `url` is ``redis+cluster://[:password@]host:port`` (``rediss+cluster://`` for TLS), any one
    node of the cluster: the client learns the others from it. Reads go through the client's
    non-atomic MGET (one request per node holding keys of the batch), writes through a cluster
    pipeline; a write that fails part-way deletes what it wrote (see the module docstring).
    """

    name = "redis_cluster"

    def _connect(self, url: str, options: dict[str, Any], max_connections: int):
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.replace("+cluster", "")
        if parts.path not in ("", "/", "/0"):
            raise ValueError(f"a cluster has only database 0, got path {parts.path!r}")
        plain = urllib.parse.urlunsplit(parts._replace(scheme=scheme, path=""))
        return RedisCluster.from_url(
            plain, max_connections=max_connections, require_full_coverage=True, **options
        )

    def _mget(self, names: list[bytes]) -> list[bytes | None]:
        return self._client.mget_nonatomic(names)

    def _write(self, frames: dict[bytes, bytes]) -> None:
        pipe = self._client.pipeline()
        for key, frame in frames.items():
            pipe.set(self._k(key), frame, px=self.ttl_ms)
        try:
            pipe.execute()
        except BaseException:
            try:
                self._delete([self._k(k) for k in frames])
            except (redis.RedisError, OSError) as e:
                logger.warning("block store %s: a failed batch not undone: %s", self.url, _why(e))
            raise

    def _delete(self, names: list[bytes]) -> int:
        # DEL over keys in several slots is split per slot by the client (delete_many).
        pipe = self._client.pipeline()
        for name in names:
            pipe.delete(name)
        return int(sum(pipe.execute()))

    def _memory_info(self) -> dict[str, Any]:
        per_node = self._client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        infos = list(per_node.values()) if isinstance(per_node, dict) else [per_node]
        if infos and not isinstance(infos[0], dict):  # one node answered for all
            infos = [per_node]
        total: dict[str, Any] = {}
        for info in infos:
            for k in ("maxmemory", "used_memory"):
                total[k] = total.get(k, 0) + int(info.get(k, 0))
            total.setdefault("total_system_memory", int(info.get("total_system_memory", 0)))
            policy = info.get("maxmemory_policy")
            total["maxmemory_policy"] = policy.decode() if isinstance(policy, bytes) else policy
        return total


class _Translate:
    """Turns redis-py's failures into the storage errors: a lost server is
    `StoreUnavailableError` (a timeout, a refused or reset connection), a full one
    `StoreFullError` (OOM with `maxmemory-policy noeviction`)."""

    def __init__(self, url: str, what: str) -> None:
        self.url, self.what = url, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or not isinstance(exc, redis.RedisError | OSError):
            return False
        if isinstance(exc, StoreUnavailableError | StoreFullError):
            return False
        if isinstance(exc, redis.ResponseError) and str(exc).startswith("OOM"):
            raise StoreFullError(
                self.url, f"block store {self.url} is full (server: {exc}); the write was refused"
            ) from None
        if isinstance(exc, redis.ResponseError):
            raise OSError(f"block store {self.url}: {self.what} failed: {exc}") from None
        raise StoreUnavailableError(self.url, f"{self.what} failed: {_why(exc)}") from None


def _why(e: BaseException) -> str:
    """A one-line reason for a redis-py error (its messages never hold the password)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
