"""A full SSD tier warns once per state change, counts the blocks it skipped, and the count
reaches the memory report and /metrics."""

from __future__ import annotations

import logging

import numpy as np

from unikv.memory.services import WriteThrough
from unikv.storage import StoreFullError


class _Src:
    def snapshot(self, ids):
        return {"kv": np.zeros((len(ids), 4), np.uint8)}


class _Dst:
    """A store tier whose disk is full while `full` is set."""

    def __init__(self) -> None:
        self.full, self.stored = True, set()

    def has_content(self, h: bytes) -> bool:
        return h in self.stored

    def write_content(self, keys, snapshot) -> None:
        if self.full:
            raise StoreFullError("/ssd", "block store /ssd: the disk cannot take a write")
        self.stored.update(keys)


def test_a_full_disk_warns_once_and_counts_what_it_skipped(caplog):
    dst = _Dst()
    w = WriteThrough(dst)
    try:
        with caplog.at_level(logging.INFO, logger="unikv.memory.services"):
            for step in range(10):  # ten steps, each persisting two blocks, on a full disk
                w.submit(_Src(), [(0, b"a%d" % step), (1, b"b%d" % step)])
                w.wait_writes()
            assert caplog.text.count("cannot take a write") == 1
            assert w.writes_skipped == 20 and w.blocks_written == 0 and w.failing
            dst.full = False  # room again: one line says so, and writes land
            w.submit(_Src(), [(0, b"c")])
            w.wait_writes()
            assert "written through again (20 skipped meanwhile)" in caplog.text
            assert not w.failing and w.blocks_written == 1
            dst.full = True  # full again: a new state, a new warning
            w.submit(_Src(), [(0, b"d")])
            w.wait_writes()
        assert caplog.text.count("cannot take a write") == 2
        assert w.writes_skipped == 21
    finally:
        w.close()


def test_skipped_writes_reach_the_memory_report_and_metrics():
    from unikv.cli.main import _memory_lines
    from unikv.engine.report import MemoryReport
    from unikv.kvstrategies.kv import KVReport
    from unikv.serving.metrics import ServerMetrics

    mem = MemoryReport(KVReport("hierarchical_offload", 0, 0, placement={"ssd_writes_skipped": 7}))
    assert "[SSD tier full: 7 block writes skipped" in _memory_lines(mem)
    metrics = ServerMetrics(lambda: mem, lambda: {"status": "green", "load_share": 1.0})
    text = metrics.exposition().decode()
    assert "unikv_ssd_writes_skipped_total 7.0" in text
