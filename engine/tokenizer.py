"""Tokenizers, with the `tokenizers` library: built from a GGUF file's metadata (`GGUFTokenizer`)
or read from a Hugging Face checkpoint's tokenizer.json (`HFTokenizer`; same interface).

Byte-level BPE (`tokenizer.ggml.model = "gpt2"`) is built the way Hugging Face `transformers` builds
it from the same file, so both produce identical ids. Also here: the chat template (rendered with
Jinja2 like `apply_chat_template`) and incremental detokenization for streaming.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from .config import ModelLoadError
from .gguf_loader import _field

_CONTROL = 3  # llama.cpp token type CONTROL (special tokens such as <|im_start|>)
_USER_DEFINED = 4


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


# The pre-tokenizers (llama.cpp's `tokenizer.ggml.pre`) whose splitting this tokenizer does:
# GPT-2's regex over byte-level BPE ("default" is what llama.cpp assumes when the key is missing).
# SmolLM's also splits digits one by one, which its merges already do (none joins two digits).
# Others (llama-bpe, qwen2, ...) split differently and are refused by name.
SUPPORTED_PRE = ("default", "gpt2", "smollm")


class GGUFTokenizer:
    """Encode/decode text, with the special tokens and chat template a GGUF file declares."""

    def __init__(self, reader, path: str = "<gguf>") -> None:
        kind = _field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"{path}: unsupported tokenizer {kind!r}; supported: gpt2 (BPE)")
        pre = _field(reader, "tokenizer.ggml.pre") or "default"
        if pre not in SUPPORTED_PRE:
            raise ModelLoadError(
                f"{path}: unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
                f"{', '.join(SUPPORTED_PRE)}. Its text would be split unlike the model's "
                "training, so its answers would be wrong without an error"
            )
        tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
        merges: list[str] = _field(reader, "tokenizer.ggml.merges") or []
        types: list[int] = _field(reader, "tokenizer.ggml.token_type") or []
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # Tokens outside the byte alphabet are respelled, as transformers' converter does.
        vocab = {
            tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode()): i
            for i, tok in enumerate(tokens)
        }
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges])
        tk = Tokenizer(bpe)
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.decoder = decoders.ByteLevel()
        special = [
            AddedToken(t, normalized=False, special=True)
            for t, ty in zip(tokens, types, strict=False)
            if ty == _CONTROL and set(t) <= alphabet
        ]
        tk.add_special_tokens(special)
        user = [
            AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types, strict=False)
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
        self.add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
        self.chat_template: str | None = _field(reader, "tokenizer.chat_template")

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; BOS is prepended when the model file asks for it."""
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Text of `ids`; special tokens are dropped unless asked for."""
        return self._tk.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render messages with the model's chat template, ready for the assistant's answer."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; drop --chat / chat=True")
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        template = env.from_string(self.chat_template)
        return template.render(
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
