"""The torch side of the unified memory pool: arenas, tables, moves, swapping, prefixes."""

import json

import pytest
import torch

from unikv.engine.assembly import build_kv
from unikv.memory.layout import BLOCKS, ArenaSpec, BlockLayout
from unikv.memory.pool import UnifiedMemoryPool
from unikv.settings.config import PoolConfig, TierConfig

BS = 4
LAYOUT = BlockLayout(BS, (ArenaSpec("kv", torch.float32, (2, BLOCKS, BS, 3)),))
PAGE = LAYOUT.page_bytes  # 2 * 4 * 3 * 4 = 96 bytes


def make_pool(device_blocks=8, host_blocks=0, watermark=0.0):
    tiers = [TierConfig("device", device_blocks * PAGE, low_watermark=watermark)]
    if host_blocks:
        tiers.append(TierConfig("host", host_blocks * PAGE))
    return UnifiedMemoryPool(PoolConfig(block_size=BS, tiers=tuple(tiers)), LAYOUT, identity="t")


def fill(pool, seq, start, n, value):
    """Write `value` into the token slots [start, start+n) of `seq` (as a strategy would)."""
    slots = pool.slot_ids(seq, start, start + n)
    arena = pool.arena("kv").view(2, -1, 3)  # [2, blocks*BS, 3]
    arena[:, slots] = value
    pool.commit(seq, n)


def read(pool, seq):
    n = pool.num_tokens(seq)
    return pool.arena("kv").view(2, -1, 3)[:, pool.slot_ids(seq, 0, n)]


def test_layout_page_bytes_and_validation():
    assert PAGE == 96
    with pytest.raises(ValueError, match="BLOCKS"):
        ArenaSpec("x", torch.float32, (2, 3))
    with pytest.raises(ValueError, match="holds no block"):
        UnifiedMemoryPool(PoolConfig(block_size=BS, tiers=(TierConfig("device", 10),)), LAYOUT)


def test_reserve_commit_free_and_contiguous_growth():
    pool = make_pool()
    assert pool.reserve("a", 6)
    fill(pool, "a", 0, 6, 1.0)
    assert pool.table("a").num_tokens == 6 and len(pool.table("a")) == 2
    for i in range(6, 14):  # decode-like growth stays in consecutive blocks
        assert pool.reserve("a", 1)
        fill(pool, "a", i, 1, float(i))
    assert pool.slot_runs("a", 14) == [(0, 14)]
    assert torch.equal(read(pool, "a")[0, 6:, 0], torch.arange(6.0, 14.0))
    pool.free("a")
    assert pool.usage() == 0.0 and pool.table("a") is None
    pool.free("a")  # freeing an unknown sequence is a no-op


def test_reserve_fails_without_changing_anything():
    pool = make_pool(device_blocks=3)
    assert pool.reserve("a", 8)
    assert not pool.reserve("b", 8)  # needs 2 blocks, 1 left
    assert pool.table("b") is None and pool.allocators["device"].num_free == 1
    assert not pool.can_admit(8) and pool.can_admit(4)


def test_growth_room_keeps_concurrent_sequences_in_one_run():
    pool = make_pool(device_blocks=40)
    pool.reserve("a", 4)
    pool.reserve("b", 4)  # placed after a's growth room, not right after a
    fill(pool, "a", 0, 4, 1.0)
    fill(pool, "b", 0, 4, 2.0)
    for i in range(4, 4 + 4 * 8):  # a grows through its whole room
        pool.reserve("a", 1)
        fill(pool, "a", i, 1, 3.0)
    assert pool.slot_runs("a", 36) == [(0, 36)]
    assert len(pool.slot_runs("b", 4)) == 1
    pool.reserve("a", 1)  # past its room, the next block is b's: a continues elsewhere
    fill(pool, "a", 36, 1, 4.0)
    runs = pool.slot_runs("a", 37)
    assert len(runs) == 2 and sum(e - s for s, e in runs) == 37
    assert read(pool, "a")[0, :, 0].tolist() == [1] * 4 + [3] * 32 + [4]
    assert read(pool, "b")[0, :, 0].tolist() == [2] * 4


def test_growth_room_is_given_up_when_memory_is_short():
    pool = make_pool(device_blocks=3)
    pool.reserve("a", 4)  # block 0; blocks 1, 2 kept as its room
    fill(pool, "a", 0, 4, 1.0)
    assert pool.reserve("b", 8)  # nothing else is free: b takes a's room
    assert not pool.reserve("a", 1)
    pool.free("b")
    assert pool.reserve("a", 8)


def test_move_to_host_and_back_keeps_data():
    pool = make_pool(device_blocks=4, host_blocks=4)
    pool.reserve("a", 7)
    data = torch.arange(2 * 7 * 3, dtype=torch.float32).view(2, 7, 3)
    fill(pool, "a", 0, 7, data)
    assert pool.swap_out("a")
    assert {r.tier for r in pool.table("a")} == {"host"}
    assert pool.usage("device") == 0.0
    with pytest.raises(RuntimeError, match="swap it in"):
        pool.reserve("a", 1)
    assert pool.swap_in("a")
    assert torch.equal(read(pool, "a"), data)
    snap = pool.snapshot()
    assert snap.counters.moves == {"device->host": 2, "host->device": 2}
    assert snap.counters.preemptions == 1


def test_move_without_room_returns_false():
    pool = make_pool(device_blocks=4, host_blocks=1)
    pool.reserve("a", 8)
    assert not pool.swap_out("a")  # 2 blocks, host holds 1
    assert {r.tier for r in pool.table("a")} == {"device"}


def test_prefix_publish_attach_and_collision_safety():
    pool = make_pool()
    tokens = list(range(100, 110))
    pool.reserve("a", 10)
    fill(pool, "a", 0, 10, 7.0)
    assert pool.sharing.publish("a", tokens) == 2  # two full blocks of 4; the partial one isn't
    refs = pool.sharing.match(tokens)
    assert [r.block_id for r in refs] == pool.table("a").block_ids()[:2]
    assert pool.sharing.match([100, 101, 102, 999, 104]) == []  # differs inside the first block
    assert pool.sharing.attach("b", refs) == 8
    pool.table("b").check(pool.allocators)
    assert pool.allocators["device"].ref_count(refs[0].block_id) == 2
    pool.reserve("b", 3)  # b grows in its own block, never into the shared ones
    fill(pool, "b", 8, 3, 9.0)
    assert read(pool, "b")[0, :, 0].tolist() == [7.0] * 8 + [9.0] * 3
    assert read(pool, "a")[0, :, 0].tolist() == [7.0] * 10
    pool.free("a")
    pool.free("b")
    # Freed cached blocks stay revivable until reused.
    assert len(pool.sharing.match(tokens)) == 2
    snap = pool.snapshot()
    assert snap.prefix.hits >= 4 and snap.tiers["device"].num_used == 0


def test_table_pointing_at_foreign_block_is_named():
    pool = make_pool()
    pool.reserve("a", 4)
    pool.reserve("b", 4)
    stolen = pool.table("a")[0]
    pool.table("b").append_blocks("device", [stolen.block_id])
    with pytest.raises(RuntimeError, match=f"block {stolen.block_id}.*owned by sequence 'a'"):
        pool.table("b").check(pool.allocators)


def test_double_free_of_a_block_is_named():
    pool = make_pool()
    pool.reserve("a", 4)
    block = pool.table("a")[0].block_id
    pool.allocators["device"].free([block])
    with pytest.raises(RuntimeError, match=f"double free of block {block}"):
        pool.allocators["device"].free([block])


def test_ssd_tier_needs_a_store():
    cfg = PoolConfig(
        block_size=BS,
        tiers=(TierConfig("device", 4 * PAGE), TierConfig("ssd", 8 * PAGE, path="/tmp/x")),
    )
    with pytest.raises(ValueError, match=r"\[tiers.ssd\] needs a block store"):
        UnifiedMemoryPool(cfg, LAYOUT)


def test_a_tier_too_large_to_allocate_is_one_clear_error():
    """A config written for a bigger machine: the failed allocation names the tier and size."""
    with pytest.raises(ValueError, match=r"the device tier cannot allocate 1048576\.0 GiB on cpu"
                       r" \(\w+\); lower \[tiers.device\] capacity"):  # fmt: skip
        make_pool(device_blocks=(1 << 50) // PAGE)


def test_oom_predictor_fed_by_usage_samples_turns_health_red():
    now = [0.0]
    tiers = (TierConfig("device", 40 * PAGE),)
    pool = UnifiedMemoryPool(PoolConfig(block_size=BS, tiers=tiers), LAYOUT, clock=lambda: now[0])
    assert pool.health().status == "green"
    for i in range(39):  # fill the tier over ~20 s: far faster than 5 points per minute
        now[0] += 0.5
        pool.reserve(i, BS)
        pool.sample_usage()
        pool.sample_usage()  # rate-limited: a second call at the same time adds nothing
    assert len(pool.health_monitor.predictor.samples) == 39  # health() only reads
    report = pool.health()
    assert report.status == "red" and any("OOM" in r for r in report.reasons)
    assert pool.health_monitor.predictor.events


def test_growth_room_bookkeeping_stays_consistent():
    """Every room entry is listed under its owner, through growth, takes and frees."""
    pool = make_pool(device_blocks=64)
    for step in range(200):
        seq = step % 5
        if step % 37 == 36:
            pool.free(seq)
        assert pool.reserve(seq, 3) or pool.usage() > 0.5
        if pool.table(seq) is not None:
            pool.commit(seq, min(3, pool.table(seq).num_free_slots))
        room, room_of = pool.placement._room, pool.placement._room_of
        listed = {b: s for s, blocks in room_of.items() for b in blocks}
        assert listed == room
        assert all(pool.allocators["device"].ref_count(b) == 0 for b in room)


def make_ssd_pool(tmp_path, device_blocks=8, ssd_blocks=8):
    from unikv.memory.tiers import StoreTier
    from unikv.storage import create_store

    store = create_store("lmdb", path=tmp_path / "ssd", map_size=1 << 20)
    tiers = (
        TierConfig("device", device_blocks * PAGE),
        TierConfig("ssd", ssd_blocks * PAGE, path=str(tmp_path / "ssd")),
    )
    cfg = PoolConfig(block_size=BS, tiers=tiers)
    ssd = StoreTier("ssd", LAYOUT, ssd_blocks, store)
    return UnifiedMemoryPool(cfg, LAYOUT, stores={"ssd": ssd}), store


def test_blocks_move_to_the_ssd_tier_and_back_bit_exact(tmp_path):
    pool, store = make_ssd_pool(tmp_path)
    pool.reserve("a", 10)
    data = torch.randn(2, 10, 3)
    fill(pool, "a", 0, 10, data)
    assert pool.move("a", [0, 1], "ssd")
    assert [r.tier for r in pool.table("a")] == ["ssd", "ssd", "device"]
    assert len(store) == 2 and pool.usage("device") == 1 / 8
    assert pool.swap_in("a")
    assert torch.equal(read(pool, "a"), data)
    store.close()


def test_a_lost_ssd_block_is_reported_and_changes_nothing(tmp_path):
    from unikv.memory.tiers import BlockLostError

    pool, store = make_ssd_pool(tmp_path)
    pool.reserve("a", 8)
    fill(pool, "a", 0, 8, 1.0)
    assert pool.move("a", [0, 1], "ssd")
    lost = pool.table("a")[1].block_id
    store.delete(pool.tiers["ssd"]._key(lost, 0))
    free_before = pool.allocators["device"].num_free
    with pytest.raises(BlockLostError, match=rf"\[{lost}\] missing or corrupt"):
        pool.swap_in("a")
    assert [r.tier for r in pool.table("a")] == ["ssd", "ssd"]  # the table is untouched
    assert pool.allocators["device"].num_free == free_before  # nothing leaked
    store.close()


def test_build_makes_the_ssd_tier_from_the_config(tmp_path):
    from unikv import kvstrategies

    cfg_file = tmp_path / "pool.toml"
    cfg_file.write_text(
        'strategy = "full"\n[tiers.device]\ncapacity = "8MiB"\n'
        f'[tiers.ssd]\ncapacity = "16MiB"\npath = "{tmp_path / "kv"}"\n'
    )
    spec = kvstrategies.KVSpec(2, 2, 8)
    built = build_kv(spec, config=str(cfg_file))
    pool = built.strategy.pool
    assert set(pool.tiers) == {"device", "ssd"}
    assert pool.allocators["ssd"].num_blocks == (16 << 20) // pool.layout.page_bytes
    assert (tmp_path / "kv").is_dir()
    pool.tiers["ssd"].close()


def test_a_corrupt_stored_chain_costs_one_recompute(tmp_path):
    """Corrupt values in different slices (layers) of several blocks of a stored chain: the
    first failed read checks the whole chain, deletes every corrupt block and counts them, so
    the next lookup stops at the first one (a miss from there) and everything before reads."""
    from unikv.memory.tiers import BlockLostError, StoreTier
    from unikv.storage import create_store

    from .test_storage import _lmdb_corrupt

    path = tmp_path / "ssd"
    store = create_store("lmdb", path=path, map_size=1 << 20)
    tiers = (TierConfig("device", 8 * PAGE), TierConfig("ssd", 8 * PAGE, path=str(path)))
    ssd = StoreTier("ssd", LAYOUT, 8, store, slices=2)
    cfg = PoolConfig(block_size=BS, tiers=tiers)
    pool = UnifiedMemoryPool(cfg, LAYOUT, identity="m", stores={"ssd": ssd})
    tokens = list(range(6 * BS))
    pool.reserve("a", len(tokens))
    fill(pool, "a", 0, len(tokens), 1.0)
    pool.sharing.publish("a", tokens)
    assert pool.move("a", list(range(6)), "ssd")
    hashes = pool.sharing.chain("a")
    pool.free("a")
    assert pool.sharing.stored([*tokens, 0]) == hashes  # the whole chain is stored
    store.close()
    for h, s in [(hashes[1], 1), (hashes[3], 0), (hashes[4], 1)]:
        _lmdb_corrupt({"path": path}, h + s.to_bytes(2, "little"))
    ssd._store = store = create_store("lmdb", path=path, map_size=1 << 20)

    assert pool.sharing.attach_stored("b", hashes) == len(tokens)
    ids = [r.block_id for r in pool.table("b")]
    with pytest.raises(BlockLostError, match="3 corrupt stored values deleted") as lost:
        ssd.read_slice(ids, 0)  # slice 0 meets only hashes[3]; all three are found
    assert lost.value.corrupt == 3
    pool.free("b")
    assert pool.sharing.stored([*tokens, 0]) == hashes[:1]  # a miss from the first corrupt one
    assert not any(store.contains(h + s.to_bytes(2, "little")) for h in
                   (hashes[1], hashes[3], hashes[4]) for s in (0, 1))  # fmt: skip
    assert store.contains(hashes[2] + b"\0\0")  # intact blocks after it are kept
    snap = pool.snapshot()
    assert snap.counters.checksum_failures == 3  # recorded where detected: stats, health
    health = snap.health  # detected and recomputed, never served: one indicator, yellow
    assert health.status == "yellow" and "failed its checksum" in health.reasons[0]
    assert snap.readings.checksum_failure
    assert json.loads(json.dumps(snap.as_dict()))["health"]["signals"]["checksum_recent"]
    assert pool.sharing.attach_stored("c", hashes[:1]) == BS
    c = [r.block_id for r in pool.table("c")]
    assert all(torch.equal(ssd.read_slice(c, s)["kv"], torch.ones(1, BS, 3)) for s in (0, 1))
    store.close()


def test_the_ssd_tier_stays_usable_after_ten_times_its_capacity(tmp_path):
    """Issue 31: content-keyed values were never evicted and a killed process's transient
    values never collected, so the SSD tier filled for good and every write was skipped. A
    bounded tier keeps its content within capacity by last use (held and recently used
    content stays), and collects ended sessions' values at open."""
    import numpy as np

    from unikv.memory.tiers import StoreTier
    from unikv.storage import create_store

    path = tmp_path / "ssd"
    cap = 8
    tier = StoreTier("ssd", LAYOUT, cap, create_store("lmdb", path=path, map_size=1 << 20),
                     bounded=True)  # fmt: skip
    snap = {"kv": np.zeros((1, 2, BS, 3), np.float32)}

    def key(i: int) -> bytes:
        return i.to_bytes(32, "little")

    tier.assign(0, key(0))  # held by a block of this tier: never evicted
    for i in range(10 * cap):
        tier.write_content([key(i)], snap)
        if i % 5 == 0:
            assert tier.has_content(key(1)) or i < 1  # used again and again: stays
    assert tier.has_content(key(10 * cap - 1))  # the newest write landed
    assert tier.has_content(key(0)) and tier.has_content(key(1))
    assert len(tier._lru) <= cap and tier.evicted >= 10 * cap - cap
    assert len(tier.store) <= cap + 1  # its content and this session's record
    # A process killed with transient values (`release` never ran): collected at next open.
    tier.write([5], {"kv": torch.zeros(2, 1, BS, 3)})
    stored = len(tier.store)
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()  # a process that has ended: its pid names no one now
    tier.store.put(b"s" + tier._session, gone.pid.to_bytes(8, "little"))
    tier.store.close()  # as a SIGKILL would leave it: no release, no session clean-up
    again = StoreTier("ssd", LAYOUT, cap, create_store("lmdb", path=path, map_size=1 << 20),
                      bounded=True)  # fmt: skip
    # the orphan and the ended session's record gone, this session's record added
    assert again.orphans_collected == 1 and len(again.store) == stored - 1
    assert again.has_content(key(10 * cap - 1))  # content survives the restart
    again.close()


def test_a_warm_prefix_cache_still_gives_new_sequences_one_run():
    """A finished sequence's blocks go back to the free queue last first and stay cached; a
    new sequence growing block by block starts at the low end of that run and grows upward
    through it (evicting the old hashes), instead of taking it top down in pieces (serving
    slowed by a quarter once a long-running server's cache was warm)."""
    pool = make_pool(device_blocks=16)
    n = 8 * BS
    for k, seq in enumerate(("a", "b")):  # two sequences fill all 16 blocks and publish them
        assert pool.reserve(seq, n)
        fill(pool, seq, 0, n, 1.0)
        pool.sharing.publish(seq, list(range(1000 * k, 1000 * k + n)))
    pool.free("a")
    pool.free("b")
    device = pool.allocators["device"]
    assert device.num_cached == 16 and device.free_blocks()[:2] == [7, 6]  # a's, last first
    for i in range(n):  # decode-like growth from nothing
        assert pool.reserve("c", 1)
        fill(pool, "c", i, 1, 2.0)
    assert pool.slot_runs("c", n) == [(0, n)]  # a's old run, in one piece
    assert device.num_evictions == 8 and device.num_cached == 8  # a's hashes went, b's stay


@pytest.mark.parametrize("views", [True, False])
def test_the_prefetcher_stages_some_rows_ahead_and_fills_the_rest(tmp_path, views):
    """A group read ahead in part: slice 1 stages rows 0 and 3 of five SSD blocks; `fill`
    reads the others into the same staged tensor; a `stage` that copies its input gets the
    group whole instead. Every staged value is the block's own."""
    from unikv.memory.services import Prefetcher
    from unikv.memory.tiers import StoreTier
    from unikv.storage import create_store

    store = create_store("lmdb", path=tmp_path / "s", map_size=1 << 20)
    ssd = StoreTier("ssd", LAYOUT, 8, store, slices=2)
    data = torch.arange(5 * 2 * BS * 3, dtype=torch.float32).view(2, 5, BS, 3)  # [slices, ...]
    ssd.write(range(5), {"kv": data})
    stage = (lambda d: d["kv"]) if views else (lambda d: d["kv"].clone())
    fetcher = Prefetcher({"ssd": ssd}, num_slices=2, depth=1, threads=1, stage=stage)
    ids = (0, 1, 2, 3, 4)
    plan = (("seq", (("ssd", ids, (None, (0, 3))),)),)  # slice 0: every row; slice 1: 0 and 3
    fetcher.start_step(plan)
    assert torch.equal(fetcher.get(0)[0][0], data[0])  # read whole
    got = fetcher.get(1)[0][0]
    assert torch.equal(got[0], data[1, 0]) and torch.equal(got[3], data[1, 3])
    if views:
        assert fetcher.stats()["rows_ahead"] == 2
        fetcher.fill(1, 0, 0, [1, 3])  # row 3 is there already
        assert fetcher.stats()["rows_late"] == 1 and torch.equal(got[1], data[1, 1])
        fetcher.fill_all(1)
        assert fetcher.stats()["rows_late"] == 3
    assert torch.equal(got, data[1])  # everything, filled (or read whole)
    assert fetcher.get(1, count=False) is fetcher.get(1)  # the last slice is kept, not re-read
    with pytest.raises(RuntimeError, match="not the one staged last"):
        fetcher.fill(0, 0, 0)
    fetcher.close()
    store.close()
