"""GGUF loading: dequantization of the types gguf can write, the Q/K un-permutation, bad files
(the K-quants and IQ types: tests/test_gguf_fidelity.py)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from unikv.engine.config import ModelLoadError
from unikv.engine.gguf_loader import load_gguf, resolve_model_path

from . import tinygguf

# Worst-case absolute error of each format on weights of scale 0.05 (4-bit: step ~ range / 15).
TOLERANCE = {"F32": 0.0, "F16": 1e-4, "Q8_0": 2e-3, "Q4_0": 3e-2, "Q4_1": 2e-2}


@pytest.mark.parametrize("qtype", sorted(TOLERANCE))
def test_dequantized_weights_match_originals(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype}.gguf"
    original = tinygguf.write(path, qtype)
    cfg, tensors, _ = load_gguf(path, progress=False)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.tie_embeddings
    for name, ref in original.items():
        got = tensors[name].numpy()
        assert got.shape == ref.shape, name
        err = np.abs(got - ref).max()
        assert err <= TOLERANCE[qtype], (name, err)
    # The permutation is undone exactly: with F32 the Q rows come back bit for bit.
    if qtype == "F32":
        assert np.array_equal(
            tensors["blk.0.attn_q.weight"].numpy(), original["blk.0.attn_q.weight"]
        )


def test_bfloat16_model_runs(tmp_path):
    from unikv.engine.model import LlamaModel
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    path = tmp_path / "tiny.gguf"
    tinygguf.write(path, "Q8_0")
    cfg, tensors, _ = load_gguf(path, progress=False)
    m = LlamaModel(cfg, tensors, dtype=torch.bfloat16)
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    logits = m.forward(torch.arange(10), torch.arange(10), kv, StepBatch([0], [10]))
    assert logits.shape == (10, tinygguf.VOCAB) and logits.dtype == torch.bfloat16
    assert torch.isfinite(logits.float()).all()


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    tinygguf.write(path, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gpt2'; supported: llama"):
        load_gguf(path, progress=False)


def test_a_pre_tokenizer_it_cannot_follow_is_refused_by_name(tmp_path):
    """Issue 33: a Llama-3 GGUF (`tokenizer.ggml.pre = "llama-bpe"`) was accepted and its text
    split with GPT-2's rule, wrong without an error. Those it can split (GPT-2's, SmolLM's,
    Llama 3's, Qwen2's: tests/test_gguf_fidelity.py) load; another is refused by name."""
    from unikv.engine.loading import load_tokenizer

    for pre in ("gpt2", "smollm", "llama-bpe", "qwen2"):
        tinygguf.write(tmp_path / f"{pre}.gguf", pre=pre)
        assert load_tokenizer(str(tmp_path / f"{pre}.gguf")).vocab_size == tinygguf.VOCAB
    tinygguf.write(tmp_path / "jais.gguf", pre="jais")
    with pytest.raises(ModelLoadError, match=r"pre-tokenizer 'jais'.*supported: default"):
        load_tokenizer(str(tmp_path / "jais.gguf"))


def test_corrupt_and_truncated_files(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_gguf(junk, progress=False)
    good = tmp_path / "good.gguf"
    tinygguf.write(good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ModelLoadError):
        load_gguf(cut, progress=False)


def test_missing_model_paths():
    with pytest.raises(ModelLoadError, match="model not found"):
        resolve_model_path("/no/such/model.gguf")
    with pytest.raises(ModelLoadError, match="not found"):
        load_gguf(Path("/no/such.gguf"), progress=False)


def test_packaged_model_resolves_without_import():
    path = resolve_model_path("smollm2")
    assert path.suffix == ".gguf" and path.is_file()
