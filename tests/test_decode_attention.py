"""A dense float32 cache attends a decode step (a few new tokens per sequence) by the C kernel
over every block read in place (`attention.blocks`), and a longer step by PyTorch's attention
over the arena's runs. Both must give the same outputs, for every placement, whatever the
blocks' order in the arenas, and for batches that mix sequences of different lengths."""

import pytest
import torch

from unikv import kvstrategies
from unikv.kernels import sparse as kernels
from unikv.kvstrategies import full
from unikv.kvstrategies.kv import KVSpec, StepBatch
from unikv.settings.config import PoolConfig, TierConfig

BS, LAYERS, HEADS, DIM, GROUP = 16, 2, 2, 32, 3
SPEC = KVSpec(LAYERS, HEADS, DIM, query_group=GROUP)


def build(placement: str, tmp_path, label: str):
    if placement == "resident":
        return kvstrategies.create(
            "full", SPEC, PoolConfig(block_size=BS, tiers=(TierConfig("device", 8 << 20),))
        )
    from unikv.engine.assembly import store_tiers

    name = "dense+tiered+all"
    tiers = (TierConfig("device", 4 << 20), TierConfig("host", 4 << 20),
             TierConfig("ssd", 16 << 20, path=str(tmp_path / f"ssd-{label}")))  # fmt: skip
    cfg = PoolConfig(block_size=BS, tiers=tiers)
    opts = {"device_window": 32, "host_window": 48}
    return kvstrategies.create(name, SPEC, cfg, opts, stores=store_tiers(name, SPEC, cfg, opts))


def run(s, steps, monkeypatch, rows_in_c: int):
    """Feed `steps` (per step: {seq: (k [L, n, H, D], v, q [L, n, Hq, D])}) with
    `full.DECODE_ROWS` = rows_in_c; every attention output, in order."""
    monkeypatch.setattr(full, "DECODE_ROWS", rows_in_c)
    outs = []
    for batch in steps:
        seqs = list(batch)
        lens = [batch[sid][0].shape[1] for sid in seqs]
        for sid, n in zip(seqs, lens, strict=True):
            assert s.reserve(sid, n)
        s.begin_step(StepBatch(seqs, lens))
        for layer in range(LAYERS):
            s.append(layer, torch.cat([batch[sid][0][layer] for sid in seqs]),
                     torch.cat([batch[sid][1][layer] for sid in seqs]))  # fmt: skip
            outs.append(s.attend(layer, torch.cat([batch[sid][2][layer] for sid in seqs])))
        s.end_step()
    return outs


def tokens(g, n):
    shape = (LAYERS, n, HEADS, DIM)
    return (torch.randn(*shape, generator=g), torch.randn(*shape, generator=g),
            torch.randn(LAYERS, n, HEADS * GROUP, DIM, generator=g))  # fmt: skip


@pytest.mark.parametrize("placement", ["resident", "tiered"])
def test_decode_steps_through_the_kernel_attend_as_pytorch_does(tmp_path, placement,
                                                                monkeypatch):  # fmt: skip
    g = torch.Generator().manual_seed(0)
    # Two prompts written a chunk at a time in turn (their blocks interleave in the arenas),
    # then decode steps of 1 to 4 tokens for both, and one of 5 (PyTorch's in both runs).
    steps = [{0: tokens(g, 40)}, {1: tokens(g, 23)}, {0: tokens(g, 57)}, {1: tokens(g, 70)}]
    steps += [{0: tokens(g, n), 1: tokens(g, m)} for n, m in ((1, 1), (2, 1), (4, 3), (1, 4))]
    steps += [{0: tokens(g, 5), 1: tokens(g, 1)}, {1: tokens(g, 1)}]
    c = build(placement, tmp_path, "c")
    ref = build(placement, tmp_path, "ref")
    got = run(c, steps, monkeypatch, rows_in_c=4)
    want = run(ref, steps, monkeypatch, rows_in_c=0)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (i, (a - b).abs().max())
    if placement == "tiered":  # the older blocks were read on the host and SSD tiers
        assert {r.tier for r in c.pool.table(1).refs} >= {"device", "host", "ssd"}
    report = c.stats().format["kernels"]["attention.blocks"]
    assert report["active"] == ("c" if kernels.unavailable() is None else "torch")
    assert "attention.blocks" not in ref.stats().format.get("kernels", {})  # never called
    c.close()
    ref.close()


def test_a_step_of_more_rows_and_other_dtypes_keep_pytorch_attention(monkeypatch):
    """A prefill chunk (more than DECODE_ROWS new tokens) and a float16 cache (the kernel reads
    float32) never reach the kernel."""
    g = torch.Generator().manual_seed(1)
    for name in ("full", "fp16+resident+all"):
        s = kvstrategies.create(name, SPEC, PoolConfig(block_size=BS,
                                tiers=(TierConfig("device", 8 << 20),)))  # fmt: skip
        steps = [{0: tokens(g, 33)}, {0: tokens(g, full.DECODE_ROWS + 1)}]
        if name != "full":
            steps.append({0: tokens(g, 1)})
        run(s, steps, monkeypatch, rows_in_c=full.DECODE_ROWS)
        assert "attention.blocks" not in s.stats().format.get("kernels", {}), name
        s.close()
