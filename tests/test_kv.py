"""The KV seam: StepBatch bookkeeping and attention of the contiguous cache against a reference."""

import math

import pytest
import torch

from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch, attention_one


def naive_attention(q, k, v, num_past, scale):
    """Reference: repeat K/V per query head, explicit causal mask, softmax."""
    t, hq, d = q.shape
    hkv = k.shape[0]
    k = k.repeat_interleave(hq // hkv, 0)  # [Hq, S, D]
    v = v.repeat_interleave(hq // hkv, 0)
    scores = torch.einsum("thd,hsd->hts", q, k) * scale
    s = k.shape[1]
    mask = torch.arange(s)[None, :] > (num_past + torch.arange(t))[:, None]
    scores = scores.masked_fill(mask, -math.inf)
    return torch.einsum("hts,hsd->thd", scores.softmax(-1), v)


def _keys_values(g, s, values):
    """k [2, s, 8] and v: its own [2, s, 8] ("full"), the keys' first 6 channels ("latent",
    a view as a latent cache hands it), or its own narrower [2, s, 6] ("narrow")."""
    k = torch.randn(2, s, 8, generator=g)
    if values == "latent":
        return k, k[..., :6]
    return k, torch.randn(2, s, 8 if values == "full" else 6, generator=g)


VALUES = ("full", "latent", "narrow")


@pytest.mark.parametrize("values", VALUES)
@pytest.mark.parametrize(("t", "past"), [(1, 0), (1, 17), (5, 0), (7, 30), (70, 0), (70, 300)])
def test_attention_one_matches_naive(t, past, values):
    """Decode rows and prompt chunks (T > 1: on a CPU the stored tokens and the chunk's own
    are attended apart and merged; 70 rows span several of the flash kernel's tiles)."""
    g = torch.Generator().manual_seed(t * 100 + past)
    q = torch.randn(t, 6, 8, generator=g)
    k, v = _keys_values(g, past + t, values)
    got = attention_one(q, k, v, past, 0.3)
    assert got.shape == (t, 6, v.shape[-1])
    torch.testing.assert_close(got, naive_attention(q, k, v, past, 0.3))


def test_step_batch_offsets_and_bad_input():
    b = StepBatch([4, 9], [3, 1])
    assert b.num_tokens == 4 and b.rows(1) == slice(3, 4)
    with pytest.raises(ValueError, match="twice"):
        StepBatch([1, 1], [1, 1])
    with pytest.raises(ValueError, match="at least one"):
        StepBatch([1], [0])


def test_contiguous_cache_stores_appends_and_frees():
    kv = ContiguousKVCache(num_layers=2, num_kv_heads=2, head_dim=4)
    g = torch.Generator().manual_seed(0)
    all_k = {0: [], 1: []}
    for ids, lens in (([0, 1], [5, 3]), ([0, 1], [1, 1]), ([1], [70])):
        batch = StepBatch(ids, lens)
        kv.begin_step(batch)
        n = batch.num_tokens
        k, v = torch.randn(n, 2, 4, generator=g), torch.randn(n, 2, 4, generator=g)
        q = torch.randn(n, 4, 4, generator=g)
        for layer in range(2):
            kv.append(layer, k, v)
            out = kv.attend(layer, q)
            assert out.shape == q.shape
        for i, sid in enumerate(ids):
            all_k[sid].append(k[batch.rows(i)])
        kv.end_step()
    assert kv.stored_tokens(0) == 6 and kv.stored_tokens(1) == 74
    stored = kv._k[1][0, :, :74].transpose(0, 1)
    torch.testing.assert_close(stored, torch.cat(all_k[1]))  # growth kept old contents
    elem = 2 * 2 * 2 * 4 * 4  # layers * (K, V) * heads * dims * float32 bytes
    assert kv.bytes_used() == 80 * elem
    assert kv.bytes_reserved() >= kv.bytes_used()
    kv.free(1)
    assert kv.stored_tokens(1) == 0 and kv.bytes_used() == 6 * elem
    kv.free(12345)  # unknown ids are a no-op


def test_contiguous_latent_cache_stores_keys_only():
    """With value_dim, values are the keys' first channels: not stored, not counted."""
    kv = ContiguousKVCache(num_layers=2, num_kv_heads=1, head_dim=12, scale=0.4, value_dim=8)
    g = torch.Generator().manual_seed(1)
    keys = []
    for lens in ([6], [1], [3]):
        batch = StepBatch([0], lens)
        kv.begin_step(batch)
        k = torch.randn(batch.num_tokens, 1, 12, generator=g)
        q = torch.randn(batch.num_tokens, 4, 12, generator=g)
        keys.append(k)
        hist = torch.cat(keys).transpose(0, 1)  # [1, S, 12]
        for layer in range(2):
            kv.append(layer, k, k[..., :8])
            out = kv.attend(layer, q)
            assert out.shape == (batch.num_tokens, 4, 8)
            ref = naive_attention(q, hist, hist[..., :8], hist.shape[1] - lens[0], 0.4)
            torch.testing.assert_close(out, ref)
        kv.end_step()
    assert not kv._v
    assert kv.bytes_used() == 10 * 2 * 12 * 4  # tokens * layers * key channels * float32
    with pytest.raises(ValueError, match="value_dim = 13"):
        ContiguousKVCache(1, 1, 12, value_dim=13)


def test_abort_step_keeps_previous_state():
    kv = ContiguousKVCache(num_layers=1, num_kv_heads=1, head_dim=2)
    kv.begin_step(StepBatch([0], [2]))
    kv.append(0, torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    kv.end_step()
    kv.begin_step(StepBatch([0], [3]))
    kv.abort_step()
    assert kv.stored_tokens(0) == 2


def _pieces(k, v, cuts, end):
    bounds = [0, *[c for c in cuts if c < end], end]
    return [(k[:, a:b], v[:, a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize(
    "cuts",
    [[5], [14], [15], [16], [18], [3, 15, 17], [1, 2, 3, 19]],
    ids=lambda c: "cuts" + "-".join(map(str, c)),
)
@pytest.mark.parametrize("values", VALUES)
def test_attention_over_pieces_equals_one_piece(cuts, values):
    """K/V split into runs anywhere, also inside the step's own tokens, attend like one run;
    also with values narrower than the keys (a latent cache's, or unrelated ones)."""
    from unikv.kvstrategies.kv import attention_runs

    g = torch.Generator().manual_seed(len(cuts))
    q = torch.randn(6, 4, 8, generator=g)  # a chunk of 6 new tokens after 14 stored ones
    k, v = _keys_values(g, 20, values)
    got = attention_runs(q, _pieces(k, v, cuts, 20), 14, 0.3)
    torch.testing.assert_close(got, naive_attention(q, k, v, 14, 0.3))
    # Decoding: one new token after 14 stored ones.
    got = attention_runs(q[:1], _pieces(k, v, cuts, 15), 14, 0.3)
    torch.testing.assert_close(got, naive_attention(q[:1], k[:, :15], v[:, :15], 14, 0.3))


def test_attention_falls_back_to_the_math_kernel_where_the_fused_one_cannot_run(monkeypatch):
    """PyTorch 2.13's bfloat16 flash attention on an AMX CPU with ATEN_CPU_CAPABILITY=avx2
    raises "pack_vnni2 is only supported when avx512 is supported": the math kernel serves
    from then on, with the same result; any other error still raises."""
    import torch.nn.functional as F

    from unikv.kvstrategies import kv as kvmod

    q, k = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    want = F.scaled_dot_product_attention(q, k, k)
    real, calls = F.scaled_dot_product_attention, []

    def refusing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")
        return real(*args, **kwargs)

    monkeypatch.setattr(kvmod, "_math_only", False)
    monkeypatch.setattr(F, "scaled_dot_product_attention", refusing)
    torch.testing.assert_close(kvmod.sdpa(q, k, k), want)
    assert kvmod._math_only and len(calls) == 2  # the refused call, then the math kernel
    monkeypatch.setattr(kvmod, "_math_only", False)

    def broken(*args, **kwargs):
        raise RuntimeError("something else")

    monkeypatch.setattr(F, "scaled_dot_product_attention", broken)
    with pytest.raises(RuntimeError, match="something else"):
        kvmod.sdpa(q, k, k)


def test_fragmented_runs_copy_only_their_short_stretches():
    """A sequence in several runs of slots is attended as pieces in token order: long runs as
    views into the arena (never copied on every step), each stretch of short runs between them
    gathered into one piece."""
    from unikv.kvstrategies.full import _pieces

    a = torch.arange(2 * 3 * 64 * 4, dtype=torch.float32).view(2, 3, 64, 4)
    runs = [(40, 44), (0, 20), (50, 52), (54, 56), (20, 24)]
    pieces = _pieces(a, runs, long=16)
    assert [p.shape[2] for p in pieces] == [4, 20, 8]  # short | long | three short ones
    assert pieces[1].data_ptr() == a[:, :, 0:20].data_ptr()  # the long run is a view
    whole = torch.cat([a[:, :, s:e] for s, e in runs], dim=2)
    assert torch.equal(torch.cat(pieces, dim=2), whole)  # token order kept
    assert len(_pieces(a, [(0, 4)], long=16)) == 1
