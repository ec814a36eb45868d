"""Sampling parameters (validated on construction) and the token sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): logits / 1e-300 overflow
# to inf, and softmax of infs is nan, which `multinomial` refuses.
GREEDY_BELOW = 1e-5
MAX_SEED = 2**63 - 1  # what torch.Generator.manual_seed takes on every platform
# `priority` (lower runs first): bounded where a request enters, so no value can overflow the
# scheduler's arithmetic or take every step for itself (docs/serving.md, limits and trust).
PRIORITY_RANGE = (-1000, 1000)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        t = self.temperature
        if not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, int | float) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
            or not 0 <= self.seed <= MAX_SEED
        ):  # fmt: skip
            raise ValueError(
                f"seed must be an integer in [0, 2**63 - 1] or None, got {self.seed!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(i, int) or i < 0 for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def make_generator(self) -> torch.Generator | None:
        """A seeded generator for reproducible sampling (None for greedy or unseeded)."""
        if self.greedy:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def check_priority(priority: object) -> int:
    """`priority` if it is an integer within PRIORITY_RANGE, else ValueError naming the range."""
    lo, hi = PRIORITY_RANGE
    if not isinstance(priority, int) or isinstance(priority, bool) or not lo <= priority <= hi:
        raise ValueError(
            f"priority must be an integer in [{lo}, {hi}] (lower runs first), got {priority!r}"
        )
    return priority


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """Pick the next token from logits [V] under `params`."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = probs.cumsum(-1) - probs >= params.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
