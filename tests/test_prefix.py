"""Tests of memory.prefix: stable chained hashes and collision-safe prefix lookups."""

import subprocess
import sys
from pathlib import Path

import pytest

import unikv.memory.prefix as prefix
from unikv.memory.prefix import BlockRef, PrefixCache, block_hash, chain_hashes

BS = 4
ROOT = Path(__file__).resolve().parents[1]


def test_hash_is_stable_across_processes() -> None:
    # PYTHONHASHSEED differs per process by default; block_hash must not depend on it.
    code = (
        "from memory.prefix import block_hash; "
        "p = block_hash(None, [1, 2, 3, 4], 'smollm2/full'); "
        "print(block_hash(p, [5, 6, 7, 8], 'smollm2/full').hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout.strip()
    here = block_hash(block_hash(None, [1, 2, 3, 4], "smollm2/full"), [5, 6, 7, 8], "smollm2/full")
    assert out == here.hex()
    assert len(here) == 32


def test_hash_depends_on_every_input() -> None:
    base = block_hash(None, [1, 2, 3, 4], "m")
    assert block_hash(None, [1, 2, 3, 4], "m") == base
    assert block_hash(None, [1, 2, 3, 5], "m") != base
    assert block_hash(None, [1, 2, 3, 4], "m2") != base
    assert block_hash(b"\x00" * 32, [1, 2, 3, 4], "m") != base
    assert block_hash(None, [1, 2, 3], "m") != block_hash(None, [1, 2, 3, 0], "m")


@pytest.mark.parametrize("tokens", [[-1], [2**64], [1.5], ["a"], [None]])
def test_bad_token_ids(tokens: list) -> None:
    with pytest.raises(ValueError, match="token ids must be integers"):
        block_hash(None, tokens, "m")


def test_bad_identity_and_parent() -> None:
    with pytest.raises(ValueError, match="identity"):
        block_hash(None, [1], "")
    with pytest.raises(ValueError, match="parent"):
        block_hash("abc", [1], "m")  # type: ignore[arg-type]


def test_chain_hashes_full_blocks_only() -> None:
    hs = list(chain_hashes(list(range(10)), BS, "m"))
    assert len(hs) == 2
    assert hs[1] == block_hash(hs[0], [4, 5, 6, 7], "m")


def fill(cache: PrefixCache, tokens: list[int], identity: str = "m", tier: str = "device") -> None:
    parent = None
    for i in range(len(tokens) // BS):
        parent = cache.insert(BlockRef(tier, i), parent, tokens[i * BS : (i + 1) * BS], identity)
        assert parent is not None


def test_match_prefix_longest_chain_and_hit_rate() -> None:
    cache = PrefixCache()
    fill(cache, list(range(12)))  # 3 blocks
    refs = cache.match_prefix(list(range(8)) + [99, 9, 10, 11, 12], BS, "m")
    assert refs == [BlockRef("device", 0), BlockRef("device", 1)]
    assert (cache.queries, cache.hits, cache.misses) == (3, 2, 1)
    assert cache.match_prefix(list(range(12)), BS, "other-model") == []
    assert cache.hit_rate == pytest.approx(2 / 6)


def test_lookup_and_evict() -> None:
    cache = PrefixCache()
    h = cache.insert(BlockRef("device", 3), None, [1, 2, 3, 4], "m")
    assert cache.lookup(None, [1, 2, 3, 4], "m") == BlockRef("device", 3)
    assert cache.lookup(None, [1, 2, 3, 5], "m") is None
    assert cache.lookup(None, [1, 2, 3, 4], "m") == BlockRef("device", 3)
    assert cache.hash_of(BlockRef("device", 3)) == h
    assert cache.evict(BlockRef("device", 3)) and not cache.evict(BlockRef("device", 3))
    assert cache.lookup(None, [1, 2, 3, 4], "m") is None
    assert (cache.queries, cache.hits) == (4, 2)


def test_insert_rules() -> None:
    cache = PrefixCache()
    ref = BlockRef("device", 0)
    h = cache.insert(ref, None, [1, 2, 3, 4], "m")
    assert cache.insert(ref, None, [1, 2, 3, 4], "m") == h  # idempotent
    assert cache.insert(BlockRef("device", 1), None, [1, 2, 3, 4], "m") is None  # first wins
    with pytest.raises(RuntimeError, match="block 0 in tier 'device' is already cached"):
        cache.insert(ref, None, [9, 9, 9, 9], "m")


def test_collision_never_serves_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    # Force every block to the same digest: lookups must compare the stored tokens.
    monkeypatch.setattr(prefix, "block_hash", lambda parent, tokens, identity: b"\x00" * 32)
    cache = PrefixCache()
    assert cache.insert(BlockRef("device", 0), None, [1, 2, 3, 4], "m") is not None
    assert cache.lookup(None, [5, 6, 7, 8], "m") is None
    assert cache.lookup(None, [1, 2, 3, 4], "other") is None
    assert cache.lookup(b"\x01" * 32, [1, 2, 3, 4], "m") is None
    assert cache.match_prefix([5, 6, 7, 8], BS, "m") == []
    assert cache.lookup(None, [1, 2, 3, 4], "m") == BlockRef("device", 0)
