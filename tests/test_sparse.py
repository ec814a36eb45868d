"""The `sparse` selection (dynamic sparse attention): every token keeps its KV, and each step reads
the sink blocks, the recent window and the blocks whose key bounds (Quest's per-channel min and
max) score highest for its queries. The contract suite checks that attention is exact over the
blocks chosen, for every format and placement; here: that the chosen blocks are the ones a query
needs, that the bounds are bounds, and what the options and the report say."""

import math

import pytest
import torch

from unikv import kvstrategies
from unikv.kvstrategies.kv import KVSpec, StepBatch
from unikv.settings.config import PoolConfig, TierConfig

BS, LAYERS, HEADS, DIM, GROUP = 16, 3, 2, 32, 2
SPEC = KVSpec(LAYERS, HEADS, DIM, query_group=GROUP)


def build(name="dense+resident+sparse", **opts):
    cfg = PoolConfig(block_size=BS, tiers=(TierConfig("device", 64 << 20),))
    return kvstrategies.create(name, SPEC, cfg, {"dense_layers": 0, **opts})


def build_tiered(tmp_path, name="dense+tiered+sparse", **opts):
    """`name` over device, host and SSD tiers: the newest 64 tokens on the device, the next
    256 on the host, older ones in the SSD tier (LMDB in `tmp_path`)."""
    from unikv.engine.assembly import store_tiers

    tiers = (TierConfig("device", 4 << 20), TierConfig("host", 4 << 20),
             TierConfig("ssd", 16 << 20, path=str(tmp_path / "ssd")))  # fmt: skip
    cfg = PoolConfig(block_size=BS, tiers=tiers)
    opts = {"dense_layers": 0, "device_window": 64, "host_window": 256, **opts}
    return kvstrategies.create(name, SPEC, cfg, opts, stores=store_tiers(name, SPEC, cfg, opts))


def step(s, seq, k, q, more_prompt=False):
    """One step of `k` [L, n, H, D] keys (values: the keys) and queries `q` [L, n, Hq, D]."""
    n = k.shape[1]
    assert s.reserve(seq, n)
    s.begin_step(StepBatch([seq], [n], [more_prompt]))
    outs = []
    for layer in range(LAYERS):
        s.append(layer, k[layer], k[layer])
        outs.append(s.attend(layer, q[layer]))
    s.end_step()
    return outs


def haystack(n: int, needle_at: int, direction: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Keys [L, n, H, D]: small noise, and 4 needle tokens at `needle_at` along `direction`
    (what a query looking for them dots with: q.k of 12 against about 1 for the noise)."""
    g = torch.Generator().manual_seed(seed)
    k = 0.1 * torch.randn(LAYERS, n, HEADS, DIM, generator=g)
    k[:, needle_at : needle_at + 4] = 4.0 * direction
    return k


@pytest.mark.parametrize("score", [{}, {"summary": "centres", "block_score": "max"},
                                   {"summary": "centres", "summary_tokens": 1},
                                   {"key_group": 16}],
                         ids=["keys-lse", "centres-max", "token-lse", "keys16-lse"])  # fmt: skip
@pytest.mark.parametrize("share", [0.125, 0.25])
@pytest.mark.parametrize("depth", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_the_needle_block_is_read_at_every_depth_and_budget(share, depth, score):
    n = 1024
    direction = torch.nn.functional.normalize(torch.randn(HEADS, DIM), dim=-1)
    at = int(depth * n) // BS * BS + 3  # across a block boundary: two blocks hold it
    s = build(budget_tokens=int(share * n), **score)
    step(s, 0, haystack(n, at, direction), torch.randn(LAYERS, n, HEADS * GROUP, DIM),
         more_prompt=True)  # fmt: skip
    q = (3.0 * direction).repeat_interleave(GROUP, 0).expand(LAYERS, 1, -1, -1)
    step(s, 0, 0.1 * torch.randn(LAYERS, 1, HEADS, DIM), q)
    needle = {at // BS, (at + 3) // BS}
    for layer in range(LAYERS):
        blocks = s.selection.last_read[layer][0]
        assert blocks is not None, "the step read everything: nothing was selected"
        read = blocks.shape[1] * BS
        assert read <= int(share * n) + BS + 1  # the budget (the last block partly filled)
        for h in range(HEADS):
            assert needle <= set(blocks[h].tolist()), (layer, h, sorted(blocks[h].tolist()))
    assert s.stored_tokens(0) == n + 1  # nothing evicted
    assert s.stats().selection["blocks_read_share"] < share + 0.05
    s.close()


@pytest.mark.parametrize("sub", [16, 4, 5])
def test_the_bound_is_never_below_a_blocks_true_largest_score(sub):
    """range_weight 1: a block's score (its summaries' best) is Quest's upper bound of q . k
    over its keys, with summaries of a whole block, of 4 tokens, and of 5 (a block of 16 in
    runs of 5, 5, 5 and 1)."""
    s = build(budget_tokens=64, summary="centres", range_weight=1.0, summary_tokens=sub)
    parts = -(-BS // sub)
    k = torch.randn(LAYERS, 300, HEADS, DIM)
    step(s, 0, k, torch.randn(LAYERS, 300, HEADS * GROUP, DIM), more_prompt=True)
    sel = s.selection
    q = torch.randn(HEADS, DIM)
    blocks = 300 // BS
    for layer in range(LAYERS):
        bounds = sel.summaries(0)[layer, :, : blocks * parts]  # full blocks: [H, S, 2D]
        ub = (torch.cat([q, q.abs()], -1).unsqueeze(1) * bounds).sum(-1)  # [H, S]
        ub = ub.view(HEADS, blocks, parts).amax(-1)
        true = torch.einsum("hd,bthd->hbt", q, k[layer, : blocks * BS].view(-1, BS, HEADS, DIM))
        assert (ub >= true.amax(-1) - 1e-4).all()
    s.close()


def test_a_summary_of_a_few_tokens_is_their_centre():
    """summary = centres: per run of `summary_tokens` keys (across step boundaries: a
    decode step adds one token to the open run) the midpoint of their per-channel minimum
    and maximum, as int8 codes with one scale (their largest magnitude / 127), and nothing
    else."""
    s = build(budget_tokens=64, summary="centres", summary_tokens=4)
    k = torch.randn(LAYERS, 40, HEADS, DIM)
    step(s, 0, k[:, :37], torch.randn(LAYERS, 37, HEADS * GROUP, DIM), more_prompt=True)
    for t in range(37, 40):  # one token a step, into the open summary [36, 40)
        step(s, 0, k[:, t : t + 1], torch.randn(LAYERS, 1, HEADS * GROUP, DIM))
    runs = k.view(LAYERS, 10, 4, HEADS, DIM)
    want = ((runs.amin(2) + runs.amax(2)) / 2).transpose(1, 2)  # [L, H, 10, D]
    sel = s.selection
    assert sel._codes[0].dtype == torch.int8
    got = sel.summaries(0)[:, :, :10]
    assert got.shape[-1] == DIM  # the centre alone
    scale = want.abs().amax(-1, keepdim=True) / 127
    assert torch.allclose(sel._scales[0][:, :, :10], scale[..., 0])
    assert ((got - want).abs() <= scale * 0.5001).all()  # to the nearest code
    assert not torch.equal(got, torch.zeros_like(got))
    s.close()


def test_int8_summaries_still_cover_every_key():
    """The summaries choosing reads are int8 codes with a float32 scale each (a quarter of
    float32's bytes): per channel the stored centre c and half-range r must still span the
    summary's keys, c - r <= min and c + r >= max, at every magnitude (tiny, ordinary, huge)
    and with channels of very different sizes in one summary, so that Quest's score stays an
    upper bound."""
    from unikv.kvstrategies.sparse import _summaries

    g = torch.Generator().manual_seed(0)
    for scale in (1e-6, 1e-2, 1.0, 300.0, 1e4, 1e30):
        a = torch.randn(4, 7, 64, generator=g) * scale
        b = a + torch.rand(4, 7, 64, generator=g) * scale
        a[0, 0, 5], b[0, 0, 5] = -1e3 * scale, 1e3 * scale  # one channel dwarfs the rest
        a[1, 1], b[1, 1] = 0.0, 0.0  # a summary of zero keys
        codes, scales = _summaries(a.clone(), b.clone(), ranged=True)
        assert codes.dtype == torch.int8 and codes.shape == (4, 7, 128)
        c = codes[..., :64].double() * scales.double().unsqueeze(-1)
        r = codes[..., 64:].double() * scales.double().unsqueeze(-1)
        assert (c - r <= a.double()).all() and (c + r >= b.double()).all(), scale
        assert torch.isfinite(scales).all()


def test_an_attached_prefix_is_summarized_from_the_stored_keys():
    """A second sequence attached to a shared prefix gets the summaries the first one built
    while writing it (computed from the stored keys), and so chooses the same blocks."""
    s = build(budget_tokens=64)
    ids = list(range(1000, 1000 + 320))
    k = torch.randn(LAYERS, 320, HEADS, DIM)
    step(s, 0, k, torch.randn(LAYERS, 320, HEADS * GROUP, DIM), more_prompt=True)
    s.publish(0, ids)
    assert s.match_prefix(1, ids + [7]) == 320
    q = torch.randn(LAYERS, 1, HEADS * GROUP, DIM)
    new = torch.randn(LAYERS, 1, HEADS, DIM)
    out0 = step(s, 0, new, q)
    first = [s.selection.last_read[layer][0].sort(-1).values for layer in range(LAYERS)]
    out1 = step(s, 1, new, q)
    for layer in range(LAYERS):
        assert torch.equal(s.selection.last_read[layer][0].sort(-1).values, first[layer])
        assert torch.allclose(out0[layer], out1[layer], atol=1e-6)
    blocks = 320 // BS
    got, want = s.selection.summaries(1)[:, :, :blocks], s.selection.summaries(0)[:, :, :blocks]
    assert torch.equal(got, want)
    s.close()


def test_a_prefill_and_a_short_sequence_read_everything():
    s = build(budget_tokens=64, prefill_tokens=32)
    k = torch.randn(LAYERS, 200, HEADS, DIM)
    step(s, 0, k[:, :100], torch.randn(LAYERS, 100, HEADS * GROUP, DIM))  # > prefill_tokens
    assert all(x == [None] for x in s.selection.last_read)
    step(s, 0, k[:, 100:116], torch.randn(LAYERS, 16, HEADS * GROUP, DIM))  # a scored chunk
    assert all(x[0] is not None for x in s.selection.last_read)
    short = build(budget_tokens=4096)
    step(short, 0, k, torch.randn(LAYERS, 200, HEADS * GROUP, DIM), more_prompt=True)
    step(short, 0, k[:, :1], torch.randn(LAYERS, 1, HEADS * GROUP, DIM))
    assert all(x == [None] for x in short.selection.last_read)  # all it stores fits
    s.close()
    short.close()


@pytest.mark.parametrize(
    ("stored", "floor", "reads"),
    [(1000, None, None), (4000, None, 1024), (4000, 0, 500), (10000, None, 1250)],
)
def test_a_share_of_the_stored_tokens_never_reads_fewer_than_the_floor(stored, floor, reads):
    """budget_share (1/8) of the stored tokens, but at least budget_floor (1,024 by default):
    a sequence of fewer tokens reads them all; budget_tokens is not floored."""
    opts = {} if floor is None else {"budget_floor": floor}
    s = build(**opts)
    k = torch.randn(LAYERS, stored, HEADS, DIM)
    step(s, 0, k, torch.randn(LAYERS, stored, HEADS * GROUP, DIM), more_prompt=True)
    step(s, 0, k[:, :1], torch.randn(LAYERS, 1, HEADS * GROUP, DIM))
    blocks = s.selection.last_read[0][0]
    if reads is None:
        assert blocks is None  # all of it fits the floor
    else:  # whole blocks up to the budget; the window's last block partly filled
        assert reads - 2 * BS < blocks.shape[1] * BS <= reads + BS, blocks.shape
    s.close()
    assert build(budget_tokens=64, budget_floor=4096).selection._budget(8000) == 64
    with pytest.raises(ValueError, match="budget_floor"):
        build(budget_floor=-1)


def test_options_are_checked_and_the_axis_composes_with_every_format_and_placement():
    with pytest.raises(ValueError, match="budget_tokens"):
        build(budget_tokens=0)
    with pytest.raises(ValueError, match="budget_share"):
        build(budget_share=1.5)
    names = {kvstrategies.composed.name_of(a) for a in kvstrategies.composed.combinations()}
    for fmt in kvstrategies.FORMATS.names():
        for place in ("resident", "tiered"):
            assert f"{fmt}+{place}+sparse" in names


def test_the_run_report_shows_the_share_of_blocks_read():
    from unikv.cli.main import _memory_lines
    from unikv.engine.report import MemoryReport

    s = build(budget_tokens=96)
    k = torch.randn(LAYERS, 400, HEADS, DIM)
    step(s, 0, k, torch.randn(LAYERS, 400, HEADS * GROUP, DIM), more_prompt=True)
    for i in range(3):
        step(s, 0, k[:, i : i + 1], torch.randn(LAYERS, 1, HEADS * GROUP, DIM))
    report = s.stats()
    lines = _memory_lines(MemoryReport(report))
    share = report.selection["blocks_read_share"]
    assert 0 < share < 0.3  # 96 tokens of budget (and the partly filled last block) of 400
    assert f"[sparse attention (budget 96): {share:.1%} of the stored blocks read per step" in lines
    assert "chosen the step before" in lines  # stability, from the second decode step on
    s.close()


def test_tiered_reads_the_chosen_blocks_where_they_live(tmp_path):
    """Tiered: the needles' blocks sit on the host and SSD tiers (only the newest tokens are on
    the device); a decode step reads them there and attends exactly as the resident cache
    does over the same chosen blocks."""
    n, at, at_host = 640, 100, 400
    g = torch.Generator().manual_seed(3)
    direction = torch.nn.functional.normalize(torch.randn(HEADS, DIM, generator=g), dim=-1)
    tiered = build_tiered(tmp_path, budget_tokens=96)
    resident = build(budget_tokens=96)
    k = haystack(n, at, direction)
    k[:, at_host : at_host + 4] = 4.0 * direction  # a second needle, on the host tier
    q = (3.0 * direction).repeat_interleave(GROUP, 0).expand(LAYERS, 1, -1, -1)
    new = 0.1 * torch.randn(LAYERS, 1, HEADS, DIM)
    outs = []
    for s in (tiered, resident):
        step(s, 0, k, torch.randn(LAYERS, n, HEADS * GROUP, DIM), more_prompt=True)
        outs.append(step(s, 0, new, q))
    tiers_of = [r.tier for r in tiered.pool.table(0).refs]
    chosen = tiered.selection.last_read[0][0]
    places = {tiers_of[b] for b in chosen.flatten().tolist()}
    assert {"device", "host", "ssd"} <= places  # chosen blocks in all three places
    assert at // BS in chosen[0].tolist()  # the needle's block, on the SSD tier
    assert tiers_of[at // BS] == "ssd" and tiers_of[at_host // BS] == "host"
    assert at_host // BS in chosen[0].tolist()
    assert torch.equal(chosen.sort().values, resident.selection.last_read[0][0].sort().values)
    for a, b in zip(*outs, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    from unikv.kernels import sparse as kernels

    if kernels.unavailable() is None:  # read in place from all three places by the C kernel
        assert tiered.stats().format["kernels"]["attention.blocks"]["active"] == "c"
    tiered.close()
    resident.close()


@pytest.mark.parametrize("placement", ["resident", "tiered"])
def test_a_packed_format_attends_only_the_chosen_records(tmp_path, placement, monkeypatch):
    """int8 (a packed format): a decode step gathers the chosen blocks' records where they
    live (the needle's on the SSD tier when tiered) and the kernel attends them; the whole
    cache is never decoded, and the output is what attention over the decoded chosen tokens
    gives."""
    from unikv.kvstrategies.axes import Format

    n, at = 640, 100
    g = torch.Generator().manual_seed(5)
    direction = torch.nn.functional.normalize(torch.randn(HEADS, DIM, generator=g), dim=-1)
    name = f"int8+{placement}+sparse"
    if placement == "resident":
        s = build(name, budget_tokens=96)
    else:
        s = build_tiered(tmp_path, name, budget_tokens=96)
    step(s, 0, haystack(n, at, direction), torch.randn(LAYERS, n, HEADS * GROUP, DIM),
         more_prompt=True)  # fmt: skip
    q = (3.0 * direction).repeat_interleave(GROUP, 0).expand(LAYERS, 1, -1, -1)
    new = 0.1 * torch.randn(LAYERS, 1, HEADS, DIM)
    assert s.reserve(0, 1)
    s.begin_step(StepBatch([0], [1]))  # blocks move to their tiers first
    if placement == "tiered":
        assert s.pool.table(0).refs[at // BS].tier == "ssd"
    for layer in range(LAYERS):
        s.append(layer, new[layer], new[layer])
        with monkeypatch.context() as m:  # decoding the whole cache is not allowed
            m.setattr(type(s.format), "read", lambda *a: pytest.fail("read every block"))
            out = s.attend(layer, q[layer])
        chosen = s.selection.last_read[layer]
        assert at // BS in chosen[0][0].tolist() and chosen[0].shape[1] * BS <= 96 + BS
        ref = Format.attend_tokens(s.format, layer, q[layer], s._step, chosen)  # decoded
        assert torch.allclose(out, ref, atol=1e-4), (out - ref).abs().max()
        assert not torch.allclose(out, s.format.attend(layer, q[layer]), atol=1e-3)
    s.end_step()
    assert s.stored_tokens(0) == n + 1
    s.close()


def test_tiered_stages_the_likely_ssd_blocks_and_reads_a_new_choice_late(tmp_path):
    """With an SSD tier, a step stages ahead only the SSD blocks the step before read (per
    layer); a block chosen anew (the query turns to another needle) is read when chosen. Every
    step attends exactly as the resident cache does over the same blocks."""
    n, at_a, at_b = 640, 100, 200  # both needles on the SSD tier (tokens below 320)
    g = torch.Generator().manual_seed(11)
    dirs = torch.nn.functional.normalize(torch.randn(2, HEADS, DIM, generator=g), dim=-1)
    tiered = build_tiered(tmp_path, budget_tokens=96, dense_layers=1)
    resident = build(budget_tokens=96, dense_layers=1)
    k = haystack(n, at_a, dirs[0])
    k[:, at_b : at_b + 4] = 4.0 * dirs[1]
    prompt_q = torch.randn(LAYERS, n, HEADS * GROUP, DIM)
    for s in (tiered, resident):
        step(s, 0, k, prompt_q, more_prompt=True)
    fetcher = tiered.placement.prefetcher
    late = []
    for t, d in enumerate((0, 0, 0, 1, 1)):  # the query turns to needle B at the 4th step
        q = (3.0 * dirs[d]).repeat_interleave(GROUP, 0).expand(LAYERS, 1, -1, -1)
        new = 0.1 * torch.randn(LAYERS, 1, HEADS, DIM)
        before = fetcher.rows_late
        outs = [step(s, 0, new, q) for s in (tiered, resident)]
        late.append(fetcher.rows_late - before)
        for layer in range(LAYERS):
            for a, b in zip(*(x[layer] for x in outs), strict=True):
                assert torch.allclose(a, b, atol=1e-6), (t, layer)
        chosen = tiered.selection.last_read[LAYERS - 1][0]
        assert (at_a if d == 0 else at_b) // BS in chosen[0].tolist()
    assert tiered.pool.table(0).refs[at_b // BS].tier == "ssd"
    ssd_blocks = sum(r.tier == "ssd" for r in tiered.pool.table(0).refs)
    assert late[1] == late[2] == 0  # the same needle: every chosen block was staged ahead
    assert late[3] > 0  # needle B's block was not: read when chosen
    stats = fetcher.stats()
    # The first decode step staged every SSD block (no step before it selected); the later
    # ones about the blocks they read, far fewer than all of them per sparse layer.
    assert stats["rows_ahead"] > 0
    assert stats["rows_ahead"] + stats["rows_late"] < 4 * (LAYERS - 1) * ssd_blocks / 2
    from unikv.cli.main import _memory_lines
    from unikv.engine.report import MemoryReport

    lines = _memory_lines(MemoryReport(tiered.stats()))
    want = f"sparse: {stats['rows_ahead']} likely blocks staged ahead, {stats['rows_late']} read"
    assert want in lines, lines
    tiered.close()
    resident.close()


def test_a_packed_format_falls_back_where_one_sink_mask_cannot_serve_every_head():
    """Block 0's first tokens are attended from the fp16 sinks (the kernel masks them in the
    record). Chosen blocks where some KV heads read block 0 and others do not cannot share one
    mask: that layer takes the generic path (every block decoded, the chosen tokens attended);
    where every head reads it, the kernel does, with the same result."""
    from unikv.kvstrategies.axes import Format

    s = build("int8+resident+sparse", budget_tokens=96)
    n = 320
    step(s, 0, torch.randn(LAYERS, n, HEADS, DIM), torch.randn(LAYERS, n, HEADS * GROUP, DIM),
         more_prompt=True)  # fmt: skip
    assert s.reserve(0, 1)
    s.begin_step(StepBatch([0], [1]))
    s.append(0, torch.randn(1, HEADS, DIM), torch.randn(1, HEADS, DIM))
    q = torch.randn(1, HEADS * GROUP, DIM)
    last = n // BS  # the block the step's token goes into
    fmt = s.format
    for blocks, kernel in (([[0, 3, 7, last], [2, 3, 7, last]], False),
                           ([[0, 3, 7, last], [0, 4, 9, last]], True)):  # fmt: skip
        chosen = [torch.tensor(blocks)]
        pieces, seq = fmt._parts(0, count=False)[0], fmt._seqs[0]
        assert (fmt._chosen(pieces, seq, chosen[0]) is not None) == kernel
        got = fmt.attend_tokens(0, q, s._step, chosen)
        ref = Format.attend_tokens(fmt, 0, q, s._step, chosen)
        assert torch.allclose(got, ref, atol=1e-4)
    s.abort_step()
    s.close()


def _summaries_and_queries(rows, hq, h, d, summaries, seed=0, width=2):
    """Queries [rows, hq, d] and random summaries for `sparse.choose`: int8 codes in tiles
    ([h, summaries rounded up to 16, width x d]: centre and half-range, or the centre alone)
    and a float32 scale each. The kernel and the reference compute the same scores bit for
    bit (integer dots); random scales leave no two equal."""
    from unikv.kernels.sparse import TILE, tile

    g = torch.Generator().manual_seed(seed)
    n = -(-summaries // TILE) * TILE
    q = torch.randn(rows, hq, d, generator=g) * 3
    codes = torch.randint(-127, 128, (h, n, width * d), generator=g, dtype=torch.int8)
    codes[..., d:] = codes[..., d:].abs()  # a half-range is not negative
    return q, tile(codes), torch.rand(h, n, generator=g) + 0.01


@pytest.mark.parametrize("group", [16, 64, 128])
def test_the_key_quantizer_kernel_makes_the_references_bytes(group, isa):
    """summary = keys: `sparse_quantize_keys` (one pass in C) against `quantize_key_tiles`
    (PyTorch), byte for byte, under every build (F16C or the integer float16 rounding): keys of
    every scale from float16's subnormals to beyond its range, a constant channel, ties; a last
    group of fewer tokens (the open one), of any length, read in place from a longer buffer."""
    from unikv.kernels import sparse as kernels
    from unikv.kvstrategies.sparse import quantize_key_tiles

    if kernels.unavailable() is not None:
        pytest.skip(kernels.unavailable())
    g = torch.Generator().manual_seed(group)
    d = 64
    n = 2 * group + 16
    x = torch.randn(5, n, d, generator=g) * torch.logspace(-9, 5.5, d)
    x[:, :, 3] = 0.3  # constant: step 0, codes 0
    x[:, :, 7] = torch.arange(n).float() / 2  # steps whose codes tie at .5
    x[1] *= -1
    for threads in (1, 2):
        torch.set_num_threads(threads)
        got_c, got_p = kernels.quantize_key_tiles(x, group)
        want_c, want_p = quantize_key_tiles(x, group)
        assert got_c.shape == (5, n // 16, d // 8, 16, 4) and got_p.shape == (5, 3, 2, d)
        assert torch.equal(got_c, want_c)
        assert torch.equal(got_p.view(torch.int16), want_p.view(torch.int16))
    assert torch.isinf(want_p[..., 1, :].float()).any()  # float16's range was passed
    assert (want_p[..., 0, :].float().abs() < 6.1e-5).any()  # and its subnormals reached
    # any length (a last tile padded with its last key), rows at a stride (a buffer's slice)
    buf = torch.randn(5, group, d, generator=g)
    for part in (buf[:, :1], buf[:, :23], buf[:, : group - 1], buf):
        got_c, got_p = kernels.quantize_key_tiles(part, group)
        want_c, want_p = quantize_key_tiles(part, group)
        assert torch.equal(got_c, want_c) and torch.equal(got_p, want_p)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.quantize_key_tiles(x, 24)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.quantize_key_tiles(x.transpose(1, 2)[:, :, :64], group)


@pytest.mark.parametrize("ranged", [False, True])
def test_the_summary_kernel_makes_the_references_bytes(ranged, isa):
    """A decode step's keys into the centres' summaries: `sparse_summarize` (one pass in C)
    against `summarize_torch`, byte for byte (codes, scales, the running minimum and maximum),
    under every build: a summary started and one filling on, one token and several, keys from
    a batch's slice, keys of every scale, a constant channel, centres that round at .5; a
    refused call writes nothing."""
    from unikv.kernels import sparse as kernels
    from unikv.kvstrategies.sparse import summarize_torch

    if kernels.unavailable() is not None:
        pytest.skip(kernels.unavailable())
    g = torch.Generator().manual_seed(7 + ranged)
    layers, h, d, tiles = 4, 3, 64, 3
    w = 2 * d if ranged else d
    batch = torch.randn(layers, 5, h, d, generator=g) * torch.logspace(-6, 4, d)
    batch[..., 3] = 0.75  # constant: half-range 0
    batch[..., 5] = torch.arange(5).float().view(1, 5, 1) * 0.5  # centres at .25 and .5 steps
    codes = torch.randint(-127, 128, (layers, h, tiles, w // 4, 16, 4), generator=g,
                          dtype=torch.int8)  # fmt: skip
    got = (torch.randn(2, layers, h, d, generator=g).sort(0).values, codes,
           torch.rand(layers, h, 16 * tiles, generator=g))  # fmt: skip
    want = tuple(t.clone() for t in got)
    untouched = codes.clone()
    for keys, goes_on, index in ((batch[:, 1:2], False, 0), (batch[:, 2:4], True, 0),
                                 (batch[:, 4:5], True, 0), (batch[:, :1], False, 17),
                                 (batch[:, 1:4], True, 17), (batch[:, 4:], False, 47)):  # fmt: skip
        kernels.summarize(keys, got[0], goes_on, ranged, got[1], got[2], index)
        summarize_torch(keys, want[0], goes_on, ranged, want[1], want[2], index)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (goes_on, index)
    written = (want[1] != untouched).flatten(3).any(-1)  # [L, Hkv, tiles]
    assert written[:, :, 0].all() and written[:, :, 1].all() and written[:, :, 2].all()
    before = tuple(t.clone() for t in got)
    with pytest.raises(ValueError, match="rejected"):  # past the last tile: nothing written
        kernels.summarize(batch[:, :1], got[0], True, ranged, got[1], got[2], 16 * tiles)
    with pytest.raises(ValueError, match="float32 keys"):
        kernels.summarize(batch[:, :1].double(), got[0], True, ranged, got[1], got[2], 0)
    assert all(torch.equal(a, b) for a, b in zip(got, before, strict=True))


def test_the_add_keys_kernel_makes_the_references_bytes(isa):
    """A decode step's keys into the 4-bit keys' open group: `sparse_add_keys` (one call in C,
    computing again only the codes whose key or channel moved) against `add_keys_torch`
    (the whole group quantized again), byte for byte (the open group's keys and range, the
    tiles, the minima and steps), under every build: a group's first token, tokens filling it
    on across a tile boundary, several tokens at once, one that widens every channel, its last
    token, a later group; keys from a batch's slice, of every scale, a constant channel; a
    refused call writes nothing."""
    from unikv.kernels import sparse as kernels
    from unikv.kvstrategies.sparse import add_keys_torch

    if kernels.unavailable() is not None:
        pytest.skip(kernels.unavailable())
    gen = torch.Generator().manual_seed(11)
    layers, h, d, g, groups = 4, 3, 64, 32, 3
    batch = torch.randn(layers, 5, h, d, generator=gen) * torch.logspace(-6, 4, d)
    batch[..., 3] = 0.75  # constant: step 0, codes 0
    codes = torch.randint(0, 256, (layers, h, groups * g // 16, d // 8, 16, 4), generator=gen,
                          dtype=torch.uint8)  # fmt: skip
    params = torch.randn(layers, h, groups, 2, d, generator=gen).half()
    got = (torch.randn(layers, h, g, d, generator=gen), torch.zeros(layers, h, 2, d), codes,
           params)  # fmt: skip
    want = tuple(t.clone() for t in got)
    untouched = codes.clone()
    for keys, have, index in ((batch[:, 1:2], 0, 1), (batch[:, 2:4], 1, 1), (batch[:, :5], 3, 1),
                              (batch[:, 4:] * 1e3, 8, 1), (batch[:, 4:], 9, 1),
                              (batch[:, 1:4], 10, 1), (batch[:, :5], 13, 1), (batch[:, :5], 18, 1),
                              (batch[:, :5], 23, 1), (batch[:, 1:4], 28, 1), (batch[:, 4:], 31, 1),
                              (batch[:, :1], 0, 2)):  # fmt: skip
        kernels.add_keys(keys, got[0], got[1], have, got[2], got[3], index)
        add_keys_torch(keys, want[0], want[1], have, want[2], want[3], index)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (have, index)
    written = (want[2] != untouched).flatten(3).any(-1)  # [L, Hkv, tiles]: group 1, 2's first
    assert written[:, :, 2:5].all() and not written[:, :, :2].any()
    before = tuple(t.clone() for t in got)
    with pytest.raises(ValueError, match="open group"):  # past the group's end: nothing written
        kernels.add_keys(batch[:, :2], got[0], got[1], g - 1, got[2], got[3], 0)
    with pytest.raises(ValueError, match="float32 keys"):
        kernels.add_keys(batch[:, :1].double(), got[0], got[1], 0, got[2], got[3], 0)
    with pytest.raises(ValueError, match="float16"):
        kernels.add_keys(batch[:, :1], got[0], got[1], 0, got[2], got[3], groups)
    assert all(torch.equal(a, b) for a, b in zip(got, before, strict=True))


def test_a_key_group_shares_its_minimum_and_step_as_it_fills():
    """key_group = 64: keys written over a prompt and single steps (the open group quantized
    again as it fills, across its tiles) come back within half their group's step, and each
    group's minima and steps are its keys'."""
    s = build(summary="keys", key_group=64, budget_tokens=64)
    k = torch.randn(LAYERS, 100, HEADS, DIM) * torch.logspace(-1, 1, DIM)
    step(s, 0, k[:, :40], torch.randn(LAYERS, 40, HEADS * GROUP, DIM), more_prompt=True)
    for t in range(40, 100):
        step(s, 0, k[:, t : t + 1], torch.randn(LAYERS, 1, HEADS * GROUP, DIM))
    sel = s.selection
    got = sel.summaries(0)[:, :, :100]  # [L, Hkv, tokens, D]
    kt = k.transpose(1, 2)
    for g0 in (0, 64):
        x = kt[:, :, g0 : g0 + 64]
        step_ = (x.amax(2) - x.amin(2)).unsqueeze(2) / 15
        assert ((got[:, :, g0 : g0 + 64] - x).abs() <= 0.5 * step_ + 2e-3 * x.abs().amax()).all()
    params = sel._scales[0].float()  # [L, Hkv, groups, 2, D]
    for g, (a, b) in enumerate(((0, 64), (64, 100))):
        lo, hi = kt[:, :, a:b].amin(2), kt[:, :, a:b].amax(2)
        assert torch.allclose(params[:, :, g, 0], lo, atol=1e-3, rtol=1e-3)
        assert torch.allclose(params[:, :, g, 1], (hi - lo) / 15, atol=1e-3, rtol=2e-3)


@pytest.mark.parametrize("group,budget", [(16, 64), (128, 64)], ids=["closing", "open"])
def test_keys_kept_unquantized_while_nothing_is_chosen_give_the_same_choices_and_bytes(
    group, budget, monkeypatch
):
    """summary = keys: while a sequence's steps choose nothing (all it stores fits the budget)
    its keys are only kept, and quantized when a choice first reads them: across groups that
    closed meanwhile (groups of 16), and with the first choice reading the kept group's first
    blocks (groups of 128). Every step's blocks read and every summary byte equal a selection
    that quantizes at every step; the groups' bytes are those of all the keys quantized whole."""
    from unikv.kvstrategies.sparse import SparseSelection, quantize_key_tiles

    k = torch.randn(LAYERS, 130, HEADS, DIM) * torch.logspace(-1, 1, DIM)
    q = torch.randn(LAYERS, 130, HEADS * GROUP, DIM)
    runs, kept, real = [], [], SparseSelection._add_keys
    for eager in (False, True):
        if eager:  # the reference: never keeps
            monkeypatch.setattr(SparseSelection, "_add_keys",
                                lambda self, sid, k, start, layer, keep=False:
                                real(self, sid, k, start, layer, False))  # fmt: skip
        s = build(summary="keys", key_group=group, budget_tokens=budget, sink_tokens=16)
        step(s, 0, k[:, :20], q[:, :20], more_prompt=True)
        reads, stale = [], []
        for t in range(20, 130):
            step(s, 0, k[:, t : t + 1], q[:, t : t + 1])
            reads.append([x[0] for x in s.selection.last_read])
            stale.append(0 in s.selection._stale)
        runs.append((s.selection, reads))
        kept.append(stale)
    (lazy, a), (ref, b) = runs
    assert any(kept[0]) and not all(kept[0]) and not any(kept[1])  # kept, then chosen
    assert sum(x is not None for r in b for x in r) > 100  # the reference chose at many steps
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            assert (u is None and v is None) or torch.equal(u, v)
    assert torch.equal(lazy.summaries(0), ref.summaries(0))
    assert torch.equal(lazy._codes[0], ref._codes[0])
    assert torch.equal(lazy._scales[0], ref._scales[0])
    codes, params = quantize_key_tiles(k.transpose(1, 2).flatten(0, 1), group)
    assert torch.equal(lazy._codes[0][:, :, : codes.shape[1]].flatten(0, 1), codes)
    assert torch.equal(lazy._scales[0][:, :, : params.shape[1]].flatten(0, 1), params)


@pytest.mark.parametrize("rows,room", [(1, 5), (1, 0), (16, 40), (100, 700 - 16)])
def test_the_choice_kernel_chooses_what_the_reference_chooses(rows, room, isa):
    """unikv/kernels/sparse.c against the PyTorch reference (`sparse.choose`), bit for bit: the
    sinks, the best blocks per KV head in ascending order, the window; one and several query
    rows (a scored chunk; 300 query vectors), no room, every candidate, and enough blocks that
    two threads score them; summaries of whole blocks, of half blocks and of 5 parts (a
    block's score: its best; candidates that start and end inside a tile of 16 summaries),
    with the half-range or the centre alone; head dims of whole vectors and not (36), GQA
    groups that leave the kernel's passes of 4 queries part full (1, 2, 3), and a block scored
    by its summaries' largest or their log-sum-exp (`block_score` lse: the kernel's exp is a
    polynomial within 2e-7 of torch's, so a block may differ only where the two scores of the
    blocks swapped tie within 1e-5)."""
    from unikv.kernels import sparse as kernels
    from unikv.kvstrategies.sparse import block_scores, choose_torch

    if kernels.unavailable() is not None:
        pytest.skip(kernels.unavailable())
    h, blocks = 3, 720
    cases = ((1.0, 1, 2, 64, 3), (0.25, 1, 2, 64, 3), (0.0, 1, 2, 64, 3), (0.25, 2, 2, 64, 3),
             (0.0, 2, 1, 64, 3), (0.0, 8, 1, 64, 3), (0.0, 5, 1, 36, 2), (0.5, 2, 2, 36, 1),
             (0.0, 1, 1, 128, 4))  # alpha, parts, width, head dim, group  # fmt: skip
    for alpha, parts, width, d, group in cases:
        q, codes, scales = _summaries_and_queries(rows, h * group, h, d, blocks * parts,
                                                  width=width)  # fmt: skip
        for threads, temp in ((1, 0.0), (2, 0.0), (2, 0.125)):  # largest; log-sum-exp
            torch.set_num_threads(threads)
            args = (q, codes, scales, 1, 701, room, 705, alpha, parts, temp)  # window [701, 705)
            got, want = kernels.choose_blocks(*args), choose_torch(*args)
            assert got.shape == (h, 1 + room + 4)
            if temp == 0:
                assert torch.equal(got, want), (alpha, parts, width, d, group, threads)
            else:  # the kernel's exp is a polynomial: only near ties may differ
                _equal_but_near_ties(got, want, block_scores(q, codes, scales, 1, 701, alpha,
                                                             parts, temp), 1, room)  # fmt: skip
    q, codes, scales = _summaries_and_queries(rows, 9, 3, 64, 720)
    with pytest.raises(ValueError, match="refused"):
        kernels.choose_blocks(q, codes, scales, 2, 600, 599, 610, 0.25)  # more room than blocks
    with pytest.raises(ValueError, match="int8 summaries"):
        kernels.choose_blocks(q, codes.float(), scales, 2, 600, 50, 610, 0.25)
    with pytest.raises(ValueError, match="do not cover"):
        kernels.choose_blocks(q, codes, scales, 2, 600, 50, 610, 0.25, 2)
    for temp in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="refused"):
            kernels.choose_blocks(q, codes, scales, 2, 600, 50, 610, 0.25, 1, temp)


def _equal_but_near_ties(got, want, scores, lo, room):
    """The kernel's choice `got` against the reference's `want` ([Hkv, blocks]): the same
    sinks and window, and per KV head the chosen blocks the same but where a block one chose
    and the other did not scores within 1e-5 of the other's lowest chosen (`scores`: the
    reference's, [Hkv, candidates] from block `lo`)."""
    assert torch.equal(got[:, :lo], want[:, :lo]) and torch.equal(
        got[:, lo + room :], want[:, lo + room :]
    )
    for h in range(got.shape[0]):
        a, b = set(got[h, lo : lo + room].tolist()), set(want[h, lo : lo + room].tolist())
        if a == b:
            continue
        line = min(scores[h, x - lo].item() for x in b)
        for x in a ^ b:
            assert abs(scores[h, x - lo].item() - line) < 1e-5, (h, x, line)


def _keys(h: int, tokens: int, d: int, seed: int = 0, group: int = 16):
    """Random keys [Hkv, tokens, D] (channels of different scales and offsets, as a model's
    are) as `sparse_choose` reads them: codes in tiles and float16 minima and steps, one for
    each `group` tokens."""
    from unikv.kernels.sparse import tile_keys
    from unikv.kvstrategies.sparse import quantize_keys

    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 1, d)[torch.randperm(d, generator=g)]
    k = torch.randn(h, tokens, d, generator=g) * scale + torch.randn(d, generator=g) * scale
    c, m, s = quantize_keys(k.view(h, -1, group, d))
    return k, tile_keys(c.view(h, -1, 16, d)), torch.stack((m, s), dim=2).contiguous()


def test_keys_in_4_bits_are_within_half_a_step_and_tile_both_ways():
    """summary = keys: a tile's keys come back as minimum + code x step within half a step
    (and float16's rounding of both), a constant channel exactly; `untile_keys` inverts
    `tile_keys`; the selection's `summaries` are those keys."""
    from unikv.kernels.sparse import tile_keys, untile_keys
    from unikv.kvstrategies.sparse import quantize_keys

    x = torch.randn(3, 2, 16, 24) * torch.logspace(-2, 2, 24)
    x[..., 5] = 1.25  # one channel constant: step 0, codes 0
    c, m, s = quantize_keys(x)
    assert c.dtype == torch.uint8 and int(c.max()) <= 15 and m.dtype == s.dtype == torch.float16
    back = m.float().unsqueeze(-2) + c.float() * s.float().unsqueeze(-2)
    slack = s.float().unsqueeze(-2) * 0.5 + x.abs().amax(-2, keepdim=True) * 2e-3
    assert ((back - x).abs() <= slack).all()
    assert torch.equal(back[..., 5], x[..., 5])
    assert torch.equal(untile_keys(tile_keys(c)), c.flatten(-3, -2))
    s = build(summary="keys", budget_tokens=64)
    k = torch.randn(LAYERS, 40, HEADS, DIM)
    step(s, 0, k, torch.randn(LAYERS, 40, HEADS * GROUP, DIM), more_prompt=True)
    got = s.selection.summaries(0)[:, :, :40]  # [L, Hkv, tokens, D]
    assert ((got - k.transpose(1, 2)).abs() <= 0.5 * (k.amax(1) - k.amin(1)).unsqueeze(2) / 15
            + 1e-2).all()  # fmt: skip
    for bad, match in (({"range_weight": 0.5}, "needs summary = centres"),
                       ({"summary_tokens": 4}, "needs summary = centres"),
                       ({"summary": "all"}, "summary"), ({"key_group": 48}, "key_group"),
                       ({"summary": "centres", "key_group": 32}, "summary = keys")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            build(**bad)
    with pytest.raises(ValueError, match="divisible by 8"):
        kvstrategies.create("dense+resident+sparse", KVSpec(1, 1, 12), options={"summary": "keys"})


@pytest.mark.parametrize("rows,room", [(1, 5), (1, 0), (16, 40), (100, 700 - 16)])
def test_the_choice_kernel_chooses_from_keys_what_the_reference_chooses(rows, room, isa):
    """summary = keys: unikv/kernels/sparse.c against the PyTorch reference, the sinks and window
    exact and the chosen blocks the same but for near ties (the two sum q . m in different
    orders): blocks of 16, 8 and 12 tokens (tiles of 16 keys spanning blocks), head dims 64, 40
    and 128, GQA groups of 1 to 4, one and two threads, a block's best token or its tokens'
    log-sum-exp; the integer dots are exact, so scores agree to float32 rounding."""
    from unikv.kernels import sparse as kernels
    from unikv.kvstrategies.sparse import block_scores, choose_torch, key_scores

    if kernels.unavailable() is not None:
        pytest.skip(kernels.unavailable())
    h, blocks = 3, 720
    # (tokens sharing a minimum and step: 16, or groups whose tiles the kernel scores with the
    # same query codes, the first candidate tile inside a group)
    for parts, d, group, key_group in ((16, 64, 3, 16), (8, 40, 1, 16), (12, 128, 4, 16),
                                       (16, 64, 2, 16), (16, 64, 3, 64),
                                       (8, 40, 4, 128)):  # fmt: skip
        n = -(-blocks * parts // key_group) * key_group
        _, codes, params = _keys(h, n, d, seed=parts + d, group=key_group)
        q = torch.randn(rows, h * group, d, generator=torch.Generator().manual_seed(d))
        got_s = key_scores(q, codes, params, parts, 701 * parts)
        assert got_s.shape == (h, 700 * parts) and torch.isfinite(got_s).all()
        for threads, temp in ((1, 0.0), (2, 0.0), (2, 0.125)):
            torch.set_num_threads(threads)
            args = (q, codes, params, 1, 701, room, 705, 0.0, parts, temp)
            got, want = kernels.choose_blocks(*args), choose_torch(*args)
            assert got.shape == (h, 1 + room + 4)
            _equal_but_near_ties(got, want, block_scores(q, codes, params, 1, 701, 0.0, parts,
                                                         temp), 1, room)  # fmt: skip
    # blocks of one token, room for one: each head's best token by the reference's scores
    _, codes, params = _keys(h, 64, 64)
    q = torch.randn(1, h * 3, 64)
    want = key_scores(q, codes, params, 0, 64)  # [h, 64]
    got = kernels.choose_blocks(q, codes, params, 0, 64, 1, 64, 0.0, 1)
    assert torch.equal(got[:, 0], want.argmax(-1))
    with pytest.raises(ValueError, match="minima and steps"):
        kernels.choose_blocks(q, codes, params.transpose(1, 2), 0, 4, 1, 4, 0.0, 16)


def test_queries_are_quantized_alike_in_the_kernel_and_the_reference(isa):
    """The choice's one approximation beyond the summaries: each query vector as int8 codes
    within [-63, 63] and one scale. A query whose codes round half to even and one of mixed
    magnitudes choose in the kernel what they choose in the reference, and the
    reference's codes are within half a scale of the query; a zero query's codes are zeros."""
    from unikv.kernels import sparse as kernels
    from unikv.kvstrategies.sparse import QMAX, choose_torch, quantize_queries

    q = torch.randn(2, 3, 64) * torch.logspace(-3, 3, 64)
    codes, scale = quantize_queries(q)
    assert codes.abs().max() == QMAX and torch.equal(codes, codes.round())
    assert ((codes * scale - q).abs() <= scale * 0.5001).all()
    zero, zscale = quantize_queries(torch.zeros(1, 8))
    assert torch.equal(zero, torch.zeros(1, 8)) and zscale.item() == 0.0
    if kernels.unavailable() is not None:
        pytest.skip(kernels.unavailable())
    _, c, sc = _summaries_and_queries(1, 3, 1, 64, 64 * 4)
    halves = torch.zeros(1, 3, 64)
    halves[..., 0], halves[..., 1:4] = 63.0, torch.tensor([0.5, 1.5, -2.5])  # ties: to even
    for qq in (q[:1], halves):  # (a zero query scores every block 0: all ties)
        args = (qq, c, sc, 0, 64, 8, 64, 0.0, 4)
        assert torch.equal(kernels.choose_blocks(*args), choose_torch(*args))


def test_range_weight_moves_the_score_between_the_bound_and_the_centre():
    """range_weight 1 is Quest's bound; 0 scores a block by its channels' centre alone: a block
    of one outlier key and a block of keys all moderately aligned swap places."""
    from unikv.kernels.sparse import tile
    from unikv.kvstrategies.sparse import choose_torch

    d = 4
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    codes = torch.zeros(1, 16, 2 * d, dtype=torch.int8)  # a tile of 16 summaries, scale 1/2
    codes[0, 1, 0], codes[0, 1, d] = 2, 6  # one key at 4, the rest at -2: centre 1, range 3
    codes[0, 2, 0], codes[0, 2, d] = 4, 1  # every key near 2: centre 2, range 0.5
    b, scales = tile(codes), torch.full((1, 16), 0.5)
    assert choose_torch(q, b, scales, 0, 3, 1, 3, 1.0)[0].tolist() == [1]  # bound: 4 vs 2.5
    assert choose_torch(q, b, scales, 0, 3, 1, 3, 0.0)[0].tolist() == [2]  # centre: 1 vs 2


def test_log_sum_exp_prefers_many_strong_tokens_to_one_stronger(isa):
    """`block_score` max ranks a block by its best token; lse by about the softmax mass its
    tokens take: a block of one key at 10 and fifteen at 0 against a block of sixteen at 9.5
    (one token per summary, scale 1) swap places, in the reference and in the kernel."""
    from unikv.kernels import sparse as kernels
    from unikv.kernels.sparse import tile
    from unikv.kvstrategies.sparse import choose_torch

    d = 4
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])  # one query: code 63, scale 1 / 63
    codes = torch.zeros(1, 48, d, dtype=torch.int8)  # 3 blocks of 16 one-token summaries
    codes[0, 16, 0] = 20  # block 1: one key at 10, the others at 0
    codes[0, 32:48, 0] = 19  # block 2: every key at 9.5
    b, scales = tile(codes), torch.full((1, 48), 0.5)
    for temp, want in ((0.0, [1]), (1.0, [2])):
        args = (q, b, scales, 0, 3, 1, 3, 0.0, 16, temp)
        assert choose_torch(*args)[0].tolist() == want
        if kernels.unavailable() is None:
            assert kernels.choose_blocks(*args)[0].tolist() == want
    kv = kvstrategies.create("dense+resident+sparse", SPEC, options={"block_score": "lse"})
    assert kv.selection._temp == SPEC.scale
    with pytest.raises(ValueError, match="block_score"):
        kvstrategies.create("dense+resident+sparse", SPEC, options={"block_score": "sum"})


@pytest.mark.parametrize("d,bs", [(64, 16), (40, 12), (128, 16)])
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("picked", [9, 30])
@pytest.mark.parametrize("group", [1, 3, 5])
def test_attention_in_place_over_the_chosen_blocks_equals_the_gathered_path(
    rows, d, bs, picked, group, isa
):
    """unikv/kernels/sparse.c's `sparse_attend` reads the chosen blocks where they lie; against the
    reference (gather, then attention): one decode row and a scored chunk of 16 (causal
    within the step's own tokens, which end in a partly filled block whose empty slots hold
    NaN: never read), each head's blocks in a shuffled arena, or spread over three places of
    different sizes (a tiered cache's device and host arenas and a staged tensor), one and two
    threads; head dims and block sizes that are and are not whole vectors of 8 or 16 keys or
    channels (the kernel's wide and narrow paths), and GQA groups of 1, 3 and 5 query heads (a
    row's queries go through a block in fours: 5 is a four and a one); 12 blocks a head (36 in
    all: attended on one thread, sparse.c's SERIAL_BLOCKS) and 33 (99: split over the
    threads)."""
    from unikv.kernels import sparse as kernels
    from unikv.kvstrategies.full import attend_blocks_torch

    if kernels.unavailable() is not None:
        pytest.skip(kernels.unavailable())
    g = torch.Generator().manual_seed(rows)
    h, n_blocks = 3, 70
    arena = torch.randn(2, h, n_blocks * bs, d, generator=g)
    past = 60 * bs + 5 - rows  # the last block (60) holds the step's rows, partly filled
    chosen = torch.stack([torch.randperm(58, generator=g)[:picked] + 1 for _ in range(h)])
    blocks = torch.cat([torch.zeros(h, 1, dtype=torch.long), chosen,
                        torch.tensor([[59, 60]]).expand(h, -1)], dim=1)  # fmt: skip
    ids = torch.randperm(n_blocks, generator=g)  # per block of the sequence: its arena block
    places = [torch.randn(2, h, s * bs, d, generator=g) for s in (80, 40, 12)]
    where = torch.randint(0, 3, (n_blocks,), generator=g)  # or: its place, and its index there
    spread = ids % torch.tensor([80, 40, 12])[where]
    q = torch.randn(rows, h * group, d, generator=g)
    # the arena with NaN in the last block's empty slots (in the places, blocks share slots)
    bad = arena.clone()
    filled = (past + rows) % bs
    bad[:, :, int(ids[60]) * bs + filled : (int(ids[60]) + 1) * bs] = float("nan")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for args, read in ((([arena], None, ids), [bad]), ((places, where, spread), places)):
            got = kernels.attend_blocks(q, read, *args[1:], blocks, bs, past, 0.125)
            want = attend_blocks_torch(q, *args, blocks, bs, past, 0.125)
            assert (got - want).abs().max().item() < 1e-5, (threads, len(args[0]))


def test_the_dense_format_attends_the_chosen_blocks_in_place():
    """With the kernel built, the resident dense format's sparse steps go through it (the
    kernels report says so) and equal attention over the same blocks gathered."""
    from unikv.kernels import sparse as kernels

    if kernels.unavailable() is not None:
        pytest.skip(kernels.unavailable())
    s = build(budget_tokens=64)
    k = torch.randn(LAYERS, 400, HEADS, DIM)
    step(s, 0, k, torch.randn(LAYERS, 400, HEADS * GROUP, DIM), more_prompt=True)
    q = torch.randn(LAYERS, 1, HEADS * GROUP, DIM)
    new = torch.randn(LAYERS, 1, HEADS, DIM)
    outs = step(s, 0, new, q)
    assert s.stats().format["kernels"]["attention.blocks"]["active"] == "c"
    keys = torch.cat([k, new], dim=1)
    for layer in range(LAYERS):
        blocks = s.selection.last_read[layer][0]
        for hd in range(HEADS):
            tok = (blocks[hd].unsqueeze(-1) * BS + torch.arange(BS)).view(-1)
            kk = keys[layer, tok[tok < 401], hd]  # [S, D]: values are the keys here
            for g in range(GROUP):
                qq = q[layer, 0, hd * GROUP + g]
                w = torch.softmax(kk @ qq * SPEC.scale, 0)
                want = w @ kk
                assert torch.allclose(outs[layer][0, hd * GROUP + g], want, atol=1e-5)
    s.close()
