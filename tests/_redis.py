"""Real Redis servers for the tests: one server, or a three-master cluster, on free ports.

Each server runs from Debian's `redis-server` in a temporary directory with a password, on a
port found free, and is stopped (and waited for) when the test session is done. Tests that need
one skip with a reason when `redis-server` is not installed.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PASSWORD = "unikv-test-secret"
REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def need_redis() -> None:
    """Skip the calling test when redis-server or redis-cli is not installed."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server / redis-cli not installed (make test installs redis-server)")


def free_port(also_bus: bool = False) -> int:
    """A TCP port free now on 127.0.0.1 (with `also_bus`, port + 10000 is free too)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535 and also_bus:
            continue
        if not also_bus:
            return port
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair found")


@dataclass
class RedisServer:
    """One redis-server process: its port, directory and password."""

    dir: Path
    port: int
    password: str = PASSWORD
    cluster: bool = False
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server and wait until it answers."""
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--requirepass", self.password,
            "--masterauth", self.password,
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", "512mb",
            "--maxmemory-policy", "allkeys-lru",
            "--logfile", str(self.dir / "redis.log"),
        ]  # fmt: skip
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-500:]
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}): {log}")
            if self.cli("PING", check=False).strip() == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer in 10 s")

    def cli(self, *args: str, check: bool = True) -> str:
        """Run redis-cli against this server (the password through the environment)."""
        out = subprocess.run(
            [REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *args],
            capture_output=True,
            text=True,
            env={"REDISCLI_AUTH": self.password, "PATH": "/usr/bin:/bin"},
            timeout=10,
        )
        if check and out.returncode:
            raise RuntimeError(f"redis-cli {' '.join(args)}: {out.stderr}")
        return out.stdout

    def stop(self) -> None:
        """Kill the server (as a crash would) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@contextlib.contextmanager
def redis_server(root: Path) -> Iterator[RedisServer]:
    """A running redis-server in `root` with a password; stopped on exit."""
    need_redis()
    server = RedisServer(root, free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class RedisCluster:
    """Three masters (no replicas) joined by `redis-cli --cluster create`."""

    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        n = self.nodes[0]
        return f"redis+cluster://:{n.password}@127.0.0.1:{n.port}"


@contextlib.contextmanager
def redis_cluster(root: Path) -> Iterator[RedisCluster]:
    """A running three-master cluster in `root`; every node stopped on exit."""
    need_redis()
    nodes: list[RedisServer] = []
    try:
        for i in range(3):
            node = RedisServer(root / f"node{i}", free_port(also_bus=True), cluster=True)
            nodes.append(node)
            node.start()
        addrs = [f"127.0.0.1:{n.port}" for n in nodes]
        nodes[0].cli("--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes")
        deadline = time.monotonic() + 20
        while "cluster_state:ok" not in nodes[0].cli("CLUSTER", "INFO", check=False):
            if time.monotonic() > deadline:
                raise RuntimeError("the test cluster did not reach cluster_state:ok in 20 s")
            time.sleep(0.1)
        for n in nodes[1:]:  # every node must know the others before clients ask it
            while "cluster_state:ok" not in n.cli("CLUSTER", "INFO", check=False):
                if time.monotonic() > deadline:
                    raise RuntimeError("a test cluster node is not ready in 20 s")
                time.sleep(0.1)
        yield RedisCluster(nodes)
    finally:
        for n in nodes:
            n.stop()
