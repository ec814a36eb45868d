"""Sampling parameters and the sampler, on synthetic logits."""

import pytest
import torch

from engine.sampling import SamplingParams, sample

LOGITS = torch.tensor([0.0, 3.0, 2.9, 1.0, -2.0])


def draw(params, n=400):
    gen = params.make_generator()
    return [sample(LOGITS, params, gen) for _ in range(n)]


def test_greedy_is_argmax():
    assert sample(LOGITS, SamplingParams(), None) == 1
    assert set(draw(SamplingParams(temperature=1.0, top_k=1), 20)) == {1}


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
        ({"max_new_tokens": 0}, "max_new_tokens"),
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
