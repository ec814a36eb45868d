"""The remote tier against real servers: sharing, the circuit breaker, bad values and URLs.

Servers are real (tests/_redis.py: redis-server on a free port in a temporary directory, with
a password), started per test where a test kills them, and stopped afterwards. Without the
model: a tiny two-layer KV spec through `hierarchical_offload`. With it (`slow`): two engine
processes share a prompt's blocks, and an engine keeps answering while the server is killed.
The filesystem store is checked under two processes writing one key.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch

from unikv import kvstrategies, storage
from unikv.engine.assembly import create_kv
from unikv.engine.engine import Engine
from unikv.engine.sampling import SamplingParams
from unikv.kvstrategies.kv import StepBatch
from unikv.memory.remote import CircuitBreaker
from unikv.serving.health import HealthInputs, evaluate
from unikv.settings.config import PoolConfig, TierConfig
from unikv.storage.fs_store import FileBlockStore

from ._redis import PASSWORD, free_port, redis_server
from .conftest import make_english

HERE = Path(__file__).resolve().parent
NAME = "hierarchical_offload"
SMALL = {"device_window": 64, "host_window": 64, "min_disk_hit_tokens": 0}
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def config(ssd: Path, url: str) -> PoolConfig:
    tiers = (TierConfig("device", 1 << 28), TierConfig("host", 1 << 28),
             TierConfig("ssd", 1 << 30, path=str(ssd)),
             TierConfig("remote", 1 << 30, path=url))  # fmt: skip
    return PoolConfig(block_size=16, tiers=tiers, strategy=NAME)


def tiny(ssd: Path, url: str, identity: str = "model-a"):
    spec = kvstrategies.KVSpec(2, 2, 16, identity=identity)
    return create_kv(NAME, spec, config(ssd, url), dict(SMALL))


def prefill(s, seq, tokens, seed=0):
    """Random K/V for `tokens` through strategy `s` (2 layers), then publish them."""
    g = torch.Generator().manual_seed(seed)
    b = StepBatch([seq], [len(tokens)])
    s.reserve(seq, len(tokens))
    s.begin_step(b)
    for layer in range(2):
        k, v = torch.randn(2, len(tokens), 2, 16, generator=g)
        s.append(layer, k, v)
        s.attend(layer, torch.randn(len(tokens), 4, 16, generator=g))
    s.end_step()
    s.publish(seq, tokens)


TOKENS = list(range(100, 100 + 16 * 5 + 3))  # 5 full blocks and a partial one


@pytest.fixture
def server(tmp_path):
    with redis_server(tmp_path / "redis") as s:
        yield s


# ---- the breaker (no server) ----------------------------------------------------------------


def test_breaker_opens_skips_backs_off_and_closes():
    now = [0.0]
    b = CircuitBreaker(1.0, 4.0, clock=lambda: now[0])
    assert b.allow() and b.problem() is None
    b.failure("read: refused")
    assert b.is_open and not b.allow() and b.skipped == 1
    assert "remote tier unavailable" in b.problem() and "refused" in b.problem()
    now[0] = 1.0
    assert b.allow() and not b.allow()  # exactly one trial after the backoff
    b.failure("read: refused")
    assert b.backoff_s == 2.0 and not b.allow()
    now[0] = 3.0
    assert b.allow()
    b.failure("again")
    now[0] = 7.0
    assert b.allow()
    b.failure("again")
    assert b.backoff_s == 4.0  # the ceiling
    now[0] = 11.0
    assert b.allow()
    b.success()
    assert not b.is_open and b.backoff_s == 1.0 and b.problem() is None and b.opened == 1


# ---- URLs, passwords ------------------------------------------------------------------------


def test_a_url_picks_the_store_and_a_bad_one_is_one_line(tmp_path):
    assert storage.url_store("redis://h:1/2?ttl=5")[0] == "redis"
    assert storage.url_store("rediss://h:1")[0] == "redis"
    assert storage.url_store("redis+cluster://h:1")[0] == "redis_cluster"
    name, args = storage.url_store(f"file://{tmp_path}/kv?max_bytes=1000")
    assert name == "fs" and args == {"path": f"{tmp_path}/kv", "max_bytes": 1000}
    with pytest.raises(ValueError, match=r"unknown scheme 'memcached'; supported: redis://"):
        storage.open_url("memcached://h:1")
    port = free_port()  # nothing listens there
    with pytest.raises(ValueError) as info:
        storage.open_url(f"redis://:hunter2@127.0.0.1:{port}/0", connect_timeout_s=0.5)
    msg = str(info.value)
    assert f"cannot reach block store redis://:***@127.0.0.1:{port}/0" in msg
    assert "hunter2" not in msg and "\n" not in msg


def test_a_refused_password_names_file_key_and_url(server, tmp_path):
    """A server that answers but refuses the password is a start-up error (unlike one that
    does not answer yet: the next test)."""
    url = f"redis://:hunter2@127.0.0.1:{server.port}/0"
    with pytest.raises(ValueError, match=r"\[tiers.remote\] url = 'redis://:\*\*\*@") as info:
        tiny(tmp_path / "ssd", url)
    assert "hunter2" not in str(info.value) and "authentication failed" in str(info.value)


def test_a_server_not_up_at_start_is_picked_up_when_it_answers(tmp_path):
    """Issue 31: with the Redis server down when unikv started, `run` and `serve` exited 2.
    Now the tier starts with its breaker open (lookups miss, writes are skipped, the health
    view says why) and, once the server answers, a trial picks it up."""
    from ._redis import RedisServer, need_redis

    need_redis()
    port = free_port()
    srv = RedisServer(tmp_path / "redis", port)
    s = tiny(tmp_path / "ssd", srv.url)  # nothing listens yet: no error
    try:
        remote = s.pool.persistence.remote
        assert "not reachable at start" in remote.problem()
        prefill(s, 0, TOKENS)
        s.pool.persistence.remote_writer.wait_writes()
        assert remote.breaker.state == "open"  # the writes were skipped, nothing failed
        srv.start()
        try:
            remote.breaker.retry_at = 0.0  # the backoff is over (no waiting in a test)
            key = next(iter(s.pool.sharing.chain(0)))
            remote.has_content(key)  # the trial reaches the server: closed again
            assert remote.breaker.state == "closed" and remote.problem() is None
            prefill(s, 1, TOKENS, seed=1)
            s.pool.persistence.remote_writer.wait_writes()
            assert int(srv.cli("DBSIZE").strip()) > 0  # writes land now
        finally:
            srv.stop()
    finally:
        s.close()


def test_a_wrong_or_missing_password_is_one_line_never_shown(server, monkeypatch, caplog):
    url = f"redis://127.0.0.1:{server.port}"
    monkeypatch.delenv("REDISCLI_AUTH", raising=False)
    with pytest.raises(ValueError, match="authentication failed|needs a password"):
        storage.open_url(url)
    with pytest.raises(ValueError, match="authentication failed") as info:
        storage.open_url(f"redis://:not-the-password@127.0.0.1:{server.port}")
    assert "not-the-password" not in str(info.value)
    monkeypatch.setenv("REDISCLI_AUTH", PASSWORD)  # from the environment, as redis-cli reads it
    with storage.open_url(url, namespace="t") as s:
        s.put(b"k", b"v")
        assert s.get(b"k") == b"v" and PASSWORD not in s.stats()["url"]
    assert PASSWORD not in caplog.text


def test_ttl_expires_values(server):
    with storage.open_url(server.url + "?ttl=0.2", namespace="ttl") as s:
        s.put(b"k", b"v")
        assert s.get(b"k") == b"v"
        time.sleep(0.4)
        assert s.get(b"k") is None


# ---- the tier in the pool -------------------------------------------------------------------


def test_a_resident_full_cache_shares_prefixes_through_the_server(server, tmp_path):
    """Issue 32: prefix persistence is the pool's service, not the tiered placement's. A
    user's first config, `strategy = "full"` with SSD and remote tables, writes its prompt
    through; another pool (its own SSD directory, as another process) finds it on the server
    and loads it straight into device blocks, which hold exactly what the first pool
    computed."""
    spec = kvstrategies.KVSpec(2, 2, 16, identity="model-a")
    a = create_kv("full", spec, config(tmp_path / "ssd-a", server.url), {"min_disk_hit_tokens": 0})
    prefill(a, 0, TOKENS)
    a.pool.persistence.remote_writer.wait_writes()
    assert a.pool.persistence.remote_writer.blocks_written == 5
    kv_a = [a.pool.arena("kv")[:, :, :, i].clone() for i in a.pool.table(0).block_ids()[:5]]
    a.close()

    b = create_kv("full", spec, config(tmp_path / "ssd-b", server.url), {"min_disk_hit_tokens": 0})
    assert b.match_prefix(1, TOKENS) == 5 * 16
    st = b.stats().placement
    assert st["disk_prefix_hits"]["remote_blocks"] == 5 and st["disk_prefix_hits"]["blocks"] == 5
    table = b.pool.table(1)
    assert all(r.tier == "device" for r in table.refs)  # resident: loaded, not read in place
    kv_b = [b.pool.arena("kv")[:, :, :, i] for i in table.block_ids()]
    assert all(torch.equal(x, y) for x, y in zip(kv_a, kv_b, strict=True))
    b.close()


def test_a_resident_cache_without_an_ssd_tier_loads_remote_hits_into_device_blocks(
    server, tmp_path
):
    """Issue 32: `full` + `[tiers.remote]` alone (no SSD tier): pool A writes its prompt through
    to the server; pool B finds it there and reads it straight into device blocks, which hold
    exactly what A computed; nothing is left attached in the remote tier."""
    spec = kvstrategies.KVSpec(2, 2, 16, identity="model-a")
    tiers = (TierConfig("device", 1 << 28), TierConfig("remote", 1 << 30, path=server.url))
    cfg = PoolConfig(block_size=16, tiers=tiers)
    a = create_kv("full", spec, cfg, {"min_disk_hit_tokens": 0})
    assert a.pool.persistence.ssd is None and a.pool.persistence.tier == "remote"
    prefill(a, 0, TOKENS, seed=7)
    a.pool.persistence.remote_writer.wait_writes()
    assert a.pool.persistence.remote_writer.blocks_written == 5
    kv_a = [a.pool.arena("kv")[:, :, :, i].clone() for i in a.pool.table(0).block_ids()[:5]]
    a.close()

    b = create_kv("full", spec, cfg, {"min_disk_hit_tokens": 0})
    assert b.match_prefix(1, TOKENS) == 5 * 16
    hits = b.stats().placement["disk_prefix_hits"]
    assert hits["remote_blocks"] == 5 and hits["blocks"] == 5
    table = b.pool.table(1)
    assert all(r.tier == "device" for r in table.refs)
    assert b.pool.allocators["remote"].num_used == 0  # read once, released
    kv_b = [b.pool.arena("kv")[:, :, :, i] for i in table.block_ids()]
    assert all(torch.equal(x, y) for x, y in zip(kv_a, kv_b, strict=True))
    b.close()


def test_a_store_tier_a_strategy_cannot_use_is_refused_at_start(server, tmp_path):
    spec = kvstrategies.KVSpec(2, 2, 16, identity="model-a")
    tiers = (TierConfig("device", 1 << 28), TierConfig("host", 1 << 28),
             TierConfig("remote", 1 << 30, path=server.url))  # fmt: skip
    with pytest.raises(ValueError, match=r"\[tiers.remote\] needs an \[tiers.ssd\] tier under "
                       "the tiered placement"):  # fmt: skip
        create_kv("hierarchical_offload", spec, PoolConfig(block_size=16, tiers=tiers))
    with pytest.raises(ValueError, match=r"'learned_prune' evicts tokens .* would be unused"):
        create_kv("learned_prune", spec, config(tmp_path / "ssd", server.url))
    with pytest.raises(ValueError, match=r"persist_prefix = false the resident placement leaves"):
        create_kv("full", spec, config(tmp_path / "ssd", server.url), {"persist_prefix": False})


def test_published_prefixes_are_shared_through_the_server(server, tmp_path):
    """Pool A writes its prompt through; pool B (its own SSD directory) finds it on the
    server, promotes it into its SSD tier; a pool for other weights finds nothing."""
    a = tiny(tmp_path / "ssd-a", server.url)
    assert a.pool.persistence.remote is not None
    prefill(a, 0, TOKENS)
    a.pool.persistence.remote_writer.wait_writes()
    assert a.pool.persistence.remote_writer.blocks_written == 5
    a.close()

    b = tiny(tmp_path / "ssd-b", server.url)
    assert b.match_prefix(1, TOKENS) == 5 * 16
    st = b.stats().placement
    assert st["disk_prefix_hits"]["remote_blocks"] == 5
    assert st["remote"]["promoted_blocks"] == 5 and st["remote"]["breaker"]["state"] == "closed"
    assert b.pool.persistence.ssd.has_content(b.pool.sharing.chain(1)[0])  # promoted: now local
    b.close()
    other = tiny(tmp_path / "ssd-c", server.url, identity="model-b")
    assert other.match_prefix(1, TOKENS) == 0
    other.close()


def test_a_corrupt_value_on_the_server_is_a_miss_and_deleted(server, tmp_path):
    a = tiny(tmp_path / "ssd-a", server.url)
    prefill(a, 0, TOKENS)
    a.pool.persistence.remote_writer.wait_writes()
    third = a.pool.sharing.chain(0)[2]
    namespace = a.pool.persistence.remote.store.namespace
    a.close()
    raw = redis.Redis.from_url(server.url)
    name = f"unikv:{namespace}:".encode() + third + (1).to_bytes(2, "little")  # layer 1
    frame = bytearray(raw.get(name))
    frame[100] ^= 0x01
    raw.set(name, bytes(frame))
    b = tiny(tmp_path / "ssd-b", server.url)
    assert b.match_prefix(1, TOKENS) == 2 * 16  # the blocks before the corrupt one
    assert raw.get(name) is None  # deleted, so the next reader does not meet it
    assert b.pool.persistence.remote.store.stats()["checksum_failures"] == 1
    b.close()
    raw.close()


@pytest.mark.timeout(60)
def test_a_killed_server_opens_the_breaker_and_a_restart_closes_it(server, tmp_path):
    a = tiny(tmp_path / "ssd-a", server.url)
    prefill(a, 0, TOKENS)
    a.pool.persistence.remote_writer.wait_writes()
    server.stop()
    prefill(a, 1, [t + 1 for t in TOKENS], seed=1)  # the write-through fails in the background
    a.pool.persistence.remote_writer.wait_writes()  # (a failure is the writer's, not the step's)
    breaker = a.pool.persistence.remote.breaker
    assert breaker.is_open
    skipped = breaker.skipped
    assert a.match_prefix(2, [t + 2 for t in TOKENS]) == 0  # a miss, not an error
    assert a.match_prefix(3, [t + 3 for t in TOKENS]) == 0
    assert breaker.skipped >= skipped + 2  # refused while open: no server round trip
    problems = a.pool.snapshot().readings.tier_problems
    assert problems and "remote tier unavailable" in problems[0]
    view = evaluate(HealthInputs(0.1, 0, 10, 0, 0, tier_problems=tuple(problems)))
    assert view.status == "yellow" and "remote tier unavailable" in " ".join(view.reasons)
    server.start()  # the same port, empty
    time.sleep(a.pool.persistence.remote.breaker.backoff_s + 0.1)
    assert a.match_prefix(4, [t + 4 for t in TOKENS]) == 0  # the trial: the server answers
    assert not a.pool.persistence.remote.breaker.is_open
    assert a.pool.snapshot().readings.tier_problems == ()
    prefill(a, 5, TOKENS, seed=5)  # sharing works again
    a.pool.persistence.remote_writer.wait_writes()
    assert a.pool.persistence.remote_writer.blocks_written >= 5
    a.close()


def test_the_filesystem_store_serves_as_the_remote_tier(tmp_path):
    url = f"file://{tmp_path}/shared"
    a = tiny(tmp_path / "ssd-a", url)
    prefill(a, 0, TOKENS)
    a.pool.persistence.remote_writer.wait_writes()
    a.close()
    b = tiny(tmp_path / "ssd-b", url)
    assert b.match_prefix(1, TOKENS) == 5 * 16
    b.close()


# ---- the filesystem store -------------------------------------------------------------------

_FS_WRITER = """
import sys
sys.path.insert(0, {root!r})
from unikv.storage.fs_store import FileBlockStore
s = FileBlockStore({path!r}, namespace="race")
value = bytes([{n}]) * 200_000
for _ in range(150):
    s.put(b"same-key", value)
"""


@pytest.mark.timeout(60)
def test_the_filesystem_store_under_two_processes_writing_one_key(tmp_path):
    path = tmp_path / "shared"
    s = FileBlockStore(path, namespace="race")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _FS_WRITER.format(root=str(HERE.parent), path=str(path), n=n)]
        )  # fmt: skip
        for n in (1, 2)
    ]
    seen = set()
    while any(p.poll() is None for p in procs):
        got = s.get(b"same-key")
        if got is not None:
            assert got in (bytes([1]) * 200_000, bytes([2]) * 200_000)  # whole, never mixed
            seen.add(got[0])
    assert all(p.wait(timeout=30) == 0 for p in procs)
    assert s.get(b"same-key")[0] in (1, 2) and s.verify().ok and len(s) == 1
    leftovers = [p for p in (path / "race").rglob("*") if p.name.startswith(".tmp-")]
    assert not leftovers and s.stats()["checksum_failures"] == 0


def test_the_filesystem_store_cleans_up_the_least_recently_read(tmp_path):
    s = FileBlockStore(tmp_path / "fs", max_bytes=10 * 1016)  # ten values of 1000 + header
    for i in range(8):
        s.put(bytes([i]), bytes(1000))
        time.sleep(0.01)
    s.get(bytes([0]))  # read: now the most recent
    for i in range(8, 12):
        s.put(bytes([i]), bytes(1000))
    kept = set(s.keys())
    assert bytes([0]) in kept and bytes([1]) not in kept
    assert s.stats()["bytes"] <= 10 * 1016 and s.stats()["evictions"] >= 2


@pytest.mark.timeout(10)
async def test_the_filesystem_store_async_through_aiofiles(tmp_path):
    s = FileBlockStore(tmp_path / "fs")
    await s.aput_many({b"a": b"1" * 5000, b"b": b"2"})
    assert await s.aget_many([b"a", b"b", b"c"]) == [b"1" * 5000, b"2", None]
    assert s.get(b"a") == b"1" * 5000  # the same files as the blocking path
    assert await s.aget(b"b") == b"2"


# ---- two engine processes, and a server killed under a running engine (real model) ----------


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode(make_english(30, seed=8))[:300]


@pytest.fixture(scope="module")
def reference(model, tokenizer, prompt):
    async def run():
        async with Engine(model, tokenizer) as e:
            return (await e.generate(prompt, GREEDY)).token_ids

    return asyncio.run(run())


def engine_kv(model, ssd: Path, url: str):
    return create_kv(NAME, model.kv_spec(), config(ssd, url), dict(SMALL))


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_second_engine_process_hits_the_first_ones_prompt(
    model, tokenizer, prompt, reference, server, tmp_path
):
    ids_file = tmp_path / "prompt.txt"
    ids_file.write_text(" ".join(map(str, prompt)))
    child = subprocess.Popen(
        [sys.executable, str(HERE / "_remote_writer.py"), server.url, str(tmp_path / "ssd-a"),
         str(ids_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        line = child.stdout.readline()
        assert line.startswith("shared"), line or child.stderr.read()
    finally:
        child.kill()
        child.wait(timeout=30)
    assert int(line.split()[1]) == len(prompt) // 16
    kv = engine_kv(model, tmp_path / "ssd-b", server.url)
    async with Engine(model, tokenizer, kv=kv) as e:
        out = await e.generate(prompt, GREEDY)
        report = e.memory_report()
    kv.close()
    assert out.token_ids == reference  # equal to recomputing
    assert report.kv.placement["disk_prefix_hits"]["remote_blocks"] == (len(prompt) - 1) // 16


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_requests_complete_while_the_server_is_killed_and_restarted(
    model, tokenizer, prompt, reference, server, tmp_path
):
    kv = engine_kv(model, tmp_path / "ssd", server.url)
    async with Engine(model, tokenizer, kv=kv) as e:
        assert (await e.generate(prompt, GREEDY)).token_ids == reference
        server.stop()
        other = [t for t in reversed(prompt)]
        outs = await asyncio.wait_for(
            asyncio.gather(*(e.generate(p, GREEDY) for p in (other, other[10:], prompt))), 120
        )
        assert outs[2].token_ids == reference  # its own SSD still serves the first prompt
        assert kv.pool.persistence.remote.breaker.is_open
        server.start()
        time.sleep(kv.pool.persistence.remote.breaker.backoff_s + 0.1)
        await e.generate(other[20:], GREEDY)
        assert not kv.pool.persistence.remote.breaker.is_open
    kv.close()


def test_the_deployment_secret_reaches_the_remote_tier(server, tmp_path, monkeypatch):
    """`UNIKV_STORE_SECRET` signs what the tier writes: a pool of the same deployment reads it,
    and a value written without the secret under the same hash is not served."""
    monkeypatch.setenv("UNIKV_STORE_SECRET", "deployment-secret-0123456789")
    a = tiny(tmp_path / "ssd-a", server.url)
    assert a.pool.persistence.remote._store._secret == b"deployment-secret-0123456789"
    prefill(a, 0, TOKENS)
    a.pool.persistence.remote_writer.wait_writes()
    a.close()
    b = tiny(tmp_path / "ssd-b", server.url)
    assert b.match_prefix(1, TOKENS) == 5 * 16  # signed, found
    b.close()
    monkeypatch.delenv("UNIKV_STORE_SECRET")
    # another model's namespace, written first without the secret (stored content is never
    # overwritten, so the planted values stay)
    c = tiny(tmp_path / "ssd-c", server.url, identity="model-b")
    prefill(c, 0, TOKENS, seed=3)
    c.pool.persistence.remote_writer.wait_writes()
    c.close()
    monkeypatch.setenv("UNIKV_STORE_SECRET", "deployment-secret-0123456789")
    d = tiny(tmp_path / "ssd-d", server.url, identity="model-b")
    assert d.match_prefix(1, TOKENS) == 0  # c's unsigned values are refused
    d.close()
