"""ExpertCache: routed-expert weights in device (LRU), host and SSD tiers; tiny tensors, CPU."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from unikv.memory.experts import ExpertCache, ExpertLoadError, _store_key

LAYERS, EXPERTS, HIDDEN, INTER = 2, 6, 4, 3


@pytest.fixture
def weights() -> dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {
        (layer, e): (
            torch.randn(2 * INTER, HIDDEN, generator=g),  # gate_up: [2I, H]
            torch.randn(HIDDEN, INTER, generator=g),  # down: [H, I]
        )
        for layer in range(LAYERS)
        for e in range(EXPERTS)
    }


def same(got, want) -> bool:
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def tiers(cache: ExpertCache) -> dict[str, set]:
    out: dict[str, set] = {"device": set(), "host": set(), "ssd": set()}
    for layer in range(LAYERS):
        for e in range(EXPERTS):
            out[cache.tier_of(layer, e)].add((layer, e))
    return out


def test_get_returns_the_original_weights_from_every_tier(weights, tmp_path):
    originals = {k: tuple(t.clone() for t in w) for k, w in weights.items()}
    with ExpertCache(weights, device_capacity=2, host_capacity=4, ssd_path=tmp_path) as cache:
        placed = tiers(cache)
        assert [len(placed[t]) for t in ("device", "host", "ssd")] == [2, 4, 6]
        for tier in ("device", "host", "ssd"):
            for k in placed[tier]:
                assert same(cache.get(*k), originals[k]), (tier, k)
                assert cache.tier_of(*k) == "device"
        # Many rounds of promotion and demotion (device -> host and -> SSD) lose nothing.
        for _ in range(3):
            for k in reversed(list(weights)):
                assert same(cache.get(*k), originals[k])
        st = cache.stats()
        assert st["promotions"]["host"] > 0 and st["promotions"]["ssd"] > 0
        assert st["moves"]["device->ssd"] > 0 and st["moves"]["device->host"] > 0
        assert sum(st["residents"].values()) == LAYERS * EXPERTS
    for k, w in weights.items():  # the cache never writes into the caller's tensors
        assert same(w, originals[k])


def test_initial_placement_follows_frequencies(weights, tmp_path):
    freq = {(1, 5): 9.0, (0, 3): 8.0, (1, 2): 7.0, (0, 0): 6.0}
    with ExpertCache(
        weights, device_capacity=2, host_capacity=2, ssd_path=tmp_path, frequencies=freq
    ) as cache:
        placed = tiers(cache)
        assert placed["device"] == {(1, 5), (0, 3)}
        assert placed["host"] == {(1, 2), (0, 0)}
        assert cache.frequency(1, 5) == 9.0


def test_without_frequencies_every_layer_gets_its_share(weights):
    with ExpertCache(weights, device_capacity=4) as cache:
        assert tiers(cache)["device"] == {(0, 0), (1, 0), (0, 1), (1, 1)}


def test_lru_eviction_order(weights):
    with ExpertCache(weights, device_capacity=3) as cache:  # the rest on host, no SSD tier
        a, b, c, d = (0, 4), (0, 5), (1, 4), (1, 5)
        for k in (a, b, c):
            cache.get(*k)
        assert tiers(cache)["device"] == {a, b, c}
        cache.get(*a)  # a is now the most recent: b is the least
        cache.get(*d)
        assert tiers(cache)["device"] == {a, c, d} and cache.tier_of(*b) == "host"
        cache.get(*b)  # evicts c, the least recent now
        assert tiers(cache)["device"] == {a, d, b} and cache.tier_of(*c) == "host"
        assert cache.stats()["residents"] == {"device": 3, "host": 9, "ssd": 0}


def test_hits_and_misses_are_counted(weights):
    with ExpertCache(weights, device_capacity=2) as cache:
        resident = sorted(tiers(cache)["device"])
        for k in resident:
            cache.get(*k)
        cache.get(0, 5)
        cache.get(0, 5)
        st = cache.stats()
        assert (st["hits"], st["misses"]) == (3, 1)
        assert st["hit_rate"] == pytest.approx(0.75)
        assert st["promotions"] == {"host": 1, "ssd": 0}
        nbytes = sum(t.numel() * t.element_size() for t in weights[(0, 5)])
        assert st["bytes_moved"]["host->device"] == nbytes
        assert st["bytes_moved"]["device->host"] == nbytes  # the LRU resident went down
        json.dumps(st)


def test_get_many_keeps_order_and_duplicates_and_counts_distinct(weights, tmp_path):
    with ExpertCache(weights, device_capacity=4, host_capacity=2, ssd_path=tmp_path) as cache:
        placed = tiers(cache)
        ssd = sorted(k[1] for k in placed["ssd"] if k[0] == 1)[:2]
        host = [k[1] for k in placed["host"] if k[0] == 1][:1]
        dev = [k[1] for k in placed["device"] if k[0] == 1][:1]
        experts = [*ssd, *host, *dev, ssd[0]]
        got = cache.get_many(1, experts)
        assert [same(w, weights[(1, e)]) for w, e in zip(got, experts, strict=True)] == [True] * 5
        assert got[0] is got[-1]
        st = cache.stats()
        assert (st["hits"], st["misses"]) == (1, 3)
        assert st["promotions"] == {"host": 1, "ssd": 2}


def test_all_resident_get_is_a_plain_lookup(weights, tmp_path):
    with ExpertCache.from_fractions(
        weights, expert_cache=1.0, expert_host=0.0, ssd_path=tmp_path
    ) as cache:
        assert cache.store is None and list(tmp_path.iterdir()) == []  # no SSD tier needed
        first = cache.get(1, 3)
        assert cache.get(1, 3) is first and first[0] is weights[(1, 3)][0]  # no copy on CPU
        assert cache.get_many(0, [2, 2])[0] is cache.get(0, 2)
        st = cache.stats()
        assert st["hits"] == 4 and st["misses"] == 0 and st["residents"]["device"] == 12


def test_from_fractions_capacities(weights, tmp_path):
    with ExpertCache.from_fractions(
        weights, expert_cache=0.25, expert_host=0.5, ssd_path=tmp_path
    ) as cache:
        st = cache.stats()
        assert st["capacity"] == {"device": 3, "host": 4}  # 25% of 12; half of the other 9
        assert st["residents"] == {"device": 3, "host": 4, "ssd": 5}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"expert_cache": 0.0},
        {"expert_cache": 1.5},
        {"expert_cache": -0.25},
        {"expert_cache": math.nan},
        {"expert_cache": True},
        {"expert_cache": "0.5"},
        {"expert_cache": 0.01},  # rounds to no expert at all
        {"expert_cache": 0.5, "expert_host": 1.5},
        {"expert_cache": 0.5, "expert_host": -0.1},
    ],
)
def test_bad_fractions_are_refused(weights, tmp_path, kwargs):
    with pytest.raises(ValueError, match="expert_"):
        ExpertCache.from_fractions(weights, ssd_path=tmp_path, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_capacity": 0}, "device_capacity"),
        ({"device_capacity": -1}, "device_capacity"),
        ({"device_capacity": 2.5}, "device_capacity"),
        ({"device_capacity": 2, "host_capacity": -1}, "host_capacity"),
        ({"device_capacity": 2, "host_capacity": 4}, "ssd_path"),  # 6 experts fit nowhere
        ({"device_capacity": 2, "rebalance_every": 0}, "rebalance_every"),
        ({"device_capacity": 2, "decay": 0.0}, "decay"),
        ({"device_capacity": 2, "frequencies": {(5, 0): 1.0}}, "frequencies"),
        ({"device_capacity": 2, "frequencies": {(0, 0): -1.0}}, "frequency"),
    ],
)
def test_bad_capacities_are_refused(weights, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExpertCache(weights, **kwargs)


def test_bad_weights_and_keys_are_refused(weights):
    with pytest.raises(ValueError, match="no routed expert"):
        ExpertCache({}, device_capacity=1)
    with pytest.raises(ValueError, match="pairs"):
        ExpertCache({(0, -1): weights[(0, 0)]}, device_capacity=1)
    with pytest.raises(ValueError, match="tuple of tensors"):
        ExpertCache({(0, 0): torch.zeros(2)}, device_capacity=1)
    with ExpertCache(weights, device_capacity=2) as cache:
        with pytest.raises(ValueError, match="layer 0, expert 9"):
            cache.get(0, 9)
        with pytest.raises(ValueError, match=r"\[0, 6\)"):
            cache.observe(0, torch.tensor([1, 6]))
        with pytest.raises(ValueError, match="layer 7"):
            cache.observe(7, torch.tensor([1]))


def test_rebalance_puts_the_most_frequent_on_host_and_the_rarest_on_ssd(weights, tmp_path):
    with ExpertCache(
        weights, device_capacity=1, host_capacity=3, ssd_path=tmp_path, rebalance_every=None
    ) as cache:
        placed = tiers(cache)
        hot = sorted(placed["ssd"])[-3:]  # three SSD residents become the most routed
        for layer, e in hot:
            cache.observe(layer, torch.tensor([[e, e], [e, e]]))
        assert cache.rebalance() == 6  # three up, three down
        after = tiers(cache)
        assert after["host"] == set(hot)
        assert placed["host"] <= after["ssd"]  # the unrouted ones went down
        assert after["device"] == placed["device"]  # the device tier is the LRU's alone
        for k in weights:
            assert same(cache.get(*k), weights[k])
        assert cache.stats()["moves"]["ssd->host"] == 3


def test_rebalance_runs_every_n_observations_and_decays(weights, tmp_path):
    with ExpertCache(
        weights, device_capacity=1, host_capacity=2, ssd_path=tmp_path, rebalance_every=3
    ) as cache:
        hot = sorted(tiers(cache)["ssd"])[-1]
        for _ in range(2):
            cache.observe(hot[0], torch.tensor([hot[1]] * 4))
        assert cache.stats()["rebalances"] == 0 and cache.tier_of(*hot) == "ssd"
        cache.observe(hot[0], torch.tensor([hot[1]] * 4))
        assert cache.stats()["rebalances"] == 1 and cache.tier_of(*hot) == "host"
        assert cache.frequency(*hot) == 6.0  # 12 counted, halved by the default decay


def test_a_device_victim_displaces_a_colder_host_resident(weights, tmp_path):
    with ExpertCache(
        weights, device_capacity=1, host_capacity=1, ssd_path=tmp_path, rebalance_every=None
    ) as cache:
        (victim,) = tiers(cache)["device"]
        (cold,) = tiers(cache)["host"]
        cache.observe(victim[0], torch.tensor([victim[1]] * 5))
        up = sorted(tiers(cache)["ssd"])[0]
        assert same(cache.get(*up), weights[up])
        assert cache.tier_of(*victim) == "host" and cache.tier_of(*cold) == "ssd"
        st = cache.stats()
        assert st["ssd_writes"] == 1  # the cold one was never stored: written once, now
        # A rarely routed victim goes to SSD instead, and host keeps the hotter one.
        nxt = sorted(tiers(cache)["ssd"])[-1]
        cache.get(*nxt)
        assert cache.tier_of(*up) == "ssd" and cache.tier_of(*victim) == "host"
        for k in (up, cold, nxt, victim):
            assert same(cache.get(*k), weights[k])


def test_a_batch_never_pushes_its_own_host_experts_down(weights, tmp_path):
    with ExpertCache(
        weights, device_capacity=1, host_capacity=1, ssd_path=tmp_path, rebalance_every=None
    ) as cache:
        (victim,) = tiers(cache)["device"]
        (on_host,) = tiers(cache)["host"]
        cache.observe(victim[0], torch.tensor([victim[1]] * 5))  # hotter than the host one
        up = next(k for k in sorted(tiers(cache)["ssd"]) if k[0] == on_host[0])
        got = cache.get_many(up[0], [up[1], on_host[1]])  # the SSD one first
        assert same(got[0], weights[up]) and same(got[1], weights[on_host])
        assert cache.tier_of(*on_host) == "device" and cache.tier_of(*victim) == "ssd"


def test_ssd_files_are_removed_on_close(weights, tmp_path):
    cache = ExpertCache(weights, device_capacity=2, host_capacity=2, ssd_path=tmp_path)
    (sub,) = tmp_path.iterdir()
    assert (sub / "data.mdb").exists() and cache.stats()["ssd_path"] == str(sub)
    cache.close()
    assert list(tmp_path.iterdir()) == []
    cache.close()  # twice is harmless
    with pytest.raises(ValueError, match="closed"):
        cache.get(0, 0)


def test_ssd_files_are_removed_when_an_unclosed_cache_is_collected(weights, tmp_path):
    cache = ExpertCache(weights, device_capacity=2, host_capacity=2, ssd_path=tmp_path)
    del cache
    assert list(tmp_path.iterdir()) == []


def test_tiers_left_by_dead_processes_are_removed(weights, tmp_path):
    dead = tmp_path / "experts-999999999-0badc0de"  # above Linux's pid_max: no such process
    alive = tmp_path / f"experts-{os.getpid()}-0badc0de"  # this process: kept
    other = tmp_path / "kv"  # not an expert tier: kept
    for d in (dead, alive, other):
        d.mkdir()
        (d / "data.mdb").write_bytes(b"x")
    with ExpertCache(weights, device_capacity=2, host_capacity=2, ssd_path=tmp_path):
        assert not dead.exists() and alive.exists() and other.exists()


def _flip_payload_byte(cache: ExpertCache, key: tuple[int, int], w) -> Path:
    """Damage the stored value of `key` in data.mdb behind the store's back."""
    path = cache.ssd_dir / "data.mdb"
    payload = b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in w)
    data = path.read_bytes()
    offset = data.index(payload)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes([data[offset + 5] ^ 0x40]), offset + 5)
    finally:
        os.close(fd)
    return path


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_lost_ssd_expert_raises_a_clear_error_and_nothing_changes(
    weights, tmp_path, damage, caplog
):
    with ExpertCache(weights, device_capacity=2, host_capacity=2, ssd_path=tmp_path) as cache:
        placed = tiers(cache)
        bad, good = sorted(placed["ssd"])[:2]
        if damage == "corrupt":
            _flip_payload_byte(cache, bad, weights[bad])
        else:
            cache.store.delete(_store_key(bad))
        before = cache.stats()
        assert good[0] == bad[0]
        with caplog.at_level("WARNING"), pytest.raises(ExpertLoadError) as err:
            cache.get_many(bad[0], [good[1], bad[1]])  # the good one is not promoted either
        msg = str(err.value)
        assert f"(layer {bad[0]}, expert {bad[1]})" in msg
        assert str(cache.ssd_dir / "data.mdb") in msg
        assert err.value.keys == [bad]
        if damage == "corrupt":
            assert "checksum mismatch" in caplog.text and _store_key(bad).hex() in caplog.text
            assert cache.store.stats()["checksum_failures"] == 1
        assert tiers(cache) == placed  # nothing moved
        after = cache.stats()
        assert after["misses"] == before["misses"] and after["residents"] == before["residents"]
        with pytest.raises(ExpertLoadError):
            cache.get(*bad)  # still reported, never served
        assert same(cache.get(*good), weights[good])  # the rest still works


def test_a_failed_ssd_write_leaves_every_expert_where_it_was(weights, tmp_path, monkeypatch):
    with ExpertCache(
        weights, device_capacity=1, host_capacity=0, ssd_path=tmp_path, rebalance_every=None
    ) as cache:
        placed = tiers(cache)
        (victim,) = placed["device"]

        def full(items):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(cache.store, "put_many", full)
        up = sorted(placed["ssd"])[0]
        with pytest.raises(OSError, match="No space"):
            cache.get(*up)  # the victim has to be written to SSD, which fails
        assert tiers(cache) == placed
        assert same(cache.get(*victim), weights[victim])
        monkeypatch.undo()
        assert same(cache.get(*up), weights[up]) and cache.tier_of(*victim) == "ssd"
        assert same(cache.get(*victim), weights[victim])


def test_observe_counts_routing_decisions(weights):
    with ExpertCache(weights, device_capacity=2, rebalance_every=None) as cache:
        cache.observe(1, torch.tensor([[0, 3], [3, 5]]))  # [tokens, top_k]
        cache.observe(1, torch.tensor([], dtype=torch.long))
        assert [cache.frequency(1, e) for e in range(EXPERTS)] == [1, 0, 0, 2, 0, 1]
        assert cache.stats()["observations"] == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_residents_are_device_tensors_and_host_copies_pinned(weights, tmp_path):
    with ExpertCache(
        weights, "cuda", device_capacity=2, host_capacity=4, ssd_path=tmp_path
    ) as cache:
        assert all(t.is_pinned() for w in cache._host.values() for t in w)
        for _ in range(2):
            for k in weights:
                got = cache.get(*k)
                assert all(t.is_cuda for t in got)
                assert same(tuple(t.cpu() for t in got), weights[k])
        assert all(t.is_pinned() for w in cache._host.values() for t in w)
        assert cache.stats()["promotions"]["ssd"] > 0
