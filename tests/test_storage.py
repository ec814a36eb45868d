"""Block stores: the contract every registered store keeps, then LMDB specifics.

The contract tests are parametrized over `storage.available()`: a new backend gets them by
registering and adding its test setup to `SETUPS` and `CORRUPTORS` (a test fails until it
does). Redis and Redis Cluster run against real servers (tests/_redis.py: started once per
session on free ports with a password, skipped when redis-server is not installed); every test
gets its own key namespace there. LMDB specifics: map growth, a full map or disk, bad paths,
location hints, bit rot in the data file, and crash safety against a real child process killed
with SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from unikv import storage
from unikv.storage import AsyncBlockStore, BlockStore, ChecksumError, StoreFullError
from unikv.storage.base import HEADER_BYTES, decode_frame, encode_frame
from unikv.storage.lmdb_store import _LOC, LmdbBlockStore

from ._crash_writer import block_key, block_value
from ._redis import need_redis, redis_cluster, redis_server

HERE = Path(__file__).resolve().parent


def key(i: int) -> bytes:
    """A 32-byte content-hash-like key."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def value(i: int, n: int = 100) -> bytes:
    """`n` deterministic bytes for entry `i`."""
    return (hashlib.blake2b(b"v" + i.to_bytes(8, "little")).digest() * (n // 64 + 1))[:n]


# -- per-backend test setup ---------------------------------------------------------------


def _lmdb_kwargs(root: Path) -> dict:
    return {"path": root / "lmdb", "map_size": 1 << 20}


def _lmdb_corrupt(kwargs: dict, k: bytes) -> None:
    """Flip one payload byte of `k`'s stored frame, bypassing the store (the store is closed)."""
    with lmdb.open(str(kwargs["path"]), max_dbs=3) as env:
        db = env.open_db(b"blocks")
        with env.begin(write=True, db=db) as txn:
            frame = bytearray(txn.get(k))
            frame[-1] ^= 0x40
            txn.put(k, bytes(frame))


def _namespace(root: Path) -> str:
    """A namespace of its own for each test (the servers are shared by the session)."""
    return hashlib.blake2b(str(root).encode(), digest_size=8).hexdigest()


def _redis_kwargs(root: Path) -> dict:
    return {"url": _servers.single(root).url, "namespace": _namespace(root)}


def _cluster_kwargs(root: Path) -> dict:
    return {"url": _servers.cluster(root).url, "namespace": _namespace(root)}


def _redis_corrupt(kwargs: dict, k: bytes) -> None:
    """Flip one payload byte of `k`'s value on the server, bypassing the store."""
    import redis

    if kwargs["url"].startswith("redis+cluster"):
        client = redis.RedisCluster.from_url(kwargs["url"].replace("redis+cluster", "redis"))
    else:
        client = redis.Redis.from_url(kwargs["url"])
    name = f"unikv:{kwargs['namespace']}:".encode() + k
    frame = bytearray(client.get(name))
    frame[-1] ^= 0x40
    client.set(name, bytes(frame))
    client.close()


def _fs_kwargs(root: Path) -> dict:
    return {"path": root / "fs", "namespace": "test", "max_bytes": 1 << 26}


def _fs_corrupt(kwargs: dict, k: bytes) -> None:
    """Flip one payload byte of `k`'s file, bypassing the store."""
    name = k.hex()
    file = Path(kwargs["path"]) / kwargs["namespace"] / name[:2] / name
    frame = bytearray(file.read_bytes())
    frame[-1] ^= 0x40
    file.write_bytes(bytes(frame))


class _Servers:
    """The session's Redis server and cluster, started when a test first asks for them."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._single = self._cluster = None

    def single(self, root: Path):
        if self._single is None:
            self._single = self._stack.enter_context(redis_server(root.parent / "redis-single"))
        return self._single

    def cluster(self, root: Path):
        if self._cluster is None:
            self._cluster = self._stack.enter_context(redis_cluster(root.parent / "redis-cluster"))
        return self._cluster

    def close(self) -> None:
        self._stack.close()
        self._single = self._cluster = None


_servers = _Servers()


@pytest.fixture(scope="module", autouse=True)
def _stop_servers():
    yield
    _servers.close()


SETUPS: dict[str, Callable[[Path], dict]] = {
    "lmdb": _lmdb_kwargs,
    "redis": _redis_kwargs,
    "redis_cluster": _cluster_kwargs,
    "fs": _fs_kwargs,
}
CORRUPTORS: dict[str, Callable[[dict, bytes], None]] = {
    "lmdb": _lmdb_corrupt,
    "redis": _redis_corrupt,
    "redis_cluster": _redis_corrupt,
    "fs": _fs_corrupt,
}


@pytest.fixture(params=storage.available())
def name(request) -> str:
    return request.param


@pytest.fixture
def kwargs(name, tmp_path) -> dict:
    if name.startswith("redis"):
        need_redis()
    return SETUPS[name](tmp_path)


@pytest.fixture
def store(name, kwargs):
    s = storage.create_store(name, **kwargs)
    yield s
    s.close()


# -- the contract -------------------------------------------------------------------------


def test_every_registered_store_has_a_test_setup():
    assert "lmdb" in storage.available()
    assert storage.get("lmdb") is LmdbBlockStore
    for n in storage.available():
        assert n in SETUPS and n in CORRUPTORS, f"add a test setup for block store {n!r}"


def test_unknown_store_name_lists_supported():
    with pytest.raises(ValueError, match="unknown block store 'nope'; supported: .*lmdb"):
        storage.create_store("nope")


def test_put_get_roundtrip_missing_overwrite(store: BlockStore):
    assert store.get(key(1)) is None
    store.put(key(1), value(1))
    assert store.get(key(1)) == value(1)
    store.put(key(1), value(2, 5000))
    assert store.get(key(1)) == value(2, 5000)
    assert store.get(key(2)) is None
    assert len(store) == 1


def test_delete(store: BlockStore):
    store.put(key(1), value(1))
    assert store.delete(key(1)) is True
    assert store.delete(key(1)) is False
    assert store.get(key(1)) is None and not store.contains(key(1))


def test_bytes_like_empty_and_large_values(store: BlockStore):
    store.put(b"e", b"")
    store.put(b"ba", bytearray(b"abc"))
    store.put(b"mv", memoryview(b"xyz123")[2:])
    big = os.urandom(737_280)
    store.put(b"big", big)
    assert store.get(b"e") == b""
    assert store.get(b"ba") == b"abc"
    assert store.get(b"mv") == b"z123"
    assert store.get(b"big") == big
    assert isinstance(store.get(b"ba"), bytes)


def test_bad_keys_and_values_are_value_errors(store: BlockStore):
    for bad in (b"", "text", 7, b"k" * 10_000):
        with pytest.raises(ValueError, match="block key"):
            store.put(bad, b"v")
        with pytest.raises(ValueError, match="block key"):
            store.get(bad)
    with pytest.raises(ValueError, match="must be bytes, got str"):
        store.put(b"k", "not bytes")
    with pytest.raises(ValueError, match="pairs"):
        store.put_many([b"not a pair"])
    assert len(store) == 0


def test_batched_operations(store: BlockStore):
    store.put_many({key(i): value(i) for i in range(10)})
    store.put_many((key(i), value(i, 3000)) for i in range(10, 20))
    got = store.get_many([key(3), key(99), key(15)])
    assert got == [value(3), None, value(15, 3000)]
    assert store.delete_many([key(1), key(2), key(99), key(1)]) == 2
    assert len(store) == 18
    store.put_many([(b"dup", b"first"), (b"dup", b"last")])
    assert store.get(b"dup") == b"last"
    store.put_many([])
    assert store.get_many([]) == [] and store.delete_many([]) == 0


def test_read_into_fills_scattered_buffers(store: BlockStore):
    store.put_many({key(i): value(i, 5000) for i in range(4)})
    bufs = [[bytearray(1000), bytearray(4000)], [bytearray(5000)], [bytearray(5000)],
            [bytearray(10)]]  # fmt: skip
    found = store.read_into([key(2), key(99), key(0), key(1)], bufs)
    assert found == [True, False, True, False]  # absent; of another size
    assert bytes(bufs[0][0] + bufs[0][1]) == value(2, 5000) and bytes(bufs[2][0]) == value(0, 5000)


def test_failed_batch_leaves_nothing_of_it(store: BlockStore):
    store.put(key(0), value(0))
    bad = [(key(1), value(1)), (key(2), value(2)), (key(3), 42)]
    with pytest.raises(ValueError):
        store.put_many(bad)
    assert store.get_many([key(1), key(2), key(3)]) == [None, None, None]
    assert store.get(key(0)) == value(0) and len(store) == 1


def test_contains_len_keys(store: BlockStore):
    keys = {key(i) for i in range(50)}
    store.put_many({k: b"x" for k in keys})
    assert len(store) == 50
    assert set(store.keys()) == keys
    assert store.contains(key(3)) and key(3) in store
    assert not store.contains(key(999)) and "str" not in store
    # Writing while iterating neither deadlocks nor breaks the iteration.
    for i, k in enumerate(store.keys()):
        if i < 5:
            store.put(k + b"-new", b"y")
    assert len(store) == 55


def test_stats_counters(store: BlockStore):
    store.put_many({key(i): value(i) for i in range(4)})
    store.get(key(0))
    store.get(key(1))
    store.get(key(9))
    store.delete(key(3))
    st = store.stats()
    assert st["entries"] == 3
    assert st["puts"] == 4 and st["gets"] == 3 and st["hits"] == 2 and st["misses"] == 1
    assert st["deletes"] == 1 and st["checksum_failures"] == 0
    assert st["bytes"] > 0 and st["map_size"] > 0


def test_persists_across_reopen(name, kwargs):
    with storage.create_store(name, **kwargs) as s:
        s.put_many({key(i): value(i, 9000) for i in range(5)})
    with storage.create_store(name, **kwargs) as s:
        assert s.get_many([key(i) for i in range(5)]) == [value(i, 9000) for i in range(5)]


def test_corruption_is_reported_and_a_miss(name, kwargs, caplog):
    with storage.create_store(name, **kwargs) as s:
        s.put_many({key(i): value(i, 20_000) for i in range(3)})
        assert s.verify().ok
    CORRUPTORS[name](kwargs, key(1))
    with storage.create_store(name, **kwargs) as s:
        report = s.verify()
        assert report.corrupted == [key(1)] and report.checked == 3 and not report.ok
        with caplog.at_level(logging.WARNING):
            assert s.get(key(1)) is None
        assert key(1).hex() in caplog.text
        assert s.get_many([key(0), key(1), key(2)]) == [value(0, 20_000), None, value(2, 20_000)]
        st = s.stats()
        assert st["checksum_failures"] >= 2 and st["misses"] >= 2
        s.put(key(1), value(1))  # rewriting a corrupt entry heals it
        assert s.get(key(1)) == value(1) and s.verify().ok


def test_clear(store: BlockStore):
    store.put_many({key(i): value(i, 10_000) for i in range(10)})
    store.clear()
    assert len(store) == 0 and list(store.keys()) == [] and store.get(key(1)) is None
    store.put(key(1), value(1))
    assert store.get(key(1)) == value(1)


def test_closed_store_refuses_calls(name, kwargs):
    with storage.create_store(name, **kwargs) as s:
        s.put(b"k", b"v")
    s.close()  # twice is harmless
    for call in (lambda: s.get(b"k"), lambda: s.put(b"k", b"v"), lambda: len(s)):
        with pytest.raises(ValueError, match="closed"):
            call()


@pytest.mark.timeout(20)
def test_threads_share_one_store(store: BlockStore):
    errors: list[BaseException] = []

    def writer(base: int) -> None:
        try:
            for i in range(base, base + 40):
                store.put(key(i), value(i, 6000))
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    def reader() -> None:
        try:
            for _ in range(20):
                for got in store.get_many([key(i) for i in range(0, 120, 7)]):
                    assert got is None or len(got) == 6000
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(b,)) for b in (0, 40, 80)]
    threads += [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.get_many([key(i) for i in range(120)]) == [value(i, 6000) for i in range(120)]


@pytest.mark.timeout(10)
async def test_async_facade(store: BlockStore):
    a = AsyncBlockStore(store)
    await a.put(key(1), value(1))
    await a.put_many({key(i): value(i) for i in range(2, 6)})
    assert await a.get(key(1)) == value(1)
    got = await asyncio.gather(*(a.get(key(i)) for i in range(1, 7)))
    assert got == [value(i) for i in range(1, 6)] + [None]
    assert await a.get_many([key(2), key(9)]) == [value(2), None]
    assert await a.contains(key(3)) and await a.count() == 5
    assert await a.delete(key(1)) and await a.delete_many([key(2), key(3)]) == 2
    assert sorted(await a.keys()) == sorted([key(4), key(5)])
    assert (await a.verify()).ok and (await a.stats())["entries"] == 2
    await a.clear()
    assert await a.count() == 0


# -- the frame ------------------------------------------------------------------------------


def test_frame_roundtrip_and_damage():
    frame = encode_frame(b"k1", b"payload")
    assert len(frame) == HEADER_BYTES + 7 and decode_frame(b"k1", frame) == b"payload"
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        decode_frame(b"k2", frame)  # a value stored under the wrong key is caught too
    with pytest.raises(ChecksumError, match="length"):
        decode_frame(b"k1", frame[:-1])
    with pytest.raises(ChecksumError, match="header"):
        decode_frame(b"k1", b"xx" + frame[2:])
    with pytest.raises(ChecksumError, match="shorter"):
        decode_frame(b"k1", frame[:5])


# -- LMDB specifics -------------------------------------------------------------------------


def test_lmdb_map_grows_from_tiny(tmp_path):
    with LmdbBlockStore(tmp_path / "s", map_size=64 * 1024) as s:
        blocks = {key(i): os.urandom(200_000) for i in range(20)}  # 4 MB
        for k, v in list(blocks.items())[:10]:
            s.put(k, v)
        s.put_many(dict(list(blocks.items())[10:]))
        st = s.stats()
        assert st["map_size"] >= 4 * 10**6 and st["map_growths"] >= 6
        assert s.get_many(list(blocks)) == list(blocks.values())


def test_lmdb_full_at_max_map_size_keeps_old_data(tmp_path):
    path = tmp_path / "s"
    with LmdbBlockStore(path, map_size=64 * 1024, max_map_size=1 << 20) as s:
        s.put_many({key(i): value(i, 100_000) for i in range(5)})
        with pytest.raises(StoreFullError, match="max_map_size") as info:
            s.put_many({key(i): value(i, 100_000) for i in range(5, 15)})
        assert isinstance(info.value, OSError) and str(path) in str(info.value)
        assert s.get_many([key(i) for i in range(15)]) == [
            value(i, 100_000) if i < 5 else None for i in range(15)
        ]
        assert s.stats()["map_size"] == 1 << 20
        s.put(b"small", b"still fits")
        assert s.verify().ok
    with LmdbBlockStore(path, map_size=64 * 1024, max_map_size=1 << 20) as s:
        assert len(s) == 6 and s.get(key(4)) == value(4, 100_000)


def test_lmdb_full_disk_is_a_store_full_error(tmp_path):
    """A file-size limit stands in for a full disk: the kernel refuses the write the same way."""
    with LmdbBlockStore(tmp_path / "s", map_size=1 << 24) as s:
        s.put(key(0), value(0, 50_000))
        size = os.path.getsize(tmp_path / "s" / "data.mdb")
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 64 * 1024, old_limit[1]))
        try:
            with pytest.raises(StoreFullError, match="cannot take a write"):
                s.put_many({key(i): value(i, 300_000) for i in range(1, 4)})
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
            signal.signal(signal.SIGXFSZ, old_handler)
        assert s.get(key(0)) == value(0, 50_000) and s.get(key(1)) is None
        s.put(key(1), value(1, 300_000))  # room again: writes work
        assert s.get(key(1)) == value(1, 300_000) and s.verify().ok


def test_lmdb_bad_paths_and_sizes(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(ValueError, match=f"{f} exists and is not a directory"):
        LmdbBlockStore(f)
    with pytest.raises(ValueError, match=f"cannot create block store directory {f}/sub"):
        LmdbBlockStore(f / "sub")
    with pytest.raises(ValueError, match="map_size must be >= 65536"):
        LmdbBlockStore(tmp_path / "s", map_size=1000)
    with pytest.raises(ValueError, match="max_map_size"):
        LmdbBlockStore(tmp_path / "s", map_size=1 << 20, max_map_size=1 << 19)
    with LmdbBlockStore(tmp_path / "s"), pytest.raises(ValueError, match="cannot open"):
        LmdbBlockStore(tmp_path / "s")  # LMDB forbids opening one environment twice


def test_lmdb_refuses_a_foreign_environment(tmp_path):
    with lmdb.open(str(tmp_path / "other")) as env, env.begin(write=True) as txn:
        txn.put(b"someone", b"else's data")
    with pytest.raises(ValueError, match="not a unikv block store"):
        LmdbBlockStore(tmp_path / "other")
    with lmdb.open(str(tmp_path / "other")) as env, env.begin() as txn:
        assert txn.get(b"someone") == b"else's data"  # and nothing was written into it
    LmdbBlockStore(tmp_path / "newer").close()
    with lmdb.open(str(tmp_path / "newer"), max_dbs=3) as env:
        meta = env.open_db(b"meta")
        with env.begin(write=True, db=meta) as txn:
            txn.put(b"format", b"unikv.storage.lmdb/99")
    with pytest.raises(ValueError, match="has format b'unikv.storage.lmdb/99'"):
        LmdbBlockStore(tmp_path / "newer")


def test_lmdb_bit_rot_in_the_data_file_is_detected(tmp_path):
    with LmdbBlockStore(tmp_path / "s") as s:
        s.put_many({key(i): value(i, 100_000) for i in range(3)})
    with LmdbBlockStore(tmp_path / "s") as s, s._reading() as txn:
        # The location hint says where the frame lies in data.mdb.
        offset, length = _LOC.unpack(txn.get(key(2), db=s._locs))
        assert length == HEADER_BYTES + 100_000
    fd = os.open(tmp_path / "s" / "data.mdb", os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset + 5000)
        os.pwrite(fd, bytes([byte[0] ^ 1]), offset + 5000)  # one flipped bit on "disk"
    finally:
        os.close(fd)
    with LmdbBlockStore(tmp_path / "s") as s:
        assert s.verify().corrupted == [key(2)]
        assert s.get(key(2)) is None and s.get(key(1)) == value(1, 100_000)


def test_lmdb_location_hints_are_advisory(tmp_path):
    path = tmp_path / "s"
    with LmdbBlockStore(path) as s:
        s.put_many({key(i): value(i, 50_000) for i in range(4)})
        s.put(b"tiny", b"t")  # one page or less: no hint needed
    with LmdbBlockStore(path) as s:
        assert s.stats()["location_hints"] == 4  # saved by the next write or by close
        s.put(key(0), value(100, 80_000))  # moves: the old hint is dropped in the same write
        assert s.get(key(0)) == value(100, 80_000)
        s._pending[key(1)] = _LOC.pack(123 * 4096, 4096)  # a wrong hint: a useless prefetch
        assert s.get(key(1)) == value(1, 50_000)
    with LmdbBlockStore(path, prefetch=False, readahead=True) as s:
        assert s.get_many([key(i) for i in range(4)]) == [value(100, 80_000)] + [
            value(i, 50_000) for i in range(1, 4)
        ]


@pytest.mark.timeout(20)
def test_lmdb_growth_while_other_threads_read(tmp_path):
    with LmdbBlockStore(tmp_path / "s", map_size=64 * 1024) as s:
        s.put(b"anchor", value(0, 30_000))
        stop = threading.Event()
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                while not stop.is_set():
                    assert s.get(b"anchor") == value(0, 30_000)
            except BaseException as e:  # noqa: BLE001 - reported by the assert below
                errors.append(e)

        threads = [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            for i in range(40):
                s.put(key(i), value(i, 60_000))
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors and s.stats()["map_growths"] >= 5


@pytest.mark.timeout(30)
def test_lmdb_survives_sigkill_mid_stream(tmp_path):
    """Kill a writing child three times; every block it reported committed reads back exactly."""
    path = tmp_path / "s"
    committed: list[int] = []
    start = 0
    for round_ in range(3):
        child = subprocess.Popen(
            [sys.executable, str(HERE / "_crash_writer.py"), str(path), str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            seen = []
            deadline = time.monotonic() + 15
            while len(seen) < 60 + 40 * round_ and time.monotonic() < deadline:
                line = child.stdout.readline()
                if not line:
                    break
                seen.append(int(line))
            child.send_signal(signal.SIGKILL)  # mid-stream: the child never stops writing
            rest, err = child.communicate(timeout=10)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        seen += [int(x) for x in rest.split()]
        assert child.returncode == -signal.SIGKILL, err
        assert len(seen) >= 20, f"the child committed too little before the kill: {err}"
        assert seen == list(range(start, start + len(seen)))
        committed += seen
        start = seen[-1] + 1
    with LmdbBlockStore(path) as s:
        got = s.get_many([block_key(i) for i in committed])
        assert all(g == block_value(i) for g, i in zip(got, committed, strict=True))
        # At most the one put in flight at each kill may have landed without being reported.
        assert len(committed) <= len(s) <= len(committed) + 3
        report = s.verify()
        assert report.ok and report.checked == len(s)


def test_the_file_store_refuses_planted_files_and_collects_stale_temporaries(tmp_path):
    """Issue 31: the shared-directory store followed symlinks and read without a size cap
    (`ln -s /dev/zero` hung it), and killed writers' temporaries were never collected. Now a
    symlink, a FIFO or a file longer than its header declares is a corrupt value (a miss,
    deleted), and temporaries older than an hour go at open."""
    import os
    import time

    from unikv.storage.fs_store import STALE_TMP_S, FileBlockStore

    st = FileBlockStore(tmp_path, "ns")
    st.put(b"good", b"x" * 100)
    good = st._file(b"good").read_bytes()
    planted = {b"link": lambda f: os.symlink("/dev/zero", f),
               b"fifo": lambda f: os.mkfifo(f),
               b"long": lambda f: f.write_bytes(good + b"tail")}  # fmt: skip
    for key, plant in planted.items():
        f = st._file(key)
        f.parent.mkdir(exist_ok=True)
        plant(f)
    assert st.get_many(list(planted)) == [None, None, None]  # no hang, no data
    assert not any(os.path.lexists(st._file(k)) for k in planted)  # deleted as corrupt
    assert st.stats()["checksum_failures"] == 3 and st.get(b"good") == b"x" * 100
    st.close()
    sub = st._file(b"good").parent
    old, fresh = sub / ".tmp-deadbeef-1-1", sub / ".tmp-cafe-2-2"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"in flight")
    past = time.time() - STALE_TMP_S - 60
    os.utime(old, (past, past))
    again = FileBlockStore(tmp_path, "ns")
    assert again.stale_removed == 1 and not old.exists() and fresh.exists()
    assert again.get(b"good") == b"x" * 100
    again.close()


@pytest.mark.parametrize("make", ["fs", "redis"])
def test_with_a_secret_a_planted_value_is_a_miss_and_deleted(make, tmp_path):
    """Issue 31: anyone who can write to the shared tier could plant KV under a known
    prompt's hash (a CRC is no defence against an author). With the deployment's secret every
    value is signed (HMAC-SHA256 over key, header, payload): a value written without it, or
    with another, is a miss, counted and deleted; the signed value reads back."""
    from unikv.storage.fs_store import FileBlockStore
    from unikv.storage.redis_store import RedisBlockStore

    from ._redis import redis_server

    secret, other = "s" * 32, "t" * 32
    with contextlib.ExitStack() as stack:
        if make == "fs":

            def opened(key):
                return FileBlockStore(tmp_path, "ns", secret=key)
        else:
            srv = stack.enter_context(redis_server(tmp_path / "redis"))

            def opened(key):
                return RedisBlockStore(srv.url, "ns", secret=key)

        signed, plain, foreign = opened(secret), opened(None), opened(other)
        signed.put(b"mine", b"kv" * 50)
        plain.put(b"planted", b"evil" * 25)  # an author without the secret
        foreign.put(b"forged", b"evil" * 25)  # or with another one
        assert signed.get_many([b"mine", b"planted", b"forged"]) == [b"kv" * 50, None, None]
        assert signed.stats()["checksum_failures"] == 2
        assert not plain.contains(b"planted") and not plain.contains(b"forged")  # deleted
        assert plain.get(b"mine") == b"kv" * 50  # signed frames still pass the CRC alone
        with pytest.raises(ValueError, match="at least 16 bytes"):
            opened("short")
        for s in (signed, plain, foreign):
            s.close()


def test_a_store_whose_dependency_is_missing_is_named_with_what_to_install():
    """Without redis-py (the `remote` extra) the other stores work, and asking for Redis names
    what to install."""
    code = (
        "import sys; sys.modules['redis'] = None  # as if not installed\n"
        "from unikv.storage import registry\n"
        "print(registry.available())\n"
        "registry.get('redis')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stdout.strip() == "['fs', 'lmdb']"
    assert "unknown block store 'redis'; supported: fs, lmdb; not installed:" in proc.stderr
    assert "pip install 'unikv[remote]'" in proc.stderr
