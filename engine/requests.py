"""A request as the engine keeps it, what it returns, and the text its tokens make.

What lives here: `Request` (one request's state from submission to its end), `Completion` (its
result) and `Piece` (a piece of its stream), and the pure steps between tokens and text:
`prompt_ids` (a prompt checked and tokenized), `advance` (a sampled token recorded, the text it
makes safe to stream, stop strings held back) and `piece` (the next piece, with the
log-probabilities not yet sent). What does not: the loop and the queues (`engine.engine`), the
forward pass and sampling (`engine.stepping`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, TokenLogprob
from .tokenizer import GGUFTokenizer, IncrementalDecoder


@dataclass(slots=True)
class Completion:
    """The result of one request."""

    text: str
    token_ids: list[int]  # generated, with the EOS or stop token that ended it (as vLLM counts)
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # With `SamplingParams.logprobs`: one per generated token; with `prompt_logprobs`: one per
    # prompt token (None for the first, which nothing predicts).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def completion_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.token_ids)


@dataclass(slots=True)
class Piece:
    """A piece of a request's stream: new text, the log-probabilities of the tokens generated
    since the last piece (with `SamplingParams.logprobs`; the pieces' lists add up to the
    completion's) and, on the first piece only, the prompt's (with `prompt_logprobs`)."""

    text: str
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(eq=False)
class Request:
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    decoder: IncrementalDecoder
    gen: torch.Generator | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    priority: int = 0  # lower runs first (vLLM's convention)
    arrival: float = 0.0  # time.monotonic() at submission
    num_computed: int = 0  # tokens fed through the model (their KV is in the cache)
    output_ids: list[int] = field(default_factory=list)
    prefix_hit: int = 0  # prompt tokens whose KV came from the prefix cache
    emitted: int = 0  # characters of decoded text already streamed
    finish_reason: str | None = None
    cancelled: bool = False
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    stop_token: int | None = None  # the EOS or stop token that ended it (never fed)
    logprobs_sent: int = 0  # of `logprobs`, how many went out with pieces
    prompt_sent: bool = False  # whether the prompt's log-probabilities went out
    shares_prefix: bool = True  # looks up and publishes its blocks (the warm-up does not)
    streamed: bool = False  # whether anything of it went to its queue (the first goes at once)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether every prompt token's logits are wanted (so none comes from the cache)."""
        return self.params.prompt_logprobs is not None

    @property
    def generated(self) -> list[int]:
        """The generated token ids as a client counts them: the outputs, then the EOS or stop
        token that ended the request (vLLM's convention; its text is never in the answer)."""
        return self.output_ids + ([] if self.stop_token is None else [self.stop_token])

    @property
    def tokens(self) -> list[int]:
        """Everything to feed: the prompt, then the outputs (a stop token is never one)."""
        return self.prompt_ids + self.output_ids


def prompt_ids(tokenizer: GGUFTokenizer, vocab: int, prompt: str | Sequence[int],
               chat: bool) -> list[int]:  # fmt: skip
    """A prompt (text, or token ids below `vocab`) as token ids; a ValueError names what is
    wrong with it."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt is empty")
        if chat:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return tokenizer.encode(prompt)
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt is empty")
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < vocab]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
    if chat:
        raise ValueError("chat=True needs a text prompt, not token ids")
    return ids


def advance(req: Request, token: int, eos: int | None, context: int) -> tuple[str, str | None]:
    """Record a sampled token of `req`: (the text it makes safe to stream, "" when none; the
    finish reason when the request should stop, else None). A stop string is never streamed:
    text that may be its start is held back."""
    p = req.params
    if token in p.stop_token_ids or (token == eos and not p.ignore_eos):
        req.stop_token = token
        return "", "stop"
    req.output_ids.append(token)
    req.decoder.push(token)
    text = req.decoder.text
    hold = 0
    if p.stop:
        # Search only where a stop string could newly end.
        longest = max(map(len, p.stop))
        tail_from = max(0, len(req.text) - longest)
        hits = [i for s in p.stop if (i := text.find(s, tail_from)) >= 0]
        if hits:
            req.text = text[: min(hits)]
            return "", "stop"
        hold = longest - 1  # a stop string may be starting at the end of the text
    req.text = text
    safe = max(req.emitted, len(text) - hold)
    new, req.emitted = text[req.emitted : safe], safe
    if len(req.output_ids) >= p.max_new_tokens or req.num_computed + 1 >= context:
        return new, "length"
    return new, None


def piece(req: Request, text: str) -> Piece:
    """The next piece of `req`'s stream: `text` and the log-probabilities not yet sent."""
    p, piece = req.params, Piece(text)
    if p.logprobs is not None:
        n = len(req.generated)
        piece.logprobs, req.logprobs_sent = req.logprobs[req.logprobs_sent : n], n
    if p.prompt_logprobs is not None and not req.prompt_sent:
        piece.prompt_logprobs, req.prompt_sent = [None, *req.prompt_logprobs], True
    return piece
