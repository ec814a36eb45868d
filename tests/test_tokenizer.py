"""The GGUF tokenizer must tokenize exactly like transformers does for the same file."""

import copy

import pytest

from unikv.engine.tokenizer import IncrementalDecoder

TEXTS = [
    "Hello world, 12345 tokens!\n\n  x",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n\tTabs\tand  double  spaces",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🚀🔥, Ελληνικά",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Numbers 3.14159, 1,000,000 and dates 2026-11-30; URLs https://example.org/a?b=c",
    "   leading spaces and trailing   ",
    "I'm sure they'll say it's fine, won't they? We've seen what you'd do.",
]


@pytest.mark.parametrize("text", TEXTS)
def test_matches_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer(text, add_special_tokens=True).input_ids


def test_generated_prose_matches(tokenizer, hf_tokenizer, english_text):
    assert tokenizer.encode(english_text) == hf_tokenizer(english_text).input_ids


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text), skip_special=False) == text


def test_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>"
    ids = tokenizer.encode("<|im_start|>")
    assert ids == [tokenizer.bos_id]
    assert tokenizer.decode(ids) == ""  # special tokens are dropped by default


def test_chat_template_matches_transformers(tokenizer, hf_tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ours = tokenizer.apply_chat_template(messages)
    ref = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == ref
    assert ours.endswith("<|im_start|>assistant\n")


def test_chat_template_is_compiled_once_and_follows_its_text(tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    first = tokenizer.apply_chat_template(messages)
    compiled = tokenizer.__dict__["_compiled"][1]
    assert tokenizer.apply_chat_template(messages) == first
    assert tokenizer.__dict__["_compiled"][1] is compiled  # rendered, not compiled again
    other = copy.copy(tokenizer)  # (the fixture is shared: its template stays)
    other.chat_template = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    assert other.apply_chat_template(messages) == "[What is 2+2?]"
    assert tokenizer.apply_chat_template(messages) == first


def test_incremental_decoder_holds_back_split_characters(tokenizer):
    text = "naïve 日本語 🚀 done"
    ids = tokenizer.encode(text)
    dec = IncrementalDecoder(tokenizer)
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def _long_output(tokenizer, n: int = 4000) -> list[int]:
    """Thousands of token ids: prose with multi-byte characters, with special tokens between."""
    from tests.conftest import make_english

    unicode = "naïve café 日本語のテキスト 🚀🔥 Ελληνικά"
    parts = [make_english(40, seed=3), unicode, "tabs\t\tand  gaps"]
    chunk = tokenizer.encode("\n".join(parts))
    ids: list[int] = []
    specials = sorted(tokenizer.special_ids)
    while len(ids) < n:
        ids += chunk + [specials[len(ids) % len(specials)]]
    return ids[:n]


def _streamed(tokenizer, ids: list[int]) -> str:
    dec = IncrementalDecoder(tokenizer)
    pieces = [dec.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == dec.text
    return dec.text


def test_long_streams_equal_one_shot_decode(tokenizer):
    ids = _long_output(tokenizer)
    assert len(ids) == 4000
    assert _streamed(tokenizer, ids) == tokenizer.decode(ids)
    # Cut the stream inside a multi-byte character: the held-back bytes never come out alone.
    emoji = tokenizer.encode("🚀")
    assert len(emoji) > 1
    assert _streamed(tokenizer, ids + emoji[:1]) == tokenizer.decode(ids)
    assert _streamed(tokenizer, ids + emoji) == tokenizer.decode(ids) + "🚀"


def test_hf_tokenizer_streams_equal_one_shot_decode(tokenizer, tmp_path):
    from unikv.engine.tokenizer import HFTokenizer

    tokenizer._tk.save(str(tmp_path / "tokenizer.json"))  # the same vocabulary as tokenizer.json
    hf = HFTokenizer(tmp_path)
    ids = _long_output(tokenizer, 3000)
    assert _streamed(hf, ids) == hf.decode(ids) == tokenizer.decode(ids)


def test_streaming_never_decodes_the_whole_output(tokenizer, monkeypatch):
    """O(1) per token: pushing never calls the whole-sequence decode."""

    def whole(*args, **kwargs):
        raise AssertionError("push decoded the whole output")

    dec = IncrementalDecoder(tokenizer)
    monkeypatch.setattr(tokenizer, "decode", whole)
    monkeypatch.setattr(tokenizer._tk, "decode", whole, raising=False)
    for i in tokenizer._tk.encode("streamed ünïcode 🚀", add_special_tokens=False).ids:
        dec.push(i)
    assert dec.text == "streamed ünïcode 🚀"
