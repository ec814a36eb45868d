"""Loopback only: a guard for tests that run clients written elsewhere (LiteLLM,
lm-evaluation-harness), so that nothing they do reaches the network. A name lookup or a
connection to anything but this machine is refused (ConnectionRefusedError) and recorded.

In-process: `restore = install(record)`. In a subprocess: copy this file as `sitecustomize.py`
into a folder on its PYTHONPATH; it then installs itself at start-up and appends what it refused
to the file named by `$UNIKV_NO_NETWORK_LOG`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


def install(record: Callable[[str], None]) -> Callable[[], None]:
    """Refuse non-loopback lookups and connections, calling `record` with each; returns the
    function that puts the socket module back."""
    real = (socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex)

    def refuse(what: str):
        record(what)
        raise ConnectionRefusedError(f"the tests allow no network access: {what}")

    def allowed(address) -> bool:
        return not isinstance(address, tuple) or address[0] in LOOPBACK

    def getaddrinfo(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if name is not None and name not in LOOPBACK:
            refuse(f"getaddrinfo({name!r})")
        return real[0](host, *args, **kwargs)

    def connect(self, address):
        if not allowed(address):
            refuse(f"connect({address!r})")
        return real[1](self, address)

    def connect_ex(self, address):
        if not allowed(address):
            refuse(f"connect_ex({address!r})")
        return real[2](self, address)

    socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex = (
        getaddrinfo, connect, connect_ex
    )  # fmt: skip

    def restore() -> None:
        socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex = real

    return restore


if __name__ == "sitecustomize" and os.environ.get("UNIKV_NO_NETWORK_LOG"):

    def _append(what: str, path: str = os.environ["UNIKV_NO_NETWORK_LOG"]) -> None:
        with open(path, "a") as f:
            f.write(what + "\n")

    install(_append)
