"""DeepSeekMoE routing: router logits -> the top-k routed experts of each token and their weights.

What lives here: `route` (the router of DeepSeek-V2/V3 as Hugging Face `transformers` computes
it), the two implementations of its final top-k (`exact_topk`, `blockwise_topk`),
`default_winners` (how many winners each block keeps), and `choose_topk` (which top-k a chip's
profile prefers, and a config's [moe] override). What does not: the
router's matmul and the experts themselves (`engine.deepseek`), the expert cache.

The router, step by step (`transformers` `DeepseekV3TopkRouter` / `DeepseekV2TopkRouter`):

1. scores = softmax(logits) (V2) or sigmoid(logits) (V3), float32;
2. choice = scores + bias, where `bias` is V3's `e_score_correction_bias`. The bias only
   *chooses*: the weights always come from the unbiased scores;
3. group-limited methods pick `topk_groups` of the `num_groups` groups of consecutive experts and
   hide the rest: "group_limited_greedy" (V2) scores a group by its best expert,
   "noaux_tc" (V3) by the sum of its two best (biased) experts; "greedy" has no groups;
4. the final top-k over the experts that remain (`topk` = "exact" or "blockwise", below);
5. weights = scores of the chosen experts; with `norm_topk` divided by their sum (+ 1e-20, as V3
   does), then multiplied by `routed_scaling`.

Hidden experts are filled with -inf (V3's choice). transformers' V2 router fills them with 0 and
takes the top-k of what is left; softmax scores are positive, so both choose the same experts
whenever the kept groups hold at least k experts, which `route` requires (the checkpoint loader
refuses other configs too).

Normalisation: transformers' V2 router ignores `norm_topk_prob` (it only scales); this `route`
honours the config flag for V2 as for V3, as DeepSeek's own modelling code does. (DeepSeek's V2
code also skips the scaling when it normalises; the released V2 configs have
norm_topk_prob = false, where every reading agrees.) As transformers does, the weights are
normalised for k = 1 too (DeepSeek's code skips that; the weight is then 1 either way, up to the
1e-20).

The final top-k. "exact" is `torch.topk` over all experts (the heap-select family). "blockwise"
splits the experts into blocks of `block` consecutive ones, keeps the best `winners` of each
block, then takes the top-k among the block winners (the quick-select family): the first pass
reads each block once and keeps only a few values on chip, the second reads experts / block *
winners candidates instead of all experts. It is exact whenever no block holds more than
`winners` of a token's true top-k, in particular whenever winners >= k; otherwise the expert
ranked winners + 1 inside a crowded block is replaced by the best one left out elsewhere (still
a valid set of k distinct experts, each at least as good as every expert not in any block's
winners). The default `winners` (`default_winners`) is the smallest number for which, if a
token's top-k were spread at random over the candidate experts (all of them for "greedy"; the
experts of the kept groups otherwise), the chance that some block holds more than `winners` of
them is at most `WINNERS_MISS_TARGET` (0.1%; union bound over blocks, hypergeometric tail).
That null model is the right one for *where* a token's experts sit: experts are exchangeable at
initialisation, so the index of an expert inside its group means nothing to a trained router.
What it misses: V3's group choice favours groups with two strong experts, which spreads the
top-k and makes misses rarer, and popular experts and correlated tokens make them come in bursts
within a sequence. benchmarks/routing.py measures both on synthetic routers: with blocks of
16, 0.003% of V3-like tokens at 4K and 0.02-0.08% of V2-Lite-like ones at 512-4K are routed
differently (the field figure: 0.79% at 4K).

Defaults: blocks of `DEFAULT_TOPK_BLOCK` = 16 experts (16 fp32 scores: one 64-byte cache line,
one 512-bit vector) when neither the chip profile nor the config names a size; the GPU-like
profiles use 32 (a warp). DeepSeek-V3 (256 experts, 4 of 8 groups kept, k = 8) then keeps 5 of
each 16 or 6 of each 32, so the second pass reads 80 or 48 scores instead of 256. Which mode a
chip uses is its profile's `moe_topk`, overridden by a config's [moe] table (`choose_topk`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch

from unikv.settings.config import MoEOptions, PoolConfig
from unikv.settings.profiles import DEFAULT_TOPK_BLOCK, TOPK_MODES, ChipProfile

from .config import MoEConfig

__all__ = [
    "DEFAULT_TOPK_BLOCK",
    "HF_KEYS",
    "TOPK_MODES",
    "WINNERS_MISS_TARGET",
    "blockwise_topk",
    "check_moe",
    "choose_topk",
    "default_winners",
    "exact_topk",
    "route",
]

SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
# Null-model chance (per token) that blockwise top-k misses one of the true top-k; see above.
WINNERS_MISS_TARGET = 1e-3


def route(
    logits: torch.Tensor,
    moe: MoEConfig,
    bias: torch.Tensor | None,
    topk: str = "exact",
    block: int = 0,
    *,
    winners: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] float32, expert indices [N, k] int64) of router logits [N, E].

    `topk` is "exact" or "blockwise"; `block` (blockwise only) the experts per block, 0 for
    `DEFAULT_TOPK_BLOCK`; `winners` the winners kept per block, None for `default_winners`.
    The order of the k experts of a row is unspecified.
    """
    _check_moe(moe)
    if logits.dim() != 2 or logits.shape[1] != moe.num_experts:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)}: expected [tokens, {moe.num_experts}]"
        )
    if not logits.is_floating_point():
        raise ValueError(f"logits of dtype {logits.dtype}: expected a floating-point tensor")
    if bias is not None and tuple(bias.shape) != (moe.num_experts,):
        raise ValueError(
            f"bias of shape {tuple(bias.shape)}: expected [{moe.num_experts}] (one per expert)"
        )
    if topk not in TOPK_MODES:
        raise ValueError(f"topk = {topk!r}: expected one of {', '.join(TOPK_MODES)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 0:
        raise ValueError(f"block = {block!r}: expected an integer >= 0 (0: the default)")

    logits = logits.float()
    # scores, choice: [N, E]
    scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if moe.topk_method != "greedy":
        choice = _limit_groups(choice, moe)

    k = moe.top_k
    if topk == "exact":
        idx = exact_topk(choice, k)
    else:
        block = block or DEFAULT_TOPK_BLOCK
        candidates = _candidates(moe)
        if winners is None:
            winners = default_winners(k, block, candidates)
        elif winners < k and min(winners, block) * candidates < k * block:
            # Below this, the blocks of the kept groups may hold fewer than k winners, and a
            # hidden expert would be chosen (see default_winners).
            raise ValueError(
                f"winners = {winners}: expected at least k * block / candidates = "
                f"{k} * {block} / {candidates} (and >= 1)"
            )
        idx = blockwise_topk(choice, k, block, winners)

    weights = scores.gather(1, idx)  # [N, k]
    if moe.norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling, idx


def exact_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [N, k] of the k largest values of each row of x [N, E] (`torch.topk`)."""
    return torch.topk(x, k, dim=-1, sorted=False).indices


def blockwise_topk(x: torch.Tensor, k: int, block: int, winners: int) -> torch.Tensor:
    """Indices [N, k] of the k largest among the best `winners` of each block of `block`
    consecutive columns of x [N, E]; equal to the exact top-k when winners >= k."""
    n, e = x.shape
    nb = -(-e // block)
    if block < 1 or winners < 1 or nb * min(winners, block) < k:
        raise ValueError(
            f"block = {block}, winners = {winners}: expected integers >= 1 leaving at least "
            f"k = {k} winners over the {nb} blocks"
        )
    winners = min(winners, block, k)
    if block >= e or winners == block:
        return exact_topk(x, k)  # one block, or every column is a winner
    if nb * block != e:  # pad the last block with -inf, which never wins over a real score
        x = torch.nn.functional.pad(x, (0, nb * block - e), value=-math.inf)
    # first pass, within blocks: vals, pos [N, nb, winners]
    vals, pos = torch.topk(x.view(n, nb, block), winners, dim=-1, sorted=False)
    ids = pos + torch.arange(0, nb * block, block, device=x.device).view(1, nb, 1)
    # second pass, among the nb * winners block winners
    pick = torch.topk(vals.reshape(n, nb * winners), k, dim=-1, sorted=False).indices
    return ids.reshape(n, nb * winners).gather(1, pick)


@functools.cache
def default_winners(k: int, block: int, candidates: int) -> int:
    """Winners per block for blockwise top-k: the smallest w such that k experts drawn at random
    from `candidates` put more than w in some block with chance <= WINNERS_MISS_TARGET.

    Never below k * block / candidates: with fewer, the blocks holding the candidates (the kept
    groups; the others are at -inf) could offer fewer than k winners. (Each block holds at most
    `block` candidates and min(L, w) >= L * w / block, so the blocks offer at least
    candidates * w / block finite winners wherever the candidates lie.)
    """
    if min(k, block, candidates) < 1:
        raise ValueError(f"k = {k}, block = {block}, candidates = {candidates}: expected >= 1")
    k = min(k, candidates)
    blocks = -(-candidates // block)
    if blocks == 1:
        return min(k, block)
    total = math.comb(candidates, k)
    for w in range(max(1, -(-k * block // candidates)), min(k, block)):
        # P(a given block holds more than w of the k): hypergeometric tail
        tail = sum(
            math.comb(block, j) * math.comb(candidates - block, k - j)
            for j in range(w + 1, min(k, block) + 1)
        )
        if blocks * tail / total <= WINNERS_MISS_TARGET:
            return w
    return min(k, block)


# -- internals -------------------------------------------------------------------------------


def _limit_groups(choice: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """choice [N, E] with every expert outside the token's `topk_groups` best groups at -inf."""
    n = choice.shape[0]
    g = moe.num_groups
    grouped = choice.view(n, g, moe.num_experts // g)  # [N, G, E/G]
    if moe.topk_method == "group_limited_greedy":
        group_scores = grouped.amax(dim=-1)  # [N, G]
    else:  # noaux_tc
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    keep = torch.topk(group_scores, moe.topk_groups, dim=-1, sorted=False).indices  # [N, tg]
    mask = torch.ones(n, g, dtype=torch.bool, device=choice.device)
    mask.scatter_(1, keep, False)  # True: hidden
    return grouped.masked_fill(mask.unsqueeze(-1), -math.inf).view(n, moe.num_experts)


def _candidates(moe: MoEConfig) -> int:
    """How many experts the final top-k chooses among."""
    if moe.topk_method == "greedy":
        return moe.num_experts
    return moe.topk_groups * (moe.num_experts // moe.num_groups)


# The config.json key each checked MoEConfig field comes from (the loader's errors name these).
HF_KEYS = {
    "scoring": "scoring_func",
    "topk_method": "topk_method",
    "top_k": "num_experts_per_tok",
    "num_experts": "n_routed_experts",
    "num_groups": "n_group",
    "topk_groups": "topk_group",
}


def check_moe(moe: MoEConfig, names: Mapping[str, str] | None = None) -> None:
    """ValueError naming the field (as `names` spells it, e.g. `HF_KEYS`) when a MoEConfig
    cannot be routed: unknown scoring or method, top-k out of range, groups that do not divide
    the experts or hold fewer than k of them."""

    def n(field: str) -> str:
        return (names or {}).get(field, field)

    e, k = moe.num_experts, moe.top_k
    if moe.scoring not in SCORING:
        raise ValueError(f"{n('scoring')} = {moe.scoring!r}; supported: {', '.join(SCORING)}")
    if moe.topk_method not in TOPK_METHODS:
        raise ValueError(
            f"{n('topk_method')} = {moe.topk_method!r}; supported: {', '.join(TOPK_METHODS)}"
        )
    if not 1 <= k <= e:
        raise ValueError(f"{n('top_k')} = {k} must be in 1..{n('num_experts')} ({e})")
    if moe.topk_method == "greedy":
        return
    g, tg = moe.num_groups, moe.topk_groups
    if g < 1 or e % g:
        raise ValueError(f"{n('num_experts')} = {e} is not a multiple of {n('num_groups')} = {g}")
    if not 1 <= tg <= g:
        raise ValueError(f"{n('topk_groups')} = {tg} must be in 1..{n('num_groups')} ({g})")
    if k > tg * (e // g):
        raise ValueError(
            f"{n('top_k')} = {k} exceeds the experts of {n('topk_groups')} = {tg} groups "
            f"({tg * (e // g)})"
        )
    if moe.topk_method == "noaux_tc" and e // g < 2:
        raise ValueError("noaux_tc needs at least 2 experts per group (group score: top-2 sum)")


_check_moe = functools.cache(check_moe)  # route checks each config once


def choose_topk(profile: ChipProfile, config: PoolConfig | MoEOptions) -> tuple[str, int, str]:
    """(mode, block, why) of the MoE router's final top-k: the config's [moe] topk, else the
    chip profile's preference. `block` is the experts per block, 0 for "exact"."""
    moe = config.moe if isinstance(config, PoolConfig) else config
    tuned = profile.tuned
    if moe.topk == "auto":
        mode, why = tuned.moe_topk, f"auto: the {profile.name} profile prefers {tuned.moe_topk!r}"
    else:
        mode, why = moe.topk, f"configured [moe] topk = {moe.topk!r}"
    if mode == "exact":
        return "exact", 0, why
    if moe.topk_block is not None:
        return mode, moe.topk_block, f"{why}, configured blocks of {moe.topk_block} experts"
    return mode, tuned.moe_topk_block, f"{why}, blocks of {tuned.moe_topk_block} (profile)"
