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


def _sorted_nucleus(x: torch.Tensor, top_p: float) -> set[int]:
    """The top-p nucleus as a sort of every token finds it (the sampler before 2026-12-07, in
    float64)."""
    sorted_x, order = torch.sort(x, descending=True)
    probs = torch.softmax(sorted_x.double(), dim=-1)
    keep = probs.cumsum(-1) - probs < top_p
    return set(order[keep].tolist())


@pytest.mark.parametrize("scale", [12.0, 3.0, 0.3, 0.01])
def test_the_nucleus_equals_a_sort_of_every_token(scale):
    """`nucleus` looks among the 64, then 512 most likely tokens before sorting all: peaked
    logits (a nucleus of a few tokens), broader ones (beyond 64 and 512: the later tries),
    flat ones (every token), and logits with -inf (top-k's mask) keep the same tokens as a
    sort of all of them, most likely first, with their own logits."""
    from unikv.engine.sampling import NUCLEUS_TRIES, nucleus

    g = torch.Generator().manual_seed(int(scale * 100))
    sizes = []
    for top_p in (0.05, 0.5, 0.9, 0.95, 0.999):
        x = torch.randn(49152, generator=g) * scale
        if scale == 0.3:  # top-k's mask: 9,152 tokens left
            x[torch.randperm(49152, generator=g)[:40000]] = float("-inf")
        vals, ids = nucleus(x, top_p)
        assert set(ids.tolist()) == _sorted_nucleus(x, top_p), top_p
        assert torch.equal(vals, x[ids]) and bool((vals[:-1] >= vals[1:]).all())
        sizes.append(len(ids))
    if scale == 3.0:  # the tries in between were taken, and a full sort
        assert min(sizes) <= NUCLEUS_TRIES[0] < max(sizes)
    if scale == 0.01:
        assert max(sizes) > NUCLEUS_TRIES[-1]


def test_categorical_draws_each_index_at_its_weight(monkeypatch):
    """`categorical` draws an index in proportion to its weight (any sum), never a zero
    weight, and is reproducible from a seeded generator; where the uniform number times the
    total rounds up to the total, the last index with weight; NaN or all-zero weights raise."""
    from unikv.engine.sampling import categorical

    w = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, 0.0])
    gen = torch.Generator().manual_seed(7)
    n = 40000
    counts = torch.bincount(torch.tensor([categorical(w, gen) for _ in range(n)]), minlength=6)
    assert counts[[0, 2, 5]].tolist() == [0, 0, 0]
    for i, p in ((1, 0.5), (3, 0.25), (4, 0.25)):
        sigma = (n * p * (1 - p)) ** 0.5
        assert abs(counts[i].item() - n * p) < 4 * sigma, (i, counts)
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [categorical(w, a) for _ in range(50)] == [categorical(w, b) for _ in range(50)]
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0 - 2.0**-53))
    assert categorical(torch.tensor([0.1, 0.2, 0.0]), None) == 1
    monkeypatch.undo()
    for bad in (torch.zeros(4), torch.tensor([0.5, float("nan")])):
        with pytest.raises(RuntimeError, match="cannot sample"):
            categorical(bad, None)


def test_top_k_keeps_the_k_largest_and_their_ties():
    """`top_k`: the k largest logits with their token ids, most likely first, and every logit
    tied with the k-th (as vLLM's and transformers' masks keep them); sampling under top-k (and
    top-p over its candidates) draws token ids, not candidate positions."""
    from unikv.engine.sampling import top_k

    x = torch.tensor([0.5, 3.0, 1.0, 2.0, 1.0, -1.0, 1.0])
    vals, ids = top_k(x, 2)
    assert ids.tolist() == [1, 3] and torch.equal(vals, x[ids])
    vals, ids = top_k(x, 3)  # the 3rd largest is 1.0, held by tokens 2, 4 and 6
    assert ids[:2].tolist() == [1, 3] and sorted(ids[2:].tolist()) == [2, 4, 6]
    assert torch.equal(vals, x[ids])
    g = SamplingParams(temperature=1.0, top_k=2, top_p=0.9, seed=5)
    gen = g.make_generator()
    assert {sample(x, g, gen) for _ in range(200)} == {1, 3}


def test_hostile_sampling_values_still_draw_a_token(monkeypatch):
    """Values a request may send (any finite temperature, any top_k, a top_p of 1e-300, min_p
    1): both draws, gemv.c's and torch's, return a token of finite logit; a top_p too small
    for float32 keeps the most likely token; top_k past 2**31 filters nothing."""
    from unikv.engine import sampling
    from unikv.engine.sampling import spec

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3000, generator=g) * 3
    x[::7] = float("-inf")
    cases = [{"temperature": 1e30}, {"temperature": 1e-4}, {"temperature": 1.0, "top_k": 10**30},
             {"temperature": 1.0, "top_p": 1e-300}, {"temperature": 0.7, "min_p": 1.0},
             {"temperature": 3e38, "top_k": 5, "top_p": 1e-300}]  # fmt: skip
    assert spec(SamplingParams(temperature=1.0, top_k=10**30))[1] == 0
    for torch_only in (False, True):
        if torch_only:  # the path without the C kernels
            monkeypatch.setattr(sampling.gemv, "unavailable", lambda: "hidden")
        for kw in cases:
            p = SamplingParams(seed=1, **kw)
            gen = p.make_generator()
            got = {sample(x, p, gen) for _ in range(30)}
            assert all(torch.isfinite(x[t]) for t in got), (kw, got)
            if kw.get("top_p") == 1e-300 and kw["temperature"] == 1.0 or kw.get("min_p") == 1.0:
                assert got == {int(x.argmax())}, (kw, torch_only)
