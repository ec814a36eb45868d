"""GGUF loading: dequantization of the types gguf can write, the Q/K un-permutation, bad files
(the K-quants and IQ types: tests/test_gguf_fidelity.py)."""

import contextlib
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


def _every_value_type(path: Path) -> None:
    """A GGUF file with a key of each value type, nested arrays and tensors of several types."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ü", "\x00b"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("t.none", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("i32", np.arange(7, dtype=np.int32))
    for qtype in ("Q8_0", "Q4_1"):
        q = gguf.GGMLQuantizationType[qtype]
        blocks = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), q)
        w.add_tensor(qtype.lower(), blocks, raw_shape=blocks.shape, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_reader_equals_gguf_s_on_every_value_and_tensor(tmp_path):
    """engine/gguf_file.py against gguf.GGUFReader (what it replaced for speed): the same
    metadata values and the same tensor views, on a file of every value type and on the tiny
    model files of each weight type."""
    import gguf

    from unikv.engine.gguf_file import read_gguf

    paths = [tmp_path / "types.gguf"]
    _every_value_type(paths[0])
    for qtype in sorted(TOLERANCE):
        paths.append(tmp_path / f"{qtype}.gguf")
        tinygguf.write(paths[-1], qtype)
    for path in paths:
        mine, ref = read_gguf(path), gguf.GGUFReader(path)
        want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
        if "t.nested" in want:  # gguf's contents() flattens an array of arrays (its FIXME)
            want["t.nested"] = [[1, 2], [3]]
        assert mine.fields == want and list(mine.fields) == list(want)
        assert mine.version == ref.fields["GGUF.version"].contents()
        assert len(mine.tensors) == len(ref.tensors)
        for a, b in zip(mine.tensors, ref.tensors, strict=True):
            assert (a.name, a.tensor_type) == (b.name, int(b.tensor_type))
            assert a.shape == tuple(int(s) for s in b.shape)
            assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
            assert np.array_equal(a.data, b.data)
    types = read_gguf(paths[0]).fields
    assert types["t.u64"] == 2**63 + 5
    assert types["t.strs"] == ["a", "", "ü", "\x00b"] and types["t.bool"] is True


def _header(n_tensors: int, n_keys: int, version: int = 3) -> bytes:
    import struct

    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_keys)


def _key(name: str, vtype: int, payload: bytes) -> bytes:
    import struct

    raw = name.encode()
    return struct.pack("<Q", len(raw)) + raw + struct.pack("<I", vtype) + payload


@pytest.mark.parametrize(
    "body, reason",
    [
        (b"GGUF" + b"\x01\x00\x00\x00" + bytes(16), "GGUF version 1"),
        (_header(0, 2**60), "key 0 at byte 24 needs 8 bytes"),
        (_header(0, 1) + (2**62).to_bytes(8, "little"),
         "key 0 at byte 32 needs 4611686018427387904"),
        (_header(0, 1) + _key("a", 9, (8).to_bytes(4, "little") + (2**50).to_bytes(8, "little")),
         "a at byte 49 needs 9007199254740992 bytes"),
        (_header(0, 1) + _key("a", 9, (4).to_bytes(4, "little") + (2**60).to_bytes(8, "little")),
         "a at byte 49 needs"),
        (_header(0, 1) + _key("a", 42, b""), "a: unknown value type 42"),
        (_header(0, 2) + _key("a", 4, bytes(4)) * 2, "key 'a' appears twice"),
        (_header(1, 0) + _key("w", 99, b"")[:-4] + (2**32 - 1).to_bytes(4, "little"),
         "tensor 'w' has 4294967295 dimensions"),
        (_header(1, 0) + _key("w", 1, (64).to_bytes(8, "little") + bytes(12)),
         "tensor 'w' (256 bytes at 64) lies outside the data section of a 57-byte file"),
    ],
    ids=["version", "keys", "string", "array", "array-u32", "type", "twice", "dims", "outside"],
)  # fmt: skip
def test_a_damaged_or_hostile_header_is_refused_with_its_reason(tmp_path, body, reason):
    """Every length and count is checked against the bytes left before it is used: a count of
    2^60 keys or a string of 2^62 bytes is an error naming the place, not an allocation."""
    path = tmp_path / "bad.gguf"
    path.write_bytes(body)
    with pytest.raises(ModelLoadError, match="not a readable GGUF") as err:
        load_gguf(path, progress=False)
    assert reason in str(err.value)


def test_a_header_claiming_more_layers_than_the_file_holds_is_refused(tmp_path):
    """block_count is checked against the tensors before the expected names are listed: one
    flipped byte there once claimed 2,046,820,354 layers, and listing their names took 20 GB
    until the kernel killed the process (found by the property test below)."""
    path = tmp_path / "tiny.gguf"
    tinygguf.write(path, "Q8_0")
    raw = bytearray(path.read_bytes())
    key = b"llama.block_count"
    at = raw.find(key) + len(key) + 4  # the key, its value type (uint32), then the value
    assert int.from_bytes(raw[at : at + 4], "little") == tinygguf.LAYERS
    raw[at : at + 4] = (2**31 - 1).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ModelLoadError, match="2147483647 layers declared, the checkpoint holds"):
        load_gguf(path, progress=False)


def test_any_truncation_or_flipped_byte_loads_or_is_a_model_load_error(tmp_path):
    """A property over the tiny model's bytes: cut anywhere, or with a byte changed anywhere
    in its header, the loader returns or raises ModelLoadError, never anything else."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    good = tmp_path / "good.gguf"
    tinygguf.write(good, "Q8_0")
    raw = good.read_bytes()
    from unikv.engine.gguf_file import read_gguf

    header = raw.find(read_gguf(good).tensors[0].data.tobytes())  # where the data section begins
    assert header > 0
    bad = tmp_path / "bad.gguf"

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(cut=st.integers(0, len(raw)), at=st.integers(0, header - 1), byte=st.integers(0, 255))
    def check(cut, at, byte):
        for body in (raw[:cut], raw[:at] + bytes([byte]) + raw[at + 1 :]):
            bad.write_bytes(body)
            with contextlib.suppress(ModelLoadError):
                load_gguf(bad, progress=False)

    check()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_the_native_formats_decode_bit_for_bit_as_gguf_s_numpy_decoder(qtype):
    """decode_tensor decodes Q8_0 / Q4_0 / Q4_1 with torch (engine/quantized.py), 15x faster than
    gguf.quants: the same float32 bits on random blocks whose fp16 scales take every value
    class (normal, subnormal, negative, zero, the largest)."""
    import gguf

    from unikv.engine.gguf_file import GGUFTensor
    from unikv.engine.gguf_loader import decode_tensor

    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (64, 4 * size), dtype=np.uint8)
    fp16 = np.array([0.01, -0.3, 6e-8, -0.0, 0.0, 65504.0, 1e-5, 2.0], dtype=np.float16)
    for b in range(raw.shape[1] // size):
        for at in (0, 2) if qtype == "Q4_1" else (0,):
            raw[:, b * size + at : b * size + at + 2] = rng.choice(fp16, 64)[:, None].view(np.uint8)
    t = GGUFTensor("blk.0.ffn_up.weight", int(q), (4 * block, 64), raw)
    got = decode_tensor(t, (64, 4 * block), None, Path("x"))  # no Q/K rows: no config read
    want = gguf.quants.dequantize(raw, q).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
