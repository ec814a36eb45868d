"""The OpenAI wire format `unikv serve` speaks: request and response models, and errors.

Requests follow OpenAI's `/v1/completions` and `/v1/chat/completions`; the extra sampling fields
`top_k`, `ignore_eos` and `priority` are vLLM's extensions, documented as such. A field this
server cannot honour (`n > 1`, `logprobs`, `tools`, ...) or does not know is a 400 naming the
field, never silently ignored. Every error is OpenAI's error object.

What does not live here: serving requests (`serving.app`), the engine's sampling rules
(`engine.sampling.SamplingParams`, which every request is turned into).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.sampling import MAX_SEED, PRIORITY_RANGE, SamplingParams

# Fields OpenAI defines that this server does not implement, with the value that means "off":
# a request may send them only with that value.
UNSUPPORTED: dict[str, Any] = {
    "n": 1,
    "best_of": 1,
    "logprobs": None,
    "top_logprobs": None,
    "echo": False,
    "suffix": None,
    "logit_bias": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "response_format": None,
    "parallel_tool_calls": None,
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


class StreamOptions(BaseModel):
    """`stream_options`: only `include_usage` exists."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="forbid")

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
    # Known to OpenAI, refused unless left at their "off" value (see UNSUPPORTED).
    n: int | None = None
    best_of: int | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    echo: bool | None = None
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

    def refuse_unsupported(self) -> None:
        """A 400 naming the first field set to something this server cannot do."""
        for name, off in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if value is not None and value != off:
                raise APIError(
                    400,
                    f"'{name}' = {value!r} is not supported by this server "
                    f"(leave it out{'' if off is None else f' or send {off!r}'})",
                    param=name,
                    code="unsupported_field",
                )

    def sampling(self, max_tokens: int) -> SamplingParams:
        """The engine's sampling parameters for this request, `max_tokens` already resolved."""
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            seed=self.seed,
            stop=tuple(self.stop or ()),
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: one prompt (text or token ids)."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and all(isinstance(p, str) for p in v):
            if len(v) != 1:
                raise ValueError("one prompt per request (a list of several is not supported)")
            return v[0]
        return v


class ChatMessage(BaseModel):
    """One message of a conversation: text content only."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        """The content as plain text (OpenAI's list of text parts joined)."""
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
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template reads them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def new_id(prefix: str) -> str:
    """An OpenAI-style object id."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    """Unix seconds, as OpenAI's `created` fields carry them."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's `usage` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(reason: str) -> str:
    """The engine's finish reason as OpenAI spells it ("stop" | "length")."""
    return "length" if reason == "length" else "stop"
