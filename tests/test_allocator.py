"""Tests of memory.allocator: free queue, tier allocator, block tables (pure Python, fast)."""

import subprocess
import sys
from pathlib import Path

import pytest

from unikv.memory.allocator import Block, BlockTable, FreeBlockQueue, TierAllocator
from unikv.memory.prefix import BlockRef, PrefixCache

BS = 4


def make(num_blocks: int = 8, **kw) -> TierAllocator:
    return TierAllocator("device", num_blocks, BS, **kw)


def test_memory_imports_no_torch_or_numpy() -> None:
    # The allocator must stay importable and testable without torch;
    # a fresh interpreter is the only honest check, since pytest plugins may import torch.
    code = "import sys, memory; assert not {'torch', 'numpy'} & set(sys.modules), sys.modules"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=root)


# -- FreeBlockQueue ------------------------------------------------------------------------


def test_queue_fifo_and_remove() -> None:
    blocks = [Block(i, "t") for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and [b.block_id for b in q] == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and blocks[2] not in q
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 4, 0]
    for b in list(q):
        q.remove(b)
    assert len(q) == 0 and list(q) == []
    with pytest.raises(RuntimeError, match="empty"):
        q.popleft()


def test_queue_rejects_double_append_and_bad_remove() -> None:
    b = Block(7, "host")
    q = FreeBlockQueue([b])
    with pytest.raises(RuntimeError, match="block 7 in tier 'host' is already free"):
        q.append(b)
    q.remove(b)
    with pytest.raises(RuntimeError, match="block 7 in tier 'host' is not free"):
        q.remove(b)


# -- TierAllocator -------------------------------------------------------------------------


def test_allocate_free_counts() -> None:
    a = make(8)
    assert (a.num_free, a.num_used, a.usage) == (8, 0, 0.0)
    ids = a.allocate(3, owner="s1")
    assert ids == [0, 1, 2]
    assert (a.num_free, a.num_used) == (5, 3) and a.usage == pytest.approx(3 / 8)
    assert all(a.ref_count(i) == 1 and a.block(i).owner == "s1" for i in ids)
    a.free(ids)
    assert (a.num_free, a.num_used) == (8, 0)
    assert a.num_allocations == 3 and a.num_frees == 3
    assert a.allocate(0, owner="s") == []


def test_allocate_does_not_fit_returns_none_and_takes_nothing() -> None:
    a = make(4)
    assert a.allocate(3, "s") is not None
    assert not a.can_allocate(2)
    assert a.allocate(2, "s") is None
    assert a.num_free == 1


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, None])
def test_bad_counts_are_value_errors(bad: object) -> None:
    a = make()
    with pytest.raises(ValueError, match="n must be an integer >= 0"):
        a.allocate(bad, "s")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        a.can_allocate(bad)  # type: ignore[arg-type]


def test_constructor_validation() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        TierAllocator("device", -1, 16)
    with pytest.raises(ValueError, match="block_size"):
        TierAllocator("device", 4, 0)
    with pytest.raises(ValueError, match="low_watermark"):
        TierAllocator("device", 4, 16, low_watermark=1.0)
    with pytest.raises(ValueError, match="tier"):
        TierAllocator("", 4, 16)


def test_lru_order_freed_later_reused_later() -> None:
    a = make(4)
    ids = a.allocate(4, "s")
    assert ids is not None
    for i in (2, 0, 3, 1):  # free one by one: the queue keeps that order
        a.free([i])
    assert a.free_blocks() == [2, 0, 3, 1]
    assert a.allocate(2, "t") == [2, 0]


def test_free_returns_chain_in_reverse_order() -> None:
    # The end of a sequence is reused before its beginning (prefix heads are shared most).
    a = make(4)
    ids = a.allocate(4, "s")
    a.free(ids)
    assert a.free_blocks() == [3, 2, 1, 0]


def test_refcount_shared_block() -> None:
    a = make(4, prefix_cache=PrefixCache())
    (b,) = a.allocate(1, "s1")
    a.cache_block(b, None, [1, 2, 3, 4], "m")
    a.acquire_cached(b)  # a second sequence shares the cached block
    assert a.ref_count(b) == 2 and a.block(b).owner is None  # shared: read-only
    a.free([b])
    assert a.ref_count(b) == 1 and a.num_free == 3
    a.free([b])
    assert a.ref_count(b) == 0 and a.num_free == 4


def test_double_free_names_block_and_tier_and_changes_nothing() -> None:
    a = make(4)
    ids = a.allocate(2, "s")
    a.free([ids[0]])
    with pytest.raises(RuntimeError, match=r"double free of block 0 in tier 'device'"):
        a.free([ids[1], ids[0]])
    assert a.ref_count(ids[1]) == 1 and a.num_free == 3  # validated before mutating
    with pytest.raises(RuntimeError, match="double free of block 1"):
        a.free([ids[1], ids[1]])


def test_use_after_free() -> None:
    a = make(4, prefix_cache=PrefixCache())
    (b,) = a.allocate(1, "s")
    a.free([b])
    with pytest.raises(RuntimeError, match=r"cache of freed block 0 in tier 'device'"):
        a.cache_block(b, None, [1, 2, 3, 4], "m")
    with pytest.raises(RuntimeError, match="free but sequence 's' still references it"):
        a.check_owner(b, "s")


@pytest.mark.parametrize("bad", [-1, 4, 99, True])
def test_out_of_range(bad: int) -> None:
    a = make(4)
    with pytest.raises(RuntimeError, match=rf"block id {bad!r} out of range for tier 'device'"):
        a.free([bad])
    with pytest.raises(RuntimeError, match="out of range"):
        a.acquire_cached(bad)
    with pytest.raises(RuntimeError, match="out of range"):
        a.ref_count(bad)


def test_watermark_admission_vs_growth() -> None:
    a = make(10, low_watermark=0.2)  # 2 blocks kept for growth
    assert a.watermark_blocks == 2
    assert a.can_admit(8) and not a.can_admit(9)
    assert a.allocate(8, "s") is not None
    assert not a.can_admit(1)  # a new sequence would eat the reserve
    assert a.can_allocate(2)  # a running sequence may grow into it
    assert a.allocate(2, "s") is not None
    assert not a.can_allocate(1)


# -- prefix cache integration --------------------------------------------------------------


def test_cached_block_survives_free_and_revives_on_hit() -> None:
    cache = PrefixCache()
    a = make(4, prefix_cache=cache)
    (b,) = a.allocate(1, "s1")
    h = a.cache_block(b, None, [1, 2, 3, 4], "m")
    assert h is not None and a.num_cached == 1 and a.block(b).owner is None
    a.free([b])
    assert a.num_free == 4 and a.block(b).block_hash == h  # kept while free

    refs = cache.match_prefix([1, 2, 3, 4, 5], BS, "m")
    assert refs == [BlockRef("device", b)]
    a.acquire_cached(b)  # remove-on-hit: out of the free queue in O(1)
    assert a.ref_count(b) == 1 and b not in a.free_blocks() and a.num_revived == 1
    a.check_owner(b, "s2")  # shared blocks are legal for any sequence


def test_reuse_evicts_hash_and_counts() -> None:
    cache = PrefixCache()
    a = make(2, prefix_cache=cache)
    x, y = a.allocate(2, "s")
    a.cache_block(x, None, [1, 2, 3, 4], "m")
    a.free([x])
    a.free([y])  # queue: x, y -> x is reused first
    assert a.allocate(1, "t") == [x]
    assert a.num_evictions == 1 and a.num_cached == 0 and len(cache) == 0
    assert a.block(x).block_hash is None and a.block(x).owner == "t"
    assert cache.match_prefix([1, 2, 3, 4], BS, "m") == []
    with pytest.raises(RuntimeError, match="not in the prefix cache"):
        a.acquire_cached(x)


def test_recently_freed_cached_block_outlives_older_ones() -> None:
    cache = PrefixCache()
    a = make(3, prefix_cache=cache)
    ids = a.allocate(3, "s")
    for i, b in enumerate(ids):
        a.cache_block(b, None, [i] * BS, "m")
    a.free([ids[0]])
    a.free([ids[1]])
    a.free([ids[2]])
    a.acquire_cached(ids[0])  # a hit takes it out of the queue ...
    a.free([ids[0]])  # ... and freeing it again puts it at the tail
    assert a.allocate(2, "t") == [ids[1], ids[2]]
    assert a.block(ids[0]).block_hash is not None


def test_cache_block_rules() -> None:
    a = make(4)
    (b,) = a.allocate(1, "s")
    with pytest.raises(RuntimeError, match="without a prefix cache"):
        a.cache_block(b, None, [1, 2, 3, 4], "m")
    cache = PrefixCache()
    a = make(4, prefix_cache=cache)
    x, y = a.allocate(2, "s")
    with pytest.raises(ValueError, match="only full blocks"):
        a.cache_block(x, None, [1, 2], "m")
    assert a.cache_block(x, None, [1, 2, 3, 4], "m") is not None
    assert a.cache_block(y, None, [1, 2, 3, 4], "m") is None  # same content: first stays
    assert a.block(y).owner == "s" and a.num_cached == 1
    assert a.uncache(x) and not a.uncache(x) and len(cache) == 0 and a.num_evictions == 0


# -- BlockTable ----------------------------------------------------------------------------


def test_block_table_growth() -> None:
    a = make(8)
    t = BlockTable("s", BS)
    assert t.slots_needed(0) == 0 and t.slots_needed(1) == 1 and t.slots_needed(9) == 3
    t.append_blocks("device", a.allocate(t.slots_needed(6), "s"))
    t.append_tokens(6)
    assert (len(t), t.capacity, t.num_tokens, t.num_free_slots) == (2, 8, 6, 2)
    assert t.slots_needed(2) == 0 and t.slots_needed(3) == 1
    with pytest.raises(RuntimeError, match="needs 1 more block"):
        t.append_tokens(3)
    with pytest.raises(ValueError):
        t.slots_needed(-1)
    t.check({"device": a})


def test_block_table_version_counts_every_change_of_its_blocks() -> None:
    """A reader that caches the block ids (the dense format's decode step) rereads them when
    `version` moved: every change of which blocks are listed moves it; filling slots does not."""
    t = BlockTable("s", BS)
    seen = [t.version]
    t.append_blocks("device", [3, 4])
    seen.append(t.version)
    t.append_tokens(5)
    assert t.version == seen[-1]
    t.move(1, BlockRef("host", 9))
    seen.append(t.version)
    t.truncate(2)
    seen.append(t.version)
    assert len(set(seen)) == len(seen) and t.block_ids() == [3]


def test_block_table_detects_foreign_block() -> None:
    a = make(8)
    mine = a.allocate(1, "s1")
    theirs = a.allocate(1, "s2")
    t = BlockTable("s1", BS)
    t.append_blocks("device", mine + theirs)
    with pytest.raises(RuntimeError, match=r"block 1 in tier 'device' is owned by sequence 's2'"):
        t.check({"device": a})


def test_block_table_detects_freed_duplicate_and_unknown_tier() -> None:
    a = make(8)
    ids = a.allocate(2, "s")
    t = BlockTable("s", BS)
    t.append_blocks("device", ids)
    a.free([ids[1]])
    with pytest.raises(RuntimeError, match="block 1 in tier 'device' is free"):
        t.check({"device": a})
    t2 = BlockTable("s", BS)
    t2.append_blocks("device", [ids[0], ids[0]])
    with pytest.raises(RuntimeError, match="twice"):
        t2.check({"device": a})
    t3 = BlockTable("s", BS)
    t3.append_blocks("ssd", [0])
    with pytest.raises(RuntimeError, match="unknown tier 'ssd'"):
        t3.check({"device": a})


def test_block_table_move_and_truncate() -> None:
    t = BlockTable("s", BS)
    t.append_blocks("device", [5, 6, 7])
    t.append_tokens(10)
    assert t.move(0, BlockRef("host", 2)) == BlockRef("device", 5)
    assert t.refs[0] == BlockRef("host", 2) and t.block_ids("device") == [6, 7]
    assert t.truncate(5) == [BlockRef("device", 7)]
    assert (len(t), t.num_tokens) == (2, 5)
    with pytest.raises(ValueError, match="has 5"):
        t.truncate(6)


def test_allocate_passes_over_avoided_blocks_while_others_are_free():
    alloc = TierAllocator("device", 8, 16)
    assert alloc.allocate(2, "a", avoid={0, 1, 2}) == [3, 4]
    assert alloc.free_blocks()[-3:] == [0, 1, 2]  # passed-over blocks went to the tail
    # Only avoided blocks are left for the 4th: pass over while others remain, then take.
    assert alloc.allocate(4, "b", avoid={0, 1, 2}) == [5, 6, 7, 2]
    many = TierAllocator("device", 100, 16)
    avoided = set(range(99))
    got = many.allocate(1, "c", avoid=avoided)
    assert got == [TierAllocator.MAX_PASSED]  # the pass-over is bounded, not a scan


def test_take_evicts_a_cached_free_block_only_from_the_older_half_of_the_queue() -> None:
    a = make(8, prefix_cache=PrefixCache())
    ids = a.allocate(8, "s")
    for i, b in enumerate(ids):
        a.cache_block(b, None, [i] * BS, "m")
    a.free(ids[:4])  # older: back in the queue first (last first: 3, 2, 1, 0)
    a.free(ids[4:])  # newer: 7, 6, 5, 4
    assert a.free_blocks() == [3, 2, 1, 0, 7, 6, 5, 4]
    assert a.takeable(1) and not a.takeable(5)  # cached, older half / newer half
    assert not a.take(5, "t") and a.block(5).block_hash is not None  # LRU decides for it
    assert a.take(1, "t") and a.block(1).block_hash is None and a.num_evictions == 1
    assert not a.takeable(1)  # now used
    assert a.next_free() == 3
