"""hybrid_fp16_int4: quantization primitives, attention on the packed form against attention over
the strategy's own reconstruction (C kernel and PyTorch path), calibration files, bad options,
and quality on the real model."""

import math

import pytest
import torch

from unikv import kvstrategies
from unikv.engine.evaluate import perplexity
from unikv.engine.recording import ensure_calibration
from unikv.kernels import native as kernels
from unikv.kvstrategies.calibration import CalibrationMismatch, ChannelStats
from unikv.kvstrategies.kv import StepBatch
from unikv.kvstrategies.packed import channel_plan
from unikv.kvstrategies.quant import channel_counts, dequantize, pack, quantize, unpack
from unikv.settings.config import PoolConfig, TierConfig

from .conftest import make_english

NAME = "hybrid_fp16_int4"
LAYERS, HEADS, QHEADS, DIM, BS = 2, 2, 6, 32, 16
SPEC = kvstrategies.KVSpec(LAYERS, HEADS, DIM, torch.float32, "unit", QHEADS // HEADS)
# A latent (MLA) cache: one KV head of 24 latent + 8 RoPE channels read by all query heads.
LATENT = kvstrategies.KVSpec(LAYERS, 1, DIM, torch.float32, "unit-mla", QHEADS, latent=True,
                             value_dim=24, softmax_scale=0.3)  # fmt: skip


@pytest.mark.parametrize("scales", ["fp16", "fp8"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_roundtrip_and_quantization_error(bits, scales):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(3, 5, 64, generator=g) * 4 + 3
    codes, scale, low = quantize(x, bits, -1, scales)
    assert codes.max() <= 2**bits - 1
    assert torch.equal(unpack(pack(codes, bits), bits), codes)
    assert pack(codes, bits).shape[-1] == 64 * bits // 8
    err = (dequantize(codes, scale, low) - x).abs()
    # Rounding error is at most half a step (plus fp16 rounding of scale and low).
    assert (err <= scale.float() * 0.5 + 1e-2 * x.abs().amax(-1, keepdim=True)).all()


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("offset", [0.0, 3.0, 300.0])
def test_quantizing_again_does_not_drift(bits, offset):
    """Re-packing compacted blocks quantizes values that are already quantized: 40 passes keep
    every scale and leave the error within 1.2x of one pass (the plain fp8 rule grew int2
    scales 32x and the error up to 100x, and pruned x hybrid fell apart)."""
    torch.manual_seed(0)
    x = torch.randn(64, 64) * torch.rand(64, 1) + offset * torch.randn(64, 1)
    codes, scale, zero = quantize(x, bits, -1, "fp8")
    first = y = dequantize(codes, scale, zero)
    for _ in range(40):
        c, s, z = quantize(y, bits, -1, "fp8", again=True)
        assert (s.float() <= scale.float()).all()
        y = dequantize(c, s, z)
    assert (y - x).abs().mean() <= 1.2 * (first - x).abs().mean()


@pytest.mark.parametrize("scales", ["fp16", "fp8"])
def test_blocks_of_several_layers_pack_at_once_as_one_by_one(scales):
    """A step's completed blocks are packed in one codec call over every layer
    (`sink_blocks`: the blocks whose leading tokens are sinks, left out of their key ranges):
    the same records, bit for bit, as one call per block. The sinks are far out of range, so
    a block that counted them would differ."""
    s = make({"scales": scales})
    codec, t = s.format.codec, s.format.T
    g = torch.Generator().manual_seed(3)
    k = torch.randn(5, HEADS, t, DIM, generator=g)
    v = torch.randn(5, HEADS, t, DIM, generator=g)
    k[[0, 3], :, :4] += 50.0  # blocks 0 and 3 begin with sinks
    sinks = torch.tensor([0, 3])
    together = codec.quantize(k, v, 4, sink_blocks=sinks)
    alone = [codec.quantize(k[i : i + 1], v[i : i + 1], 4 if i in (0, 3) else 0) for i in range(5)]
    assert torch.equal(together, torch.cat(alone))
    assert not torch.equal(together[1:2], codec.quantize(k[1:2], v[1:2], 4))  # a sink-free block
    s.close()


def test_channel_counts_pack_into_whole_bytes():
    for share in (0.0, 0.03, 0.0625, 0.2, 1.0):
        for low in (0.0, 0.5, 0.8):
            if share + low > 1:
                continue
            nf, nm, nl = channel_counts(64, share, low, 4, 2)
            assert nf + nm + nl == 64 and nm % 2 == 0 and nl % 4 == 0


def make(options=None, kernel=True, blocks=64, spec=SPEC, bs=BS):
    cls = kvstrategies.get(NAME)
    opts = cls.check_options(options)
    layout = cls.layout(spec, bs, opts)
    cfg = PoolConfig(block_size=bs, tiers=(TierConfig("device", blocks * layout.page_bytes),))
    s = kvstrategies.create(NAME, spec, cfg, options)
    if not kernel:
        s.format.attention.kernel = None
    return s


def reference(spec, q, k, v, num_past):
    """Exact causal attention; q: [T, Hq, D], k: [Hkv, S, D], v: [Hkv, S, Dv]."""
    t = q.shape[0]
    k = k.repeat_interleave(QHEADS // spec.num_kv_heads, 0)
    v = v.repeat_interleave(QHEADS // spec.num_kv_heads, 0)
    scores = torch.einsum("thd,hsd->hts", q, k) * spec.scale
    mask = torch.arange(k.shape[1])[None, :] > (num_past + torch.arange(t))[:, None]
    return torch.einsum("hts,hsd->thd", scores.masked_fill(mask, -math.inf).softmax(-1), v)


STEPS = [([0], [13]), ([0, 1], [1, 21])] + [([1, 0], [1, 1])] * 10 + [([0], [5]), ([1], [40])]


def drive(s, seed=0, steps=STEPS):
    """Feed random steps; return (max error vs own reconstruction, vs exact, kernel outputs)."""
    g = torch.Generator().manual_seed(seed)
    spec = s.spec
    h, dv = spec.num_kv_heads, spec.v_dim
    hist, e_rec, e_exact, outs = {}, 0.0, 0.0, []
    for sids, lens in steps:
        b = StepBatch(sids, lens)
        for sid, n in zip(sids, lens, strict=True):
            assert s.reserve(sid, n)
        s.begin_step(b)
        for layer in range(LAYERS):
            n = b.num_tokens
            k = torch.randn(n, h, DIM, generator=g) * 2
            v = k[..., :dv] if spec.latent else torch.randn(n, h, DIM, generator=g)
            q = torch.randn(n, QHEADS, DIM, generator=g)
            s.append(layer, k, v)
            ks, vs = s.read(layer)
            out = s.attend(layer, q)
            outs.append(out)
            for i, sid in enumerate(sids):
                rows, past = b.rows(i), s.format.step.past[i]
                pk, pv = hist.get((sid, layer), (torch.empty(h, 0, DIM), torch.empty(h, 0, dv)))
                pk = torch.cat([pk, k[rows].transpose(0, 1)], 1)
                pv = torch.cat([pv, v[rows].transpose(0, 1)], 1)
                hist[(sid, layer)] = (pk, pv)
                assert ks[i].shape == pk.shape and vs[i].shape == pv.shape
                rec = reference(spec, q[rows], ks[i], vs[i], past)
                e_rec = max(e_rec, (out[rows] - rec).abs().max().item())
                exact = reference(spec, q[rows], pk, pv, past)
                e_exact = max(e_exact, (out[rows] - exact).abs().max().item())
        s.end_step()
    return e_rec, e_exact, outs


OPTION_SETS = [
    {},
    {"v_fp16_share": 0.25, "v_low_share": 0.5, "fp16_share": 0.0},
    {"low_share": 0.0},
    {"fp16_share": 0.0, "low_share": 0.0, "bits": 8},
    {"fp16_share": 0.25, "bits": 2, "low_share": 0.0},
    {"sink_tokens": 0},
    {"scales": "fp8", "fp16_share": 0.0, "low_share": 0.625, "v_low_share": 0.625},
    # No quantized class at all on one side: no key (or value) scale headers to read.
    {"fp16_share": 1.0, "low_share": 0.0},
    {"v_fp16_share": 1.0, "v_low_share": 0.0},
    {"scales": "fp8", "fp16_share": 1.0, "low_share": 0.0, "v_fp16_share": 1.0, "v_low_share": 0.0},
]


@pytest.mark.parametrize("spec", [SPEC, LATENT], ids=["mha", "latent"])
@pytest.mark.parametrize("options", OPTION_SETS)
def test_attends_exactly_over_its_own_reconstruction(options, spec):
    """Attention on the packed form equals exact attention over what the strategy stores."""
    e_rec, _, torch_outs = drive(make(options, kernel=False, spec=spec))
    assert e_rec < 1e-5
    s = make(options, kernel=True, spec=spec)
    if s.format.attention.kernel is None:
        pytest.skip(f"C kernel unavailable: {kernels.KERNEL_ERROR}")
    e_rec_k, _, kernel_outs = drive(s)
    assert e_rec_k < 1e-5
    assert (
        max((a - b).abs().max().item() for a, b in zip(torch_outs, kernel_outs, strict=True)) < 1e-5
    )


@pytest.mark.parametrize("bs", [BS, 64])
@pytest.mark.parametrize("options", [OPTION_SETS[0], OPTION_SETS[6]], ids=["default", "fp8"])
def test_the_kernel_is_exact_under_every_instruction_set(options, bs, isa):
    """hybrid_attend.c is C on vectors of each instruction set's width: built for each one
    this CPU runs (AVX-512, AVX2 with AVX-512 hidden, baseline x86-64), it attends exactly,
    over 16-token blocks (a 2-bit channel's codes shorter than a vector) and 64-token ones
    (the packaged model's: every code run a whole number of vectors)."""
    steps = STEPS + [([0], [64]), ([1, 0], [1, 1]), ([1, 0], [1, 1])]  # packed 64-token blocks
    _, _, torch_outs = drive(make(options, kernel=False, bs=bs), steps=steps)
    s = make(options, kernel=True, bs=bs)
    if s.format.attention.kernel is None:
        pytest.skip(f"C kernel unavailable: {kernels.KERNEL_ERROR}")
    assert isa in kernels.status()
    e_rec_k, _, kernel_outs = drive(s, steps=steps)
    assert s.stored_tokens(0) > bs  # at least one whole block, packed
    assert e_rec_k < 1e-5
    assert (
        max((a - b).abs().max().item() for a, b in zip(torch_outs, kernel_outs, strict=True)) < 1e-5
    )


def test_more_bits_less_error():
    errors = [drive(make({"fp16_share": 0.0, "low_share": 0.0, "bits": b}))[1] for b in (2, 4, 8)]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.02


def test_bytes_count_every_field():
    s = make({"fp16_share": 0.0, "low_share": 0.0, "bits": 4, "sink_tokens": 2, "scales": "fp16"})
    b = StepBatch([0], [2 * BS + 3])
    assert s.reserve(0, 2 * BS + 3)
    s.begin_step(b)
    for layer in range(LAYERS):
        s.append(layer, torch.randn(2 * BS + 3, HEADS, DIM), torch.randn(2 * BS + 3, HEADS, DIM))
        s.attend(layer, torch.randn(2 * BS + 3, QHEADS, DIM))
    s.end_step()
    # Per block, layer and head: key codes + key scale/low per channel + value codes + value
    # scale/low per token (one class, fp16), plus 2 sinks and 3 tail tokens at fp16.
    rec = DIM * BS // 2 + 2 * 2 * DIM + BS * DIM // 2 + 2 * BS * 2
    dense = (2 + 3) * LAYERS * 2 * HEADS * DIM * 2
    assert s.bytes_used() == 2 * LAYERS * HEADS * rec + dense
    s.free(0)
    assert s.bytes_used() == 0 and s.bytes_reserved() == 0


def test_latent_stores_keys_only():
    """A latent cache's record has no value fields, its side buffers no value part."""
    s = make(
        {"fp16_share": 0.0, "low_share": 0.0, "bits": 4, "sink_tokens": 2, "scales": "fp16"},
        spec=LATENT,
    )
    n = 2 * BS + 3
    assert s.reserve(0, n)
    s.begin_step(StepBatch([0], [n]))
    for layer in range(LAYERS):
        k = torch.randn(n, 1, DIM)
        s.append(layer, k, k[..., :24])
        assert s.attend(layer, torch.randn(n, QHEADS, DIM)).shape == (n, QHEADS, 24)
    s.end_step()
    rec = DIM * BS // 2 + 2 * 2 * DIM  # key codes + key scale/low per channel
    dense = (2 + 3) * LAYERS * DIM * 2  # 2 sinks and 3 tail tokens, keys at fp16
    assert s.format.rec.nbytes == rec and s.bytes_used() == 2 * LAYERS * rec + dense
    assert s.stats().format["channels"]["values"] == "the keys' first 24 channels"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"fp16_share": 1.5}, r"option fp16_share = 1.5; allowed: a number in \[0, 1\]"),
        ({"low_share": -0.1}, "option low_share = -0.1"),
        ({"bits": 3}, "option bits = 3; allowed: 2, 4, 8"),
        ({"low_bits": 4, "bits": 2}, "low_bits = 4 is wider than bits = 2"),
        ({"fp16_share": 0.6, "low_share": 0.6}, "fp16_share \\+ low_share"),
        ({"v_low_share": 2}, r"option v_low_share = 2; allowed: a number in \[0, 1\]"),
        ({"method": "vibes"}, "option method = 'vibes'; allowed: score_error"),
        ({"scales": "fp4"}, "option scales = 'fp4'; allowed: fp16, fp8"),
        ({"sink_tokens": -1}, "option sink_tokens = -1"),
    ],
)
def test_bad_options_name_the_key(options, message):
    with pytest.raises(ValueError, match=message):
        kvstrategies.get(NAME).check_options(options)


def test_bad_option_in_a_config_file_names_file_and_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('strategy = "hybrid_fp16_int4"\n[strategy_options]\nfp16_share = 2\n')
    with pytest.raises(ValueError, match=r"bad.toml.*fp16_share = 2"):
        kvstrategies.build(SPEC, None, path)


def test_calibration_file_roundtrip_and_mismatch(model, calibration, tmp_path):
    cfg = model.cfg
    shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    stats = ChannelStats.load(calibration, cfg.identity, shape)
    assert stats.tokens == 4 * 128 and stats.k_blocks == 4 * 2
    for method in ("score_error", "magnitude", "outlier"):
        k, v = stats.scores(method)
        assert k.shape == v.shape == shape and (k >= 0).all()
    with pytest.raises(CalibrationMismatch, match="made for model .* recompute it"):
        ChannelStats.load(calibration, "another-model", shape)
    with pytest.raises(CalibrationMismatch, match="KV shape"):
        ChannelStats.load(calibration, cfg.identity, (2, 2, 2))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a calibration")
    with pytest.raises(CalibrationMismatch, match="not readable"):
        ChannelStats.load(junk, cfg.identity, shape)


def test_ensure_calibration_computes_once_and_refuses_another_models_file(
    model, tokenizer, tmp_path
):
    text = tmp_path / "warm.txt"
    text.write_text(make_english(30, seed=5))
    opts = {"calibration": str(tmp_path / "c.pt"), "calibration_text": str(text),
            "calibration_samples": 2, "calibration_window": 64}  # fmt: skip
    path = ensure_calibration(model, tokenizer, opts)
    mtime = path.stat().st_mtime_ns
    assert ensure_calibration(model, tokenizer, opts) == path
    assert path.stat().st_mtime_ns == mtime  # reused, not recomputed
    stats = ChannelStats.load(path, model.cfg.identity, (30, 3, 64))
    stats.identity = "other"
    stats.save(path)
    with pytest.raises(CalibrationMismatch):
        ensure_calibration(model, tokenizer, opts)
    ensure_calibration(model, tokenizer, {**opts, "recalibrate": True})  # recomputed on request
    ChannelStats.load(path, model.cfg.identity, (30, 3, 64))


def test_the_packaged_model_ships_its_calibration(model, tokenizer, tmp_path, monkeypatch):
    """Issue 33: a first run spent 31 s (AVX-512) to 73 s (AVX2) of a 2-core CPU calibrating
    the default strategy's channels before its first token. The packaged model's calibration
    (the default settings on the warm-up text) ships in the package; other settings, an
    explicit file or `recalibrate` still compute one."""
    import unikv.engine.recording as recording
    from unikv.kvstrategies.calibration import shipped_path

    monkeypatch.setenv("UNIKV_CACHE_DIR", str(tmp_path))  # nothing cached yet

    def computed(*args, **kwargs):
        raise AssertionError("computed a calibration")

    monkeypatch.setattr(recording, "collect_channel_stats", computed)
    shipped = shipped_path(model.cfg.identity)
    assert shipped is not None and shipped.parent.name == "data"
    assert ensure_calibration(model, tokenizer, {}) == shipped
    assert ensure_calibration(model, tokenizer, {"calibration_samples": 100}) == shipped
    ChannelStats.load(shipped, model.cfg.identity, (30, 3, 64))
    for other in ({"calibration_samples": 50}, {"recalibrate": True},
                  {"calibration": str(tmp_path / "mine.pt")}):  # fmt: skip
        with pytest.raises(AssertionError, match="computed"):
            ensure_calibration(model, tokenizer, other)


class _LatentModel:
    """What calibration needs of an MLA model: its config, KV spec and a forward that writes
    latent keys (values: their first channels) and attends, layer by layer, through the cache
    it is given."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        mla = SimpleNamespace(kv_lora_rank=LATENT.value_dim, softmax_scale=LATENT.softmax_scale)
        self.cfg = SimpleNamespace(num_layers=LAYERS, num_heads=QHEADS, num_kv_heads=1,
                                   head_dim=DIM, identity=LATENT.identity, mla=mla)  # fmt: skip
        self.dtype, self.device = torch.float32, torch.device("cpu")
        g = torch.Generator().manual_seed(4)
        # Channel 3 an outlier, so that the plan has something to find.
        self.keys = torch.randn(LAYERS, 100, 1, DIM, generator=g) * torch.linspace(1, 2, DIM)
        self.keys[..., 3] *= 20
        self.queries = torch.randn(LAYERS, 100, QHEADS, DIM, generator=g)

    def kv_spec(self) -> kvstrategies.KVSpec:
        return LATENT

    def forward(self, toks, pos, kv, batch, last):
        kv.begin_step(batch)
        for layer in range(LAYERS):
            k = self.keys[layer, toks]
            kv.append(layer, k, k[..., : LATENT.value_dim])
            assert kv.attend(layer, self.queries[layer, toks]).shape[-1] == LATENT.value_dim
        kv.end_step()


def test_latent_calibration_ranks_key_channels(tmp_path):
    """A latent cache is calibrated on its keys alone; the plan orders values as keys."""
    from unikv.engine.recording import collect_channel_stats

    m = _LatentModel()
    stats = collect_channel_stats(m, list(range(100)), samples=3, window=2 * BS, block=BS)
    assert (stats.num_kv_heads, stats.head_dim) == (1, DIM)
    assert stats.v_sq.abs().sum() == 0 and stats.wo_sq.abs().sum() == 0
    path = tmp_path / "mla.pt"
    stats.save(path)
    plan = channel_plan(LATENT, kvstrategies.get(NAME).check_options({"calibration": str(path)}))
    assert (plan.k_order[:, 0, 0] == 3).all() and torch.equal(plan.v_order, plan.k_order)
    e_rec, _, _ = drive(make({"calibration": str(path)}, kernel=False, spec=LATENT))
    assert e_rec < 1e-5


def test_real_model_quality_and_size(model, tokenizer, calibration):
    """On real text, the default setting stays close to the full cache at under 4.5 bits."""
    spec = model.kv_spec()
    ids = tokenizer.encode(make_english(120, seed=2))[:640]
    full = perplexity(model, ids, kvstrategies.build(spec, "full").strategy, prefill=128)
    hybrid = kvstrategies.build(spec, NAME, options={"calibration": str(calibration)}).strategy
    res = perplexity(model, ids, hybrid, prefill=128)
    assert res.bits_per_element < 4.5
    assert abs(res.ppl / full.ppl - 1) < 0.03
    low = kvstrategies.build(
        spec,
        NAME,
        options={
            "calibration": str(calibration),
            "fp16_share": 0.0,
            "bits": 2,
            "low_share": 0.0,
        },  # fmt: skip
    ).strategy
    worse = perplexity(model, ids, low, prefill=128)
    assert worse.bits_per_element < res.bits_per_element
    assert worse.ppl > res.ppl  # fewer bits cost quality: the measurement can tell them apart


def test_transformers_adapter_runs_hybrid_on_a_hf_model(hf_model, tokenizer, calibration):
    from transformers import DynamicCache

    from unikv.kvstrategies.hf_cache import StrategyCache

    c = hf_model.config
    spec = kvstrategies.KVSpec(c.num_hidden_layers, c.num_key_value_heads,
                               c.hidden_size // c.num_attention_heads)  # fmt: skip
    strategy = kvstrategies.build(spec, NAME).strategy  # no model: channel order, still valid
    ids = torch.tensor([tokenizer.encode(make_english(20, seed=4))[:150]])
    with torch.inference_mode():
        ref = hf_model(input_ids=ids, cache=DynamicCache(config=c)).logits
        cache = StrategyCache(strategy, c.num_hidden_layers)
        out = hf_model(input_ids=ids[:, :100], cache=cache).logits
        out2 = hf_model(input_ids=ids[:, 100:], cache=cache).logits
    got = torch.cat([out, out2], 1)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.9


async def test_engine_serves_hybrid_with_shared_prefixes(model, tokenizer, calibration):
    """Concurrent requests through the engine; a prompt served again from its published blocks
    (with the sinks' fp16 KV from the sink cache) gives the same greedy tokens. The engine
    publishes after every step; a sequence's sinks are copied into the cache once per first
    tokens, not at every step."""
    import asyncio

    from unikv.engine.engine import Engine
    from unikv.engine.sampling import SamplingParams

    spec = model.kv_spec()
    kv = kvstrategies.build(spec, NAME, options={"calibration": str(calibration)}).strategy
    prefix, remembered = kv.format.prefix, []
    real = prefix._remember
    prefix._remember = lambda key, sinks: (remembered.append(key), real(key, sinks))
    ids = tokenizer.encode(make_english(40, seed=9))
    prompt, others = ids[:150], [ids[200:260], ids[300:330]]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    async with Engine(model, tokenizer, kv=kv) as e:
        first = await e.generate(prompt, greedy)
        again = e.submit(prompt, greedy)
        rest = await asyncio.gather(again.result(), *(e.generate(p, greedy) for p in others))
    assert again._req.prefix_hit == 128  # two full 64-token blocks reused
    assert rest[0].token_ids == first.token_ids
    # the prompt's first tokens, and the 60-token prompt's once its first block filled (the
    # 30-token one never fills one)
    assert sorted(remembered) == sorted({tuple(prompt[:4]), tuple(others[0][:4])})
    assert all(len(c.token_ids) == 12 for c in rest)
    assert kv.bytes_used() == 0  # every request finished and freed its blocks and side buffers


async def test_preemption_by_swap_changes_no_output(model, tokenizer, calibration):
    """A device tier too small for all requests: swapped-out sequences come back with their
    packed blocks (moved through the host tier) and their fp16 side buffers intact."""
    import asyncio

    from unikv.engine.engine import Engine
    from unikv.engine.sampling import SamplingParams

    spec = model.kv_spec()
    opts = {"calibration": str(calibration)}
    page = kvstrategies.get(NAME).layout(spec, 64, kvstrategies.get(NAME).check_options(opts))
    ids = tokenizer.encode(make_english(60, seed=12))
    prompts = [ids[i * 50 : i * 50 + 120] for i in range(4)]
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)

    async def serve(device_blocks, host_blocks=0):
        tiers = [TierConfig("device", device_blocks * page.page_bytes)]
        if host_blocks:
            tiers.append(TierConfig("host", host_blocks * page.page_bytes))
        kv = kvstrategies.build(spec, NAME, PoolConfig(tiers=tuple(tiers)), options=opts).strategy
        async with Engine(model, tokenizer, kv=kv, prefix_sharing=False) as e:
            outs = await asyncio.gather(*(e.generate(p, greedy) for p in prompts))
            return [c.token_ids for c in outs], e.memory_report()

    roomy, _ = await serve(64)
    tight, report = await serve(8, host_blocks=32)  # 4 requests need 12 blocks at the end
    assert report.pool.counters.preemptions > 0 and report.pool.counters.moves
    assert tight == roomy
