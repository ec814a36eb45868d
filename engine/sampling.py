"""Sampling parameters (validated on construction) and the token sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from unikv.kernels import gemv

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): logits / 1e-300 overflow
# to inf, and softmax of infs is nan, which `multinomial` refuses.
GREEDY_BELOW = 1e-5
MAX_SEED = 2**63 - 1  # what torch.Generator.manual_seed takes on every platform
# `priority` (lower runs first): bounded where a request enters, so no value can overflow the
# scheduler's arithmetic or take every step for itself (docs/serving.md, limits and trust).
PRIORITY_RANGE = (-1000, 1000)
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs limit)


@dataclass(slots=True)
class TokenLogprob:
    """A token's log-probability under the model (log-softmax of its raw logits), and the
    `top` most likely tokens at that position with theirs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy.

    `max_new_tokens` 0 computes the prompt only (its logprobs, or the prefix cache). `min_p`
    drops tokens less likely than that share of the most likely one; `repetition_penalty`
    (vLLM's) divides the positive logits and multiplies the negative ones of every token seen in
    the prompt or the output; `min_tokens` holds EOS and `stop_token_ids` back until that many
    tokens are out. `logprobs` (0-20) returns each generated token's log-probability with that
    many alternatives; `prompt_logprobs` the same for every prompt token after the first (its
    whole prompt is computed, not read from the prefix cache).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # 0: no min-p filter
    repetition_penalty: float = 1.0  # 1: none
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
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
        m = self.min_p
        if not isinstance(m, int | float) or not 0.0 <= m <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {m!r}")
        r = self.repetition_penalty
        if not isinstance(r, int | float) or not math.isfinite(r) or not 0 < r <= 100:
            raise ValueError(f"repetition_penalty must be in (0, 100], got {r!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, "
                                 f"got {v!r}")  # fmt: skip

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


def greedy_token(x: torch.Tensor) -> int:
    """The index of the first largest of logits x [V] (a NaN counts as the largest, as argmax
    has it). A CPU float32 row through numpy's argmax: 5 against torch's 33 us (max's index; its
    argmax 84) over SmolLM2's 49,152 logits here, about 1% of a 4 ms decode step."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 1:
        return int((x.detach() if x.requires_grad else x).numpy().argmax())
    return int(x.max(-1).indices)


def greedy_rows(logits: torch.Tensor) -> list[int]:
    """`greedy_token` of every row of logits [M, V]: a CPU float32 matrix in one numpy argmax.

    Why not row by row: right after a decode step, whose weights have streamed through every
    cache, each torch call pays for its code and data again (a row's select, detach and numpy
    took 0.1-0.3 ms there, against a few us warm); one call over the matrix saved 4.5% of a Q4_1
    step (docs/kernels.md, "Fixed costs of a step")."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and not logits.requires_grad):  # fmt: skip
        return logits.numpy().argmax(axis=1).tolist()
    return [greedy_token(row) for row in logits]


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    gen: torch.Generator | None,
    seen: list[int] | tuple[int, ...] = (),
    banned: tuple[int, ...] = (),
) -> int:
    """Pick the next token from logits [V] under `params`: the repetition penalty over the
    `seen` tokens, `banned` ones (EOS before `min_tokens`) never, then greedy or filtered
    sampling (top-k, top-p, min-p): on a CPU with the C kernels gemv.c's (`draw`), else the
    torch ops below. RuntimeError where no token can be drawn (every logit banned or NaN)."""
    x = penalized(logits, params, seen, banned)
    if params.greedy:
        return greedy_token(x)
    if x.device.type == "cpu" and gemv.unavailable() is None:
        return draw(x, params, gen)  # gemv.c's draw: a run of steps draws the same
    return torch_draw(x, params, uniform(gen))


def penalized(
    logits: torch.Tensor,
    params: SamplingParams,
    seen: list[int] | tuple[int, ...] = (),
    banned: tuple[int, ...] = (),
) -> torch.Tensor:
    """logits [V] after the repetition penalty over `seen` and with `banned` tokens at -inf (a
    copy where either changes them; the caller's row is left as it is)."""
    x = logits
    if params.repetition_penalty != 1.0 and seen:
        x = x.float().clone()
        idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=x.device)
        v = x[idx]
        x[idx] = torch.where(v > 0, v / params.repetition_penalty, v * params.repetition_penalty)
    if banned:
        x = x.float().clone() if x is logits else x
        x[list(banned)] = float("-inf")
    return x


def torch_draw(x: torch.Tensor, params: SamplingParams, u: float) -> int:
    """A token drawn from logits x [V] under `params` with the uniform number u, in torch ops
    (no C kernels, or logits on another device): `candidates`, then `categorical`. The same
    tokens as gemv.c's `draw` up to float rounding at the boundaries."""
    probs, ids = candidates(x, params)
    j = categorical(probs, None, u)
    return j if ids is None else int(ids[j])


def candidates(x: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tokens a sampled draw chooses among and their probabilities: logits x [V] at the
    temperature, `top_k`, `nucleus`, then min-p's zeros; (probs, their token ids in ascending
    order, as gemv.c's draw scans them; or None where probs covers every token)."""
    x = x.float() / params.temperature
    ids = None  # x's positions are the token ids
    if params.top_k and params.top_k < x.shape[-1]:
        x, ids = top_k(x, params.top_k)
    if params.top_p < 1.0:
        x, order = nucleus(x, params.top_p)
        ids = order if ids is None else ids[order]
    probs = torch.softmax(x, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if ids is not None:  # in token order: a uniform number picks what gemv.c's draw picks
        ids, order = ids.sort()
        probs = probs[order]
    return probs, ids


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of x [V], and any tied with the k-th (as vLLM and transformers keep
    them), most likely first, and their token ids: the candidates the rest of the sampler
    reads (one `topk`, not a mask over all V tokens that each later filter would pass over)."""
    vals, ids = torch.topk(x, k)
    kth = vals[-1]
    if int((x == kth).sum()) > int((vals == kth).sum()):  # ties beyond the k-th: all of them
        ids = torch.nonzero(x >= kth).view(-1)
        vals, order = torch.sort(x[ids], descending=True)
        ids = ids[order]
    return vals, ids


NUCLEUS_TRIES = (64, 512)  # the most likely tokens `nucleus` looks among before sorting all


def nucleus(x: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p nucleus of logits x [V]: the smallest run of most likely tokens whose
    probability (softmax of x) reaches `top_p`, the first always kept; their logits in
    descending order and their token ids.

    Why not a sort of all V: torch.sort of SmolLM2's 49,152 logits took 3.4 ms on a 2-core AMD
    EPYC (Zen 4), about a whole decode step. A language model's nucleus mostly lies among its
    few hundred most likely tokens, so those are looked at first (`topk` of 64, then 512: 0.09
    and 0.12 ms), all of them sorted only when their mass falls short of top_p."""
    lse = torch.logsumexp(x.double(), -1)
    n = x.shape[-1]
    for k in (*NUCLEUS_TRIES, n):
        top, order = torch.topk(x, k) if k < n else torch.sort(x, descending=True)
        probs = torch.exp(top.double() - lse)  # (float64: the mass to the boundary exact)
        mass = probs.cumsum(-1)
        if k >= n or mass[-1] >= top_p:  # the token after these would be dropped
            keep = int((mass - probs < top_p).sum())  # the mass before each below top_p
            return top[:keep], order[:keep]
    raise AssertionError("unreachable: the last try holds every token")


def uniform(gen: torch.Generator | None) -> float:
    """One uniform number in [0, 1) of `gen` (None: torch's default generator): what each
    sampled token takes from its request's generator."""
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def spec(params: SamplingParams) -> list[float]:
    """A sampled request's row for gemv.c's draw (`gemv.sample_rows`, `gemv.decode_steps`):
    temperature (0: the argmax), top_k, top_p, min_p."""
    if params.greedy:
        return [0.0, 0.0, 1.0, 0.0]
    k = params.top_k if params.top_k < 2**31 else 0  # (past any vocabulary: no filter)
    return [params.temperature, k, params.top_p, params.min_p]


def draw(x: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """A token drawn from CPU logits x [V] under `params` (temperature, top-k, top-p, min-p)
    with one `uniform` number of `gen`: gemv.c's sample_row, the draw of a run of several
    steps in one native call (`gemv.decode_steps`) too, so a seed gives the same tokens either
    way. It keeps what `top_k`, `nucleus` and min-p keep up to float rounding at the boundary.
    RuntimeError where no token can be drawn."""
    u = uniform(gen)
    row = torch.tensor([spec(params)], dtype=torch.float64)
    token = int(gemv.sample_rows(x[None], row, torch.tensor([u], dtype=torch.float64))[0])
    if token < 0:
        raise RuntimeError("cannot sample a token: the probabilities are NaN or all zero")
    return token


def categorical(probs: torch.Tensor, gen: torch.Generator | None, u: float | None = None) -> int:
    """An index drawn from weights probs [n] (>= 0, any sum) with one `uniform` number of `gen`
    (or `u`, given): the first whose cumulative sum, in float64, passes u times the total. A
    zero weight is never drawn. RuntimeError where the weights are NaN or all zero.

    Why not torch.multinomial: for one draw it takes an exponential variate per weight, 1.0
    ms over SmolLM2's 49,152 tokens on a 2-core AMD EPYC (Zen 4), a third of a decode step;
    this takes 0.08 ms."""
    cdf = probs.double().cumsum(-1)
    total = float(cdf[-1]) if cdf.numel() else 0.0
    if not (math.isfinite(total) and total > 0.0):
        raise RuntimeError("cannot sample a token: the probabilities are NaN or all zero")
    u = (uniform(gen) if u is None else u) * total
    j = int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64, device=cdf.device),
                               right=True))  # fmt: skip
    if j >= cdf.numel():  # u rounded up to the total: the last token that can be drawn
        j = int(torch.nonzero(probs > 0).max())
    return j


def logprobs_of(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each row's log-probability of its token in `tokens`, and its `top` alternatives (rows of
    `logits` [N, V] in order; the model's raw distribution, before any sampling rule)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long).view(-1, 1)).view(-1).tolist()
    if top:
        vals, ids = torch.topk(lp, top, dim=-1)
        alts = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(),
                                                             strict=True)]  # fmt: skip
    else:
        alts = [[] for _ in tokens]
    return [TokenLogprob(t, c, a) for t, c, a in zip(tokens, chosen, alts, strict=True)]
