"""The OpenAI wire format `unikv serve` speaks: request and response models, and errors.

Requests follow OpenAI's `/v1/completions` and `/v1/chat/completions` (with `n`, `logprobs`,
`top_logprobs`, `echo`); the extra sampling fields `top_k`, `ignore_eos`, `priority`, `min_p`,
`repetition_penalty`, `min_tokens` and `stop_token_ids` are vLLM's extensions, documented as such.
A field OpenAI defines that this server cannot honour (`tools`, `logit_bias`, penalties, ...) is
accepted at its "off" value (`tools: []`, `tool_choice: "none"`, `response_format: {"type":
"text"}`) and is a 400 naming the field otherwise, never silently ignored. A field nobody here
knows (`store`, `metadata`, a framework's own) is accepted, logged and named in the response's
`x-unikv-ignored-fields` header, as vLLM does; `--strict` refuses it instead. Every error is
OpenAI's error object.

What does not live here: serving requests (`serving.app`), the engine's sampling rules
(`engine.sampling.SamplingParams`, which every request is turned into).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from unikv.engine.sampling import (
    MAX_LOGPROBS,
    MAX_SEED,
    PRIORITY_RANGE,
    SamplingParams,
    TokenLogprob,
)

MAX_N = 16  # choices one request may ask for

# Fields OpenAI defines that this server does not implement, with the values that mean "off"
# (what SDKs and frameworks send when the feature is unused): a request may send only those.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "logit_bias": ({},),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "response_format": ({"type": "text"},),
    "parallel_tool_calls": (True, False),  # meaningless without tools
}


class APIError(Exception):
    """An error to send as OpenAI's error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        """`{"error": {"message", "type", "param", "code"}}`."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Lenient(BaseModel):
    """Unknown fields are kept in `model_extra` (listed by `unknown_fields`), not refused."""

    model_config = ConfigDict(extra="allow")
    # The unknown fields, once the server has looked (`serving.app`); never from the body.
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @property
    def ignored(self) -> list[str]:
        return self._ignored

    def unknown_fields(self, prefix: str = "") -> list[str]:
        """Dotted names of the fields this server does not know, nested models included."""
        out = [f"{prefix}{k}" for k in self.model_extra or {}]
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, _Lenient):
                    where = f"{name}[{i}]" if isinstance(value, list) else name
                    out += item.unknown_fields(f"{prefix}{where}.")
        return out


class StreamOptions(_Lenient):
    """`stream_options`: `include_usage` (and `continuous_usage_stats`, vLLM's, ignored)."""

    include_usage: bool = False


class _Sampling(_Lenient):
    """The fields completions and chat share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int = Field(default=0, ge=-1, description="vLLM extension: -1 or 0 disables it")
    ignore_eos: bool = Field(default=False, description="vLLM extension")
    priority: int = Field(
        default=0, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1],
        description="vLLM extension: lower runs first",
    )  # fmt: skip
    n: int = Field(default=1, ge=1, le=MAX_N)
    # vLLM's extensions
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="vLLM extension")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0,
                                      description="vLLM extension")  # fmt: skip
    min_tokens: int = Field(default=0, ge=0, description="vLLM extension")
    stop_token_ids: list[int] | None = Field(default=None, description="vLLM extension")
    # Known to OpenAI, refused unless left at their "off" value (see UNSUPPORTED).
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    def refuse_unsupported(self, strict: bool = False) -> list[str]:
        """A 400 naming the first field set to something this server cannot do (and, when
        `strict`, the first unknown field); returns the unknown fields otherwise."""
        for name, offs in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if value is not None and not any(_same(value, off) for off in offs):
                shown = " or ".join(repr(o) for o in offs)
                raise APIError(
                    400,
                    f"'{name}' = {value!r} is not supported by this server "
                    f"(leave it out or send {shown})",
                    param=name,
                    code="unsupported_field",
                )
        unknown = self.unknown_fields()
        if strict and unknown:
            raise APIError(
                400,
                f"unknown field '{unknown[0]}': this server does not support it "
                "(--strict; without it, unknown fields are ignored)",
                param=unknown[0],
                code="extra_forbidden",
            )
        return unknown

    def sampling(self, max_tokens: int, choice: int = 0) -> SamplingParams:
        """The engine's sampling parameters for choice `choice` of this request (its seed
        offset by the choice, so the `n` samples differ), `max_tokens` already resolved."""
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            seed=None if self.seed is None else (self.seed + choice) % (MAX_SEED + 1),
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logprobs=self.token_logprobs(),
            prompt_logprobs=self.prompt_logprobs(),
        )

    def token_logprobs(self) -> int | None:
        """Alternatives per generated token asked for (None: no logprobs)."""
        return None

    def prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token asked for (None: none; completions' `echo`)."""
        return None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: one prompt (text or token ids, alone or as a list of one).
    `echo` with `logprobs` scores every prompt token; `max_tokens` 0 scores the prompt alone
    (lm-evaluation-harness asks `max_tokens` 1 and drops the generated entry, an EOS included)."""

    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    def token_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo and self.logprobs is not None else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: object) -> object:
        """OpenAI's `prompt` is a text, token ids, or a list of several of either: one here."""
        if isinstance(v, list) and v and all(isinstance(p, str | list) for p in v):
            if len(v) != 1:
                raise ValueError("one prompt per request (a list of several is not supported)")
            return v[0]
        return v


class ChatMessage(_Lenient):
    """One message of a conversation: text content only. `developer` is OpenAI's newer name for
    `system`; `tool` (and `function`) results need tool calling, which this server lacks."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None
    name: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _role(cls, v: object) -> object:
        if v in ("tool", "function"):
            raise ValueError(f"role {v!r} needs tool calling, which this server does not support")
        return v

    def text(self) -> str:
        """The content as plain text (OpenAI's list of text parts joined; none: empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`: a conversation rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None

    def token_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template reads them."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]  # fmt: skip


def new_id(prefix: str) -> str:
    """An OpenAI-style object id."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    """Unix seconds, as OpenAI's `created` fields carry them."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's `usage` object; `cached_tokens`: prompt tokens whose KV the prefix cache held."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(tokens: list[str], lps: list[TokenLogprob | None], text_at: int,
                        decode) -> dict:  # fmt: skip
    """OpenAI's completions `logprobs` object: tokens, their logprobs (None for an echoed
    prompt's first), the top alternatives as {token text: logprob}, and text offsets from
    `text_at`."""
    offsets, at = [], text_at
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [None if x is None else x.logprob for x in lps],
        "top_logprobs": [None if x is None else {decode(i): v for i, v in x.top} for x in lps],
        "text_offset": offsets,
    }


def chat_logprobs(lps: list[TokenLogprob], decode) -> dict:
    """OpenAI's chat `logprobs` object: one entry per generated token."""

    def entry(token_id: int, logprob: float) -> dict:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(x.token_id, x.logprob), "top_logprobs": [entry(i, v) for i, v in x.top]}
            for x in lps
        ],
        "refusal": None,
    }


def _same(value: object, off: object) -> bool:
    """Whether `value` is the "off" value `off` (False is not 0, nor 1.0 True)."""
    return (
        type(value) is type(off)
        and value == off
        or (isinstance(off, float) and type(value) is int and value == off)
    )


class TokenizeRequest(_Lenient):
    """`POST /tokenize` (vLLM's): a prompt, or a conversation through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Lenient):
    """`POST /detokenize` (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[int]


def finish_reason(reason: str) -> str:
    """The engine's finish reason as OpenAI spells it ("stop" | "length")."""
    return "length" if reason == "length" else "stop"
