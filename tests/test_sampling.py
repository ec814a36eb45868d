"""Sampling parameters and the sampler, on synthetic logits."""

import pytest
import torch

from unikv.engine.sampling import SamplingParams, greedy_rows, greedy_token, logprobs_of, sample

LOGITS = torch.tensor([0.0, 3.0, 2.9, 1.0, -2.0])


def draw(params, n=400):
    gen = params.make_generator()
    return [sample(LOGITS, params, gen) for _ in range(n)]


def test_greedy_is_argmax():
    assert sample(LOGITS, SamplingParams(), None) == 1
    assert set(draw(SamplingParams(temperature=1.0, top_k=1), 20)) == {1}
    # ties and NaN as torch.argmax takes them: the first largest, a NaN first of all
    big = torch.zeros(49152)
    big[[40000, 45000]] = 5.0
    assert sample(big, SamplingParams(), None) == int(torch.argmax(big)) == 40000
    big[46000] = float("nan")
    assert sample(big, SamplingParams(), None) == int(torch.argmax(big)) == 46000
    for dtype in (torch.bfloat16, torch.float16):
        assert sample(LOGITS.to(dtype), SamplingParams(), None) == 1
    # float32 rows go through numpy's argmax: the same index as torch's for a strided row, a
    # row that requires grad, infinities and rows of nothing but -inf or NaN
    g = torch.Generator().manual_seed(0)
    grid = torch.randn(300, 7, generator=g)
    grid[[11, 250], 3] = float("inf")
    grid[:, 5] = float("-inf")
    grid[:, 6] = float("nan")
    for row in (grid[:, 3], grid[:, 4], grid[:, 5], grid[:, 6], grid[17],
                torch.randn(50, generator=g).requires_grad_()):  # fmt: skip
        assert greedy_token(row) == int(torch.argmax(row.detach())), row
    # every row of a matrix at once: the same tokens, for a strided matrix and the fallbacks
    for m in (
        grid,
        grid.t(),
        grid[::3, 2:],
        grid.to(torch.bfloat16),
        grid.clone().requires_grad_(),
    ):
        assert greedy_rows(m) == [int(torch.argmax(r.detach())) for r in m], m.shape


def test_top_k_and_top_p_restrict_support():
    assert set(draw(SamplingParams(temperature=1.0, top_k=2, seed=0))) == {1, 2}
    # softmax mass of token 1 alone is < 0.5, so top_p=0.5 keeps tokens 1 and 2 only.
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.5, seed=0))) == {1, 2}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.01, seed=0))) == {1}
    assert len(set(draw(SamplingParams(temperature=5.0, seed=0)))) == 5


def test_seed_reproducible():
    p = SamplingParams(temperature=1.0, seed=123)
    assert draw(p, 50) == draw(p, 50)
    assert draw(p, 50) != draw(SamplingParams(temperature=1.0, seed=124), 50)


def test_temperature_sharpens():
    cold = draw(SamplingParams(temperature=0.2, seed=1))
    hot = draw(SamplingParams(temperature=2.0, seed=1))
    assert cold.count(1) > hot.count(1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": -3}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_bad_parameters_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_single_stop_string_is_accepted():
    assert SamplingParams(stop="END").stop == ("END",)


def test_min_p_repetition_penalty_and_banned_tokens():
    """Issue 33's sampling fields: min-p keeps tokens at least that share as likely as the
    best (1.0: only the best, so sampling is greedy); vLLM's repetition penalty divides a seen
    token's positive logit and multiplies a negative one; banned tokens (EOS before
    `min_tokens`) are never picked."""
    logits = torch.tensor([3.0, 2.9, -1.0, 0.5])
    draws = {sample(logits, SamplingParams(temperature=1.0, min_p=1.0, seed=s), None)
             for s in range(20)}  # fmt: skip
    assert draws == {0}
    gen = SamplingParams(temperature=1.0, min_p=0.5, seed=0).make_generator()
    picks = {sample(logits, SamplingParams(temperature=1.0, min_p=0.5), gen) for _ in range(200)}
    assert picks == {0, 1}  # 2 and 3 are far below half of the best's probability
    greedy = SamplingParams()
    assert sample(logits, greedy, None) == 0
    pen = SamplingParams(repetition_penalty=2.0)
    assert sample(logits, pen, None, seen=[0]) == 1  # 3.0 / 2 < 2.9
    assert sample(torch.tensor([-1.0, -1.5]), pen, None, seen=[0]) == 1  # -1 * 2 < -1.5
    assert sample(logits, greedy, None, banned=(0, 1)) == 3
    assert torch.equal(logits, torch.tensor([3.0, 2.9, -1.0, 0.5]))  # the caller's, unchanged


def test_logprobs_are_the_models_log_softmax_with_the_top_alternatives():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    lps = logprobs_of(logits, [1, 2], 2)
    ref = torch.log_softmax(logits, dim=-1)
    assert [x.token_id for x in lps] == [1, 2]
    assert lps[0].logprob == pytest.approx(float(ref[0, 1]))
    assert [t for t, _ in lps[0].top] == [0, 1] and lps[1].top[0][0] == 2
    assert lps[1].top[0][1] == pytest.approx(float(ref[1, 2]))
    assert logprobs_of(logits, [0, 0], 0)[1].top == []
