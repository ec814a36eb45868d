"""Quantization-aware tuning (`unikv tune --kv_optimization=hybrid_fp16_int4`): the fake
quantizer reads what the strategy stores, the tuning forward matches the engine, a run learns,
resumes exactly after an interrupt, writes a checkpoint the engine loads with its calibration,
and bad input fails with a clear message."""

import json

import pytest
import torch

from unikv import kvstrategies
from unikv.engine.assembly import build_kv
from unikv.engine.tune import CHECKPOINT, TunableLlama, TuneSettings, tune_hybrid
from unikv.kvstrategies.calibration import TUNED_FILE, ChannelStats
from unikv.kvstrategies.hybrid_qat import FakeQuant, read_mask
from unikv.kvstrategies.kv import StepBatch
from unikv.kvstrategies.packed import channel_plan
from unikv.kvstrategies.quant import ChannelPlan
from unikv.settings.config import PoolConfig, TierConfig

HYBRID = "hybrid_fp16_int4"
L, H, QH, D, BS = 2, 2, 6, 32, 16
SPEC = kvstrategies.KVSpec(L, H, D, torch.float32, "unit", QH // H)
TIGHT = {"scales": "fp8", "fp16_share": 0.0, "low_share": 0.75, "v_low_share": 0.8125}


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from logits."""
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def random_plan(g: torch.Generator) -> ChannelPlan:
    def perms():
        return torch.stack([torch.stack([torch.randperm(D, generator=g) for _ in range(H)])
                            for _ in range(L)])  # fmt: skip

    return ChannelPlan(perms(), perms())


@pytest.mark.parametrize(
    "options", [{}, TIGHT, {"v_fp16_share": 0.25, "v_low_share": 0.5}, {"sink_tokens": 0}]
)
def test_fake_quant_reads_what_the_strategy_stores(options):
    """FakeQuant's output equals the strategy's dequantized records, sinks at fp16."""
    cls = kvstrategies.get(HYBRID)
    layout = cls.layout(SPEC, BS, cls.check_options(options))
    pool = PoolConfig(block_size=BS, tiers=(TierConfig("device", 64 * layout.page_bytes),))
    s = kvstrategies.create(HYBRID, SPEC, pool, options)
    g = torch.Generator().manual_seed(0)
    plan = random_plan(g)
    f = s.format
    f._k_order, f._v_order = plan.k_order, plan.v_order
    f._k_inverse, f._v_inverse = plan.k_order.argsort(-1), plan.v_order.argsort(-1)
    t = 4 * BS
    k = torch.randn(L, t, H, D, generator=g) * 2
    v = torch.randn(L, t, H, D, generator=g)
    k[..., 3] += 6  # an outlier channel
    fq = FakeQuant(SPEC, options, plan, block=BS)
    s.reserve(0, t)
    s.begin_step(StepBatch([0], [t]))
    for layer in range(L):
        s.append(layer, k[layer], v[layer])
        s.attend(layer, torch.randn(t, QH, D, generator=g))
    s.end_step()
    s.reserve(0, 1)
    s.begin_step(StepBatch([0], [1]))
    for layer in range(L):
        s.append(layer, torch.randn(1, H, D), torch.randn(1, H, D))
        ks, vs = s.read(layer)  # what this step attends: the 4 blocks are packed
        kq, vq, err = fq(layer, k[layer].transpose(0, 1)[None], v[layer].transpose(0, 1)[None])
        assert torch.allclose(ks[0][:, :t], kq[0], atol=1e-6)
        assert torch.allclose(vs[0][:, :t], vq[0], atol=1e-6)
        assert 0 < err.item() < 0.5
        assert not torch.equal(kq[0], k[layer].transpose(0, 1))
        s.attend(layer, torch.randn(1, QH, D))
    s.end_step()


def test_fake_quant_passes_gradients_straight_through():
    fq = FakeQuant(SPEC, TIGHT, random_plan(torch.Generator().manual_seed(1)), block=BS)
    k = torch.randn(1, H, 2 * BS, D, requires_grad=True)
    v = torch.randn(1, H, 2 * BS, D, requires_grad=True)
    kq, vq, _ = fq(0, k, v)
    (kq * 3).sum().backward()
    assert torch.equal(k.grad, torch.full_like(k, 3.0))
    k.grad = None
    _, _, err = fq(0, k, v)
    err.backward()  # the error term pulls keys toward the grid: nonzero, finite gradients
    assert k.grad.abs().sum() > 0 and torch.isfinite(k.grad).all()
    with pytest.raises(ValueError, match="multiple of the block"):
        fq(0, k[:, :, :-1], v[:, :, :-1])


def test_read_mask_reads_every_past_key_once():
    t, block, sinks = 12, 4, 2
    m = read_mask(t, block, sinks)
    packed, full = m[:, :t], m[:, t:]
    assert torch.equal(packed | full, torch.ones(t, t, dtype=torch.bool).tril())  # causal
    assert not (packed & full).any()
    assert not packed[:, :sinks].any()  # sinks always at full precision
    assert packed[9, 2:8].all() and not packed[9, 8:].any()  # earlier blocks quantized
    assert not packed[:block].any()  # the first block reads nothing quantized


@pytest.fixture(scope="module")
def tunable(loaded):
    cfg, tensors, _ = loaded
    return TunableLlama(cfg, tensors)


@pytest.mark.slow
def test_tuning_forward_matches_the_engine(tunable, model, tokenizer, english_text, calibration):
    """Full precision: the same logits as the engine. Hybrid reading: what the engine running
    hybrid_fp16_int4 in 16-token chunks gives (earlier blocks read from packed records)."""
    ids = tokenizer.encode(english_text)[:192]
    toks = torch.tensor(ids)
    n = len(ids)
    spec = model.kv_spec()
    opts = {**TIGHT, "calibration": str(calibration)}

    def engine_logits(name, options=None):
        kv = build_kv(spec, name, PoolConfig(), options=options, model=model,
                      tokenizer=tokenizer).strategy  # fmt: skip
        out = []
        for start in range(0, n, 16):
            rows = torch.arange(16)
            out.append(model.forward(toks[start : start + 16], torch.arange(start, start + 16),
                                     kv, StepBatch([0], [16]), rows))  # fmt: skip
        kv.free(0)
        return torch.cat(out)

    with torch.no_grad():
        ours_full, err0 = tunable(toks[None], base=True)
        plan = channel_plan(spec, kvstrategies.get(HYBRID).check_options(opts))
        ours_q, err = tunable(toks[None], FakeQuant(spec, opts, plan))
    full, hybrid = engine_logits("full"), engine_logits(HYBRID, opts)
    assert err0.item() == 0 and err.item() > 0
    assert (ours_full[0] - full).abs().max() < 1e-3
    gap = (hybrid - full).abs().max()
    assert gap > 0.1  # the hybrid cache does change the logits ...
    # ... and the tuning forward sees nearly the same. Not exactly: the engine quantizes a
    # block from the fp16 side buffer, and a rounding difference can flip an int2 code.
    ours = ours_q[0]
    assert kl(hybrid, ours).mean() < kl(full, hybrid).mean() / 10
    assert abs(kl(full, ours).mean() / kl(full, hybrid).mean() - 1) < 0.2
    assert (ours - hybrid).abs().mean() < (hybrid - full).abs().mean() / 5


def tiny_model_dir(path, loaded):
    """A 2-layer random Llama with SmolLM2's tokenizer, as a checkpoint directory."""
    import dataclasses

    from unikv.engine.hf_loader import save_hf

    cfg0, _, tok = loaded
    cfg = dataclasses.replace(cfg0, name="tiny", hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    shapes = {"token_embd.weight": (cfg.vocab_size, 64), "output_norm.weight": (64,)}
    for i in range(2):
        shapes |= {f"blk.{i}.attn_norm.weight": (64,), f"blk.{i}.ffn_norm.weight": (64,),
                   f"blk.{i}.attn_q.weight": (64, 64), f"blk.{i}.attn_k.weight": (32, 64),
                   f"blk.{i}.attn_v.weight": (32, 64), f"blk.{i}.attn_output.weight": (64, 64),
                   f"blk.{i}.ffn_gate.weight": (128, 64), f"blk.{i}.ffn_up.weight": (128, 64),
                   f"blk.{i}.ffn_down.weight": (64, 128)}  # fmt: skip
    tensors = {n: (torch.ones(s) if len(s) == 1 else torch.randn(*s, generator=g) * 0.1)
               for n, s in shapes.items()}  # fmt: skip
    save_hf(cfg, tensors, tok, path)
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, loaded):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"), loaded)


SMALL = TuneSettings(steps=4, lr=1e-3, seq_len=64, batch=2, lam=0.5)


def test_interrupted_run_resumes_exactly(tiny_dir, english_text, tmp_path, monkeypatch):
    monkeypatch.setenv("UNIKV_CACHE_DIR", str(tmp_path / "cache"))
    straight = tune_hybrid(str(tiny_dir), english_text, tmp_path / "a", SMALL, TIGHT,
                           checkpoint_every=2, progress=False)  # fmt: skip
    assert straight.steps == 4

    def stop_at_3(step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tune_hybrid(str(tiny_dir), english_text, tmp_path / "b", SMALL, TIGHT,
                    checkpoint_every=2, progress=False, on_step=stop_at_3)  # fmt: skip
    ck = torch.load(tmp_path / "b" / CHECKPOINT, weights_only=False)
    assert ck["step"] == 2  # the last checkpoint survives the interrupt
    assert not (tmp_path / "b" / "model.safetensors").exists()
    with pytest.raises(ValueError, match="exists and is not empty; pass --resume"):
        tune_hybrid(str(tiny_dir), english_text, tmp_path / "b", SMALL, TIGHT, progress=False)
    with pytest.raises(ValueError, match="settings differs"):
        tune_hybrid(str(tiny_dir), english_text, tmp_path / "b", TuneSettings(**{
            **SMALL.__dict__, "lam": 1.0}), TIGHT, resume=True, progress=False)  # fmt: skip
    resumed = tune_hybrid(str(tiny_dir), english_text, tmp_path / "b", SMALL, TIGHT,
                          resume=True, checkpoint_every=2, progress=False)  # fmt: skip
    a = torch.load(tmp_path / "a" / CHECKPOINT, weights_only=False)
    b = torch.load(tmp_path / "b" / CHECKPOINT, weights_only=False)
    assert a["history"] == b["history"]
    for name, tensor in a["params"].items():
        assert torch.equal(tensor, b["params"][name]), name
    # The same weights file, byte for byte (the identity's name part is the directory's).
    assert resumed.identity.split(":W")[1] == straight.identity.split(":W")[1]
    assert any(t.abs().sum() > 0 for t in a["params"].values())  # it did train


def test_tuned_directory_runs_with_its_calibration(tiny_dir, english_text, tmp_path, monkeypatch):
    """The output loads with --model DIR; hybrid_fp16_int4 picks up kv_calibration.pt (the plan
    the model was tuned for, under the tuned identity) without computing another."""
    from unikv.cli.main import main
    from unikv.engine.loading import load_model
    from unikv.kvstrategies.calibration import default_path

    cache = tmp_path / "cache"
    monkeypatch.setenv("UNIKV_CACHE_DIR", str(cache))
    out = tmp_path / "tuned"
    settings = TuneSettings(steps=2, lr=1e-3, seq_len=64, batch=1)
    res = tune_hybrid(str(tiny_dir), english_text, out, settings, TIGHT, progress=False)
    m, tok = load_model(str(out), progress=False)
    assert m.cfg.identity == res.identity
    shape = (2, 2, 16)
    base_id = load_model(str(tiny_dir), progress=False)[0].cfg.identity
    base_stats = ChannelStats.load(default_path(base_id), base_id, shape)
    stats = ChannelStats.load(out / TUNED_FILE, res.identity, shape)
    assert torch.equal(stats.scores()[0], base_stats.scores()[0])  # the plan it was tuned for
    built = build_kv(m.kv_spec(), HYBRID, PoolConfig(), options=TIGHT, model=m,
                     tokenizer=tok)  # fmt: skip
    assert built.strategy.opts["calibration"] == str(out / TUNED_FILE)
    assert not default_path(res.identity).exists()  # nothing recomputed for the tuned model
    meta = json.loads((out / "unikv_tune.json").read_text())
    assert meta["tuned_model"] == res.identity and len(meta["history"]) == 2
    argv = ["eval", "ppl", "--model", str(out), "--text", str(tmp_path / "t.txt"),
            "--tokens", "300", "--strategy", HYBRID, "--scales", "fp8"]  # fmt: skip
    (tmp_path / "t.txt").write_text(english_text)
    assert main(argv) == 0


@pytest.mark.slow
def test_tuning_lowers_the_gap_it_trains_on(loaded, tunable, tokenizer, english_text, tmp_path,
                                             calibration, monkeypatch):  # fmt: skip
    """A few steps on one 128-token window (the whole text): the KL between the base model with
    a full cache and the tuned model with the hybrid cache goes down."""
    text = tokenizer.decode(tokenizer.encode(english_text)[:140])
    ids = tokenizer.encode(text)[:128]
    text = tokenizer.decode(ids)
    cfg = loaded[0]
    spec = kvstrategies.KVSpec(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, identity=cfg.identity
    )
    opts = kvstrategies.get(HYBRID).check_options({**TIGHT, "calibration": str(calibration)})
    quant = FakeQuant(spec, opts, channel_plan(spec, opts))

    def gap(net):
        toks = torch.tensor([tokenizer.encode(text)[:128]])
        with torch.no_grad():
            return kl(net(toks, base=True)[0], net(toks, quant)[0]).mean().item()

    before = gap(tunable)
    settings = TuneSettings(steps=3, lr=3e-5, seq_len=128, batch=1, lam=0.0, warmup=1)
    out = tmp_path / "t"
    tune_hybrid("smollm2", text, out, settings, {**TIGHT, "calibration": str(calibration)},
                progress=False)  # fmt: skip
    net = TunableLlama(cfg, loaded[1])
    net.load_state_dict(torch.load(out / CHECKPOINT, weights_only=False)["params"])
    after = gap(net)
    assert after < 0.8 * before, (before, after)  # measured: 0.0086 -> 0.0054


def test_bad_input_is_a_clear_error(tmp_path, capsys, english_text, tiny_dir):
    from unikv.cli.main import main

    txt = tmp_path / "t.txt"
    txt.write_text(english_text)
    base = ["tune", "--model", str(tiny_dir), "--text", str(txt)]
    cases = [
        (["--kv_optimization", "int3", "--out", str(tmp_path / "o")],
         "allowed: hybrid_fp16_int4, learned_prune"),
        (["--kv_optimization", HYBRID, "--out", str(tmp_path / "o"), "--text", "/nope.txt"],
         "/nope.txt"),
        (["--kv_optimization", HYBRID, "--out", str(tmp_path / "o"), "--seq-len", "4096",
          "--batch", "4"], "one batch needs --batch x --seq-len = 16384"),
        (["--kv_optimization", HYBRID, "--out", str(tmp_path / "o"), "--resume"],
         "nothing to resume"),
        (["--kv_optimization", HYBRID, "--out", str(tmp_path / "o"), "--low-share", "2"],
         "low_share"),
        (["--kv_optimization", HYBRID, "--out", str(tmp_path / "o"), "--lambda", "-1"],
         "--lambda must be"),
        (["--kv_optimization", HYBRID, "--out", str(tmp_path / "o"), "--seq-len", "100"],
         "multiple of the block size 64"),
    ]  # fmt: skip
    if not torch.cuda.is_available():
        cases.append((["--kv_optimization", HYBRID, "--out", str(tmp_path / "o"), "--device",
                       "cuda"], "torch sees no CUDA device"))  # fmt: skip
    cases += [
        (["--kv_optimization", HYBRID, "--out", str(tmp_path / "o"), "--device", "tpu9"],
         "is not a torch device"),
        (["--kv_optimization", HYBRID, "--out", str(tmp_path / "o"), "--lr", "0"],
         "--lr must be a positive number"),
    ]  # fmt: skip
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases.append((["--kv_optimization", HYBRID, "--out", str(tmp_path / "full")],
                  "exists and is not empty"))  # fmt: skip
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (extra, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_tunes_on_the_gpu(tiny_dir, english_text, tmp_path, monkeypatch):
    monkeypatch.setenv("UNIKV_CACHE_DIR", str(tmp_path / "cache"))
    res = tune_hybrid(str(tiny_dir), english_text, tmp_path / "g", SMALL, TIGHT, device="cuda",
                      progress=False)  # fmt: skip
    assert res.steps == SMALL.steps and (tmp_path / "g" / "model.safetensors").exists()
