"""A Llama layer's dense part in two native calls (engine/fused.py, unikv/kernels/gemv.c's layer_qkv
and layer_out) against the same computation as torch ops: q, k, v and the layer's output per
call, under every instruction set this CPU runs, with float32 and packed weights; the whole
model's decode logits and PPL; and the fallbacks (rows a kernel does not take, a matmul entry
that is not gemv.c's, a native call that raises)."""

import math

import pytest
import torch

from unikv.engine import fused
from unikv.kernels import gemv

pytestmark = pytest.mark.skipif(gemv.unavailable() is not None, reason=str(gemv.unavailable()))


@pytest.fixture(scope="module")
def native_model(model_path):
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.model import LlamaModel

    cfg, tensors, _ = load_gguf(model_path, progress=False, weights="native")
    return LlamaModel(cfg, tensors)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _check_layers(m, rows: int, tol: float) -> None:
    cfg = m.cfg
    for li in (0, cfg.num_layers // 2, cfg.num_layers - 1):
        x = torch.randn(rows, cfg.hidden_size)
        pos = torch.randint(0, 2000, (rows,))
        got, ref = fused.qkv_native(m, li, x, pos), fused.qkv_ops(m, li, x, pos)
        for a, b in zip(got, ref, strict=True):
            assert a.shape == b.shape and _rel(a, b) < tol, (li, _rel(a, b))
        attn = torch.randn(rows, cfg.num_heads, cfg.head_dim)
        got, ref = fused.out_native(m, li, x, attn), fused.out_ops(m, li, x, attn)
        assert _rel(got, ref) < tol, (li, _rel(got, ref))


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_float32_layer_equals_its_ops_under_every_isa(model, isa, rows):
    assert gemv.unavailable() is None
    _check_layers(model, rows, 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 3, 12])
def test_packed_layer_equals_its_ops_under_every_isa(native_model, isa, rows):
    """Q8_0 and Q4_1 blocks; 12 rows: the int8 kernel takes any number, the float one 4. The
    int8 kernel rounds its input to codes, so a last-bit difference of the norm can move one
    code by one (measured 3e-6 of the layer's output)."""
    assert gemv.unavailable() is None
    _check_layers(native_model, rows, 2e-5)


def test_rows_a_kernel_does_not_take_go_the_ops_way(model, monkeypatch):
    """Float32 weights: gemv takes at most MAX_ROWS rows, so 5 rows are the ops path's exactly
    (a prompt chunk); a position past the RoPE table fails as the ops path fails."""
    calls = []
    monkeypatch.setattr(gemv, "layer_qkv", lambda *a: calls.append(a) or None)
    cfg = model.cfg
    x, pos = torch.randn(gemv.MAX_ROWS + 1, cfg.hidden_size), torch.arange(gemv.MAX_ROWS + 1)
    for a, b in zip(fused.qkv_native(model, 0, x, pos), fused.qkv_ops(model, 0, x, pos),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)
    assert not calls
    monkeypatch.undo()
    with pytest.raises(IndexError):
        fused.qkv_native(model, 0, x[:1], torch.tensor([cfg.context_length]))


def test_a_matmul_entry_other_than_gemv_makes_the_layer_take_the_ops_way(model_path):
    """After a fallback of one matmul (here: the output projection switched to bmm) the layer's
    description is rebuilt and the layer runs as ops, with that matmul's chosen entry."""
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.model import LlamaModel

    cfg, tensors, _ = load_gguf(model_path, progress=False)
    m = LlamaModel(cfg, tensors)
    x = torch.randn(1, cfg.hidden_size)
    assert fused._usable(m, 3, x) is not None
    wo = m.layers[3][2]
    wo.op._use([s.impl.name for s in wo.op._states].index("split_bmm"))
    assert fused._usable(m, 3, x) is None
    attn = torch.randn(1, cfg.num_heads, cfg.head_dim)
    assert torch.equal(fused.out_native(m, 3, x, attn), fused.out_ops(m, 3, x, attn))


def test_a_native_call_that_raises_falls_back_and_is_reported(model_path, monkeypatch):
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.model import LlamaModel
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    cfg, tensors, _ = load_gguf(model_path, progress=False)
    m = LlamaModel(cfg, tensors)
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, m.dtype)
    first = m.forward(torch.tensor([1, 2]), torch.arange(2), kv, StepBatch([0], [2]))

    def broken(*a):
        raise RuntimeError("injected")

    monkeypatch.setattr(gemv, "layer_out", broken)
    got = m.forward(torch.tensor([3]), torch.tensor([2]), kv, StepBatch([0], [1]))
    assert first.shape[-1] == got.shape[-1] and torch.isfinite(got).all()
    report = m.operators.report()["layer.out"]
    assert report["active"] == "ops" and report["fallbacks"] == 1
    assert "injected" in report["switched_off"]["native"]
    assert report["candidates"] == ["native", "ops"]


def test_a_bad_position_raises_without_switching_the_native_layer_off(model):
    """A position past the RoPE table makes both ways of the layer raise: the call is at
    fault, so the error reaches the caller and the native layer keeps serving later calls."""
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    c = model.cfg

    def step(pos: int):
        kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
        return model.forward(torch.tensor([5]), torch.tensor([pos]), kv, StepBatch([0], [1]))

    with pytest.raises(IndexError):
        step(c.context_length + 10)
    report = model.operators.report()
    assert report["layer.qkv"]["active"] == "native", report["layer.qkv"]
    assert "switched_off" not in report["layer.qkv"]
    assert torch.isfinite(step(3)).all()
    assert model.operators.report()["layer.qkv"]["active"] == "native"


def _decode(m, ids, ops: bool):
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    c = m.cfg
    saved = m._qkv, m._out
    if ops:
        m._qkv, m._out = (lambda *a: fused.qkv_ops(*a)), (lambda *a: fused.out_ops(*a))
    try:
        kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim, m.dtype)
        return torch.cat([m.forward(torch.tensor([t]), torch.tensor([i]), kv, StepBatch([0], [1]))
                          for i, t in enumerate(ids)])  # fmt: skip
    finally:
        m._qkv, m._out = saved


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["float32", "native"])
def test_decode_through_the_native_layer_keeps_the_ppl(
    weights, model, native_model, tokenizer, english_text
):
    """One token per step (every layer native) against the ops path: the same greedy tokens, the
    PPL within 0.01%, the logits within float32 summation order (float32 weights) or within the
    int8 kernel's rounding of its input (native weights: a code moved by one in some layer
    carries through the rest; measured 1.8e-4, docs/kernels.md's tolerance is 1e-3)."""
    m = model if weights == "float32" else native_model
    ids = tokenizer.encode(english_text)[:40]
    ref, got = _decode(m, ids, ops=True), _decode(m, ids, ops=False)
    assert m.operators.report()["layer.qkv"]["active"] == "native"
    assert _rel(got, ref) < (1e-5 if weights == "float32" else 1e-3)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    target = torch.tensor(ids[1:])[:, None]
    lp_ref, lp = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    change = math.exp(-lp[:-1].gather(1, target).mean() + lp_ref[:-1].gather(1, target).mean()) - 1
    assert abs(change) < 1e-4, f"PPL changed by {change:.5%}"
