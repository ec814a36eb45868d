"""Tests of engine.routing: parity with transformers' DeepSeek routers, blockwise top-k, the chip
profile's top-k preference, the [moe] config table and its errors."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from unikv.cli.profile import format_report, profile_report
from unikv.engine.config import MoEConfig
from unikv.engine.routing import (
    DEFAULT_TOPK_BLOCK,
    blockwise_topk,
    choose_topk,
    default_winners,
    exact_topk,
    route,
)
from unikv.settings.config import ConfigError, MoEOptions, PoolConfig, load_config
from unikv.settings.profiles import load_profile

HIDDEN = 32
TOKENS = 64


def moe_config(**kw) -> MoEConfig:
    base = dict(
        num_experts=16,
        num_shared=1,
        top_k=4,
        intermediate_size=8,
        first_dense=0,
        scoring="sigmoid",
        topk_method="noaux_tc",
        num_groups=4,
        topk_groups=2,
        norm_topk=True,
        routed_scaling=2.5,
    )
    return MoEConfig(**{**base, **kw})


def by_expert(weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert index, so that two routings can be compared as sets."""
    order = idx.argsort(dim=1)
    return weights.gather(1, order), idx.gather(1, order)


def assert_same_routing(ours, theirs) -> None:
    w0, i0 = by_expert(*ours)
    w1, i1 = by_expert(*theirs)
    assert torch.equal(i0, i1)
    torch.testing.assert_close(w0, w1, rtol=1e-6, atol=1e-7)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.int64


# -- parity with transformers ----------------------------------------------------------------


@pytest.mark.parametrize("norm", [True, False])
def test_v3_noaux_tc_matches_transformers(norm: bool) -> None:
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        hidden_size=HIDDEN,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    ref = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        ref.weight.normal_()
        ref.e_score_correction_bias.normal_(0, 0.3)
    h = torch.randn(TOKENS, HIDDEN)
    logits, w_ref, i_ref = ref(h)
    moe = moe_config(norm_topk=norm)
    ours = route(h.float() @ ref.weight.T, moe, ref.e_score_correction_bias)
    assert_same_routing(ours, (w_ref, i_ref))
    # the bias changes the choice for some tokens (so the test checks that it is applied)
    unbiased = route(logits, moe, None)[1]
    assert not torch.equal(by_expert(*ours)[1], by_expert(torch.zeros_like(unbiased), unbiased)[1])


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
@pytest.mark.parametrize("norm", [False, True])
def test_v2_matches_transformers(method: str, norm: bool) -> None:
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    torch.manual_seed(1)
    cfg = DeepseekV2Config(
        hidden_size=HIDDEN,
        num_attention_heads=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        topk_method=method,
        routed_scaling_factor=2.0,
    )
    ref = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        ref.weight.normal_()
    h = torch.randn(TOKENS, HIDDEN)
    logits, w_ref, i_ref = ref(h)
    moe = moe_config(scoring="softmax", topk_method=method, norm_topk=norm, routed_scaling=2.0)
    ours = route(logits, moe, None)
    if norm:
        # transformers' V2 router ignores norm_topk_prob; route honours it (DeepSeek's code)
        w_ref = w_ref / w_ref.sum(dim=-1, keepdim=True) * 2.0
    assert_same_routing(ours, (w_ref, i_ref))


def test_bias_chooses_but_weights_are_unbiased() -> None:
    moe = moe_config(topk_method="greedy", norm_topk=False, routed_scaling=1.0)
    logits = torch.randn(8, 16)
    bias = torch.zeros(16)
    bias[5] = 10.0  # expert 5 always chosen
    weights, idx = route(logits, moe, bias)
    assert (idx == 5).any(dim=1).all()
    chosen = weights[idx == 5]
    torch.testing.assert_close(chosen, logits[:, 5].sigmoid())


def test_group_limited_keeps_only_best_groups() -> None:
    moe = moe_config(scoring="softmax", topk_method="group_limited_greedy", topk_groups=1)
    logits = torch.full((1, 16), -5.0)
    logits[0, 4] = 3.0  # group 1 has the best expert
    logits[0, [0, 1, 2, 3]] = 2.5  # group 0 has the best four others
    idx = route(logits, moe, None)[1]
    assert sorted(idx[0].tolist()) == [4, 5, 6, 7]  # all from group 1, as V2 does


# -- blockwise top-k -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
@pytest.mark.parametrize("block", [2, 4, 5, 8, 16, 64])
def test_blockwise_is_exact_with_k_winners(method: str, block: int) -> None:
    torch.manual_seed(2)
    moe = moe_config(topk_method=method)
    logits, bias = torch.randn(TOKENS, 16), torch.randn(16) * 0.1
    exact = route(logits, moe, bias)
    assert_same_routing(route(logits, moe, bias, "blockwise", block, winners=moe.top_k), exact)


def test_blockwise_topk_pads_a_short_last_block() -> None:
    torch.manual_seed(3)
    x = torch.randn(TOKENS, 20)
    for block in (3, 6, 7, 19):
        got = blockwise_topk(x, 5, block, 5).sort(dim=1).values
        assert torch.equal(got, exact_topk(x, 5).sort(dim=1).values)
        assert got.max() < 20


def test_blockwise_default_is_exact_on_random_scores() -> None:
    torch.manual_seed(4)
    moe = moe_config(num_experts=64, num_groups=8, topk_groups=4, top_k=6)
    logits, bias = torch.randn(512, 64), torch.randn(64) * 0.1
    exact = by_expert(*route(logits, moe, bias))[1]
    blockwise = by_expert(*route(logits, moe, bias, "blockwise"))[1]  # block 0: the default
    assert (exact != blockwise).any(dim=1).float().mean() < 0.01


def test_blockwise_differs_on_a_crowded_block_and_stays_valid() -> None:
    """The four best experts share one block; two winners per block keep only two of them."""
    moe = moe_config(topk_method="greedy", norm_topk=False, routed_scaling=1.0)
    logits = torch.linspace(-2.0, 0.0, 16).flip(0).unsqueeze(0)  # expert 0 best, 15 worst
    logits[0, 0:4] += 5.0
    weights, idx = route(logits, moe, None, "blockwise", 4, winners=2)
    exact = route(logits, moe, None)[1]
    assert sorted(exact[0].tolist()) == [0, 1, 2, 3]
    got = sorted(idx[0].tolist())
    assert got != [0, 1, 2, 3]
    # still a top-k among the block winners: two from the crowded block, then the best of the
    # others; k distinct experts, weights the unbiased scores of the chosen experts
    assert got == [0, 1, 4, 5] and len(set(got)) == moe.top_k
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, idx))


def test_blockwise_never_picks_a_hidden_group() -> None:
    torch.manual_seed(5)
    moe = moe_config(num_experts=32, num_groups=8, topk_groups=2, top_k=4)  # 8 candidates
    logits, bias = torch.randn(256, 32), torch.randn(32) * 0.1
    exact = route(logits, moe, bias)[1]
    kept = torch.zeros(256, 8, dtype=torch.bool)
    kept.scatter_(1, exact // 4, True)  # the kept groups hold the exact choice
    # fewest winners allowed: k * block / candidates = 4 * 8 / 8 = 4 per block of 8
    idx = route(logits, moe, bias, "blockwise", 8, winners=4)[1]
    assert kept.gather(1, idx // 4).all()
    with pytest.raises(ValueError, match="winners = 3: expected at least k \\* block"):
        route(logits, moe, bias, "blockwise", 8, winners=3)


def test_default_winners() -> None:
    assert default_winners(8, 16, 128) == 5  # DeepSeek-V3: 4 of 8 groups of 32 kept
    assert default_winners(8, 32, 128) == 6
    assert default_winners(6, 16, 64) == 5  # V2-Lite-like
    assert default_winners(6, 64, 64) == 6  # one block: exact
    assert default_winners(4, 8, 8) == 4
    assert default_winners(8, 64, 96) >= math.ceil(8 * 64 / 96)
    with pytest.raises(ValueError):
        default_winners(0, 16, 128)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda m: route(torch.randn(4, 8), m, None), "expected [tokens, 16]"),
        (lambda m: route(torch.zeros(4, 16, dtype=torch.long), m, None), "floating-point"),
        (lambda m: route(torch.randn(4, 16), m, torch.zeros(8)), "expected [16]"),
        (lambda m: route(torch.randn(4, 16), m, None, "quick"), "topk = 'quick'"),
        (lambda m: route(torch.randn(4, 16), m, None, "blockwise", -1), "block = -1"),
        (lambda m: route(torch.randn(4, 16), dataclasses.replace(m, num_groups=3), None), "3"),
        (
            lambda m: route(
                torch.randn(4, 16), dataclasses.replace(m, topk_groups=1, top_k=5), None
            ),
            "top_k = 5",
        ),
        (lambda m: route(torch.randn(4, 16), dataclasses.replace(m, scoring="relu"), None), "relu"),
    ],
)
def test_route_rejects_bad_input(call, fragment: str) -> None:
    with pytest.raises(ValueError) as exc:
        call(moe_config())
    assert fragment in str(exc.value), exc.value


# -- chip profile and config ------------------------------------------------------------------


def test_profiles_prefer_a_topk() -> None:
    cfg = PoolConfig()
    assert choose_topk(load_profile("ascend910b"), cfg)[:2] == ("exact", 0)
    assert choose_topk(load_profile("kunpeng920"), cfg)[:2] == ("exact", 0)
    mode, block, why = choose_topk(load_profile("mlu370"), cfg)
    assert (mode, block) == ("blockwise", 32) and "auto: the mlu370 profile" in why
    assert load_profile("cpu").tuned.moe_topk_block == DEFAULT_TOPK_BLOCK


def test_config_overrides_the_profile(tmp_path: Path) -> None:
    path = tmp_path / "moe.toml"
    path.write_text('[moe]\ntopk = "blockwise"\ntopk_block = 8\nexpert_cache = 0.25\n')
    cfg = load_config(path, env={})
    assert cfg.moe == MoEOptions("blockwise", 8, 0.25, 1.0)
    mode, block, why = choose_topk(load_profile("ascend910b"), cfg)
    assert (mode, block) == ("blockwise", 8) and "configured" in why
    # without topk_block the profile's block size is used
    assert choose_topk(load_profile("ascend910b"), MoEOptions("blockwise"))[:2] == ("blockwise", 32)
    assert choose_topk(load_profile("mlu370"), MoEOptions("exact"))[:2] == ("exact", 0)
    # auto with a configured block: the profile's mode, the config's block
    assert choose_topk(load_profile("mlu370"), MoEOptions(topk_block=64))[:2] == ("blockwise", 64)
    env = {"UNIKV_MOE__TOPK": "exact", "UNIKV_MOE__EXPERT_HOST": "0.5"}
    assert load_config(path, env=env).moe == MoEOptions("exact", 8, 0.25, 0.5)
    assert load_config(None, env={}).moe == MoEOptions()


def test_profile_report_shows_the_topk() -> None:
    report = profile_report("mtt_s4000", None, env={})
    assert (report["moe_topk"], report["moe_topk_block"]) == ("blockwise", 32)
    assert report["expert_cache"] == 1.0
    text = format_report(report)
    assert "MoE top-k" in text and "all routed experts on the device" in text


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('topk = "fast"', '[moe] topk = "fast": expected one of auto, exact, blockwise'),
        ("topk_block = 1", "[moe] topk_block = 1: expected an integer >= 2"),
        ("topk_block = true", "[moe] topk_block = true: expected an integer >= 2"),
        ("expert_cache = 0", "[moe] expert_cache = 0: expected a fraction 0 < f <= 1"),
        ("expert_cache = 1.5", "[moe] expert_cache = 1.5: expected a fraction 0 < f <= 1"),
        ("expert_host = -0.1", "[moe] expert_host = -0.1: expected a fraction 0 <= f <= 1"),
        ("top_k = 8", '[moe] unknown key "top_k"; allowed: topk, topk_block, expert_cache'),
    ],
)
def test_bad_moe_config(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(f"[moe]\n{text}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    assert str(exc.value).startswith(f"{path}: ") and fragment in str(exc.value), exc.value


def test_bad_moe_env_and_table() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, env={"UNIKV_MOE__TOPK": "heap"})
    assert str(exc.value).startswith("UNIKV_MOE__TOPK (environment override of <defaults>)")
    with pytest.raises(ConfigError, match="names no configuration key"):
        load_config(None, env={"UNIKV_MOE__WINNERS": "3"})
    with pytest.raises(ValueError, match="MoEOptions: expert_host = 2"):
        MoEOptions(expert_host=2)
