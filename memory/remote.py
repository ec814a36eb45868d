"""The remote tier: a store tier on a shared server (Redis, a shared filesystem) that may fail.

What lives here: `CircuitBreaker` (closed -> open on a failure -> one trial after a backoff
that doubles up to a ceiling -> closed on success), `RemoteTier` (a `StoreTier` whose every
store call goes through the breaker, so a slow or vanished server is a miss, never an error:
lookups find nothing, write-through is skipped and counted, and health names the problem) and
`RemoteWriteThrough` (the pool's `WriteThrough` with the snapshot and the remote write on two
threads, so a slow server never holds up the step that waits for snapshots).

What does not: the stores (`storage.redis_store`, `storage.fs_store`: their timeouts bound each
call), opening them from a URL (`engine.assembly`), and which blocks to share (the strategy:
`kvstrategies.offload` writes its published prefix blocks through and promotes hits).

Why a breaker and not just timeouts: with the server gone each call would still cost a full
connect timeout; once open, the tier costs nothing until the next trial.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from unikv.memory.services import WriteThrough
from unikv.memory.tiers import BlockLostError, StoreTier, TensorTier, _slice_suffix
from unikv.storage import StoreFullError

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class CircuitBreaker:
    """Skips a failing dependency: open after a failure, one trial call after a backoff.

    `allow()` says whether a call may go ahead now; the caller reports `success()` or
    `failure(reason)`. While open, calls are refused (counted in `skipped`) until `retry_at`,
    then exactly one trial is let through: its success closes the breaker, its failure opens
    it again for twice as long (up to `max_backoff_s`).
    """

    def __init__(
        self,
        base_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < base_backoff_s <= max_backoff_s:
            raise ValueError(
                f"backoff must be 0 < base ({base_backoff_s}) <= max ({max_backoff_s}) seconds"
            )
        self.base_backoff_s, self.max_backoff_s, self._clock = base_backoff_s, max_backoff_s, clock
        self._lock = threading.Lock()
        self.state = "closed"  # closed | open | trial
        self.retry_at = 0.0
        self.backoff_s = base_backoff_s
        self.since: float | None = None  # when the current outage began
        self.reason: str | None = None
        self.failures = self.skipped = self.opened = 0

    def allow(self) -> bool:
        """Whether a call may go ahead now (while open: only the one trial after the backoff)."""
        with self._lock:
            if self.state == "closed":
                return True
            if self.state == "open" and self._clock() >= self.retry_at:
                self.state = "trial"
                return True
            self.skipped += 1
            return False

    def success(self) -> None:
        """The call worked: close the breaker and reset the backoff."""
        with self._lock:
            if self.state != "closed":
                log.info("remote tier back after %.1f s", self._clock() - (self.since or 0))
            self.state, self.backoff_s, self.since, self.reason = (
                "closed",
                self.base_backoff_s,
                None,
                None,
            )

    def failure(self, reason: str) -> None:
        """The call failed (timeout, refused, reset): open, or stay open for longer."""
        with self._lock:
            now = self._clock()
            self.failures += 1
            if self.state == "trial":
                self.backoff_s = min(2 * self.backoff_s, self.max_backoff_s)
            elif self.state == "closed":
                self.opened += 1
                self.since = now
                log.warning("remote tier unavailable (%s); skipped for now", reason)
            self.state, self.reason = "open", reason
            self.retry_at = now + self.backoff_s

    @property
    def is_open(self) -> bool:
        """Whether calls are being skipped (open, or a trial in flight)."""
        return self.state != "closed"

    def problem(self) -> str | None:
        """A plain sentence for the health view while open; None when closed."""
        with self._lock:
            if self.state == "closed":
                return None
            down = self._clock() - (self.since or self._clock())
            wait = max(0.0, self.retry_at - self._clock())
            return (
                f"remote tier unavailable for {down:.0f} s ({self.reason}); prefix sharing "
                f"through it is skipped, next try in {wait:.0f} s"
            )

    def stats(self) -> dict[str, Any]:
        """State, failures, skipped calls, times opened, current backoff."""
        return {
            "state": self.state,
            "failures": self.failures,
            "skipped": self.skipped,
            "opened": self.opened,
            "backoff_s": self.backoff_s,
            "reason": self.reason,
        }


class RemoteTier(StoreTier):
    """A store tier on a shared server: content keys only, and failure is a miss.

    Blocks here are found and written by content (the chained prefix hashes, which already
    name the model, strategy and layout), so processes sharing the server share prefixes. Each
    store call runs behind `breaker`: a `ConnectionError` or `OSError` (the stores raise
    `StoreUnavailableError` for timeouts, refused and reset connections) opens it, and the
    call returns its miss value. A corrupt or foreign value is a miss that the store deletes.
    """

    def __init__(
        self,
        name: str,
        layout,
        num_blocks: int,
        store,
        slices: int = 1,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        super().__init__(name, layout, num_blocks, store, slices)
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.counts = {"lookups": 0, "hit_blocks": 0, "promoted_blocks": 0, "write_skips": 0}
        down = getattr(store, "unreachable_at_open", None)
        if down:  # opened before its server answered: a miss until a trial reaches it
            self.breaker.failure(f"not reachable at start: {down}")

    def _guarded(self, what: str, call: Callable[[], _T], miss: _T) -> _T:
        if not self.breaker.allow():
            if what == "write":
                self.counts["write_skips"] += 1
            return miss
        try:
            result = call()
        except StoreFullError as e:  # the server answered: it is up, only full
            self.breaker.success()
            log.warning("remote tier: %s refused: %s", what, e)
            return miss
        except OSError as e:  # StoreUnavailableError is a ConnectionError, an OSError
            self.breaker.failure(f"{what}: {e}")
            return miss
        except Exception as e:  # anything else (a refused password, a protocol error) is
            # a failure too: a cache tier never fails a request, and a trial always ends
            log.warning("remote tier: %s failed: %s: %s", what, type(e).__name__, e)
            self.breaker.failure(f"{what}: {type(e).__name__}: {e}")
            return miss
        self.breaker.success()
        return result

    def has_content(self, content_key: bytes) -> bool:
        key = content_key + _slice_suffix(0)
        return self._guarded("lookup", lambda: self._store.contains(key), False)

    def present(self, content_keys: Sequence[bytes]) -> int:
        """How many of `content_keys`, from the first, the server holds (one round trip)."""
        keys = [h + _slice_suffix(0) for h in content_keys]
        if not keys:
            return 0
        many = getattr(self._store, "contains_many", None)

        def ask() -> list[bool]:
            return many(keys) if many is not None else [self._store.contains(k) for k in keys]

        found = self._guarded("lookup", ask, [])
        n = 0
        for ok in found:
            if not ok:
                break
            n += 1
        return n

    def promote(self, content_keys: Sequence[bytes], dst: StoreTier) -> list[bytes]:
        """Copy the longest leading run of `content_keys` the server holds into the store tier
        `dst` (same layout and slices: the values are byte for byte the same); the keys
        copied. Nothing is copied past a missing, corrupt or unreadable block."""
        if dst.slices != self.slices:
            raise RuntimeError(f"tier {dst.name!r} has {dst.slices} slices, remote {self.slices}")
        self.counts["lookups"] += 1
        n = self.present(content_keys)
        if not n:
            return []
        wanted = list(content_keys[:n])
        keys = [h + _slice_suffix(s) for h in wanted for s in range(self.slices)]
        values = self._guarded("read", lambda: self._store.get_many(keys), None)
        if values is None:
            return []
        size = self.slice_bytes
        good = 0
        for i in range(n):
            part = values[i * self.slices : (i + 1) * self.slices]
            if any(v is None or len(v) != size for v in part):
                break  # absent (evicted meanwhile), corrupt (deleted by the store) or foreign
            good += 1
        self.counts["hit_blocks"] += good
        if not good:
            return []
        items = list(zip(keys[: good * self.slices], values[: good * self.slices], strict=True))
        try:
            dst.store.put_many(items)
        except OSError as e:  # a full SSD: the hit is lost, the request recomputes
            log.warning("remote hits not promoted to tier %r: %s", dst.name, e)
            return []
        self.counts["promoted_blocks"] += good
        return wanted[:good]

    def write_content(
        self,
        content_keys: Sequence[bytes],
        snapshot: Mapping[str, np.ndarray],
        sides: Sequence[tuple[bytes, bytes]] = (),
    ):
        self._guarded(
            "write", lambda: StoreTier.write_content(self, content_keys, snapshot, sides), None
        )

    def read_side(self, content_key: bytes) -> bytes | None:
        return self._guarded("read", lambda: StoreTier.read_side(self, content_key), None)

    def read(self, block_ids):
        # Hits attached here (a pool without an SSD tier) are read once, when a resident
        # placement loads them into device blocks; a failure is a lost block (the prefix is
        # recomputed), never a hang.
        return self._guarded_read(lambda: super(RemoteTier, self).read(block_ids))

    def read_slice(self, block_ids, index):
        return self._guarded_read(lambda: super(RemoteTier, self).read_slice(block_ids, index))

    def _guarded_read(self, call):
        if not self.breaker.allow():
            raise BlockLostError(f"tier {self.name!r}: unavailable ({self.breaker.reason})")
        try:
            out = call()
        except OSError as e:
            self.breaker.failure(f"read: {e}")
            raise BlockLostError(f"tier {self.name!r}: {e}") from None
        except BlockLostError:  # the server answered (a corrupt or missing value)
            self.breaker.success()
            raise
        except Exception as e:  # as in `_guarded`: a failure, never a stuck trial
            self.breaker.failure(f"read: {type(e).__name__}: {e}")
            raise BlockLostError(f"tier {self.name!r}: {type(e).__name__}: {e}") from None
        self.breaker.success()
        return out

    def problem(self) -> str | None:
        """What the health view should say about this tier now; None when it is fine."""
        return self.breaker.problem()

    def stats(self) -> dict[str, Any]:
        """Lookups, hits, promotions, skipped writes and the breaker's state."""
        return {**self.counts, "breaker": self.breaker.stats()}


class RemoteWriteThrough(WriteThrough):
    """`WriteThrough` to a remote tier: the snapshot on one thread, the network on another.

    The step waits for snapshots (`wait_snapshots`) before blocks may be reused; with the plain
    `WriteThrough` a snapshot queues behind the previous job's write, so a slow server would
    stall the step. Here snapshots run on their own thread and the writes queue behind them; at
    most `max_pending` writes wait, later ones are dropped and counted (a remote write is an
    offer to other processes, never needed by this one).
    """

    def __init__(self, dst: RemoteTier, max_pending: int = 8) -> None:
        super().__init__(dst)
        self._net = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="unikv-remote")
        self._pending = 0
        self._count = threading.Lock()
        self.max_pending = max_pending
        self.blocks_dropped = 0

    def _write(self, src: TensorTier, blocks: list[tuple[int, bytes]], done: threading.Event,
               sides: tuple[tuple[bytes, bytes], ...] = ()):  # fmt: skip
        try:
            with self._count:
                full = self._pending >= self.max_pending or self.dst.breaker.state == "open"
                if not full:
                    self._pending += 1
            if full:
                self.blocks_dropped += len(blocks)
                return None
            snapshot = src.snapshot([b for b, _ in blocks])
        finally:
            done.set()
        return self._net.submit(self._send, [h for _, h in blocks], snapshot, sides)

    def _send(self, hashes: list[bytes], snapshot, sides=()) -> None:
        try:
            present = self.dst.present(hashes) if len(hashes) else 0
            # Content already there (another process wrote it) is not sent again; a chain's
            # blocks are written in order, so the stored ones lead. Side values always go.
            rest = hashes[present:]
            if rest or sides:
                part = {n: a[present:] for n, a in snapshot.items()}
                self.dst.write_content(rest, part, sides)
                self.blocks_written += len(rest)
        finally:
            with self._count:
                self._pending -= 1

    def wait_writes(self) -> None:
        """Wait for every queued write (for tests and close: the engine never waits on it)."""
        jobs = []
        for job in self._writes:
            inner = job.result()
            if inner is not None:
                jobs.append(inner)
        for inner in jobs:
            inner.result()
        self._writes.clear()
        self._snapshots.clear()

    def close(self) -> None:
        """Finish pending writes (each bounded by the store's timeouts) and stop the threads."""
        super().close()
        self._net.shutdown(wait=True)
