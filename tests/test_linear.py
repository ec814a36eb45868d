"""Quantized weights run natively: the torch block decoder against gguf's, the int4 mapping of
each format, and the packaged model (Q4_1 layers, a Q8_0 head) against its dequantized twin:
logits of a short prompt and the PPL of a self-made text (within 0.1%)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from unikv.engine.linear import BLOCK_FORMATS
from unikv.engine.quantized import FORMATS, QuantizedTensor, dequantize, int4_groups


def _quantized(fmt: str, rows: int = 48, cols: int = 96):
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    raw = quants.quantize(w, GGMLQuantizationType[fmt])
    want = quants.dequantize(raw, GGMLQuantizationType[fmt])
    return QuantizedTensor(fmt, torch.from_numpy(raw.copy()).view(rows, -1, FORMATS[fmt])), want


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_decoder_matches_gguf_and_int4_form_is_exact(fmt):
    q, want = _quantized(fmt)
    assert torch.equal(dequantize(q), torch.from_numpy(want))
    c, s, z = int4_groups(q)  # w = (code - 8) * scale + zero, planes summed for Q8_0
    w = (c.float() - 8) * s.repeat_interleave(32, 1) + z.repeat_interleave(32, 1)
    assert torch.equal(w.view(q.shape[0], -1, q.shape[1]).sum(1), dequantize(q))


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="no packed form for Q5_K"):
        QuantizedTensor("Q5_K", torch.zeros(1, 1, 34, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"Q8_0 blocks must be uint8 \[rows, blocks, 34\]"):
        QuantizedTensor("Q8_0", torch.zeros(1, 1, 18, dtype=torch.uint8))


def test_unknown_weights_value():
    from unikv.engine.loading import load_model

    with pytest.raises(ValueError, match="choose one of: native, float32, bfloat16"):
        load_model("smollm2", weights="int3")


def test_cli_rejects_unknown_weights(capsys):
    from unikv.cli.main import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["run", "--prompt", "x", "--weights", "int3"])
    assert e.value.code == 2 and "native" in capsys.readouterr().err


def test_serving_entries_default_to_native_weights():
    """`run`, `generate`-like commands, `eval` and `serve` (and each replica, and the async
    API) keep a GGUF's weights packed unless told otherwise; the low-level loader's default
    stays the float32 reference that benchmarks and tuning measure against."""
    import inspect

    from unikv.cli.main import build_parser
    from unikv.engine.engine import Engine
    from unikv.engine.loading import load_model
    from unikv.serving.replicas import ReplicaSpec

    parser = build_parser()
    assert parser.parse_args(["serve"]).weights == "native"
    assert parser.parse_args(["run", "--prompt", "x"]).weights == "native"
    assert parser.parse_args(["eval", "ppl", "--text", "t"]).weights == "native"
    assert parser.parse_args(["run", "--prompt", "x", "--weights", "float32"]).weights == "float32"
    assert inspect.signature(Engine.create).parameters["weights"].default == "native"
    assert inspect.signature(load_model).parameters["weights"].default == "float32"
    assert ReplicaSpec().weights == "native"
    with pytest.raises(ValueError, match="choose one of"):
        ReplicaSpec(weights="int3")


# ---- the packaged model, native against dequantized --------------------------------------


@pytest.fixture(scope="module")
def native(model_path):
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.model import LlamaModel

    cfg, tensors, _ = load_gguf(model_path, progress=False, weights="native")
    return LlamaModel(cfg, tensors)


def test_the_native_weights_benchmark_names_the_kernels_of_each_type(native):
    """benchmarks/native_weights.py's header line: each packed GGUF type with the kernel that
    runs it (it once read the typed report as a dict, and broke unnoticed)."""
    from benchmarks.native_weights import kernels_used
    from unikv.kernels import gemv

    how = kernels_used(native)
    assert set(how) == {"Q8_0", "Q4_1"}  # the packaged file: Q4_1 layers, a Q8_0 head
    if gemv.unavailable() is None:
        assert all("gemv" in v for v in how.values()), how
        # the report says where the rows are held interleaved (gemv.c's ROWS16)
        for fmt, kernels in how.items():
            assert ("rows interleaved by 16" in kernels) == gemv.can_interleave(fmt, 16), how


def _logits(m, ids):
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    c = m.cfg
    kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim, m.dtype)
    return m.forward(torch.tensor(ids), torch.arange(len(ids)), kv, StepBatch([0], [len(ids)]))


@pytest.mark.slow
def test_native_model_keeps_weights_packed(native):
    fmts = native.memory_report().weights
    assert set(fmts) == {"Q4_1", "Q8_0"}  # every layer packed, the tied head Q8_0
    from unikv.kernels import gemv

    report = native.operators.report()
    # the C decode kernel, where built: int8 activations where the CPU has VNNI
    first = None if gemv.unavailable() else "gemv" if gemv.i8_unavailable() else "gemv_i8"
    assert report["matmul.q4_1"]["active"] == (first or "int4")
    assert report["matmul.q8_0"]["active"] == (first or "int4x2")


@pytest.mark.slow
def test_native_logits_and_ppl_within_tolerance(native, model, tokenizer, english_text):
    """Tolerance (docs/kernels.md): mean KL < 0.005 nats and top-1 agreement >= 0.9 on every
    position of the text, PPL within 0.1% of the dequantized float32 model."""
    ids = tokenizer.encode(english_text)[:256]
    ref, got = _logits(model, ids), _logits(native, ids)
    lp_ref, lp = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    target = torch.tensor(ids[1:])[:, None]
    nll_ref = -lp_ref[:-1].gather(1, target).mean().item()
    nll = -lp[:-1].gather(1, target).mean().item()
    change = math.exp(nll - nll_ref) - 1
    assert kl < 0.005 and top1 >= 0.9, (kl, top1)
    assert abs(change) < 0.001, f"PPL changed by {change:.4%}"


def _decode_logits(m, ids):
    """Logits of feeding `ids` one token per step (decode: every matmul gets one row)."""
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    c = m.cfg
    kv = ContiguousKVCache(c.num_layers, c.num_kv_heads, c.head_dim, m.dtype)
    return torch.cat([m.forward(torch.tensor([t]), torch.tensor([i]), kv, StepBatch([0], [1]))
                      for i, t in enumerate(ids)])  # fmt: skip


def _native_untimed(model_path, monkeypatch, i8: bool):
    """The packaged model with native weights, its breakers never timing (a busy machine must
    not switch it off the kernel under test); without the int8 kernel unless `i8`."""
    from unikv.engine.gguf_loader import load_gguf
    from unikv.engine.model import LlamaModel
    from unikv.kernels import gemv, operators

    reason = gemv.i8_unavailable() if i8 else gemv.unavailable()
    if reason is not None:
        pytest.skip(reason)
    untimed = operators.BreakerSettings(every=10**9)
    monkeypatch.setattr(operators, "BreakerSettings", lambda: untimed)
    if not i8:
        monkeypatch.setattr(gemv, "i8_unavailable", lambda: "switched off by this test")
    cfg, tensors, _ = load_gguf(model_path, progress=False, weights="native")
    return LlamaModel(cfg, tensors)


@pytest.mark.slow
def test_native_decode_matches_the_dequantized_model(
    model_path, model, tokenizer, english_text, monkeypatch
):
    """At decode the float-activation kernel (unikv/kernels/gemv.c's gemv_q) multiplies the packed
    blocks with float32 activations: the logits equal the dequantized model's up to float32
    summation order (far inside the bf16 kernels' tolerance above)."""
    native = _native_untimed(model_path, monkeypatch, i8=False)
    ids = tokenizer.encode(english_text)[:24]
    ref, got = _decode_logits(model, ids), _decode_logits(native, ids)
    report = native.operators.report()["matmul.q4_1"]
    assert report["active"] == "gemv" and report["fallbacks"] == 0, report
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 1e-4, f"native decode logits differ from the dequantized model's by {err:.2e}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_native_int8_decode_matches_the_dequantized_model(
    model_path, model, tokenizer, english_text, monkeypatch
):
    """The int8-activation kernel (gemv_i8) rounds every matmul's input per block to two int8
    codes (about 16 bits; one code, as llama.cpp does, moved the decode PPL of the GPL texts by
    2.5%: gemv.c): measured 1e-4 to 2e-4 on the logits after 30 layers, the same greedy
    tokens, PPL within 0.01% on 256 tokens of every development text."""
    native = _native_untimed(model_path, monkeypatch, i8=True)
    ids = tokenizer.encode(english_text)[:48]
    ref, got = _decode_logits(model, ids), _decode_logits(native, ids)
    report = native.operators.report()
    assert report["matmul.q4_1"]["active"] == "gemv_i8", report
    assert report["matmul.q8_0"]["active"] == "gemv_i8", report
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"int8 decode logits differ from the dequantized model's by {err:.2e}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    lp_ref, lp = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    target = torch.tensor(ids[1:])[:, None]
    change = math.exp(-lp[:-1].gather(1, target).mean() + lp_ref[:-1].gather(1, target).mean()) - 1
    assert abs(change) < 0.001, f"PPL changed by {change:.4%}"


def test_no_rows_decode_no_weight():
    """A step with no logits to give (a prompt chunk that more of the prompt follows) asks the
    head for 0 rows: the answer is [0, out] without calling the format's kernel (whose
    fallback for 0 rows decoded the whole head, ~110 MB for SmolLM2's, every such chunk)."""
    from unikv.engine import linear

    from .test_operators import _packed

    calls = []

    def kernel(x, w):
        calls.append(x.shape[0])
        return x @ w.to_dense().t()

    lin = linear.Linear(linear.PackedWeight(_packed("Q8_0"), torch.float32), kernel, "Q8_0")
    out = lin(torch.empty(0, 128))
    assert out.shape == (0, 64) and out.dtype == torch.float32 and calls == []
    assert lin(torch.ones(1, 128)).shape == (1, 64) and calls == [1]


def test_the_weights_report_is_kept_until_a_kernel_builds_a_form():
    """The engine asks for the memory report every few steps: the weights' part is counted once
    and kept, and counted again when a kernel prepares another form of a packed weight (its
    bytes are part of the report)."""
    from unikv.engine import linear
    from unikv.engine.model import weight_formats

    from .test_operators import _tiny_llama

    m = _tiny_llama("Q8_0")
    first = weight_formats(m)
    assert weight_formats(m) is first  # kept
    w = next(x.weight for x in m.layers[0] if isinstance(getattr(x, "weight", None),
                                                         linear.PackedWeight))  # fmt: skip
    before = w.nbytes
    w.form("test-extra", lambda q: (torch.zeros(1000, dtype=torch.uint8),))
    # (an interleaved weight also gets its GGUF blocks back: the form is built from them)
    grew = w.nbytes - before
    assert grew == 1000 + (w.q.nbytes if w.rows16 is not None else 0)
    again = weight_formats(m)
    assert again is not first and again["Q8_0"].bytes == first["Q8_0"].bytes + grew


def test_a_step_reads_every_weight_but_an_untied_embedding_table():
    """step_weight_bytes (what benchmarks/decode_profile.py divides by the step's time) counts
    the layers and the output layer; an untied embedding table, of which a step reads one row
    a token, is in the memory report but not in the step's bytes."""
    from unikv.engine.model import step_weight_bytes, weight_formats

    from .test_operators import _tiny_llama

    tied = _tiny_llama("Q8_0")
    total = sum(w.bytes for w in weight_formats(tied).values())
    assert step_weight_bytes(tied) == total
    untied = _tiny_llama("Q8_0", tied=False)  # its output layer the same size as the table
    embed = untied.embed.weight.weight
    report = sum(w.bytes for w in weight_formats(untied).values())
    assert untied.embed is not untied.lm_head
    assert step_weight_bytes(untied) == report - embed.numel() * embed.element_size() == total
