"""GGUF fidelity (issue 33, point 5): tokenizers and tensor types as the file means them.

Small GGUF files written here: a Llama-3-style and a Qwen2-style byte-level BPE vocabulary, a
SentencePiece ("llama") one with scores and byte-fallback tokens; their ids must equal those of
`transformers`' conversion of the same file. Tensors of the types `gguf.quants` decodes but
cannot write (K-quants, IQ4) must load exactly as it decodes them, and run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from unikv.engine.config import ModelLoadError
from unikv.engine.gguf_loader import load_gguf, supported_quant_types
from unikv.engine.loading import load_model, load_tokenizer
from unikv.engine.tokenizer import IncrementalDecoder, _merges_from_scores

from . import tinygguf

CORPUS = [
    "Hello world, 12345 tokens! The year 2024 and 1999, pi is 3.14159 and 1,000,000.",
    "12345 and 123 and (12345) or 45, 12345",
    "I'm sure they'll say it's fine, won't they? We've seen what you'd do. I'M LOUD.",
    "The quick brown fox jumps over the lazy dog.\n\nAnother line\r\nand tabs\tbetween\twords",
    "def f(x):\n    return x ** 2  # square\n        nested    spaces   here",
    "naïve café déjà vu, 東京 and 日本語, emoji 🚀🔥 and Ελληνικά",
] * 4

TEXTS = [
    "12345",
    "pi 3.14159, 1,000,000 and 2024",
    "I'm sure they'll say it's fine; I'M LOUD, WE'VE SEEN",
    "line\n\nbreak\r\n x\n",
    "multiple   spaces  and\ttabs\t\t",
    "naïve 東京",
    "emoji 🚀🔥!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2",
]


def trained(pre_tokenizer, size: int, corpus: list[str], alphabet=()) -> tuple[list, list]:
    """(tokens in id order, merges "a b") of a BPE vocabulary trained on `corpus`."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=size, initial_alphabet=list(alphabet), show_progress=False
    )
    tk.train_from_iterator(corpus, trainer)
    model = json.loads(tk.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return sorted(model["vocab"], key=model["vocab"].get), merges


def byte_level_vocab(pre: str, **flags) -> tinygguf.Vocab:
    """A byte-level BPE vocabulary (tokens spelled in GPT-2's byte alphabet, as llama.cpp
    stores them) with two control tokens and a user-defined one. Its merges were learned on
    GPT-2's split, so they join whole numbers: only the right pre-tokenizer cuts them right."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokens, merges = trained(byte_level, 700, CORPUS, pre_tokenizers.ByteLevel.alphabet())
    n = len(tokens)
    return tinygguf.Vocab(
        tokens=[*tokens, "<|begin_of_text|>", "<|end_of_text|>", "<think>"],
        types=[1] * n + [3, 3, 4],
        merges=merges,
        pre=pre,
        bos=n,
        eos=n + 1,
        **flags,
    )


def sentencepiece_vocab(with_merges: bool = False, **flags) -> tinygguf.Vocab:
    """A SentencePiece BPE vocabulary as llama.cpp writes Llama 2's: <unk>, <s>, </s>, the 256
    byte tokens, then the pieces ("▁" for a space) with their scores (higher merges first); no
    merges unless asked. Trained on ASCII text plus "naïve": other characters fall back to
    their bytes."""
    ascii_corpus = [c.encode("ascii", "ignore").decode() + " naïve" for c in CORPUS]
    pieces, merges = trained(pre_tokenizers.Metaspace(), 500, ascii_corpus)
    head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    return tinygguf.Vocab(
        model="llama",
        tokens=head + pieces,
        types=[2, 3, 3] + [6] * 256 + [1] * len(pieces),
        merges=merges if with_merges else None,
        scores=[0.0] * len(head) + [-float(i) for i in range(len(pieces))],
        bos=1,
        eos=2,
        unk=0,
        **flags,
    )


def write_vocab(tmp_path, name: str, vocab: tinygguf.Vocab):
    """(unikv's tokenizer, transformers' conversion) of a tiny model file with `vocab`."""
    transformers = pytest.importorskip("transformers")
    tinygguf.write(tmp_path / name, vocab=vocab)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=name)
    return load_tokenizer(str(tmp_path / name)), hf


@pytest.fixture(scope="module")
def byte_level_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bpe")
    return {
        pre: write_vocab(tmp, f"{pre}.gguf", byte_level_vocab(pre, add_bos=pre == "llama-bpe"))
        for pre in ("llama-bpe", "qwen2", "gpt2")
    }


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_byte_level_ids_match_transformers(byte_level_files, pre):
    ours, hf = byte_level_files[pre]
    for text in [*TEXTS, "<think>x</think> <|end_of_text|>"]:
        assert ours.encode(text) == hf(text).input_ids, text
        plain = ours.encode(text, add_bos=False)
        assert ours.decode(plain, skip_special=False) == text
        assert ours.decode(plain) == hf.decode(plain, skip_special_tokens=True)
    assert (ours.encode("x")[0] == ours.bos_id) == (pre == "llama-bpe")


def test_the_pre_tokenizer_decides_the_split(byte_level_files):
    """The same vocabulary cuts "12345" three ways: GPT-2 keeps the number whole, Llama 3 in
    threes, Qwen2 digit by digit (so the ids above test the regex, not just the merges)."""
    pieces = {
        pre: [tk.decode([i]) for i in tk.encode("12345", add_bos=False)]
        for pre, (tk, _) in byte_level_files.items()
    }
    assert pieces == {
        "gpt2": ["12345"],
        "llama-bpe": ["123", "45"],
        "qwen2": ["1", "2", "3", "4", "5"],
    }


def test_llama3_takes_whole_word_tokens_like_llama_cpp(tmp_path):
    """llama.cpp's Llama 3 type takes a word that is a token whole before any merge (Llama 3's
    tokenizer.json: ignore_merges); transformers' GGUF conversion does not (it gives ab, c).
    GPT-2's type merges as usual. Without add_bos_token llama.cpp adds BOS for Llama 3 only."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    ids = {}
    for pre in ("llama-bpe", "gpt2"):
        vocab = tinygguf.Vocab(tokens=[*alphabet, "ab", "abc"], merges=["a b"], pre=pre)
        tinygguf.write(tmp_path / f"{pre}.gguf", vocab=vocab)
        tk = load_tokenizer(str(tmp_path / f"{pre}.gguf"))
        ids[pre] = [tk.decode([i]) for i in tk.encode("abc", add_bos=False)]
        assert tk.add_bos == (pre == "llama-bpe") and not tk.add_eos
    assert ids == {"llama-bpe": ["abc"], "gpt2": ["ab", "c"]}


@pytest.mark.parametrize("with_merges", [False, True], ids=["scores", "merges"])
def test_sentencepiece_ids_match_transformers(tmp_path, with_merges):
    ours, hf = write_vocab(tmp_path, "spm.gguf", sentencepiece_vocab(with_merges))
    assert ours.add_bos and not ours.add_eos  # no key: BOS, as llama.cpp and transformers do
    for text in [*TEXTS, "  leading spaces", "<s>x</s> <unk>"]:
        ids = ours.encode(text)
        assert ids == hf(text).input_ids, text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
    for text in TEXTS:  # Metaspace keeps every space but a leading one
        assert ours.decode(ours.encode(text)) == text
    # Characters outside the vocabulary come as their UTF-8 bytes, streamed whole.
    assert [ours.decode([i]) for i in ours.encode("東", add_bos=False)][0] != "東"
    dec = IncrementalDecoder(ours)
    assert "".join(dec.push(i) for i in ours.encode("naïve 東京 🚀")) == "naïve 東京 🚀"


def test_sentencepiece_without_space_prefix(tmp_path):
    """`add_space_prefix = false` (llama.cpp honours it; transformers ignores it): no "▁" is
    prepended, and decoding strips none."""
    tinygguf.write(tmp_path / "np.gguf", vocab=sentencepiece_vocab(add_space_prefix=False))
    tk = load_tokenizer(str(tmp_path / "np.gguf"))
    assert [tk._tk.id_to_token(i) for i in tk.encode("the", add_bos=False)][0][0] != "▁"
    for text in [*TEXTS, "  leading spaces"]:
        assert tk.decode(tk.encode(text)) == text


def test_merges_from_scores_are_transformers_merges():
    """The derived merges in transformers' order, ties (equal scores) included."""
    base = pytest.importorskip("transformers.tokenization_utils_base")
    v = sentencepiece_vocab()
    ids = {t: i for i, t in enumerate(v.tokens)}
    for scores in (v.scores, [0.0] * len(v.tokens)):
        ref = base.generate_merges(ids, dict(zip(v.tokens, scores, strict=True)))
        assert _merges_from_scores(v.tokens, scores) == ref


@pytest.mark.parametrize(
    ("vocab", "bos", "eos"),
    [
        (lambda: sentencepiece_vocab(add_bos=False), False, False),
        (lambda: sentencepiece_vocab(add_eos=True), True, True),
        (lambda: byte_level_vocab("qwen2", add_bos=True, add_eos=True), True, True),
        (lambda: byte_level_vocab("qwen2"), False, False),
    ],
    ids=["spm-no-bos", "spm-eos", "bpe-both", "bpe-default"],
)
def test_add_bos_and_eos_flags(tmp_path, vocab, bos, eos):
    ours, hf = write_vocab(tmp_path, "flags.gguf", vocab())
    assert (ours.add_bos, ours.add_eos) == (bos, eos)
    ids = ours.encode("Hello world")
    assert ids == hf("Hello world").input_ids
    assert (ids[0] == ours.bos_id, ids[-1] == ours.eos_id) == (bos, eos)
    assert ours.encode("Hello world", add_bos=False, add_eos=False) == ids[bos : len(ids) - eos]


def test_unknown_pre_tokenizer_and_model_are_refused_by_name(tmp_path):
    tinygguf.write(tmp_path / "jais.gguf", pre="jais")
    with pytest.raises(ModelLoadError, match=r"'jais'.*supported: .*llama-bpe.*qwen2"):
        load_tokenizer(str(tmp_path / "jais.gguf"))
    tinygguf.write(tmp_path / "bert.gguf", vocab=tinygguf.Vocab(model="bert"))
    with pytest.raises(ModelLoadError, match=r"tokenizer 'bert'; supported: gpt2 .*llama"):
        load_tokenizer(str(tmp_path / "bert.gguf"))


def test_supported_types_are_what_gguf_decodes():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    types = supported_quant_types()
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"} <= set(types)
    for name in types:  # each decodes a block of zeros to a block of zeros
        q = GGMLQuantizationType[name]
        block, size = GGML_QUANT_SIZES[q]
        assert not quants.dequantize(np.zeros((2, size), np.uint8), q).any()
    assert "I8" not in types


def test_an_undecodable_type_is_refused_by_name(tmp_path):
    path = tmp_path / "i8.gguf"
    tinygguf.write(path, extra={"extra.weight": np.ones((4, 32), np.int8)})
    with pytest.raises(ModelLoadError, match=r"extra.weight has type I8; supported: F32.*Q4_K"):
        load_gguf(path, progress=False)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL"])
def test_k_and_iq_tensors_load_exactly_as_gguf_decodes_them(tmp_path, qtype):
    path = tmp_path / f"{qtype}.gguf"
    # `write` returns the exact decoding of its synthetic blocks (Q/K rows un-permuted).
    expected = tinygguf.write(path, qtype, hidden=tinygguf.SUPER_HIDDEN, ffn=tinygguf.SUPER_FFN)
    _, tensors, _ = load_gguf(path, progress=False)
    for name, ref in expected.items():
        assert np.array_equal(tensors[name].numpy(), ref), name
    assert tensors.dequantized == []  # asked for float32: nothing to report
    _, native, _ = load_gguf(path, progress=False, weights="native")
    if qtype in ("Q4_K", "Q6_K"):  # kept packed: gemv.c reads their super-blocks
        from unikv.engine.quantized import QuantizedTensor, dequantize

        assert native.dequantized == []
        packed = [n for n in expected if isinstance(native[n], QuantizedTensor)]
        assert packed and all(native[n].qtype == qtype for n in packed)
        for n in expected:
            got = native[n]
            dense = dequantize(got) if n in packed else got
            assert torch.equal(dense, tensors[n]), n
        return
    assert native.dequantized == [qtype]
    assert all(torch.equal(native[n], tensors[n]) for n in expected)


def test_a_k_quant_without_a_kernel_runs_dequantized_and_the_report_says_so(tmp_path):
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    path = tmp_path / "q5k.gguf"
    tinygguf.write(path, "Q5_K", hidden=tinygguf.SUPER_HIDDEN, ffn=tinygguf.SUPER_FFN)
    logits = {}
    for weights in ("native", "float32"):
        model, _ = load_model(str(path), progress=False, weights=weights)
        cfg = model.cfg
        kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        logits[weights] = model.forward(torch.arange(8), torch.arange(8), kv, StepBatch([0], [8]))
        report = model.memory_report()
        assert report.dequantized == (("Q5_K",) if weights == "native" else ())
    assert logits["native"].shape == (8, tinygguf.VOCAB)
    assert torch.isfinite(logits["native"]).all()
    assert torch.equal(logits["native"], logits["float32"])


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_a_k_quant_model_runs_on_its_super_blocks(tmp_path, qtype):
    """Q4_K and Q6_K weights stay packed (the file's bytes, named in the memory report) and
    multiply by gemv.c's K-quant kernel with int8 activations (gemv_ki8), in prefill and decode
    (through the layer calls): the logits equal the float32 model's within the int8
    activations' error (two digits: 1e-5 to 1e-4 of a matmul, less on the logits)."""
    from unikv.kernels import gemv
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    if gemv.unavailable() is not None:
        pytest.skip(gemv.unavailable())
    path = tmp_path / f"{qtype}.gguf"
    tinygguf.write(path, qtype, hidden=tinygguf.SUPER_HIDDEN, ffn=tinygguf.SUPER_FFN)
    logits = {}
    for weights in ("native", "float32"):
        model, _ = load_model(str(path), progress=False, weights=weights)
        cfg = model.cfg
        kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        out = [model.forward(torch.arange(8), torch.arange(8), kv, StepBatch([0], [8]))]
        for i in range(8, 11):  # decode: one row per step
            out.append(model.forward(torch.tensor([i]), torch.tensor([i]), kv, StepBatch([0], [1])))
        logits[weights] = torch.cat(out)
        if weights == "native":
            report = model.memory_report()
            assert qtype in report.weights and report.dequantized == ()
            kernels = model.operators.report()
            assert kernels[f"matmul.{qtype.lower()}"]["active"] == "gemv_i8"
            assert kernels["layer.qkv"]["active"] == "native"
    err = ((logits["native"] - logits["float32"]).norm() / logits["float32"].norm()).item()
    assert err < 1e-4, err


def test_the_run_report_names_the_types_dequantized_at_load():
    from unikv.cli.main import _memory_lines
    from unikv.engine.report import MemoryReport, ModelReport
    from unikv.kvstrategies.kv import KVReport

    mem = MemoryReport(KVReport("full", 0, 0), ModelReport(dequantized=("Q5_K", "Q6_K")))
    assert "[dequantized at load (no native kernel): Q5_K, Q6_K]" in _memory_lines(mem)
    assert "dequantized" not in _memory_lines(MemoryReport(KVReport("full", 0, 0)))
