"""memory.hugepages: weights copied into 2 MiB-aligned chunks advised for huge pages, the
switch and the THP mode that turn it off, the report's reading of /proc/self/smaps, and the
engine's weights placed there without a change to any product."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from unikv.engine import linear
from unikv.engine.quantized import FORMATS, QuantizedTensor
from unikv.kernels import gemv
from unikv.kernels.operators import OperatorSet
from unikv.memory import hugepages
from unikv.memory.hugepages import HugePageReport

from . import tinygguf

ON = hugepages.enabled()
needs_thp = pytest.mark.skipif(not ON, reason=f"THP is {hugepages.mode()!r} here")


@pytest.fixture
def thp(monkeypatch, tmp_path):
    """Set the THP mode `place` reads (a file like the kernel's), the switch left on."""
    monkeypatch.delenv(hugepages.ENV, raising=False)

    def set_mode(text: str | None) -> None:
        f = tmp_path / "enabled"
        if text is None:
            f.unlink(missing_ok=True)
        else:
            f.write_text(text)
        monkeypatch.setattr(hugepages, "_MODE_FILE", f)

    return set_mode


@pytest.mark.parametrize(
    ("text", "mode"),
    [("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
     ("always madvise [never]\n", "never"), ("", "unavailable"), (None, "unavailable")],
)  # fmt: skip
def test_mode_reads_the_bracketed_choice(thp, text, mode):
    thp(text)
    assert hugepages.mode() == mode
    assert hugepages.enabled() == (mode in ("always", "madvise"))


@needs_thp
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
def test_place_copies_values_into_an_aligned_chunk(dtype):
    t = torch.randn(600, 257).to(dtype)  # an odd size: the next tensor starts on a new line
    before = hugepages.report().placed
    p = hugepages.place(t)
    q = hugepages.place(t[:400].contiguous())
    assert p.shape == t.shape and p.dtype == t.dtype and torch.equal(p, t)
    assert p.data_ptr() != t.data_ptr() and p.is_contiguous()
    assert p.data_ptr() % hugepages.ALIGN == 0 and q.data_ptr() % hugepages.ALIGN == 0
    assert not (q.data_ptr() < p.data_ptr() + p.nbytes and p.data_ptr() < q.data_ptr() + q.nbytes)
    r = hugepages.report()
    assert r.placed - before == p.nbytes + q.nbytes
    p.add_(1) if dtype != torch.uint8 else p.bitwise_not_()  # its own memory: t is unchanged
    assert not torch.equal(p, t) and torch.equal(q, t[:400])


@needs_thp
def test_a_large_tensor_gets_its_own_2mib_aligned_chunk():
    t = torch.ones(hugepages.CHUNK // 4 + 1000)  # more than a chunk
    p = hugepages.place(t)
    assert torch.equal(p, t) and p.data_ptr() % hugepages.HUGE == 0
    mapped = hugepages.report().mapped
    assert mapped >= p.nbytes
    del p
    gc.collect()  # the last tensor of a chunk frees its mapping
    assert hugepages.report().mapped <= mapped - hugepages.CHUNK


def test_place_leaves_what_it_cannot_help(thp, monkeypatch):
    small = torch.ones(hugepages.SMALLEST // 4 - 1)
    assert hugepages.place(small) is small
    meta = torch.empty(1 << 20, device="meta")
    assert hugepages.place(meta) is meta
    big = torch.ones(1 << 20)
    monkeypatch.setenv(hugepages.ENV, "0")
    assert hugepages.place(big) is big
    assert "off (UNIKV_HUGE_PAGES=0)" in hugepages.report().line() or not ON
    monkeypatch.delenv(hugepages.ENV)
    thp("always madvise [never]\n")
    assert hugepages.place(big) is big
    assert hugepages.report().line() == "weights in huge pages: off, THP never"


SMAPS = """\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      4096 kB
VmFlags: rd wr mr mw me ac sd hg
7f0000400000-7f0000800000 rw-p 00000000 00:00 0
AnonHugePages:      2048 kB
55d000000000-55d000021000 r--p 00000000 08:01 1234   /usr/bin/python3.11
AnonHugePages:         0 kB
"""


def test_huge_bytes_counts_only_the_mappings_of_the_spans():
    a = 0x7F0000000000
    assert hugepages.huge_bytes([(a, a + (4 << 20))], SMAPS) == 4 << 20
    assert hugepages.huge_bytes([(a + (4 << 20), a + (6 << 20))], SMAPS) == 2 << 20
    # a span inside the first mapping: its mapping's huge pages, capped at the span's bytes
    assert hugepages.huge_bytes([(a + 4096, a + 8192)], SMAPS) == 4096
    assert hugepages.huge_bytes([(0x1000, 0x2000)], SMAPS) == 0
    assert hugepages.huge_bytes([], SMAPS) == 0


def test_report_line_says_how_much_is_backed():
    r = HugePageReport("madvise", True, 100 << 20, 96 << 20, 94 << 20)
    assert r.line() == "weights in huge pages: 94 MiB of 96 MiB mapped (THP madvise)"
    assert "unknown of 96 MiB" in HugePageReport("always", True, 0, 96 << 20, None).line()


def test_live_report_is_consistent():
    r = hugepages.report()
    assert r.mode == hugepages.mode() and r.enabled == ON
    assert r.huge is None or 0 <= r.huge <= r.mapped


def _blocks(qtype: str, rows: int = 256, cols: int = 512) -> QuantizedTensor:
    """`qtype` blocks of random weights, quantized for real."""
    w = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    if qtype in ("Q4_K", "Q6_K"):
        raw = tinygguf.quantize_k(w, qtype)
    else:
        raw = quants.quantize(w, GGMLQuantizationType[qtype])
    return QuantizedTensor(qtype, torch.from_numpy(raw.copy()).view(rows, -1, FORMATS[qtype]))


@needs_thp
@pytest.mark.skipif(gemv.unavailable() is not None, reason="no C kernel")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_packed_weights_lie_in_chunks_and_multiply_alike(qtype, monkeypatch):
    """build_linear places what the kernel streams (interleaved, or in GGUF order with every
    form that is those blocks); the products equal those over the same blocks in 4 KiB pages."""
    cpu = torch.device("cpu")
    ops = OperatorSet(cpu)
    lin = linear.build_linear([_blocks(qtype)], torch.float32, cpu, 4, ops)
    w = lin.weight
    held = w.rows16 if w.rows16 is not None else w.q.blocks
    assert any(a <= held.data_ptr() < b for a, b in hugepages._spans.values())
    assert w.forms.get("blocks") in (None, held) and (w.rows16 is None or "blocks" not in w.forms)
    monkeypatch.setenv(hugepages.ENV, "0")
    plain = linear.build_linear([_blocks(qtype)], torch.float32, cpu, 4, ops)
    held4k = plain.weight.rows16 if w.rows16 is not None else plain.weight.q.blocks
    assert not any(a <= held4k.data_ptr() < b for a, b in hugepages._spans.values())
    for n in (1, 3, 40):  # decode, a few rows, a prefill's GEMM
        x = torch.randn(n, 512)
        assert torch.equal(lin(x), plain(x))


@needs_thp
def test_float_weights_are_stacked_straight_into_a_chunk():
    cpu = torch.device("cpu")
    parts = [torch.randn(256, 512), torch.randn(64, 512), torch.randn(64, 512)]  # q, k, v
    lin = linear.build_linear(parts, torch.float32, cpu, 4, OperatorSet(cpu))
    held = lin.weight.weight
    assert torch.equal(held, torch.cat(parts))
    assert any(a <= held.data_ptr() < b for a, b in hugepages._spans.values())


def test_empty_gives_chunk_memory_or_none(monkeypatch):
    assert hugepages.empty((10, 10), torch.float32) is None  # under SMALLEST
    if ON:
        t = hugepages.empty((300, 257), torch.bfloat16)
        assert t.shape == (300, 257) and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert any(a <= t.data_ptr() < b for a, b in hugepages._spans.values())
    monkeypatch.setenv(hugepages.ENV, "0")
    assert hugepages.empty((1 << 20,), torch.float32) is None


def test_the_run_report_says_where_the_weights_lie():
    from unikv.cli.main import _memory_lines  # noqa: PLC0415
    from unikv.engine.report import MemoryReport, ModelReport  # noqa: PLC0415
    from unikv.kvstrategies.kv import KVReport  # noqa: PLC0415

    line = HugePageReport("madvise", True, 1 << 20, 2 << 20, 2 << 20).line()
    mem = MemoryReport(KVReport("full", 0, 0), ModelReport(huge_pages=line))
    assert f"[{line}]" in _memory_lines(mem).splitlines()
    assert "huge pages" not in _memory_lines(MemoryReport(KVReport("full", 0, 0)))


@pytest.mark.parametrize("value", ["off", "false", "2", "yes please"])
def test_a_bad_switch_is_refused_in_one_line_naming_it(monkeypatch, capsys, value):
    from unikv.cli.main import EX_USAGE, main  # noqa: PLC0415

    monkeypatch.setenv(hugepages.ENV, value)
    with pytest.raises(ValueError, match=f"UNIKV_HUGE_PAGES={value!r}: expected 0"):
        hugepages.enabled()
    assert main(["run", "--prompt", "hi"]) == EX_USAGE  # before any model loads
    err = capsys.readouterr().err.strip().splitlines()
    want = (f"unikv: error: UNIKV_HUGE_PAGES={value!r}: expected 0 (weights in 4 KiB pages) "
            "or 1 (in huge pages where the kernel has them, the default)")  # fmt: skip
    assert err == [want]
