"""The one thread per process that runs the engine's torch work (model loading and every step).

NOTE: libgomp (PyTorch's OpenMP on Linux) keeps a team of threads per calling thread. Once two
threads have run parallel regions it counts more OpenMP threads than cores and throttles its
spin-wait for the rest of the process: a batch-1 decode step measured 19 ms on one thread and
25 ms, on either thread, once a second one had run torch work. So the async engine runs its
compute here, off the event loop but always on the same OS thread, and a program that also
calls torch itself gets the best speed by doing so through `run`/`run_sync`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import ctypes.util
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_ident: list[int] = []  # the compute thread's id, once it has started


def _started() -> None:
    _ident.append(threading.get_ident())


def executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide single compute thread (created on first use)."""
    global _executor
    with _lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="unikv-compute", initializer=_started
            )
        return _executor


def thread_id() -> int | None:
    """The compute thread's `threading.get_ident()` (None before its first task)."""
    return _ident[0] if _ident else None


async def run(fn: Callable[..., T], *args) -> T:
    """Run `fn(*args)` on the compute thread without blocking the event loop."""
    return await asyncio.get_running_loop().run_in_executor(executor(), fn, *args)


def run_sync(fn: Callable[..., T], *args) -> T:
    """Run `fn(*args)` on the compute thread and wait for it (for synchronous callers)."""
    return executor().submit(fn, *args).result()


def _libc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


_malloc_trim = _libc_trim()


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim`); False where the C
    library has none.

    NOTE: glibc keeps what PyTorch frees inside its heap: steps of ever-changing shapes (batch
    sizes, prompt chunks) left a server's RSS growing by about 1 GiB an hour although its live
    memory was flat (issue 31's soak: one `malloc_trim(0)` gave back 95 MiB of 100 MiB grown in
    four minutes). The engine calls this when it goes idle and every `TRIM_S` under load."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True
