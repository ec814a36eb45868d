"""Token pruning (groundwork for `learned_prune`): eviction to the budget, physical compaction,
exact attention over the kept tokens, the baseline scorers, and option errors."""

import json
import math

import pytest
import torch

from unikv import kvstrategies
from unikv.engine.evaluate import perplexity
from unikv.kvstrategies.kv import StepBatch
from unikv.kvstrategies.prune import SCORERS, SHIPPED_HEAD
from unikv.settings.config import PoolConfig, TierConfig

from .conftest import make_english

SPEC = kvstrategies.KVSpec(2, 2, 16, identity="prune-test")
BS = 8


def make(**options):
    cfg = PoolConfig(block_size=BS, tiers=(TierConfig("device", 1 << 22),))
    opts = {"sink_tokens": 2, "recent_window": 8, **options}
    return kvstrategies.create("learned_prune", SPEC, cfg, opts)


def step(s, n, g, hist):
    """Feed n random tokens to sequence 0; check attention against exact attention over the
    tokens the strategy kept (read back) and return them."""
    b = StepBatch([0], [n])
    s.begin_step(b)
    for layer in range(2):
        k, v = torch.randn(2, n, 2, 16, generator=g)
        q = torch.randn(n, 4, 16, generator=g)
        s.append(layer, k, v)
        out = s.attend(layer, q)
        ks, vs = s.read(layer)
        kk, vv = ks[0].repeat_interleave(2, 0), vs[0].repeat_interleave(2, 0)  # [4, S, 16]
        past = kk.shape[1] - n
        scores = torch.einsum("thd,hsd->hts", q, kk) / 4
        mask = torch.arange(kk.shape[1])[None, :] > (past + torch.arange(n))[:, None]
        ref = torch.einsum("hts,hsd->thd", scores.masked_fill(mask, -math.inf).softmax(-1), vv)
        assert torch.allclose(out, ref, atol=1e-5)
        if layer == 0:
            hist.append(k.transpose(0, 1))
    s.end_step()
    if s.wants_token_logprobs:  # what the model hands a surprisal-scoring cache
        tokens = torch.randint(0, 50, (n,), generator=g)
        s.observe_logprobs(b, tokens, torch.randn(n, 50, generator=g).log_softmax(-1))


def kept_keys(s, layer=0):
    """The keys sequence 0 holds in `layer`: [Hkv, tokens, D] (read in a step, then undone)."""
    s.begin_step(StepBatch([0], [1]))
    s.append(layer, torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))
    kept = s.read(layer)[0][0][:, :-1]
    s.abort_step()
    return kept


@pytest.mark.parametrize("scorer", SCORERS)
def test_evicts_to_the_budget_and_attends_exactly_over_what_it_keeps(scorer):
    from unikv.kvstrategies.prune_head import PruneHead

    head = PruneHead(SPEC.num_layers, SPEC.head_dim) if scorer == "head" else None  # untrained
    s = make(scorer=scorer, kept_ratio=0.5, head=head)
    g = torch.Generator().manual_seed(0)
    hist = []
    step(s, 60, g, hist)  # a prefill chunk compacts at once
    assert s.stored_tokens(0) == 30 and s.pool.num_tokens(0) == 30
    for _ in range(40):
        step(s, 1, g, hist)
        assert s.stored_tokens(0) <= math.ceil(0.5 * s.selection._seen[0]) + BS
    # Physically compacted: blocks held match the tokens kept; the bytes are real.
    assert s.pool.allocators["device"].num_used == math.ceil(s.stored_tokens(0) / BS)
    assert s.bytes_used() == s.stored_tokens(0) * SPEC.elements_per_token * 4
    s.free(0)
    assert s.pool.allocators["device"].num_used == 0 and s.bytes_used() == 0


def _feed(s, k, q, more=False):
    """One prompt chunk of sequence 0 with the given keys [n, Hkv, D] and queries [n, Hq, D]."""
    n = k.shape[0]
    s.begin_step(StepBatch([0], [n], [more]))
    for layer in range(2):
        s.append(layer, k, torch.randn(n, 2, 16))
        s.attend(layer, q)
    s.end_step()


def test_eviction_waits_for_the_prompts_end():
    """A prompt fed in chunks keeps every token until its last chunk (the question) is in,
    then evicts to the budget at once; with wait_for_prompt off, each chunk evicts."""
    waits, eager = make(scorer="knorm", kept_ratio=0.5), make(scorer="knorm", kept_ratio=0.5,
                                                            wait_for_prompt=False)  # fmt: skip
    for s in (waits, eager):
        _feed(s, torch.randn(32, 2, 16), torch.randn(32, 4, 16), more=True)
    assert waits.stored_tokens(0) == 32 and eager.stored_tokens(0) == 16
    for s in (waits, eager):
        _feed(s, torch.randn(32, 2, 16), torch.randn(32, 4, 16), more=False)
    assert waits.stored_tokens(0) == 32 and eager.stored_tokens(0) == 32  # 0.5 x 64


@pytest.mark.parametrize("scorer", ["snapkv", "head"])
def test_the_prompts_question_keeps_the_tokens_it_attends_to(scorer):
    """The observation window: the prompt's last rows attend to one early token (its key is
    their query, scaled up); SnapKV's rule and the head's reserved share keep it, streaming
    (no observation) drops it. Observed once per sequence, at the prompt's end only."""
    from unikv.kvstrategies.prune_head import PruneHead

    g = torch.Generator().manual_seed(3)
    n, needle = 64, 10
    k = torch.randn(n, 2, 16, generator=g)
    q = torch.randn(n, 4, 16, generator=g)
    q[-8:] = 3 * k[needle].repeat_interleave(2, 0)  # the question looks for the needle
    head = PruneHead(SPEC.num_layers, SPEC.head_dim) if scorer == "head" else None
    opts = {"kept_ratio": 0.25, "recent_window": 4, "recent_share": 0, "observe_window": 8}
    kept = {}
    for name, o in (("observing", {"scorer": scorer, "head": head}),
                    ("streaming", {"scorer": "streaming"})):  # fmt: skip
        s = make(**opts, **o)
        _feed(s, k, q)
        if s.wants_token_logprobs:
            s.observe_logprobs(StepBatch([0], [n]), torch.zeros(n, dtype=torch.long),
                               torch.zeros(n, 50).log_softmax(-1))  # fmt: skip
        assert s.stored_tokens(0) == 16
        kept[name] = (kept_keys(s)[:, :, None] == k.transpose(0, 1)[:, None]).all(-1).any(1)
    assert kept["observing"][:, needle].all() and not kept["streaming"][:, needle].any()
    assert s.selection._observed == set()  # streaming observes nothing


def test_streaming_keeps_the_sinks_and_the_newest_tokens():
    s = make(scorer="streaming", kept_ratio=0.25)
    g = torch.Generator().manual_seed(1)
    hist = []
    step(s, 64, g, hist)  # keeps 16: 2 sinks + the 14 newest
    expect = torch.cat([hist[0][:, :2], hist[0][:, -14:]], 1)
    assert torch.equal(kept_keys(s), expect)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"scorer": "magic"}, "scorer = 'magic'; allowed: head, streaming, random, knorm"),
        ({"kept_ratio": 0}, r"kept_ratio = 0; expected a number in \(0, 1\]"),
        ({"kept_ratio": 1.5}, r"kept_ratio = 1.5"),
        ({"recent_window": -1}, "recent_window = -1; expected an integer >= 0"),
        ({"recent_share": 2}, r"recent_share = 2; expected a number in \[0, 1\]"),
        ({"granularity": "layer"}, "granularity = 'layer'; allowed: head, token"),
    ],
)
def test_bad_options_name_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        kvstrategies.get("learned_prune").check_options(options)


def test_registered_and_no_longer_the_low_bandwidth_default():
    assert kvstrategies.get("learned_prune").axes == ("dense", "resident", "pruned")
    assert kvstrategies.select("low", PoolConfig())[0] == "sparse_attention"


def test_each_head_keeps_its_own_tokens():
    """Per-(layer, KV head) eviction: with key norms that favour even tokens in head 0 and odd
    ones in head 1, each head keeps its own half (plus sinks and the recent window), and
    attention stays exact over what it keeps (checked in `step`)."""
    s = make(scorer="knorm", kept_ratio=0.5, sink_tokens=0, recent_window=0, recent_share=0)
    n = 32
    k = torch.randn(n, 2, 16)
    k[0::2, 0] *= 10  # knorm evicts large norms: head 0 drops even tokens, head 1 odd ones
    k[1::2, 1] *= 10
    b = StepBatch([0], [n])
    s.begin_step(b)
    for layer in range(2):
        s.append(layer, k, torch.randn(n, 2, 16))
        s.attend(layer, torch.randn(n, 4, 16))
    s.end_step()
    kept = kept_keys(s)  # [Hkv, 16, D]
    assert s.stored_tokens(0) == 16
    assert torch.equal(kept[0], k[1::2, 0]) and torch.equal(kept[1], k[0::2, 1])
    token = make(scorer="knorm", kept_ratio=0.5, sink_tokens=0, recent_window=0, recent_share=0,
                 granularity="token")  # fmt: skip
    token.begin_step(b)
    for layer in range(2):
        token.append(layer, k, torch.randn(n, 2, 16))
        token.attend(layer, torch.randn(n, 4, 16))
    token.end_step()
    kept = kept_keys(token)
    which = (kept[0][:, None] == k[None, :, 0]).all(-1).nonzero()[:, 1]  # tokens head 0 kept
    assert which.numel() == 16 and torch.equal(kept[1], k[which, 1])  # head 1: the same ones


@pytest.mark.slow
def test_real_model_keeps_half_the_kv_and_stays_sane(model, tokenizer):
    ids = tokenizer.encode(make_english(60, seed=5))[:768]
    spec = model.kv_spec()
    ref = perplexity(model, ids, kvstrategies.create("full", spec))
    s = kvstrategies.create(
        "learned_prune", spec, options={"scorer": "streaming", "kept_ratio": 0.5}
    )
    got = perplexity(model, ids, s)
    assert 0.49 <= got.kept_ratio <= 0.55
    assert got.kv_bytes < 0.56 * ref.kv_bytes
    # A sanity bound, not a quality target: this generated text repeats a small vocabulary, so
    # copying from far back matters and dropping half of it costs a lot (measured +53%).
    assert ref.ppl < got.ppl < 2 * ref.ppl


@pytest.mark.parametrize("per_layer", [False, True])
def test_head_file_round_trip(tmp_path, per_layer):
    """Both head forms save and load with their shape; the per-layer form gives each layer its
    own weights (the same input scores differently by layer), the shared one a layer embedding."""
    from unikv.kvstrategies.prune_head import HeadMismatch, PruneHead

    torch.manual_seed(0)
    head = PruneHead(3, 16, hidden=8, per_layer=per_layer)
    path = tmp_path / "h.pt"
    head.save(path, "m", 2, {})
    got = PruneHead.load(path, "m", (3, 2, 16))
    assert got.per_layer == per_layer and got.num_parameters == head.num_parameters
    x = torch.randn(4, 32).expand(3, 4, 32)
    layers = torch.arange(3)[:, None].expand(3, 4)
    out = got(x, layers)
    assert torch.equal(out, head(x, layers)) and out.shape == (3, 4)
    assert not torch.allclose(out[0], out[1])  # layers differ
    with pytest.raises(HeadMismatch, match=r"KV shape \(3, 2, 16\).*\(3, 2, 8\)"):
        PruneHead.load(path, "m", (3, 2, 8))


@pytest.mark.slow
def test_tune_trains_a_head_that_loads_and_scores(tmp_path, capsys, model):
    from unikv.cli.main import main
    from unikv.kvstrategies.prune_head import HeadMismatch, PruneHead

    text = tmp_path / "train.txt"
    text.write_text(make_english(80, seed=9))
    out = tmp_path / "head"
    argv = ["tune", "--kv_optimization=learned_prune", "--text", str(text), "--out", str(out)]
    small = ["--windows", "4", "--window", "160", "--epochs", "1", "--gap", "16", "--json"]
    assert main([*argv, *small]) == 0
    made = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert 100_000 <= made["parameters"] <= 140_000 and made["samples"] > 0
    assert main([*argv, *small]) == 2  # exists: needs --resume
    assert "--resume" in capsys.readouterr().err
    assert main([*argv, *small, "--resume", "--per-layer"]) == 0  # one small MLP per layer
    per_layer = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert 100_000 <= per_layer["parameters"] < made["parameters"]
    assert main([*argv, *small, "--resume"]) == 0  # back to the shared head
    made = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert main(["tune", "--kv_optimization=magic", "--text", str(text), "--out", "x"]) == 2
    assert "allowed: hybrid_fp16_int4, learned_prune" in capsys.readouterr().err
    spec = model.kv_spec()
    shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    head = PruneHead.load(out / "prune_head.pt", spec.identity, shape)
    s = kvstrategies.create(
        "learned_prune", spec, options={"scorer": "head", "head": str(out / "prune_head.pt")}
    )
    assert s.selection.head is not None and head.num_parameters == made["parameters"]
    with pytest.raises(HeadMismatch, match="was trained for .* this model is 'other'"):
        PruneHead.load(out / "prune_head.pt", "other", shape)
    with pytest.raises(ValueError, match="not found"):
        PruneHead.load(tmp_path / "nope.pt", spec.identity, shape)


@pytest.mark.slow
def test_surprisal_keeps_the_needle_that_recency_drops(model, tokenizer):
    """At half the KV, the write-time surprisal rule finds the passkey at every depth; a
    recency window of the same size loses the needle placed early in the prompt."""
    from unikv.engine.passkey import passkey

    spec = model.kv_spec()
    opts = {"kept_ratio": 0.5, "recent_share": 0.75, "observe_window": 0}  # the rule alone
    sur = kvstrategies.create("learned_prune", spec, options={"scorer": "surprisal", **opts})
    assert sur.wants_token_logprobs
    got = passkey(model, tokenizer, sur, 512, 3)
    assert got.accuracy == 1.0 and 0.45 <= got.kept_ratio <= 0.56
    streaming = kvstrategies.create(
        "learned_prune", spec, options={"scorer": "streaming", "kept_ratio": 0.5}
    )
    assert passkey(model, tokenizer, streaming, 512, 3).by_depth["10%"] == 0.0


@pytest.mark.slow
def test_the_shipped_head_loads_for_the_packaged_model_and_not_for_others(model, caplog):
    from unikv.kvstrategies.prune_head import HeadMismatch

    spec = model.kv_spec()
    s = kvstrategies.create(
        "learned_prune", spec, options={"scorer": "head"}
    )  # head None: the shipped file
    head = s.selection.head
    assert head is not None and head.num_parameters < 140_000 and SHIPPED_HEAD.is_file()
    other = kvstrategies.KVSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                identity="another-model")  # fmt: skip
    with pytest.raises(HeadMismatch, match="another-model"):  # a given head must fit
        kvstrategies.create(
            "learned_prune", other, options={"scorer": "head", "head": str(SHIPPED_HEAD)}
        )
    # No head given, the shipped one is for another model: the surprisal rule, with a warning.
    s = kvstrategies.create("learned_prune", other, options={"scorer": "head"})
    assert "the shipped pruning head is for the packaged SmolLM2" in caplog.text
    assert s.selection.head is None and s.selection.scorer == "surprisal" and s.wants_token_logprobs


def test_config_errors_name_the_file_and_key(tmp_path):
    cfg = tmp_path / "prune.toml"
    cfg.write_text('strategy = "learned_prune"\n[strategy_options]\nkept_ratio = 1.5\n')
    with pytest.raises(ValueError, match=rf"{cfg}: \[strategy_options\] .*kept_ratio = 1.5"):
        kvstrategies.build(SPEC, config=str(cfg))
    cfg.write_text(f'strategy = "learned_prune"\n[strategy_options]\nhead = "{tmp_path}/no.pt"\n')
    with pytest.raises(ValueError, match=rf"{cfg}: .*head = '.*no.pt': pruning head file not"):
        kvstrategies.build(SPEC, config=str(cfg))
    cfg.write_text('strategy = "learned_prune"\n[strategy_options]\nscorer = "streaming"\n')
    assert kvstrategies.build(SPEC, config=str(cfg)).strategy.selection.scorer == "streaming"


def test_latent_cache_falls_back_to_surprisal_and_prunes(caplog):
    """On a latent (MLA) cache the shipped head (another model's) cannot rank: the surprisal
    rule does, over keys alone (values are their first channels); a given head is refused."""
    spec = kvstrategies.KVSpec(2, 1, 24, identity="mla-test", latent=True, value_dim=16,
                               softmax_scale=0.25)  # fmt: skip
    cfg = PoolConfig(block_size=BS, tiers=(TierConfig("device", 1 << 20),))
    opts = {"sink_tokens": 2, "recent_window": 8}
    s = kvstrategies.create("learned_prune", spec, cfg, opts)
    assert "ranking by surprisal" in caplog.text
    assert s.selection.head is None and s.selection.scorer == "surprisal" and s.wants_token_logprobs
    assert s.pool.layout.page_bytes == BS * spec.elements_per_token * 4  # keys only
    g = torch.Generator().manual_seed(0)
    for n in (40, *[1] * 12):
        b = StepBatch([0], [n])
        s.begin_step(b)
        for layer in range(2):
            k, q = torch.randn(n, 1, 24, generator=g), torch.randn(n, 4, 24, generator=g)
            s.append(layer, k, k[..., :16])
            out = s.attend(layer, q)
            ks, vs = s.read(layer)
            kk = ks[0].expand(4, -1, -1)  # the one latent head, shared by the 4 query heads
            past = kk.shape[1] - n
            scores = torch.einsum("thd,hsd->hts", q, kk) * 0.25
            mask = torch.arange(kk.shape[1])[None, :] > (past + torch.arange(n))[:, None]
            probs = scores.masked_fill(mask, -math.inf).softmax(-1)
            torch.testing.assert_close(out, torch.einsum("hts,hsd->thd", probs, kk[..., :16]))
            assert torch.equal(vs[0], ks[0][..., :16])
        s.end_step()
        s.observe_logprobs(b, torch.randint(0, 50, (n,), generator=g),
                           torch.randn(n, 50, generator=g).log_softmax(-1))  # fmt: skip
    assert s.stored_tokens(0) < 52 and s.selection.evicted > 0
    assert s.bytes_used() == s.stored_tokens(0) * 2 * 24 * 4
    with pytest.raises(ValueError, match="latent .*leave head unset"):
        kvstrategies.create("learned_prune", spec, cfg, {"head": str(SHIPPED_HEAD)})
