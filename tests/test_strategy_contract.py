"""The contract every KV strategy keeps: every preset and every valid FORMAT+PLACEMENT+SELECTION.

A new format, placement or selection is covered by registering it: it must attend like exact
attention within the tolerance it declares, handle batches of different lengths and chunked
appends, reuse shared prefix blocks correctly, free every block, and account its bytes. A
strategy that evicts tokens (`evicts`) attends exactly over the tokens it keeps (what `read`
returns) and shares no prefix.

Every test runs on a plain multi-head spec and on a latent (MLA) one: one KV head whose values
are the keys' first channels (not stored), a softmax scale of its own, and outputs narrower than
the queries. A format that declares `supports_latent = False` is skipped there, and `create`
must refuse it.

An axis defined outside the package runs the same suite by being listed in `EXTRA`
(`TinyFormat` below: a new format is one class with its option declarations, registered with
`@FORMATS.register`, and a preset is one line of `registry.PRESETS`, which `register` stands
for here); both are registered only while its tests run.
"""

import math
import re
from pathlib import Path

import pytest
import torch

from unikv import kvstrategies
from unikv.engine.assembly import create_kv
from unikv.kvstrategies import composed
from unikv.kvstrategies.full import DenseFormat
from unikv.kvstrategies.kv import StepBatch, block_tokens, take_tokens
from unikv.kvstrategies.options import Option
from unikv.kvstrategies.tables import BEGIN, END, option_tables
from unikv.settings.config import PoolConfig, TierConfig

LAYERS, QHEADS, BS = 2, 4, 8
SPECS = {
    "mha": kvstrategies.KVSpec(LAYERS, 2, 16, torch.float32, identity="contract"),
    # 24 latent channels + 8 RoPE channels, shared by all 4 query heads (MQA)
    "latent": kvstrategies.KVSpec(LAYERS, 1, 32, torch.float32, identity="contract-mla",
                                  query_group=QHEADS, latent=True, value_dim=24,
                                  softmax_scale=0.3),
}  # fmt: skip


@pytest.fixture(params=list(SPECS))
def spec(request):
    return SPECS[request.param]


def reference(spec, q, k, v, num_past):
    """Exact causal attention, K/V repeated per query head. q: [T, Hq, D]; k: [Hkv, S, D],
    v: [Hkv, S, Dv]."""
    t = q.shape[0]
    k = k.repeat_interleave(QHEADS // spec.num_kv_heads, 0)
    v = v.repeat_interleave(QHEADS // spec.num_kv_heads, 0)
    scores = torch.einsum("thd,hsd->hts", q, k) * spec.scale
    s = k.shape[1]
    mask = torch.arange(s)[None, :] > (num_past + torch.arange(t))[:, None]
    return torch.einsum("hts,hsd->thd", scores.masked_fill(mask, -math.inf).softmax(-1), v)


@pytest.fixture
def make(tmp_path, spec):
    """make(name, blocks, ssd): the strategy over a pool of `blocks` device blocks, with host
    and SSD tiers too (a strategy that offloads uses them at its `contract_options` sizes, every
    one that shares prefixes persists them there; `ssd`: the store's directory, to share it)."""
    built = []

    def make(name, blocks=64, ssd=None, **options):
        cls = kvstrategies.get(name)
        if spec.latent and not cls.supports_latent:
            with pytest.raises(ValueError, match="latent"):
                kvstrategies.create(name, spec)
            pytest.skip(f"{name} declares supports_latent = False")
        opts = cls.check_options({**cls.contract_options, **options})
        page = cls.layout(spec, BS, opts).page_bytes
        tiers = (
            TierConfig("device", blocks * page),
            TierConfig("host", 64 * page),
        )
        if not cls.evicts:  # an evicting strategy refuses a store tier it could not use
            tiers += (TierConfig("ssd", 64 * page, path=str(ssd or tmp_path / f"ssd{len(built)}")),)
        cfg = PoolConfig(block_size=BS, tiers=tiers)
        s = create_kv(name, spec, cfg, opts)
        built.append(s)
        return s

    yield make
    for s in built:
        getattr(s, "close", lambda: None)()


class Driver:
    """Feeds random K/V/Q through a strategy step by step and keeps the exact history."""

    def __init__(self, strategy, seed=0):
        self.s, self.spec = strategy, strategy.spec
        self.g = torch.Generator().manual_seed(seed)
        self.hist: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.selected = 0  # (layer, sequence) attends that read a selection of the tokens

    def step(self, seq_ids, lens):
        b = StepBatch(seq_ids, lens)
        for sid, n in zip(seq_ids, lens, strict=True):
            assert self.s.reserve(sid, n)
        self.s.begin_step(b)
        n = b.num_tokens
        spec = self.spec
        h, d, dv = spec.num_kv_heads, spec.head_dim, spec.v_dim
        errs = []
        for layer in range(LAYERS):
            k = torch.randn(n, h, d, generator=self.g)
            # A latent cache is handed its keys' first channels as values, as the model does.
            v = k[..., :dv] if spec.latent else torch.randn(n, h, dv, generator=self.g)
            q = torch.randn(n, QHEADS, d, generator=self.g)
            self.s.append(layer, k, v)
            out = self.s.attend(layer, q)
            assert out.shape == (n, QHEADS, dv)
            for i, sid in enumerate(seq_ids):
                rows = b.rows(i)
                past = self.hist.setdefault(sid, [])
                if len(past) <= layer:
                    past.append((torch.empty(h, 0, d), torch.empty(h, 0, dv)))
                pk, pv = past[layer]
                pk = torch.cat([pk, k[rows].transpose(0, 1)], 1)
                pv = torch.cat([pv, v[rows].transpose(0, 1)], 1)
                past[layer] = (pk, pv)
                if self.s.recipe.evicts:  # what it kept, the step's tokens at the end
                    ks, vs = self.s.read(layer)
                    pk, pv = ks[i].float(), vs[i].float()
                    # the step's tokens as stored (exact, or rounded to a 16-bit dtype)
                    expect = k[rows].transpose(0, 1)
                    assert torch.allclose(pk[:, -lens[i] :], expect, rtol=2**-7, atol=0)
                    if spec.latent:
                        assert torch.equal(pv, pk[..., :dv])
                # A selection that reads some tokens (sparse) attends exactly over them.
                chosen = getattr(self.s.selection, "last_read", None)
                blocks = chosen[layer][i] if chosen and chosen[layer] else None
                if blocks is not None:
                    self.selected += 1
                    idx = block_tokens(blocks, BS, pk.shape[1])
                    pk = take_tokens(pk, idx)
                    pv = pk[..., :dv] if spec.latent else take_tokens(pv, idx)
                ref = reference(spec, q[rows], pk, pv, pk.shape[1] - lens[i])
                errs.append((out[rows] - ref).abs().max().item())
        self.s.end_step()
        return max(errs)


class TinyFormat(DenseFormat):
    """A new format as one file would add it: dense storage, one option of its own."""

    name = "tiny"
    help = "dense K/V with a window the stats report"
    options = (
        *DenseFormat.options,
        Option("tiny_window", int, 16, "tokens the stats call recent", low=1, high=4096),
    )
    contract_options = {"tiny_window": 4}

    def stats(self) -> dict:
        return {**super().stats(), "tiny_window": self.opts["tiny_window"]}


# Strategies the contract runs on besides the shipped ones: a preset over a new format.
EXTRA = {"contract_tiny": ("tiny", "resident", "all")}


def register_for_the_test(monkeypatch, name: str) -> None:
    """The new format registered (`@FORMATS.register`) and a preset line for `name`, into
    copies of the registries that the test's end throws away."""
    monkeypatch.setattr(kvstrategies.FORMATS, "_classes", dict(kvstrategies.FORMATS._classes))
    monkeypatch.setattr(kvstrategies.registry, "PRESETS", dict(kvstrategies.registry.PRESETS))
    kvstrategies.FORMATS.register(TinyFormat)
    kvstrategies.register(name, EXTRA[name])


# Every valid combination of the three axes, composed (the presets are four of them, built
# from the same parts under their own names).
COMBINATIONS = [composed.name_of(axes) for axes in composed.combinations()]


@pytest.fixture(params=[*kvstrategies.available(), *EXTRA, *COMBINATIONS])
def name(request, monkeypatch):
    if request.param in EXTRA:
        register_for_the_test(monkeypatch, request.param)
    return request.param


def test_attends_like_exact_attention(name, make):
    s = make(name)
    d = Driver(s)
    tol = s.recipe.tolerance
    assert d.step([0], [13]) <= tol  # prefill
    assert d.step([0, 1], [1, 21]) <= tol  # decode + another sequence's prefill
    for _ in range(10):
        assert d.step([1, 0], [1, 1]) <= tol  # interleaved decoding, block boundaries crossed
    assert d.step([0], [5]) <= tol  # a chunk on top of a cache
    assert s.stored_tokens(0) <= 13 + 1 + 10 + 5
    if s.recipe.evicts:  # its contract options make it evict
        assert s.stored_tokens(0) < 13 + 1 + 10 + 5
    if s.selection.name == "sparse":  # its contract options make it select, and keep all
        assert d.selected > 0 and s.stored_tokens(0) == 13 + 1 + 10 + 5


@pytest.mark.parametrize("group", [16, 128])
@pytest.mark.parametrize("sparse", [n for n in COMBINATIONS if n.endswith("+sparse")])
def test_sparse_from_4_bit_keys_attends_exactly_over_what_it_chose(sparse, group, make):
    """The selection's other summaries (summary = keys: every token's key in 4 bits, a block
    ranked by its tokens' log-sum-exp), with every format and placement, a minimum and step
    per 16 or 128 keys: attention is exact over the blocks chosen, nothing is evicted, and it
    selects. The contract's 4-token blocks leave groups of keys open over several blocks,
    quantized again as they fill."""
    s = make(sparse, summary="keys", block_score="lse", key_group=group)
    d = Driver(s)
    tol = s.recipe.tolerance
    assert d.step([0], [13]) <= tol
    assert d.step([0, 1], [1, 21]) <= tol
    for _ in range(10):
        assert d.step([1, 0], [1, 1]) <= tol
    assert d.step([0], [5]) <= tol
    assert d.selected > 0 and s.stored_tokens(0) == 13 + 1 + 10 + 5


def test_frees_every_block_and_accounts_bytes(name, make):
    s = make(name)
    d = Driver(s)
    d.step([0, 1, 2], [9, 17, 3])
    used = s.bytes_used()
    assert 0 < used <= s.bytes_reserved()
    per_token_fp32 = s.spec.elements_per_token * 4  # K only for a latent spec
    assert s.pool.layout.page_bytes <= BS * per_token_fp32  # a latent block holds no values
    assert used <= (9 + 17 + 3) * per_token_fp32
    if s.recipe.lossless:
        assert used == (9 + 17 + 3) * per_token_fp32
    for sid in (0, 1, 2):
        s.free(sid)
    assert s.bytes_used() == 0 and s.bytes_reserved() == 0
    assert all(a.num_used == 0 for a in s.pool.allocators.values())


def test_shared_prefix_attends_like_recomputed(name, make):
    """A sequence started on another's published blocks sees exactly that KV."""
    s = make(name)
    d = Driver(s, seed=3)
    tokens = list(range(1000, 1000 + 3 * BS + 2))
    d.step([0], [len(tokens)])
    s.publish(0, tokens)
    reused = s.match_prefix(5, tokens)
    if s.recipe.evicts:
        assert reused == 0
        return
    assert reused == 3 * BS  # full blocks, and never the last token
    # Sequence 5's history is sequence 0's first 3 blocks.
    d.hist[5] = [(k[:, :reused], v[:, :reused]) for k, v in d.hist[0]]
    assert d.step([5], [2]) <= s.recipe.tolerance
    s.free(0)
    assert d.step([5], [1]) <= s.recipe.tolerance  # the shared blocks outlive their first owner
    s.free(5)
    assert all(a.num_used == 0 for a in s.pool.allocators.values())


def test_a_persisted_prefix_is_found_by_another_pool(name, make, tmp_path):
    """Prefix persistence is the pool's service under every placement: a prefill's blocks go
    through to the SSD tier, and a fresh strategy over the same store (nothing else shared, as
    another process) attaches them and attends over exactly that KV."""
    if kvstrategies.get(name).evicts:
        pytest.skip("an evicting strategy shares and persists nothing (refuses the SSD tier)")
    store = tmp_path / "shared-ssd"
    a = make(name, ssd=store)
    d = Driver(a, seed=5)
    tokens = list(range(2000, 2000 + 3 * BS + 2))
    d.step([0], [len(tokens)])
    a.publish(0, tokens)
    a.pool.persistence.writer.wait_writes()
    assert a.stats().placement["blocks_written_through"] == 3
    a.close()  # the writes are finished and the store closed, as at a process's end
    b = make(name, ssd=store)
    assert b.match_prefix(7, tokens) == 3 * BS  # from the store: this pool computed nothing
    assert b.stats().placement["disk_prefix_hits"]["blocks"] == 3
    d.s = b
    d.hist[7] = [(k[:, : 3 * BS], v[:, : 3 * BS]) for k, v in d.hist[0]]
    assert d.step([7], [2]) <= b.recipe.tolerance


def test_reserve_reports_a_full_pool(name, make):
    s = make(name, blocks=4)
    assert s.reserve(0, 4 * BS)
    assert not s.reserve(1, 1)
    assert not s.can_admit(1)
    s.free(0)
    assert s.reserve(1, 1)


def test_unknown_option_lists_the_allowed(name):
    with pytest.raises(ValueError, match="unknown option"):
        kvstrategies.get(name).check_options({"no_such_option": 1})


def test_create_refuses_a_latent_spec_for_a_strategy_without(monkeypatch):
    monkeypatch.setattr(kvstrategies.get("full").format, "supports_latent", False)
    with pytest.raises(ValueError, match="'full' cannot store latent"):
        kvstrategies.create("full", SPECS["latent"])


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown strategy 'nope'; supported: .*full"):
        kvstrategies.get("nope")


def test_options_are_declared_with_their_defaults(name):
    cls = kvstrategies.get(name)
    assert all(isinstance(o, Option) for o in cls.options)
    names = [o.name for o in cls.options]
    assert len(names) == len(set(names)), names
    opts = cls.check_options({})  # the defaults are valid
    assert [k for k in opts if k not in cls.fixed] == names  # and what its format fixes
    # Each option refuses a value of the wrong kind, naming strategy, option and value.
    for o in cls.options:
        if o.type is not object:
            with pytest.raises(ValueError, match=rf"strategy '{re.escape(name)}': option "
                               rf"{o.name} = \[\]"):  # fmt: skip
                cls.check_options({o.name: []})


def test_a_new_format_is_one_class_and_a_preset_one_line(monkeypatch, tmp_path, capsys):
    from unikv.cli.args import kv_options
    from unikv.cli.main import build_parser, main

    register_for_the_test(monkeypatch, "contract_tiny")
    assert "contract_tiny" in kvstrategies.available()
    cls = kvstrategies.get("contract_tiny")
    # Validation comes from the declaration.
    assert cls.check_options({})["tiny_window"] == 16
    with pytest.raises(ValueError, match=r"'contract_tiny': option tiny_window = 0; expected an "
                       r"integer in \[1, 4096\]"):  # fmt: skip
        cls.check_options({"tiny_window": 0})
    with pytest.raises(
        ValueError,
        match="unknown option.*allowed: dtype, min_disk_hit_tokens, persist_prefix, tiny_window",
    ):
        cls.check_options({"window": 3})
    # So do its flag, its help and the parsed option; inherited flags are shared.
    argv = ["run", "--prompt", "hi", "--strategy", "contract_tiny", "--tiny-window", "7"]
    args = build_parser().parse_args([*argv, "--kv-dtype", "float32"])
    assert kv_options(args) == {"tiny_window": 7, "dtype": "float32"}
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "contract_tiny options" in out
    assert "--tiny-window TINY_WINDOW tokens the stats call recent; an integer in [1, 4096] " \
        "(default: 16)" in out  # fmt: skip
    assert out.count("--kv-dtype {float32,bfloat16,float16} dtype") == 1  # one flag, shared
    # A config file's [strategy_options] is checked by the same declarations.
    cfg = tmp_path / "tiny.toml"
    cfg.write_text('strategy = "contract_tiny"\n[strategy_options]\ntiny_window = 0\n')
    with pytest.raises(ValueError, match=rf"{cfg}: \[strategy_options\] .*tiny_window = 0"):
        kvstrategies.build(SPECS["mha"], None, cfg)
    built = kvstrategies.build(SPECS["mha"], "contract_tiny").strategy
    assert built.stats().format["tiny_window"] == 16
    # And its table in the generated option tables.
    assert "**`contract_tiny`**" in option_tables()
    assert "| `tiny_window` / `--tiny-window` | int | `16` | an integer in [1, 4096] |" in (
        option_tables()
    )


def test_readme_option_tables_are_the_generated_ones():
    """README.md's tables between the markers are `python -m kvstrategies.tables`'s output."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    shown = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert shown.strip() == option_tables().strip(), (
        "README.md's strategy option tables are stale: put `python -m kvstrategies.tables`'s "
        "output between the markers"
    )
