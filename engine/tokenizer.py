"""Tokenizers, with the `tokenizers` library: built from a GGUF file's metadata (`GGUFTokenizer`)
or read from a Hugging Face checkpoint's tokenizer.json (`HFTokenizer`; same interface).

A GGUF vocabulary is built the way Hugging Face `transformers` builds it from the same file, so
both produce identical ids (tests/test_gguf_fidelity.py checks it):
- byte-level BPE (`tokenizer.ggml.model = "gpt2"`), its text split by the regex of its
  pre-tokenizer (`tokenizer.ggml.pre`: GPT-2's, Llama 3's or Qwen2's; `PRE_TOKENIZER_SPLITS`);
  one llama.cpp knows but this table lacks is refused by name. One deliberate difference: for
  Llama 3's type a word that is a token is taken whole, as llama.cpp does (`_LLAMA3_TYPE`);
- SentencePiece BPE (`"llama"`): "▁" for spaces, merges from the file or derived from the token
  scores, unknown characters as `<0xNN>` byte tokens. As in transformers, one "▁" is prepended
  to the text unless it starts with a space, and none after a special token (llama.cpp
  prepends one in both cases, so its ids differ there).
BOS / EOS are added as the file's `add_bos_token` / `add_eos_token` say (llama.cpp's defaults
when it does not). Also here: the chat template (rendered with Jinja2 like
`apply_chat_template`) and incremental detokenization for streaming.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from .config import ModelLoadError
from .gguf_loader import _field

# llama.cpp token types
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


# How a byte-level vocabulary's text is cut into words before BPE, by llama.cpp's pre-tokenizer
# name (`tokenizer.ggml.pre`); llama.cpp's own regexes (llama-vocab.cpp), the ones transformers
# uses for these names. None: GPT-2's regex, built into the ByteLevel pre-tokenizer.
# "default" is what llama.cpp assumes when the key is missing. SmolLM's also splits digits one
# by one, which its merges already do (none joins two digits).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one by one
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt2": None,
    "smollm": None,
    **dict.fromkeys(
        ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# Others (jais, deepseek-llm, chatglm, ...) split differently and are refused by name.
SUPPORTED_PRE = tuple(PRE_TOKENIZER_SPLITS)
# llama.cpp's LLAMA3 type (not dbrx / smaug-bpe, which only share its regex): a word that is a
# token is taken whole, before any merge (as Llama 3's tokenizer.json says: ignore_merges), and
# BOS is added when the file does not say. transformers' GGUF conversion drops both; this
# follows llama.cpp, the runtime these files are made for.
_LLAMA3_TYPE = ("llama-bpe", "llama3", "llama-v3", "falcon3")


def _byte_level(reader, tokens: list[str], pre: str, path: str) -> tuple[Tokenizer, set[str]]:
    """Byte-level BPE and its pre-tokenizer; also the byte alphabet (real tokens are spelled
    in it)."""
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ModelLoadError(
            f"{path}: unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
            f"{', '.join(SUPPORTED_PRE)}. Its text would be split unlike the model's "
            "training, so its answers would be wrong without an error"
        )
    merges: list[str] = _field(reader, "tokenizer.ggml.merges") or []
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet are respelled, as transformers' converter does.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode()): i
        for i, tok in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ")) for m in merges]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_TYPE))
    split = PRE_TOKENIZER_SPLITS[pre]
    if split is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:  # the model's regex, then bytes -> the printable alphabet (no second regex)
        regex = pre_tokenizers.Split(Regex(split), behavior="isolated")
        to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tk.pre_tokenizer = pre_tokenizers.Sequence([regex, to_bytes])
    tk.decoder = decoders.ByteLevel()
    return tk, alphabet


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a token into two
    tokens, ranked by the whole token's score (higher first), then longer left, longer right
    pieces; ties in vocabulary order, then by the pieces' ids. The order transformers'
    `generate_merges` gives, so both tokenizers agree."""
    ids = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, scores, strict=False))
    ranked = []
    for pos, tok in enumerate(score):  # first spelling of each token, later score (as dicts do)
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ids and right in ids:
                ranked.append((-score[tok], -len(left), -len(right), pos, ids[left], ids[right]))
    ranked.sort()
    return [(tokens[li], tokens[ri]) for *_, li, ri in ranked]


def _sentencepiece(reader, tokens: list[str]) -> Tokenizer:
    """SentencePiece BPE (llama.cpp's "llama" vocabulary) as LlamaTokenizer builds it: spaces
    as "▁" (one prepended to a text that does not start with one, unless the file's
    `add_space_prefix` is false), no normalizer, characters outside the vocabulary as their
    UTF-8 bytes (`<0xNN>`)."""
    merges: list[str] | None = _field(reader, "tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(m.split(" ")) for m in merges]
    else:  # the usual case: llama.cpp's converter writes scores, not merges
        scores = _field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        pairs = _merges_from_scores(tokens, scores)
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True))
    prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:  # the prepended space is not part of the text
        steps.append(decoders.Strip(content=" ", left=1))
    tk.decoder = decoders.Sequence(steps)
    return tk


class GGUFTokenizer:
    """Encode/decode text, with the special tokens and chat template a GGUF file declares."""

    def __init__(self, reader, path: str = "<gguf>") -> None:
        kind = _field(reader, "tokenizer.ggml.model")
        tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
        types: list[int] = _field(reader, "tokenizer.ggml.token_type") or []
        alphabet: set[str] | None = None
        # The pre-tokenizer of a byte-level vocabulary; llama.cpp ignores it for SentencePiece.
        pre = _field(reader, "tokenizer.ggml.pre") or "default"
        if kind == "gpt2":
            tk, alphabet = _byte_level(reader, tokens, pre, path)
            special_types = {_CONTROL}
        elif kind == "llama":
            tk = _sentencepiece(reader, tokens)
            # llama.cpp matches <unk> in text too, and transformers adds it as special.
            special_types = {_CONTROL, _UNKNOWN}
        else:
            raise ModelLoadError(
                f"{path}: unsupported tokenizer {kind!r}; supported: "
                "gpt2 (byte-level BPE), llama (SentencePiece BPE)"
            )
        pairs = list(zip(tokens, types, strict=False))
        special = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in pairs
            # A byte-level control token outside the byte alphabet is a llama.cpp mislabel.
            if ty in special_types and (alphabet is None or set(t) <= alphabet)
        ]
        tk.add_special_tokens(special)
        vocab = tk.get_vocab(with_added_tokens=False)
        user = [
            AddedToken(t, normalized=False, special=False)
            for t, ty in pairs
            if ty == _USER_DEFINED and t in vocab
        ]
        if user:
            tk.add_tokens(user)
        self._tk = tk
        self.vocab_size = len(tokens)
        self.special_ids = frozenset(tk.token_to_id(t.content) for t in special)

        def token(key: str) -> tuple[int | None, str | None]:
            idx = _field(reader, f"tokenizer.ggml.{key}")
            return (int(idx), tokens[int(idx)]) if idx is not None else (None, None)

        self.bos_id, self.bos_token = token("bos_token_id")
        self.eos_id, self.eos_token = token("eos_token_id")
        # Without the key llama.cpp adds BOS to a SentencePiece vocabulary (older files lack
        # it; transformers does the same) and to Llama 3's, not to other byte-level ones.
        bos_default = kind == "llama" or (kind == "gpt2" and pre in _LLAMA3_TYPE)
        self.add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", bos_default))
        self.add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
        self.chat_template: str | None = _field(reader, "tokenizer.chat_template")

    def encode(
        self, text: str, add_bos: bool | None = None, add_eos: bool | None = None
    ) -> list[int]:
        """Token ids of `text`, with BOS / EOS where the model file asks for them (None) or
        as `add_bos` / `add_eos` say.

        EOS follows the file's flag for prompts too, as transformers' `tokenizer(text)`,
        llama.cpp's server and vLLM all do: only files made for scoring or embedding set it
        (a chat model's file does not; llama.cpp's CLI refuses to generate from one that
        does), and there the model was trained to see it. A caller that wants the bare text
        passes `add_eos=False`."""
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless asked for."""
        return self._tk.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render messages with the model's chat template, ready for the assistant's answer."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; drop --chat / chat=True")
        # Compiled once per template text (1.6 ms a chat request when compiled each time; a
        # jinja template renders from many threads at once).
        cached = self.__dict__.get("_compiled")
        if cached is None or cached[0] != self.chat_template:
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            cached = self.__dict__["_compiled"] = (
                self.chat_template,
                env.from_string(self.chat_template),
            )
        return cached[1].render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class HFTokenizer(GGUFTokenizer):
    """The tokenizer of a Hugging Face checkpoint directory: tokenizer.json, with BOS/EOS and the
    chat template from tokenizer_config.json. Encoding, decoding and the template are
    `GGUFTokenizer`'s."""

    def __init__(self, path) -> None:  # the GGUF constructor is not called
        import json
        from pathlib import Path

        path = Path(path)
        file = path / "tokenizer.json"
        try:
            tk = Tokenizer.from_file(str(file))
        except Exception as e:  # missing, or not a tokenizers file
            raise ModelLoadError(f"{file}: not a readable tokenizer.json ({e})") from None
        conf_file = path / "tokenizer_config.json"
        conf = json.loads(conf_file.read_text()) if conf_file.is_file() else {}
        self._tk = tk
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        added = tk.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)

        def token(key: str) -> tuple[int | None, str | None]:
            t = conf.get(key)
            t = t.get("content") if isinstance(t, dict) else t
            return (tk.token_to_id(t), t) if t else (None, None)

        self.bos_id, self.bos_token = token("bos_token")
        self.eos_id, self.eos_token = token("eos_token")
        # BOS comes from tokenizer_config's flag, else from tokenizer.json's post-processor.
        default = self.bos_id is not None and tk.encode("", add_special_tokens=True).ids[:1] == [
            self.bos_id
        ]
        self.add_bos = bool(conf.get("add_bos_token", default))
        # EOS likewise: the flag, else whether the post-processor ends a text with it.
        probe = tk.encode("a", add_special_tokens=True).ids
        plain = tk.encode("a", add_special_tokens=False).ids
        default = self.eos_id is not None and len(probe) > len(plain) and probe[-1] == self.eos_id
        self.add_eos = bool(conf.get("add_eos_token", default))
        self.chat_template = conf.get("chat_template")


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, holding back incomplete characters.

    O(1) work per token: `tokenizers`' `DecodeStream` decodes only a short window of the newest
    ids (it re-decodes the ids since the last complete character plus one before them, so a
    decoder that treats the first token specially still joins pieces correctly), never the
    whole output. Special tokens are skipped, as `GGUFTokenizer.decode` skips them by default.
    """

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self._tk = tokenizer._tk
        self._stream = decoders.DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text (may be empty)."""
        self.ids.append(token_id)
        # None: the token ends in the middle of a multi-byte character (or is a skipped special
        # token); its text comes with the token that completes it.
        delta = self._stream.step(self._tk, token_id) or ""
        # A copy of the text (the engine holds a reference), but no decoding: a memcpy of the
        # output so far, negligible beside the model step that produced the token.
        self.text += delta
        return delta
