"""DeepSeek-V2/V3 (multi-head latent attention + DeepSeekMoE) against transformers' own
implementation: small random models of several shapes saved by transformers, loaded by unikv
from the checkpoint directory, run through the pool's latent cache.

Shapes: V3 with q low-rank, groups (noaux_tc), correction bias and YaRN; V3 without q low-rank
nor groups, non-interleaved RoPE; V2 greedy softmax routing; V2 group-limited with q low-rank.
"""

import json
import math

import pytest
import torch

from unikv import kvstrategies
from unikv.engine.assembly import create_kv
from unikv.engine.config import ModelLoadError
from unikv.engine.deepseek import DeepseekModel, kv_footprint
from unikv.engine.loading import load_model
from unikv.kvstrategies.kv import StepBatch
from unikv.settings.config import PoolConfig, TierConfig

COMMON = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
              qk_nope_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
              max_position_embeddings=512)  # fmt: skip
SHAPES = {
    "v3_qlora_groups_yarn": ("V3", dict(
        num_hidden_layers=3, q_lora_rank=48, n_group=4, topk_group=2, first_k_dense_replace=1,
        n_shared_experts=1, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
            "rope_theta": 10000.0})),
    "v3_plain_q_no_groups": ("V3", dict(
        num_hidden_layers=3, q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=1,
        n_shared_experts=2, norm_topk_prob=False, rope_interleave=False)),
    "v2_greedy": ("V2", dict(
        num_hidden_layers=3, q_lora_rank=None, first_k_dense_replace=1, n_shared_experts=2)),
    "v2_group_limited": ("V2", dict(
        num_hidden_layers=3, q_lora_rank=32, first_k_dense_replace=1, n_shared_experts=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=16.0)),
}  # fmt: skip


def build_reference(kind: str, vocab: int, **config):
    """A transformers DeepSeek model with weights large enough to make routing and greedy
    decoding decisive (the default init gives near-uniform logits)."""
    import transformers as tf

    cls, conf = {
        "V3": (tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config),
        "V2": (tf.DeepseekV2ForCausalLM, tf.DeepseekV2Config),
    }[kind]
    extra = {"num_nextn_predict_layers": 0} if kind == "V3" else {}
    torch.manual_seed(0)
    model = cls(conf(**COMMON, **config, **extra, vocab_size=vocab)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.15)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.normal_(0.0, 0.3)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    """name -> (checkpoint directory, transformers model), the tokenizer saved alongside."""
    from unikv.engine.hf_loader import save_tokenizer

    vocab = tokenizer._tk.get_vocab_size()
    out = {}
    for name, (kind, config) in SHAPES.items():
        path = tmp_path_factory.mktemp(name)
        ref = build_reference(kind, vocab, **config)
        ref.save_pretrained(path)
        save_tokenizer(tokenizer, path)
        out[name] = (path, ref)
    return out


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, checkpoints):
    """(unikv model, transformers model) of one shape."""
    path, ref = checkpoints[request.param]
    model, _ = load_model(str(path), progress=False)
    return model, ref


def pool_strategy(model, name="full", blocks=64, tmp_path=None, **options):
    spec = model.kv_spec()
    cls = kvstrategies.get(name)
    opts = cls.check_options(options)
    page = cls.layout(spec, 16, opts).page_bytes
    tiers = [TierConfig("device", blocks * page), TierConfig("host", 64 * page)]
    if tmp_path is not None and not cls.evicts:  # a pruned cache refuses a store tier
        tiers.append(TierConfig("ssd", 64 * page, path=str(tmp_path / f"ssd-{name}")))
    return create_kv(name, spec, PoolConfig(block_size=16, tiers=tuple(tiers)), opts)


def test_logits_match_transformers_through_the_latent_cache(pair):
    """Prefill and then chunks through the pool's latent cache give transformers' logits
    (1e-4, float32), past YaRN's original context."""
    model, ref = pair
    ids = torch.randint(0, model.cfg.vocab_size, (100,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    kv = pool_strategy(model)
    got = []
    for start, end in ((0, 70), (70, 71), (71, 100)):
        step = StepBatch([0], [end - start])
        got.append(model.forward(ids[start:end], torch.arange(start, end), kv, step))
    got = torch.cat(got)
    assert (got - want).abs().max().item() < 1e-4
    assert kv.stored_tokens(0) == 100
    kv.close()


def test_greedy_continuation_matches_transformers(pair, tokenizer):
    """The engine's greedy decode (latent cache, continuous batching) produces transformers'
    greedy tokens (transformers with its own cache)."""
    import asyncio

    from unikv.engine.engine import Engine
    from unikv.engine.sampling import SamplingParams

    model, ref = pair
    prompt = tokenizer.encode("The KV cache of a latent attention model")
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    want = out[0, len(prompt) :].tolist()

    async def ours():
        engine = Engine(model, tokenizer, kv=pool_strategy(model))
        try:
            params = SamplingParams(max_new_tokens=12, ignore_eos=True)
            return (await engine.generate(prompt, params)).token_ids
        finally:
            await engine.close()
            engine.kv.close()

    assert asyncio.run(ours()) == want


def test_perplexity_through_the_cache_equals_the_reference(checkpoints, english_text, tokenizer):
    """The DESIGN protocol (prefill, then chunks) through the latent cache scores a text as one
    transformers forward pass does."""
    from unikv.engine.evaluate import perplexity

    path, ref = checkpoints["v3_qlora_groups_yarn"]
    model, _ = load_model(str(path), progress=False)
    ids = tokenizer.encode(english_text)[:160]
    res = perplexity(model, ids, pool_strategy(model), prefill=64, chunk=16)
    with torch.no_grad():
        logits = ref(torch.tensor([ids])).logits[0, 63:-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[64:]))
    assert res.scored == len(ids) - 64
    assert math.isclose(res.nll, nll.item(), rel_tol=1e-5)
    # 576-per-token-like latent: K only, one "head", no separate values
    spec = model.kv_spec()
    assert spec.latent and spec.num_kv_heads == 1 and spec.head_dim == 32 + 8
    assert res.bits_per_element == 32.0  # float32 latent, nothing stored twice


def test_latent_cache_is_smaller_than_multi_head_kv(checkpoints):
    path, _ = checkpoints["v2_greedy"]
    model, _ = load_model(str(path), progress=False)
    kv = pool_strategy(model)
    n = 48
    model.forward(torch.arange(n), torch.arange(n), kv, StepBatch([0], [n]))
    latent = (32 + 8) * 3 * 4  # (kv_lora_rank + rope) x layers x float32
    assert kv.bytes_used() == n * latent
    foot = kv_footprint(model.cfg, torch.float32)
    assert foot["latent_bytes_per_token"] == latent
    assert foot["mha_bytes_per_token"] == 3 * 4 * (24 + 16) * 4  # layers x heads x (qk + v)
    # DeepSeek-V3's published shape: 576 latent channels against 128 x (192 + 128) per layer
    kv.close()


@pytest.mark.parametrize(
    "strategy", ["full", "hierarchical_offload", "learned_prune", "hybrid_fp16_int4"]
)
def test_strategies_serve_the_latent_cache(checkpoints, tmp_path, strategy):
    """Every latent-capable strategy runs the model over its latent cache; the lossless ones
    give the reference logits (the lossy ones are held to their tolerance by the contract)."""
    path, ref = checkpoints["v3_qlora_groups_yarn"]
    model, _ = load_model(str(path), progress=False)
    cls = kvstrategies.get(strategy)
    kv = pool_strategy(model, strategy, tmp_path=tmp_path, **cls.contract_options)
    ids = torch.randint(0, model.cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    got = []
    for start in range(0, 90, 30):
        step = StepBatch([0], [30])
        got.append(model.forward(ids[start : start + 30], torch.arange(start, start + 30), kv,
                                 step))  # fmt: skip
    got = torch.cat(got)
    assert torch.isfinite(got).all()
    if cls.lossless and not cls.evicts:
        assert (got - want).abs().max().item() < 1e-4
    kv.free(0)
    assert kv.bytes_used() == 0
    kv.close()


def test_hf_router_semantics_are_used(checkpoints):
    """The loaded configs carry each architecture's router: V3 sigmoid + bias + noaux_tc,
    V2 softmax greedy / group-limited."""
    moe = {n: load_model(str(p), progress=False)[0].cfg.moe for n, (p, _) in checkpoints.items()}
    v3 = moe["v3_qlora_groups_yarn"]
    assert (v3.scoring, v3.topk_method) == ("sigmoid", "noaux_tc")
    assert (v3.num_groups, v3.topk_groups) == (4, 2)
    assert v3.norm_topk and v3.routed_scaling == 2.5
    assert (moe["v2_greedy"].scoring, moe["v2_greedy"].topk_method) == ("softmax", "greedy")
    assert moe["v2_group_limited"].topk_method == "group_limited_greedy"


# ---- bad input -------------------------------------------------------------------------------


def _edit_config(path, **changes):
    file = path / "config.json"
    raw = json.loads(file.read_text())
    raw.update(changes)
    file.write_text(json.dumps(raw))


@pytest.fixture
def broken(tmp_path, tokenizer):
    """A fresh copy of a small V3 checkpoint to break."""
    from unikv.engine.hf_loader import save_tokenizer

    ref = build_reference("V3", 300, **SHAPES["v3_qlora_groups_yarn"][1])
    ref.save_pretrained(tmp_path)
    save_tokenizer(tokenizer, tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"architectures": ["DeepseekV4ForCausalLM"]}, r"unsupported architecture 'DeepseekV4"),
        ({"n_group": 3}, r"n_routed_experts = 8 is not a multiple of n_group = 3"),
        ({"topk_group": 5}, r"topk_group = 5 must be in 1..n_group \(4\)"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok = 9 must be in 1..n_routed_experts"),
        ({"qk_rope_head_dim": 7}, r"qk_rope_head_dim = 7 must be even"),
        ({"kv_lora_rank": None}, r"missing key 'kv_lora_rank'"),
        ({"scoring_func": "relu"}, r"scoring_func = 'relu'; supported: softmax, sigmoid"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantized checkpoints \(fp8\)"),
        # bounded by the tensors before the expected ones are listed (2^31 layers' names)
        ({"num_hidden_layers": 2**31 - 1}, r"2147483647 layers declared, the checkpoint holds"),
    ],
)
def test_bad_configs_name_the_key(broken, changes, message):
    _edit_config(broken, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(broken), progress=False)


def test_inconsistent_dims_name_the_tensor_and_expected_shape(broken):
    """A config whose dimensions disagree with the weights: the first tensor that does not fit
    is named with both shapes."""
    _edit_config(broken, kv_lora_rank=24)
    with pytest.raises(
        ModelLoadError,
        match=r"tensor model\.layers\.0\.self_attn\."
        r"kv_a_proj_with_mqa\.weight has shape \(40, 64\), want \(32, 64\)",
    ):
        load_model(str(broken), progress=False)


def test_missing_and_misshapen_tensors_and_shards(broken):
    from safetensors.torch import load_file, save_file

    file = broken / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError,
        match=r"missing tensor model\.layers\.2\.mlp\.experts\.5\."
        "up_proj.weight",
    ):
        load_model(str(broken), progress=False)
    tensors["model.layers.2.mlp.experts.5.up_proj.weight"] = torch.zeros(31, 64)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError,
        match=r"experts\.5\.up_proj\.weight has shape \(31, 64\), "
        r"want \(32, 64\)",
    ):
        load_model(str(broken), progress=False)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"shard model-00002-of-00002\.safetensors is missing"):
        load_model(str(broken), progress=False)


@pytest.mark.parametrize("kind", ["hybrid_fp16_int4", "learned_prune"])
def test_tune_refuses_a_latent_model(checkpoints, tmp_path, capsys, kind):
    from unikv.cli.main import main

    text = tmp_path / "t.txt"
    text.write_text("Some text to tune on. " * 200)
    argv = ["tune", f"--kv_optimization={kind}", "--model", str(checkpoints["v2_greedy"][0]),
            "--text", str(text), "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 2
    assert "has a latent (MLA) cache, not supported yet" in capsys.readouterr().err


def test_model_class_refuses_a_llama_config(model):
    with pytest.raises(ValueError, match="not a multi-head latent attention model"):
        DeepseekModel(model.cfg, {})


@pytest.mark.slow
def test_cli_runs_and_scores_a_checkpoint_dir(checkpoints, tmp_path, capsys):
    """`--model DIR` works for `run` and `eval ppl`; the run's memory report gives the latent
    cache's bytes per token against multi-head KV."""
    from unikv.cli.main import main

    path, _ = checkpoints["v2_group_limited"]
    argv = ["run", "--model", str(path), "--prompt", "Hello there", "--max-new-tokens", "6"]
    assert main([*argv, "--strategy", "full"]) == 0
    out = capsys.readouterr().out
    assert "[latent KV (MLA): 480 B per token in float32, against 1.9 KiB for multi-head" in out
    text = tmp_path / "t.txt"
    text.write_text("The river ran past the mill and the bridge. " * 40)
    config = tmp_path / "moe.toml"
    config.write_text('[moe]\ntopk = "blockwise"\ntopk_block = 4\nexpert_cache = 0.5\n')
    argv = ["eval", "ppl", "--model", str(path), "--text", str(text), "--tokens", "128",
            "--prefill", "64", "--strategy", "full", "--config", str(config), "--json"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["tokens"] == 128 and math.isfinite(res["ppl"])
    # the [moe] table survives --strategy overriding the file's strategy
    assert res["moe"].startswith("top-k blockwise (blocks of 4): configured")
    assert "8 of 16 routed experts on the device" in res["moe"]  # 2 MoE layers x 8


# ---- routing choice and experts in the pool's tiers -------------------------------------------


def test_config_places_experts_in_tiers_and_picks_the_topk(checkpoints, tmp_path):
    """A config's [moe] table: blockwise top-k and a quarter of the experts on the device, half
    of the rest on host, the remainder on SSD. Logits are the same as all-resident exact
    routing when blockwise keeps enough winners; the report gives the hit rate."""
    from unikv.settings.config import MoEOptions
    from unikv.settings.profiles import load_profile

    path, ref = checkpoints["v3_qlora_groups_yarn"]
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    model, _ = load_model(str(path), progress=False)
    tiers = (TierConfig("device", 1 << 24), TierConfig("ssd", 1 << 24, path=str(tmp_path)))
    moe = MoEOptions(topk="blockwise", topk_block=4, expert_cache=0.25, expert_host=0.5)
    why = model.configure_moe(PoolConfig(tiers=tiers, moe=moe), load_profile("cpu"))
    assert why.startswith("top-k blockwise (blocks of 4): configured [moe] topk = 'blockwise'")
    assert "4 of 16 routed experts on the device" in why
    placed = model.experts.stats()
    assert placed["residents"] == {"device": 4, "host": 6, "ssd": 6}
    assert placed["hits"] == placed["misses"] == 0  # counts start with serving
    kv = pool_strategy(model)
    got = torch.cat([model.forward(ids[s : s + 8], torch.arange(s, s + 8), kv, StepBatch([0], [8]))
                     for s in range(0, 40, 8)])  # fmt: skip
    assert (got - want).abs().max().item() < 1e-4
    report = model.memory_report()
    assert report.routing == {"topk": "blockwise", "block": 4}
    ex = report.experts
    # each step looks up its distinct experts once: >= top-k of them, in 2 MoE layers, 5 steps
    assert ex["misses"] > 0 and ex["hits"] + ex["misses"] >= 5 * 2 * 2
    assert ex["promotions"]["ssd"] > 0
    with pytest.raises(ValueError, match=r"experts were already placed at \(0.25, 0.5\)"):
        model.configure_moe(PoolConfig(tiers=tiers), load_profile("cpu"))
    kv.close()


def test_profile_chooses_the_topk_and_ssd_placement_needs_an_ssd_tier(checkpoints):
    from unikv.settings.config import MoEOptions
    from unikv.settings.profiles import load_profile

    model, _ = load_model(str(checkpoints["v2_greedy"][0]), progress=False)
    why = model.configure_moe(PoolConfig(), load_profile("mlu370"))
    assert model.topk == "blockwise" and "the mlu370 profile prefers 'blockwise'" in why
    model.configure_moe(PoolConfig(), load_profile("cuda"))
    assert model.topk == "exact"
    with pytest.raises(ValueError, match=r"expert_host = 0.0 puts experts on the SSD tier, but"):
        model.configure_moe(PoolConfig(moe=MoEOptions(expert_cache=0.5, expert_host=0.0)),
                            load_profile("cpu"))  # fmt: skip
