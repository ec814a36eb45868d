"""The kernel registry and its circuit breaker: choice per device, fallback on a raise or on a
slow window (fake clock, never the wall clock), re-probe and restore after the cool-down, and
the contract that every registered implementation agrees with its op's reference."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

import unikv.engine.linear as linear
import unikv.kvstrategies.hybrid  # noqa: F401  (registers the attention entries)
from unikv.engine.quantized import FORMATS, QuantizedTensor
from unikv.kernels import operators
from unikv.kernels.operators import Breaker, BreakerSettings, FnImplementation


class Clock:
    """A fake clock: each implementation advances it by its own cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _impls(clock: Clock, cost: dict, fail: set):
    def make(name):
        def fn(x):
            clock.now += cost[name]
            if name in fail:
                raise RuntimeError(f"{name} broke")
            return x * 2  # every implementation gives the same answer

        return FnImplementation("test.op", name, fn, ("*",))

    return [make("fast"), make("ref")]


SETTINGS = BreakerSettings(
    every=1, window=4, calibration=2, tolerance=0.15, cooldown_s=100, switch_slow=True
)


def test_by_default_only_a_failure_switches_so_the_choice_is_deterministic():
    """Without `switch_slow` (the default) a slow window changes nothing: a busy machine never
    makes one run compute with other kernels than the next. A raise still switches, and the
    re-probed entry is restored after a window whatever its pace."""
    clock, cost, fail = Clock(), {"fast": 1.0, "ref": 3.0}, set()
    settings = BreakerSettings(every=1, window=4, calibration=2, cooldown_s=100)
    assert not settings.switch_slow
    b = Breaker("test.op", _impls(clock, cost, fail), settings, clock)
    for _ in range(3):
        b(torch.tensor(1.0))
    cost["fast"] = 50.0  # 50x its budget, window after window
    for _ in range(20):
        assert b(torch.tensor(1.0)) == 2
    assert b.active.name == "fast" and b.report()["fallbacks"] == 0
    fail.add("fast")
    assert b(torch.tensor(1.0)) == 2 and b.active.name == "ref"
    fail.clear()
    clock.now += 100
    for _ in range(4):
        b(torch.tensor(1.0))
    assert b.active.name == "fast" and b.report()["restores"] == 1


def test_a_breaker_remembers_a_bounded_number_of_shapes():
    """Issue 31's soak: attention calls key on the sequence's length (and on per-call
    objects), so a server meets new shape keys for as long as it runs; the breaker's samples
    and budgets grew without end (about 1 GiB an hour). It keeps the newest MAX_KEYS."""
    clock, cost = Clock(), {"fast": 1.0, "ref": 3.0}
    settings = BreakerSettings(every=1, window=4, calibration=2, cooldown_s=100)
    b = Breaker("test.op", _impls(clock, cost, set()), settings, clock)
    n = 3 * operators.MAX_KEYS
    for length in range(1, n + 1):  # a new length every call: a sample, never a budget
        assert b(torch.ones(1, length)).sum() == 2 * length
    state = b._states[0]
    assert len(state.samples) == operators.MAX_KEYS
    assert ((1, n),) in state.samples and ((1, 1),) not in state.samples  # the newest kept
    for length in range(1, n + 1):  # each length twice more: calibrated, budgets bounded
        for _ in range(3):
            b(torch.ones(2, length))
    assert len(state.budgets) == operators.MAX_KEYS and len(state.samples) <= operators.MAX_KEYS
    assert b.active.name == "fast"


def test_a_raising_implementation_is_rerun_on_the_next_and_restored(caplog):
    clock, cost, fail = Clock(), {"fast": 1.0, "ref": 5.0}, set()
    b = Breaker("test.op", _impls(clock, cost, fail), SETTINGS, clock)
    assert b(torch.tensor(1.0)) == 2
    fail.add("fast")
    with caplog.at_level(logging.WARNING, logger="unikv.kernels.operators"):
        for _ in range(5):  # the failing call's answer comes from the next implementation
            assert b(torch.tensor(3.0)) == 6
    assert b.active.name == "ref" and caplog.text.count("switched off") == 1  # logged once
    r = b.report()
    assert r["fallbacks"] == 1 and "raised RuntimeError: fast broke" in r["problem"]
    fail.clear()
    clock.now += 100  # the cool-down is over: re-probed, timed, restored after a good window
    for _ in range(3 + 4):
        assert b(torch.tensor(1.0)) == 2
    assert b.active.name == "fast" and b.report()["restores"] == 1
    assert "problem" not in b.report()


def test_a_slow_implementation_is_switched_off_and_stays_off_while_slow():
    clock, cost = Clock(), {"fast": 1.0, "ref": 3.0}
    b = Breaker("test.op", _impls(clock, cost, set()), SETTINGS, clock)
    for _ in range(3 + 4):  # warm-up + calibration (budget 1.0) + a window within budget
        b(torch.tensor(1.0))
    assert b.active.name == "fast"
    cost["fast"] = 1.1  # 10% slower: within the 15% tolerance
    for _ in range(8):
        b(torch.tensor(1.0))
    assert b.active.name == "fast"
    cost["fast"] = 3.5  # 3.5x over a whole window, and slower than ref (3.0): switched off
    for _ in range(4):
        assert b(torch.tensor(1.0)) == 2
    assert b.active.name == "ref" and "3.50x" in b.report()["switched_off"]["fast"]
    assert "problem" not in b.report()  # slower than another is adaptation, not ill health
    for _ in range(8):  # ref's trial window: 3.0 against fast's 3.5, faster: the switch stands
        assert b(torch.tensor(1.0)) == 2  # service goes on, on the reference
    assert b.active.name == "ref" and b.report()["rebases"] == 0
    clock.now += 100
    for _ in range(8):  # re-probed, still slow (its window judged again): off again
        b(torch.tensor(1.0))
    assert b.active.name == "ref" and b.report()["fallbacks"] == 2
    cost["fast"] = 1.0
    clock.now += 100
    for _ in range(4):
        b(torch.tensor(1.0))
    assert b.active.name == "fast" and b.report()["restores"] == 1


def test_a_slow_switch_is_undone_when_the_next_is_no_faster(caplog):
    """Everything slows down (another process on the cores): the fallback's trial window is no
    faster than the slow implementation was, so the slow one is back, its budget rescaled."""
    clock, cost = Clock(), {"fast": 1.0, "ref": 3.0}
    b = Breaker("test.op", _impls(clock, cost, set()), SETTINGS, clock)
    for _ in range(3 + 4):
        b(torch.tensor(1.0))
    cost["fast"] = 1.5  # 1.5x over a window: switched off, on trial
    for _ in range(4):
        b(torch.tensor(1.0))
    assert b.active.name == "ref"
    with caplog.at_level(logging.INFO, logger="unikv.kernels.operators"):
        for _ in range(3 + 4):  # ref calibrates, then a window at 3.0x fast's budget
            assert b(torch.tensor(1.0)) == 2
    assert b.active.name == "fast" and b.report()["rebases"] == 1
    assert "is no faster" in caplog.text and "problem" not in b.report()
    for _ in range(12):  # 1.5 is now within fast's rescaled budget: no new switch
        b(torch.tensor(1.0))
    assert b.active.name == "fast" and b.report()["fallbacks"] == 1


def test_a_slow_switch_is_undone_when_the_next_is_faster_only_by_noise():
    """The next implementation must beat the slow one by more than the tolerance: 1.4 against
    1.5 (7% faster) is noise on a busy machine, and the slow one comes back."""
    clock, cost = Clock(), {"fast": 1.0, "ref": 3.0}
    b = Breaker("test.op", _impls(clock, cost, set()), SETTINGS, clock)
    for _ in range(3 + 4):
        b(torch.tensor(1.0))
    cost["fast"], cost["ref"] = 1.5, 1.4
    for _ in range(4):
        b(torch.tensor(1.0))
    assert b.active.name == "ref"
    for _ in range(3 + 4):  # ref calibrates, then its trial window at 1.4x fast's budget
        b(torch.tensor(1.0))
    assert b.active.name == "fast" and b.report()["rebases"] == 1


def test_no_switch_to_a_known_slower_implementation():
    """A machine-wide slowdown slows every kernel: the breaker keeps one that is still faster
    than the next implementation's own budget."""
    clock, cost = Clock(), {"fast": 1.0, "ref": 3.0}
    impls = _impls(clock, cost, set())
    b = Breaker("test.op", impls[::-1], SETTINGS, clock)  # ref first, to calibrate it
    for _ in range(3):
        b(torch.tensor(1.0))
    b._states.reverse()
    b._use(0)
    for _ in range(3):
        b(torch.tensor(1.0))
    cost["fast"] = 2.0  # 2x its budget, still faster than ref's 3.0
    for _ in range(12):
        b(torch.tensor(1.0))
    assert b.active.name == "fast" and b.report()["fallbacks"] == 0


def test_the_reference_raising_reaches_the_caller_and_blames_the_call():
    """When the reference raises too, the call was at fault (a bad argument), not the kernel:
    the reference's error reaches the caller and the kernel stays in service for the next."""
    clock, fail = Clock(), {"fast", "ref"}
    b = Breaker("test.op", _impls(clock, {"fast": 1, "ref": 1}, fail), SETTINGS, clock)
    with pytest.raises(RuntimeError, match="ref broke"):
        b(torch.tensor(1.0))
    assert b.active.name == "fast"
    report = b.report()
    assert report["fallbacks"] == 0 and "switched_off" not in report and "problem" not in report
    fail.clear()
    assert b(torch.tensor(1.0)) == 2 and b.active.name == "fast"
    fail.add("fast")  # the kernel alone raising is still the kernel's fault
    assert b(torch.tensor(1.0)) == 2 and b.active.name == "ref"
    assert "fast switched off (raised RuntimeError: fast broke)" in b.report()["problem"]


def test_choice_per_device_and_unknown_op():
    chosen, skipped = operators.choose("attention.hybrid", "cpu")
    assert [i.name for i in chosen] == ["torch"] and "c" in skipped  # no strategy: no library
    cuda = [i.name for i in operators.implementations("matmul.q4_1", "cuda")]
    assert cuda == ["dequant"]  # the int4 CPU kernel is not offered there
    assert [i.name for i in operators.implementations("matmul.bf16", "cuda")][0] == "split_bmm"
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        operators.implementations("nope")


def test_a_healthy_breaker_times_one_call_in_every():
    """What keeps the breaker cheap (its measured overhead is stated in
    unikv/kernels/operators.py): a healthy breaker reads the clock twice per `every` calls and
    never on the others (counted with a fake clock, not timed)."""
    reads = []

    def clock() -> float:
        reads.append(1)
        return float(len(reads))

    impl = FnImplementation("test.op", "id", lambda x: x)
    b = Breaker("test.op", [impl], BreakerSettings(every=16), clock)
    for i in range(16 * 50):
        assert b(i) == i
    assert len(reads) == 2 * 50


# ---- the contract: every implementation agrees with its op's reference ---------------------


def _packed(fmt: str, rows: int = 64, cols: int = 128) -> QuantizedTensor:
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType[fmt])
    return QuantizedTensor(fmt, torch.from_numpy(raw.copy()).view(rows, -1, FORMATS[fmt]))


def _k_packed(fmt: str, rows: int = 64, cols: int = 512) -> QuantizedTensor:
    """Random Q4_K / Q6_K super-blocks (gguf cannot quantize K-quants) with sane scales."""
    from . import tinygguf

    raw = tinygguf.synthetic_blocks((rows, cols), fmt, np.random.default_rng(0))
    return QuantizedTensor(fmt, torch.from_numpy(raw.copy()).view(rows, -1, FORMATS[fmt]))


def _example(op: str):
    """(args, relative tolerance) for one call of `op`."""
    torch.manual_seed(0)
    x = torch.randn(5, 128)
    if op == "matmul.float":
        return (x, linear.SplitLinear(torch.randn(64, 128), 4)), 1e-5
    if op == "matmul.bf16":
        return (x, linear.SplitLinear(torch.randn(64, 128).bfloat16(), 4)), 1e-2
    if op in ("matmul.q4_k", "matmul.q6_k"):  # super-blocks of 256: rows of 512
        fmt = op.removeprefix("matmul.").upper()  # int8 activations: within 1e-4 of float32
        return (torch.randn(5, 512), linear.PackedWeight(_k_packed(fmt), torch.float32)), 1e-4
    if op.startswith("matmul.q"):
        fmt = op.removeprefix("matmul.").upper()
        # bf16 activations and scales in the native kernels; int8 requantizes rows (1.5%)
        return (x, linear.PackedWeight(_packed(fmt), torch.float32)), 2e-2
    if op == "rmsnorm":
        return (x, torch.rand(128), 1e-6), 1e-5
    if op == "rope":
        from unikv.engine.config import ModelConfig
        from unikv.engine.model import RotaryTable

        cfg = ModelConfig("t", "llama", 10, 64, 128, 1, 2, 2, 32, 1e-6, 1e4, 64)
        return (RotaryTable(cfg, torch.device("cpu"), torch.float32),
                torch.randn(5, 2, 32), torch.arange(5)), 1e-6  # fmt: skip
    if op == "attention.blocks":  # 5 blocks of 16 (the last partly filled: 72 tokens), each
        # head reading 3 of them from a shuffled arena; the step's 2 rows causal in the last
        g = torch.Generator().manual_seed(0)
        arena = torch.randn(2, 2, 8 * 16, 32, generator=g)
        blocks = torch.tensor([[0, 2, 4], [0, 3, 4]])
        ids = torch.tensor([5, 1, 7, 0, 3])  # per block of the sequence: where in the arena
        return (torch.randn(2, 4, 32, generator=g), [arena], None, ids, blocks, 16, 70, 0.2), 1e-5
    if op == "sparse.choose":  # integer dots of int8 codes: every implementation's scores alike
        from tests.test_sparse import _summaries_and_queries

        return (*_summaries_and_queries(2, 6, 2, 32, 90), 1, 85, 20, 87, 0.25), 0.0
    if op == "sparse.summarize":  # a step's 2 keys into summary 17, filling on, ranged: exact
        k, opened = torch.randn(3, 2, 2, 64) * torch.logspace(-2, 2, 64), torch.randn(2, 3, 2, 64)
        codes, scales = torch.zeros(3, 2, 2, 32, 16, 4, dtype=torch.int8), torch.zeros(3, 2, 32)
        return (k, opened.sort(0).values, True, True, codes, scales, 17), 0.0
    if op == "sparse.add_keys":  # a step's 2 keys into group 1's tokens 30-31 (of 32): exact
        k = torch.randn(3, 2, 2, 64) * torch.logspace(-2, 2, 64)
        codes = torch.zeros(3, 2, 6, 8, 16, 4, dtype=torch.uint8)
        params = torch.zeros(3, 2, 3, 2, 64, dtype=torch.float16)
        opened = torch.randn(3, 2, 32, 64)
        span = torch.stack((opened[:, :, :30].amin(2), opened[:, :, :30].amax(2)), 2)
        return (k, opened, span, 30, codes, params, 1), 0.0
    if op == "sparse.quantize_keys":  # 4-bit keys in groups of 128, the last one of 16: exact
        return (torch.randn(6, 144, 64) * torch.logspace(-2, 2, 64), 128), 0.0
    if op in ("layer.qkv", "layer.out"):
        m = _tiny_llama()
        if op == "layer.qkv":
            return (m, 1, x[:3], torch.tensor([0, 7, 63])), 1e-5
        return (m, 1, x[:3], torch.randn(3, 4, 32)), 1e-5
    if op == "model.layers":  # a decode step of two sequences (1 and 2 rows) over a full cache
        return _decode_step(_tiny_llama()), 1e-5
    if op == "model.step":  # the same step from its tokens: logits of rows 0 and 2
        m, _, pos, kv = _decode_step(_tiny_llama("Q4_1", packed_embedding=True))
        return (m, torch.tensor([5, 63, 0]), pos, kv, torch.tensor([0, 2])), 1e-5
    return None, 0.0


def _decode_step(m):
    """(m, x, positions, kv) of a decode step begun over a `full` cache that holds two prompts
    (20 and 9 tokens, written in turn): rows 1 and 2 of random hidden states."""
    from unikv import kvstrategies
    from unikv.kvstrategies.kv import StepBatch
    from unikv.settings.config import PoolConfig, TierConfig

    cfg = PoolConfig(block_size=16, tiers=(TierConfig("device", 8 << 20),))
    kv = kvstrategies.create("full", m.kv_spec(), cfg)
    for sid, n in ((0, 20), (1, 9)):
        kv.reserve(sid, n)
        m.forward(torch.randint(0, 64, (n,)), torch.arange(n), kv, StepBatch([sid], [n]))
    kv.reserve(0, 1), kv.reserve(1, 2)
    kv.begin_step(StepBatch([0, 1], [1, 2]))
    x = torch.randn(3, m.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    return m, x, torch.tensor([20, 9, 10]), kv


def _tiny_llama(qtype: str | None = None, context: int = 64, packed_embedding: bool = False,
                formats: dict[str, str] | None = None, tied: bool = True):  # fmt: skip
    """A two-layer Llama of random weights (hidden 128, 4 heads of 32, 2 KV heads, MLP 256;
    K-quants, whose rows hold 256-element super-blocks: hidden 256, 8 heads, MLP 512), its
    linear layers in `qtype` GGUF blocks or float32 (`packed_embedding`: its tied embedding
    and output layer too; `formats`: another format for some tensors, as {"blk.0.attn_v":
    "Q6_K"}), positions up to `context`; `tied` False: an output layer of its own (float32)."""
    from unikv.engine.config import ModelConfig
    from unikv.engine.model import LlamaModel

    formats = formats or {}
    h = 256 if {qtype, *formats.values()} & {"Q4_K", "Q6_K"} else 128
    cfg = ModelConfig("t", "llama", 64, h, 2 * h, 2, h // 32, h // 64, 32, 1e-6, 1e4, context,
                      tie_embeddings=tied)  # fmt: skip
    shapes = {"attn_q": (h, h), "attn_k": (h // 2, h), "attn_v": (h // 2, h),
              "attn_output": (h, h), "ffn_gate": (2 * h, h), "ffn_up": (2 * h, h),
              "ffn_down": (h, 2 * h)}  # fmt: skip
    g = torch.Generator().manual_seed(1)
    t = {"token_embd.weight": torch.randn(64, h, generator=g) * 0.1,
         "output_norm.weight": torch.rand(h, generator=g) + 0.5}  # fmt: skip
    for i in range(2):
        t[f"blk.{i}.attn_norm.weight"] = torch.rand(h, generator=g) + 0.5
        t[f"blk.{i}.ffn_norm.weight"] = torch.rand(h, generator=g) + 0.5
        for name, shape in shapes.items():
            w = torch.randn(*shape, generator=g) / shape[1] ** 0.5
            fmt = formats.get(f"blk.{i}.{name}", qtype)
            t[f"blk.{i}.{name}.weight"] = w if fmt is None else _quantized(w, fmt)
    if packed_embedding:
        t["token_embd.weight"] = _quantized(t["token_embd.weight"], qtype)
    if not tied:
        t["output.weight"] = torch.randn(64, h, generator=g) * 0.1
    return LlamaModel(cfg, t)


def _quantized(w: torch.Tensor, fmt: str) -> QuantizedTensor:
    from gguf import GGMLQuantizationType, quants

    if fmt in ("Q4_K", "Q6_K"):  # gguf cannot quantize these: random super-blocks instead
        return _k_packed(fmt, *w.shape)
    raw = quants.quantize(w.numpy(), GGMLQuantizationType[fmt])
    return QuantizedTensor(fmt, torch.from_numpy(raw.copy()).view(w.shape[0], -1, FORMATS[fmt]))


CASES = [(op, impl) for op in operators.ops() for impl in operators.implementations(op)]


@pytest.mark.parametrize("op,impl", CASES, ids=[f"{o}:{i.name}" for o, i in CASES])
def test_every_implementation_agrees_with_the_reference(op, impl):
    if op == "attention.hybrid":
        pytest.skip("attention: kernel vs torch is compared in tests/test_hybrid.py")
    if op.startswith("test."):
        pytest.skip("a test's own op")
    if "cpu" not in impl.devices and "*" not in impl.devices:
        pytest.skip(f"{impl.name} is for {impl.devices}")
    if impl.available(torch.device("cpu")) is not None:
        pytest.skip(impl.available(torch.device("cpu")))
    args, rtol = _example(op)
    assert args is not None, f"op {op} has no example in this contract test: add one"
    mine, ref = (tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
                 for _ in range(2))  # fmt: skip
    got, want = impl(*mine), operators.reference(op)(*ref)
    if got is None and want is None:  # an op that writes into its arguments: what it wrote
        got, want = (tuple(a for a in x if isinstance(a, torch.Tensor)) for x in (mine, ref))
    pairs = zip(got, want, strict=True) if isinstance(got, tuple) else [(got, want)]
    for a, b in pairs:  # an op may return several tensors (layer.qkv: q, k, v)
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err <= rtol, f"{op}:{impl.name} differs from the reference by {err:.2e}"


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_the_k_quant_kernel_equals_gguf_decoding_under_every_isa(fmt, isa):
    """gemv.c's K-quant kernel against gguf's own decoding of the same super-blocks, times x: 1,
    3 and 17 rows, odd row counts (one and two threads split them), two super-blocks a row."""
    from unikv.engine.quantized import dequantize
    from unikv.kernels import gemv

    if gemv.unavailable() is not None:
        pytest.skip(gemv.unavailable())
    q = _k_packed(fmt, rows=77)
    w = dequantize(q)
    assert w.shape == (77, 512) and torch.isfinite(w).all()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows in (1, 3, 17):
            x = torch.randn(rows, 512)
            got, want = gemv.gemv_kquant(x, q.blocks.contiguous(), fmt), x @ w.t()
            assert ((got - want).norm() / want.norm()).item() < 1e-5, (threads, rows)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("op", ["layer.qkv", "layer.out"])
def test_the_native_layer_agrees_with_its_ops_on_packed_weights(op, qtype, isa):
    """The layer calls multiply packed blocks by the matmul entry each layer chose (gemv_i8,
    int8 activations: every format, every batch; rows 1 to 16)."""
    from unikv.engine import fused

    m = _tiny_llama(qtype)
    assert m.layers[1][1].fmt == qtype
    h = m.cfg.hidden_size
    for rows in (1, 4, 16):
        x = torch.randn(rows, h)
        assert fused._usable(m, 1, x) is not None  # the native call runs, not the ops path
        if op == "layer.qkv":
            args = (m, 1, x, torch.randint(0, 64, (rows,)))
            got, want = fused.qkv_native(*args), fused.qkv_ops(*args)
        else:
            args = (m, 0, x, torch.randn(rows, h // 32, 32))
            got, want = (fused.out_native(*args),), (fused.out_ops(*args),)
        for a, b in zip(got, want, strict=True):
            assert ((a - b).norm() / b.norm()).item() < 2e-5, (op, qtype, rows)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("op", ["matmul.float", "matmul.bf16", "rmsnorm"])
def test_cuda_entries_agree(op):
    args, rtol = _example(op)
    args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)
    if op.startswith("matmul"):  # the weight (and its column slices) rebuilt on the device
        args = (args[0], linear.SplitLinear(args[1].weight.cuda(), args[1].parts))
    impl = operators.choose(op, "cuda")[0][0]
    got, want = impl(*args), operators.reference(op)(*args)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() <= rtol


# ---- the decode kernel (unikv/kernels/gemv.c): a few rows, odd shapes, one and two threads ----


def _gemv_entry(op: str, name: str = "gemv"):
    impl = next(i for i in operators.implementations(op, "cpu") if i.name == name)
    reason = impl.available(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    return impl


# (out, in): out not a multiple of the thread split or of 16, in not a multiple of 16 (float) or
# of 64 (the blocks: in is a multiple of 32 there), a single output row, one block per row.
FLOAT_SHAPES = [(67, 100), (1, 16), (130, 577), (257, 1536), (96, 7)]
PACKED_SHAPES = [(67, 96), (1, 32), (130, 32), (257, 576), (80, 1568)]
K_SHAPES = [(67, 256), (1, 256), (130, 512), (257, 768)]  # K-quants: rows of whole super-blocks


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("fmt", ["float", *sorted(FORMATS)])
def test_gemv_agrees_with_the_reference_at_decode_shapes(fmt, rows, threads, isa):
    from unikv.kernels import gemv

    op = f"matmul.{fmt.lower()}"
    impl, ref = _gemv_entry(op), operators.reference(op)
    assert gemv.isa() == isa  # the path under test is the one asked for
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k_quant = fmt in ("Q4_K", "Q6_K")
        shapes = FLOAT_SHAPES if fmt == "float" else K_SHAPES if k_quant else PACKED_SHAPES
        for out, cols in shapes:
            torch.manual_seed(out + cols)
            x = torch.randn(rows, cols)
            if fmt == "float":
                w = linear.SplitLinear(torch.randn(out, cols), 4)
            else:
                q = _k_packed(fmt, out, cols) if k_quant else _packed(fmt, out, cols)
                w = linear.PackedWeight(q, torch.float32)
            got, want = impl(x, w), ref(x, w)
            assert got.shape == (rows, out)
            # float32 activations, the weights decoded exactly: only the sums' order differs
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-5, f"{op} {rows}x{cols} @ {out}x{cols}: {err:.2e}"
    finally:
        torch.set_num_threads(before)


def _i8_reference(x: torch.Tensor, w, digits: int) -> torch.Tensor:
    """x rounded as gemv.c's int8 kernel rounds it (kernels.gemv.quantize_blocks, in torch),
    times the dequantized weight, in float64."""
    from unikv.engine.quantized import dequantize
    from unikv.kernels import gemv

    codes, scale = gemv.quantize_blocks(x, digits)  # [N, K/32, 32], [N, K/32, 1]
    xq = (codes.double() * scale.double()).reshape(x.shape)
    return (xq @ dequantize(w.q).double().t()).float()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 37])  # groups of 4, a part group; 37: chunks
@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("fmt", linear.BLOCK_FORMATS)
def test_gemv_i8_agrees_with_int8_activations_at_decode_shapes(fmt, digits, rows, threads, isa):
    """The VNNI kernel equals the product of the dequantized weight with the activations
    rounded to int8 codes per block (the same rounding, done in torch) up to float32 sums: the
    integer dots are exact. The registry entry rounds to two codes (within 1e-4 of float32
    activations); one code (ggml's Q8_0 rounding) is called directly. Shapes: an odd number of
    blocks (a half step), one block, more than 16 blocks (a second header chunk), a single
    output row."""
    from unikv.kernels import gemv

    op = f"matmul.{fmt.lower()}"
    impl = _gemv_entry(op, "gemv_i8")
    assert gemv.isa() == isa and gemv.i8_isa() in ("avx512-vnni", "avx2", "portable")
    if digits == 1:
        impl = lambda x, w: gemv.gemv_packed_i8(  # noqa: E731
            x, w.q.blocks.contiguous(), gemv.headers(w.q.blocks, fmt), fmt, digits=1
        )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for out, cols in [*PACKED_SHAPES, (33, 544), (65, 32 * 49)]:
            torch.manual_seed(out + cols)
            x = torch.randn(rows, cols) * torch.rand(rows, cols).pow(4) * 3  # uneven blocks
            if cols > 32:
                x[0, :32] = 0  # an all-zero block: its scale is 0, its codes 0
            w = linear.PackedWeight(_packed(fmt, out, cols), torch.float32)
            got, want = impl(x, w), _i8_reference(x, w, digits)
            assert got.shape == (rows, out)
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-5, f"{op} {rows}x{cols} @ {out}x{cols}: {err:.2e}"
            if digits == 2:  # against float32 activations: measured 2e-5 to 5e-5
                full = operators.reference(op)(x, w)
                assert ((got - full).norm() / full.norm()).item() < 1e-4
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("digits", [2, 1])
@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_the_k_quant_int8_kernel_equals_int8_activations_times_the_weights(
    fmt, digits, threads, isa
):
    """gemv.c's gemv_ki8 equals the dequantized super-blocks times the activations rounded as
    the 32-element formats' int8 kernel rounds them (`_i8_reference`: the same rounding in
    torch, float64 products) up to float32 sums: the integer dots are exact, Q6_K's offset of
    32 included. Rows 1 to 37 (groups of 4, a part group, a second chunk of 16), row counts
    the thread split leaves uneven, one to 16 super-blocks a row (the activation scales'
    stride padded to 16), an all-zero block, uneven magnitudes; random super-blocks and blocks
    quantized from Gaussian weights (`tinygguf.quantize_k`). Two digits, the registry entry's,
    stay within 1e-4 of float32 activations."""
    from unikv.engine.quantized import dequantize
    from unikv.kernels import gemv

    from . import tinygguf

    impl = _gemv_entry(f"matmul.{fmt.lower()}", "gemv_i8")
    assert gemv.isa() == isa
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for k, (out, cols) in enumerate([*K_SHAPES, (33, 4096)]):
            torch.manual_seed(out + cols)
            if k % 2:
                q = _k_packed(fmt, out, cols)
            else:  # real blocks: the quantizer's own error is a 4- or 6-bit rounding's
                dense = np.random.default_rng(k).standard_normal((out, cols)).astype(np.float32)
                raw = torch.from_numpy(tinygguf.quantize_k(dense, fmt))
                q = QuantizedTensor(fmt, raw.view(out, -1, FORMATS[fmt]))
                err = np.linalg.norm(dequantize(q).numpy() - dense) / np.linalg.norm(dense)
                assert err < (0.1 if fmt == "Q4_K" else 0.03), err
            w = linear.PackedWeight(q, torch.float32)
            for rows in (1, 3, 5, 16, 37):
                x = torch.randn(rows, cols) * torch.rand(rows, cols).pow(4) * 3
                x[0, :32] = 0  # an all-zero block: its scale is 0, its codes 0
                if digits == 2:
                    got = impl(x, w)
                else:
                    got = gemv.gemv_kquant_i8(x, q.blocks.contiguous(), fmt, digits=1)
                want = _i8_reference(x, w, digits)
                assert got.shape == (rows, out)
                err = ((got - want).norm() / want.norm()).item()
                assert err < 1e-5, f"{fmt} {rows}x{cols} @ {out}: {err:.2e}"
                if digits == 2:  # against float32 activations: measured 2e-5 to 3e-5
                    full = operators.reference(f"matmul.{fmt.lower()}")(x, w)
                    assert ((got - full).norm() / full.norm()).item() < 1e-4
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="digits must be 1 or 2"):
        gemv.gemv_kquant_i8(torch.randn(1, 256), q.blocks[:, :1].contiguous(), fmt, digits=3)


ROWS16_FORMATS = [*linear.BLOCK_FORMATS, "Q4_K"]  # the formats an int8 path reads interleaved


@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
def test_interleaved_rows_hold_the_same_bytes(fmt):
    """gemv.c's ROWS16 layout is a permutation of the blocks (Q8_0's codes xor 0x80): the
    round trip gives the GGUF blocks back, a lookup of some rows reads back only theirs, the
    bytes are where gemv.c looks for them, and a weight that is not whole groups is refused."""
    from unikv.kernels import gemv

    q = _k_packed(fmt, rows=48, cols=768) if fmt == "Q4_K" else _packed(fmt, rows=48, cols=96)
    blocks = q.blocks.contiguous()
    r16 = gemv.interleave(blocks, fmt)
    assert r16.shape == blocks.shape and r16.is_contiguous()
    assert torch.equal(gemv.deinterleave(r16, fmt), blocks)
    index = torch.tensor([47, 0, 17, 17, 31])
    assert torch.equal(gemv.deinterleave_rows(r16, fmt, index), blocks[index])
    if fmt == "Q4_K":  # group 1, super-block 2, row 3: d, dmin, scale byte 5, codes 4..7
        group = r16.reshape(3, 3, 16 * 144)[1, 2]
        assert torch.equal(group[2048 + 6 : 2048 + 8], blocks[19, 2, 0:2])
        assert torch.equal(group[2080 + 6 : 2080 + 8], blocks[19, 2, 2:4])
        assert group[2112 + 16 * 5 + 3] == blocks[19, 2, 4 + 5]
        assert torch.equal(group[64 + 12 : 64 + 16], blocks[19, 2, 16 + 4 : 16 + 8])
        with pytest.raises(ValueError, match="whole groups of 16"):
            gemv.interleave(blocks[:40], fmt)
        return
    # group 1 (rows 16..31), block 2: row 3's scale, and its codes 4..7 (quad 1)
    bs, hdr = blocks.shape[2], 4 if fmt == "Q4_1" else 2
    group = r16.reshape(3, 3, 16 * bs)[1, 2]
    codes = 16 * (bs - hdr)
    assert torch.equal(group[codes + 6 : codes + 8], blocks[19, 2, 0:2])
    quad = blocks[19, 2, hdr + 4 : hdr + 8]
    assert torch.equal(group[64 + 12 : 64 + 16], quad ^ 0x80 if fmt == "Q8_0" else quad)
    if fmt == "Q4_1":
        assert torch.equal(group[codes + 32 + 6 : codes + 32 + 8], blocks[19, 2, 2:4])
    with pytest.raises(ValueError, match="whole groups of 16"):
        gemv.interleave(blocks[:40], fmt)


def test_silu_s_vector_exp_gives_the_c_library_s_bits(isa):
    """gemv.c's SiLU takes glibc's expf algorithm in vector lanes where the check at load finds
    it equal to this C library's expf (AVX-512 and AVX2 builds): then every one of 4,194,304
    floats spread over all bit patterns (both signs, |x| >= 88, inf and NaN among them) gets
    libm's bits; the portable build has no vector exp."""
    from unikv.kernels import gemv

    assert gemv.unavailable() is None
    if isa == "portable":
        assert not gemv.vector_exp()
        return
    if not gemv.vector_exp():
        pytest.skip("this C library's expf differs from glibc's algorithm: SiLU calls expf")
    assert gemv.exp_mismatches(0, 1024, 1 << 22) == 0
    assert gemv.exp_mismatches(0x42020000, 1, 1 << 17) == 0  # about 32.5: where r's FMA matters


@pytest.mark.parametrize("fmt", [*linear.BLOCK_FORMATS, "Q4_K", "Q6_K"])
def test_an_embedding_lookup_decodes_only_its_rows_in_either_order(fmt, isa, monkeypatch):
    """gemv.dequantize_index (a tied embedding's lookup, one call a step) gives the rows of the
    whole decoded weight, from the GGUF blocks and (the 32-element formats, Q4_K) from the rows
    interleaved by 16; PackedWeight.rows takes it, and gives what torch decodes without gemv.c.
    An index outside the weight is refused, not read."""
    from unikv.engine.quantized import dequantize
    from unikv.kernels import gemv

    assert gemv.unavailable() is None  # built for this test's instruction set
    q = _k_packed(fmt, rows=48) if fmt in ("Q4_K", "Q6_K") else _packed(fmt, rows=48, cols=96)
    index = torch.tensor([47, 0, 17, 17, 31])
    dense = dequantize(q)
    assert torch.equal(gemv.dequantize_index(q.blocks, fmt, index), dense[index])
    w = linear.PackedWeight(q, torch.float32)
    if fmt in ROWS16_FORMATS:
        r16 = gemv.interleave(q.blocks.contiguous(), fmt)
        assert torch.equal(gemv.dequantize_index(r16, fmt, index, rows16=True), dense[index])
        w.interleave()
    with monkeypatch.context() as m:  # torch's decode of the rows' blocks
        m.setattr(gemv, "unavailable", lambda: "no compiler")
        want = w.rows(index.view(5, 1))
    assert torch.equal(w.rows(index.view(5, 1)), want) and want.shape == (5, 1, q.shape[1])
    for bad in ([48], [-1]):
        with pytest.raises(IndexError, match="outside"):
            gemv.dequantize_index(q.blocks, fmt, torch.tensor(bad))


@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
def test_an_interleaved_weight_serves_every_reader(fmt, monkeypatch):
    """A PackedWeight held interleaved (gemv_i8's form on the VNNI path) gives the same rows,
    the same dense weight and, to every matmul entry of its op (the float-activation gemv, the
    int4 kernels and the reference included, after a breaker's fallback), the same product as
    the GGUF-order weight; the GGUF blocks are rebuilt only when an entry reads them, and are
    then counted in `nbytes`."""
    q = _k_packed(fmt, rows=64, cols=256) if fmt == "Q4_K" else _packed(fmt, rows=64, cols=96)
    cols = q.shape[1]
    plain, w = linear.PackedWeight(q, torch.float32), linear.PackedWeight(q, torch.float32)
    w.form("blocks", linear._blocks)  # a form of the GGUF order (a fallback entry ran first)
    w.interleave()
    assert w._q is None and "blocks" not in w.forms
    assert w.nbytes == q.nbytes  # one copy, the same size
    index = torch.tensor([3, 63, 16, 16])
    assert torch.equal(w.rows(index), plain.rows(index)) and w.rows(index).shape == (4, cols)
    from unikv.kernels import gemv

    with monkeypatch.context() as m:  # without gemv.c the groups are read back in torch
        m.setattr(gemv, "unavailable", lambda: "no compiler")
        assert torch.equal(w.rows(index), plain.rows(index))
    assert torch.equal(w.to_dense(), plain.to_dense()) and w._q is None
    op = f"matmul.{fmt.lower()}"
    x = torch.randn(3, cols)
    for impl in operators.implementations(op):
        if impl.available(torch.device("cpu")) is not None or impl.name == "gemv_i8":
            continue
        torch.testing.assert_close(impl(x, w), impl(x, plain), rtol=1e-5, atol=1e-5)
    assert w._q is not None and torch.equal(w.q.blocks, q.blocks)
    assert w.nbytes >= 2 * q.nbytes  # both copies, counted


def _i8_product(x, blocks, fmt, digits=2, rows16=False):
    """gemv.c's int8 kernel for `fmt` (gemv_ki8 for Q4_K, gemv_qi8 for the rest)."""
    from unikv.kernels import gemv

    if fmt == "Q4_K":
        return gemv.gemv_kquant_i8(x, blocks, fmt, digits, rows16=rows16)
    head = linear.NO_HEADERS if rows16 else gemv.headers(blocks, fmt)
    return gemv.gemv_packed_i8(x, blocks, head, fmt, digits, rows16=rows16)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ROWS16_FORMATS)
def test_gemv_i8_on_interleaved_rows_equals_the_gguf_order(fmt, threads, isa, monkeypatch):
    """The interleaved kernels (VNNI: Q8_0, Q4_0, Q4_1, Q4_K; AVX2: Q4_0, Q4_1, Q4_K) compute the
    GGUF-order kernel's product (the same integer dots; only the float32 sums' order differs)
    for 1 to 37 activation rows, one or two digits, one block or many (129, Q4_K's 10: the long
    rows whose codes the VNNI kernels ask for ahead), one group of 16 rows or many; the
    registry's entry interleaves a weight of whole groups on first use, and the paths that do
    not read a format so (the portable one, AVX2's Q8_0) refuse it, in Python and in C."""
    from unikv.kernels import gemv

    if gemv.unavailable() is not None:
        pytest.skip(gemv.unavailable())
    k = fmt == "Q4_K"
    if not gemv.can_interleave(fmt, 16):
        blocks = (_k_packed(fmt, 16, 256) if k else _packed(fmt, 16, 32)).blocks.contiguous()
        with pytest.raises(ValueError, match="interleaved rows"):
            _i8_product(torch.randn(1, 256 if k else 32), blocks, fmt, rows16=True)
        x, y = torch.randn(1, 256), torch.empty(1, 16)
        code, lib = gemv.FORMAT_CODE[fmt] | gemv.ROWS16, gemv._state["lib"]
        if k:  # the C entries refuse it too
            rc = lib.gemv_ki8(code, x.data_ptr(), 1, blocks.data_ptr(), 16, 1, y.data_ptr(), 1, 2)
        else:
            rc = lib.gemv_qi8(code, x.data_ptr(), 1, blocks.data_ptr(), blocks.data_ptr(), 16, 1,
                              y.data_ptr(), 1, 2)  # fmt: skip
        assert rc == -1
        pytest.skip(f"the {gemv.i8_isa()} path does not read {fmt} interleaved")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    shapes = ([(16, 256), (96, 512), (80, 1536), (256, 2048), (32, 2560)] if k
              else [(16, 32), (96, 96), (80, 1568), (256, 576), (32, 4128)])  # fmt: skip
    try:
        for out, cols in shapes:
            torch.manual_seed(out + cols)
            q = _k_packed(fmt, out, cols) if k else _packed(fmt, out, cols)
            blocks = q.blocks.contiguous()
            r16 = gemv.interleave(blocks, fmt)
            for rows in (1, 2, 3, 5, 16, 37):
                x = torch.randn(rows, cols) * torch.rand(rows, cols).pow(4) * 3
                x[0, : 32 if cols > 32 else 0] = 0  # an all-zero block: its scale is 0
                for digits in (1, 2):
                    want = _i8_product(x, blocks, fmt, digits)
                    got = _i8_product(x, r16, fmt, digits, rows16=True)
                    err = ((got - want).norm() / want.norm()).item()
                    assert err < 1e-5, f"{fmt} {rows}x{cols} @ {out}: {err:.2e}"
        entry = _gemv_entry(f"matmul.{fmt.lower()}", "gemv_i8")
        w = linear.PackedWeight(q, torch.float32)
        got = entry(x, w)
        assert w.rows16 is not None and w._q is None  # interleaved by the entry
        assert ((got - want).norm() / want.norm()).item() < 1e-5
        # a weight made while INTERLEAVE is off keeps the GGUF order for good (kernel_ab's A)
        monkeypatch.setattr(linear, "INTERLEAVE", False)
        kept = linear.PackedWeight(q, torch.float32)
        monkeypatch.setattr(linear, "INTERLEAVE", True)
        assert torch.equal(entry(x, kept), _i8_product(x, blocks, fmt))
        assert kept.rows16 is None and kept._q is q
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", [*ROWS16_FORMATS, "F32"])
def test_weight_prefetch_changes_no_bit(fmt, isa):
    """Whether the kernels ask for the weights that stream in order ahead in software
    (gemv.weight_prefetch: the VNNI path's interleaved groups, the float32 rows) changes their
    speed, never their numbers: the same bits both ways, for one and many x rows. By default it
    is off on AMD's Zen 3 and later (their hardware prefetcher reads faster alone) and on
    elsewhere."""
    from unikv.kernels import gemv

    if gemv.unavailable() is not None:
        pytest.skip(gemv.unavailable())
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    field = {x.split(":")[0].strip(): x.split(":")[1].strip() for x in lines if ":" in x}
    chosen = gemv.weight_prefetch()
    if "vendor_id" in field and "cpu family" in field:  # AMD's Zen 3 and later: off
        zen3 = field["vendor_id"] == "AuthenticAMD" and int(field["cpu family"]) >= 25
        assert chosen == (not zen3)
    torch.manual_seed(7)
    if fmt == "F32":
        w = torch.randn(96, 1568)
        product = lambda x: gemv.gemv_float(x, w)  # noqa: E731
    elif gemv.can_interleave(fmt, 16):
        q = _k_packed(fmt, 96, 512) if fmt == "Q4_K" else _packed(fmt, 96, 1568)
        r16 = gemv.interleave(q.blocks.contiguous(), fmt)
        product = lambda x: _i8_product(x, r16, fmt, rows16=True)  # noqa: E731
    else:
        pytest.skip(f"the {gemv.i8_isa()} path does not read {fmt} interleaved")
    try:
        # from 5 x rows on the groups always ask (weight_pf); gemv_float takes at most 4
        for rows in (1, 3) if fmt == "F32" else (1, 3, 7):
            x = torch.randn(rows, 512 if fmt == "Q4_K" else 1568)
            got = []
            for on in (True, False):
                assert gemv.weight_prefetch(on) is on
                got.append(product(x))
            assert torch.equal(got[0], got[1])
    finally:
        gemv.weight_prefetch(chosen)
    assert gemv.weight_prefetch() == chosen


def test_quantize_blocks_is_ggml_q8_0_rounding_plus_a_second_code():
    """One code: d = amax / 127 per 32 elements, round(x / d) (to nearest even), a zero block
    0. Two: 256 q1 + q2 with q2 the rest in 1/256 steps, so the error is at most d / 512."""
    from unikv.kernels import gemv

    x = torch.zeros(1, 64)
    x[0, :32] = torch.linspace(-1, 2.54, 32)
    codes, d = gemv.quantize_blocks(x, digits=1)
    assert d[0, 0, 0].item() == pytest.approx(2.54 / 127) and d[0, 1, 0].item() == 0
    assert codes[0, 0, -1].item() == 127 and codes[0, 0, 0].item() == -50
    assert torch.equal(codes[0, 1], torch.zeros(32, dtype=torch.int32))
    codes2, scale = gemv.quantize_blocks(x, digits=2)
    assert torch.equal(torch.round(codes2 / 256.0), codes.float())  # q1 is the first code
    err = (codes2 * scale - x.view(1, 2, 32)).abs().max().item()
    assert err <= d.max().item() / 512 * 1.001


@pytest.mark.parametrize(
    "fmt,name", [("float", "gemv"), ("Q8_0", "gemv"), ("Q4_1", "gemv")],
)  # fmt: skip
def test_gemv_hands_larger_batches_to_the_next_kernel(fmt, name, monkeypatch):
    """The float-activation gemv keeps larger batches off its decode kernel: a call of more rows
    than gemv.MAX_ROWS, or of none, never reaches it (the packed formats' go on to the decoded
    GEMM, below; gemv_i8 takes every batch below gemv.GEMM_ROWS in chunks: tested above at 37
    rows)."""
    from unikv.kernels import gemv

    op = f"matmul.{fmt.lower()}"
    impl = _gemv_entry(op, name)

    def boom(*args):
        raise AssertionError("the C kernel was called for a large batch")

    monkeypatch.setattr(gemv, "gemv_float", boom)
    monkeypatch.setattr(gemv, "gemv_packed", boom)
    monkeypatch.setattr(gemv, "gemv_packed_i8", boom)
    x = torch.randn(gemv.MAX_ROWS + 1, 128)
    w = (linear.SplitLinear(torch.randn(64, 128), 4) if fmt == "float"
         else linear.PackedWeight(_packed(fmt), torch.float32))  # fmt: skip
    want = operators.reference(op)(x, w)
    err = ((impl(x, w) - want).norm() / want.norm()).item()
    assert err < 2e-2
    assert impl(x[:0], w).shape == (0, 64)  # no rows (an empty logits selection): not C either


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_prefill_rows_multiply_by_the_decoded_gemm_under_every_isa(fmt, isa, monkeypatch):
    """From gemv.GEMM_ROWS rows on (a prefill) the packed entries decode the blocks in panels
    for PyTorch's GEMM: the decoding equals gguf's (but for a fused multiply-add's last bit),
    the product is x @ W.T over the exact weights, panels of any size (one row, a partial last
    one) give the same product, and one row fewer stays on the decode kernels (the int8
    entries pinned to the GEMM for prefill rows: `linear.PREFILL`)."""
    from unikv.engine.quantized import dequantize
    from unikv.kernels import gemv

    monkeypatch.setattr(linear, "PREFILL", {fmt: "gemm"})

    if gemv.unavailable() is not None:
        pytest.skip(gemv.unavailable())
    q = _k_packed(fmt, rows=77) if fmt in ("Q4_K", "Q6_K") else _packed(fmt, rows=77, cols=160)
    blocks, want_w = q.blocks.contiguous(), dequantize(q)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        got_w = gemv.dequantize(blocks, fmt)
        assert got_w.shape == want_w.shape
        torch.testing.assert_close(got_w, want_w, rtol=2e-7, atol=1e-7)
    x = torch.randn(gemv.GEMM_ROWS, want_w.shape[1])
    want = x @ want_w.t()
    for panel in (gemv.PANEL_BYTES, 4 * x.shape[1] * 16, 4 * x.shape[1] * 48):  # 1, 5, 2 panels
        monkeypatch.setattr(gemv, "PANEL_BYTES", panel)
        got = gemv.gemm_packed(x, blocks, fmt)
        assert ((got - want).norm() / want.norm()).item() < 1e-6, panel
    if fmt in ROWS16_FORMATS:  # interleaved rows decode the same, on every build
        r16 = gemv.interleave(blocks[:64], fmt)
        assert torch.equal(gemv.dequantize(r16, fmt, rows16=True), got_w[:64])
        monkeypatch.setattr(gemv, "PANEL_BYTES", 4 * x.shape[1] * 16)  # panels of 16 rows
        got = gemv.gemm_packed(x, r16, fmt, rows16=True)
        assert ((got - want[:, :64]).norm() / want[:, :64].norm()).item() < 1e-6
    # the registered entries: GEMM_ROWS rows through the GEMM, one fewer through the kernels
    op = f"matmul.{fmt.lower()}"
    names = ["gemv_i8", "gemv"]
    w = linear.PackedWeight(q, torch.float32)
    real = gemv.gemm_packed
    for name in names:
        impl = _gemv_entry(op, name)

        def boom(*args):
            raise AssertionError("the decoded GEMM was called below GEMM_ROWS")

        monkeypatch.setattr(gemv, "gemm_packed", boom)
        small = impl(x[: gemv.MAX_ROWS], w) if name == "gemv" else impl(x[:-1], w)
        assert small.shape[1] == 77
        if fmt in ("Q4_K", "Q6_K"):  # the K-quant kernels take any rows below GEMM_ROWS: 37
            got = impl(x[:37], w)  # (int8 activations: within 1e-4 of float32 ones)
            err = ((got - want[:37]).norm() / want[:37].norm()).item()
            assert err < (1e-4 if name == "gemv_i8" else 1e-5), name
        calls = []
        monkeypatch.setattr(gemv, "gemm_packed", lambda *a, c=calls: c.append(1) or real(*a))
        got = impl(x, w)
        assert calls == [1] and ((got - want).norm() / want.norm()).item() < 1e-6, name


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "Q4_K"])
def test_a_prefill_takes_the_way_it_measured_faster_once_per_format(fmt, monkeypatch):
    """The int8 entries time the int8 kernel and the decoded GEMM on the first prefill-sized
    product of a format (twice each) and keep the int8 kernel only where it was PREFILL_MARGIN
    times faster; later products go the chosen way without timing, and both ways give the
    product (the int8 kernel's within 1e-4 of float32 activations)."""
    from unikv.kernels import gemv

    impl = _gemv_entry(f"matmul.{fmt.lower()}", "gemv_i8")
    k_quant = fmt == "Q4_K"
    q = _k_packed(fmt, rows=48) if k_quant else _packed(fmt, rows=48, cols=96)
    w = linear.PackedWeight(q, torch.float32)
    x = torch.randn(gemv.GEMM_ROWS + 3, q.shape[1])
    want = operators.reference(f"matmul.{fmt.lower()}")(x, w)
    real = gemv.gemm_packed
    for gemm_s, int8_s, way in [(3.0, 1.0, "int8"), (1.1, 1.0, "gemm")]:
        monkeypatch.setattr(linear, "PREFILL", {})
        ticks = iter([0.0, gemm_s, 10.0, 10.0 + int8_s] * 2)  # gemm, int8, gemm, int8
        monkeypatch.setattr(linear, "_clock", lambda t=ticks: next(t))
        calls = []
        monkeypatch.setattr(
            gemv, "gemm_packed", lambda *a, c=calls, **k: c.append(1) or real(*a, **k)
        )
        first = impl(x, w)
        assert linear.PREFILL[fmt] == way and len(linear.PREFILL) == 1  # timed both, twice each
        assert calls == [1, 1]
        got = impl(x, w)  # no clock now: the iterator is spent, a call to it would raise
        assert calls == ([1, 1] if way == "int8" else [1, 1, 1])
        for y in (first, got):
            assert ((y - want).norm() / want.norm()).item() < (1e-4 if way == "int8" else 1e-5)


def test_gemv_unavailable_says_why(monkeypatch):
    from unikv.kernels import gemv
    from unikv.kernels import native as kernels

    monkeypatch.setattr(gemv, "_state", {})
    monkeypatch.setenv("UNIKV_NO_KERNEL", "1")
    assert gemv.unavailable() == "disabled by UNIKV_NO_KERNEL=1"
    monkeypatch.delenv("UNIKV_NO_KERNEL")
    if not kernels._x86():
        pytest.skip("the x86-64 instruction sets")
    for want, flags, why in [
        ("avx512", "flags : sse2 avx2 fma f16c", "UNIKV_ISA=avx512, but this CPU has no avx512f"),
        ("avx2", "flags : fpu sse2", "UNIKV_ISA=avx2, but this CPU has no avx2 / fma / f16c"),
        ("sse9", "flags : fpu sse2", "UNIKV_ISA=sse9 is unknown; choose one of"),
    ]:  # fmt: skip
        monkeypatch.setattr(gemv, "_state", {})
        monkeypatch.setenv("UNIKV_ISA", want)
        monkeypatch.setattr(kernels, "cpu_flags", lambda f=flags: f)
        assert why in gemv.unavailable()
        assert gemv.i8_unavailable() == gemv.unavailable()  # no library: no int8 kernel either
    chosen, skipped = operators.choose("matmul.q4_1", "cpu")
    assert {"gemv", "gemv_i8"} <= set(skipped) and chosen[0].name not in ("gemv", "gemv_i8")
    # then native weights are decoded at load, and the memory report says why
    op, why = linear.native_op("Q4_1", torch.device("cpu"))
    assert op is None and "decoded to float at load" in why and "sse9 is unknown" in why


def test_the_best_instruction_set_is_the_default(monkeypatch):
    """Without UNIKV_ISA: AVX-512 where the CPU has F and BW, else AVX2 (with FMA and F16C),
    else the portable C paths; the int8 kernel is first for every packed format on each."""
    from unikv.kernels import native as kernels

    if not kernels._x86():
        pytest.skip("the x86-64 instruction sets")
    monkeypatch.delenv("UNIKV_ISA", raising=False)
    for flags, want in [("avx2 fma f16c avx512f avx512bw", "avx512"), ("avx2 fma f16c", "avx2"),
                        ("avx2 fma", "portable"), ("sse2", "portable")]:  # fmt: skip
        monkeypatch.setattr(kernels, "cpu_flags", lambda f=flags: "flags : " + f)
        assert kernels.isa() == want


def test_the_int8_kernel_serves_first_on_every_instruction_set(isa):
    for fmt in ("q8_0", "q4_0", "q4_1"):
        chosen, _ = operators.choose(f"matmul.{fmt}", "cpu")
        assert [i.name for i in chosen[:2]] == ["gemv_i8", "gemv"]
    op, how = linear.native_op("Q4_1", torch.device("cpu"))
    assert op == "matmul.q4_1" and how.startswith("gemv_i8 (")
