"""`hierarchical_offload`: lossless through device/host/SSD, prefetch, the persistent prefix
cache across processes and crashes, and bad input (corrupt entries, other models, full and
unusable stores). Windows are scaled down (64/64 tokens) so short texts use every tier."""

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch

from unikv import kvstrategies
from unikv.engine.assembly import build_kv, create_kv
from unikv.engine.engine import Engine
from unikv.engine.evaluate import perplexity
from unikv.engine.sampling import SamplingParams
from unikv.kvstrategies.kv import StepBatch
from unikv.settings.config import PoolConfig, TierConfig
from unikv.storage import create_store
from unikv.storage.base import decode_frame

from .conftest import make_english

HERE = Path(__file__).resolve().parent
NAME = "hierarchical_offload"
SMALL = {"device_window": 64, "host_window": 64, "min_disk_hit_tokens": 0}
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def config(path, host=True, ssd_bytes=1 << 30, device_bytes=1 << 28):
    tiers = [TierConfig("device", device_bytes)]
    if host:
        tiers.append(TierConfig("host", 1 << 28))
    if ssd_bytes:
        tiers.append(TierConfig("ssd", ssd_bytes, path=str(path)))
    return PoolConfig(block_size=16, tiers=tuple(tiers), strategy=NAME)


def offload(model, path, options=None, **cfg):
    spec = model.kv_spec()
    return create_kv(NAME, spec, config(path, **cfg), {**SMALL, **(options or {})})


# ---- options and identity (no model) --------------------------------------------------------


@pytest.mark.parametrize(
    "options, match",
    [
        ({"device_window": 0}, "device_window = 0; expected >= 1"),
        ({"host_window": -1}, "host_window = -1; expected an integer >= 0"),
        ({"prefetch_depth": 0}, "prefetch_depth = 0; expected an integer >= 1 or unset"),
        ({"host_access": "mmap"}, "host_access = 'mmap'; allowed: auto, stage"),
        ({"persist_prefix": "yes"}, "persist_prefix = 'yes'; expected true or false"),
        ({"io_threads": 0}, "io_threads = 0"),
    ],
)
def test_bad_options_name_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        kvstrategies.get(NAME).check_options(options)


def test_windows_do_not_change_the_content_identity_but_dtype_does(tmp_path):
    spec = kvstrategies.KVSpec(2, 2, 16, identity="m")

    def ident(opts):
        cfg = config(tmp_path / str(len(opts)) / str(sorted(opts.items())), host=False)
        s = create_kv(NAME, spec, cfg, opts)
        s.close()
        return s.pool.identity

    base = ident({})
    assert ident({"device_window": 16, "host_window": 0}) == base
    assert ident({"dtype": "bfloat16"}) != base


def test_prefetch_depth_comes_from_the_chip_profile(tmp_path):
    spec = kvstrategies.KVSpec(2, 2, 16, identity="m")
    for chip, depth in (("hygon_dcu", 2), ("ascend910b", 4)):
        built = build_kv(spec, NAME, config(tmp_path / chip, host=False), chip=chip)
        assert built.strategy.placement.prefetcher.depth == depth
        built.strategy.close()
    built = build_kv(spec, NAME, config(tmp_path / "x", host=False), chip="hygon_dcu",
                               options={"prefetch_depth": 3})  # fmt: skip
    assert built.strategy.placement.prefetcher.depth == 3
    built.strategy.close()


def test_an_unusable_store_path_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg_file = tmp_path / "pool.toml"
    cfg_file.write_text(
        f'strategy = "{NAME}"\n[tiers.device]\ncapacity = "8MiB"\n'
        f'[tiers.ssd]\ncapacity = "16MiB"\npath = "{blocker}"\n'
    )
    spec = kvstrategies.KVSpec(2, 2, 8)
    with pytest.raises(ValueError, match=r"pool.toml: \[tiers.ssd\] path = .*not a directory"):
        build_kv(spec, config=str(cfg_file))


def test_a_full_store_keeps_blocks_on_host_and_attention_exact(tmp_path, caplog):
    """The SSD tier's map cannot grow: demotions fail, blocks stay up, nothing is lost."""
    from unikv.memory.tiers import StoreTier

    spec = kvstrategies.KVSpec(2, 2, 16, identity="m")
    cls = kvstrategies.get(NAME)
    opts = cls.check_options({"device_window": 16, "host_window": 16})
    layout = cls.layout(spec, 16, opts)
    store = create_store("lmdb", path=tmp_path / "s", map_size=1 << 16, max_map_size=1 << 16)
    ssd = StoreTier("ssd", layout, 64, store, slices=2)
    tiers = (TierConfig("device", 1 << 20), TierConfig("host", 1 << 20),
             TierConfig("ssd", 1 << 20, path=str(tmp_path / "s")))  # fmt: skip
    cfg = PoolConfig(block_size=16, tiers=tiers)
    s = kvstrategies.create(NAME, spec, cfg, opts, stores={"ssd": ssd})
    g = torch.Generator().manual_seed(0)
    ks, vs = [], []
    for n in [200, 1, 1]:
        b = StepBatch([0], [n])
        s.begin_step(b)
        for layer in range(2):
            k, v = torch.randn(2, n, 2, 16, generator=g)
            q = torch.randn(n, 4, 16, generator=g)
            s.append(layer, k, v)
            if layer == 0:
                ks.append(k)
                vs.append(v)
            out = s.attend(layer, q)
        s.end_step()
    assert s.placement.demotion_failures > 0
    # Said once (not at every step), and the skipped blocks are counted for the report.
    assert caplog.text.count("blocks stay off the ssd tier") == 1
    assert s.stats().placement["ssd_writes_skipped"] >= s.placement.demotion_failures
    tiers = s.stats().placement["tokens_by_tier"]
    assert tiers["ssd"] < 200 and tiers["host"] > 16
    # Layer 0 of the last step attends exactly over everything written, wherever it lives.
    k_all, v_all = torch.cat(ks).transpose(0, 1), torch.cat(vs).transpose(0, 1)
    s.begin_step(StepBatch([0], [1]))
    k, v = torch.randn(2, 1, 2, 16, generator=g)
    q = torch.randn(1, 4, 16, generator=g)
    s.append(0, k, v)
    out = s.attend(0, q)
    k_all = torch.cat([k_all, k.transpose(0, 1)], 1).repeat_interleave(2, 0)  # [4, S, 16]
    v_all = torch.cat([v_all, v.transpose(0, 1)], 1).repeat_interleave(2, 0)
    probs = torch.softmax(torch.einsum("hd,hsd->hs", q[0], k_all) / 4, -1)
    assert torch.allclose(out[0], torch.einsum("hs,hsd->hd", probs, v_all), atol=1e-5)
    s.abort_step()
    s.close()


def _prefill(s, seq, tokens, g):
    """Random K/V for `tokens` through strategy `s` (2 layers), then publish them."""
    b = StepBatch([seq], [len(tokens)])
    s.reserve(seq, len(tokens))
    s.begin_step(b)
    for layer in range(2):
        k, v = torch.randn(2, len(tokens), 2, 16, generator=g)
        s.append(layer, k, v)
        s.attend(layer, torch.randn(len(tokens), 4, 16, generator=g))
    s.end_step()
    s.publish(seq, tokens)


def test_written_through_prefixes_hit_by_identity_and_length(tmp_path):
    """Another pool over the same store finds the prompt's blocks; another model or a prefix
    shorter than `min_disk_hit_tokens` does not use them."""
    tokens = list(range(100, 100 + 16 * 5 + 3))

    def strategy(identity, **opts):
        spec = kvstrategies.KVSpec(2, 2, 16, identity=identity)
        return create_kv(NAME, spec, config(tmp_path / "s"), {**SMALL, **opts})

    s = strategy("model-a")
    _prefill(s, 0, tokens, torch.Generator().manual_seed(0))
    s.close()
    assert s.pool.persistence.writer.blocks_written == 5

    again = strategy("model-a")
    assert again.match_prefix(1, tokens) == 5 * 16
    hits = again.stats().placement["disk_prefix_hits"]
    assert (hits["requests"], hits["blocks"], hits["skipped_short"]) == (1, 5, 0)
    again.close()
    other = strategy("model-b")
    assert other.match_prefix(1, tokens) == 0
    other.close()
    short = strategy("model-a", min_disk_hit_tokens=6 * 16)
    assert short.match_prefix(1, tokens) == 0
    assert short.stats().placement["disk_prefix_hits"]["skipped_short"] == 1
    short.close()
    # Where this process measured reading to be slower than recomputing, the hit is skipped.
    slow = strategy("model-a")
    slow.placement.prefill_s_per_token = 1e-6
    slow.placement.prefetcher.read_bytes_per_s = 1e3
    assert slow.match_prefix(1, tokens) == 0
    assert slow.stats().placement["disk_prefix_hits"]["skipped_slow"] == 1
    slow.placement.prefill_s_per_token = 1.0
    assert slow.match_prefix(2, tokens) == 5 * 16
    slow.close()


# ---- the real model ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("host_access", ["auto", "stage"])
def test_perplexity_through_every_tier_equals_full(model, tokenizer, tmp_path, host_access):
    ids = tokenizer.encode(make_english(60, seed=4))[:512]
    spec = model.kv_spec()
    ref_logits, logits = [], []
    ref = perplexity(model, ids, kvstrategies.create("full", spec), logits_out=ref_logits)
    s = offload(model, tmp_path / "s", {"prefetch_depth": 2, "host_access": host_access})
    got = perplexity(model, ids, s, logits_out=logits)
    stats = s.stats()
    s.close()
    assert got.ppl == pytest.approx(ref.ppl, rel=1e-6)
    assert max((a - b).abs().max().item() for a, b in zip(ref_logits, logits, strict=True)) < 1e-3
    # Every tier was used, and the prefetcher staged the SSD blocks of every layer and step.
    pf = stats.placement["prefetch"]
    steps = 1 + (512 - 256) // 16
    assert pf["layers_fetched"] >= (steps - 2) * model.cfg.num_layers
    assert 0.5 < pf["hit_ratio"] <= 1.0
    moves = stats.pool.counters.moves
    assert moves["device->host"] > 0 and moves["host->ssd"] > 0


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode(make_english(30, seed=8))[:300]


@pytest.fixture(scope="module")
def reference(model, tokenizer, prompt):
    async def run():
        async with Engine(model, tokenizer) as e:
            return (await e.generate(prompt, GREEDY)).token_ids

    return asyncio.run(run())


async def _generate(model, tokenizer, kv, prompt):
    async with Engine(model, tokenizer, kv=kv) as e:
        out = await e.generate(prompt, GREEDY)
        report = e.memory_report()
    kv.close()  # a cache given to the engine is the caller's to close
    return out.token_ids, report


def _persist_in_child(tmp_path, prompt, *args) -> tuple[int, list[int]]:
    """Run `prompt` in a child process (tests/_prefix_writer.py with `args`) over the store
    at tmp_path / "store", SIGKILLed once its blocks are written through: (blocks written,
    the child's generated tokens)."""
    ids_file = tmp_path / "prompt.txt"
    ids_file.write_text(" ".join(map(str, prompt)))
    child = subprocess.Popen(
        [sys.executable, str(HERE / "_prefix_writer.py"), str(tmp_path / "store"),
         str(ids_file), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = child.stdout.readline()
        assert line.startswith("persisted"), line or child.stderr.read()
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    blocks, *tokens = map(int, line.split()[1:])
    return blocks, tokens


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_prefix_persisted_by_a_killed_process_is_loaded_not_recomputed(
    model, tokenizer, prompt, reference, tmp_path
):
    written, child_tokens = _persist_in_child(tmp_path, prompt)
    assert written == len(prompt) // 16 and child_tokens == reference
    kv = offload(model, tmp_path / "store")
    out, report = await _generate(model, tokenizer, kv, prompt)
    assert out == reference
    assert report.kv.placement["disk_prefix_hits"]["requests"] == 1
    assert report.kv.placement["disk_prefix_hits"]["blocks"] == (len(prompt) - 1) // 16


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_hybrid_prefix_from_another_process_is_attached_with_its_fp16_sinks(
    model, tokenizer, prompt, calibration, tmp_path
):
    """hybrid x tiered with the default sinks: another process's prompt is found on disk with
    the fp16 sinks written beside block 0, attached (not recomputed), and greedy decoding
    gives the tokens a prefix hit in one process gives. (Not necessarily the tokens of the
    process that computed the prompt: it attended its prompt's own tokens at full precision
    within the prefill, an attached prefix is read packed.)"""
    name = "hybrid+tiered+all"
    written, child_tokens = _persist_in_child(tmp_path, prompt, name, str(calibration))
    assert written == len(prompt) // 16
    spec = model.kv_spec()
    opts = {**SMALL, "calibration": str(calibration)}
    cfg = config(tmp_path / "store")
    kv = create_kv(name, spec, cfg, opts)
    out, report = await _generate(model, tokenizer, kv, prompt)
    hits = report.kv.placement["disk_prefix_hits"]
    assert hits["requests"] == 1 and hits["blocks"] == (len(prompt) - 1) // 16
    assert hits["side_loads"] == (1 if kv.format.S else 0)
    # In a pool that shares nothing: computing the prompt gives the child's tokens, and the
    # same prompt again (a prefix hit in this pool, over the same packed blocks and sinks)
    # gives the tokens of the attach from the other process's store.
    fresh = create_kv(name, spec, config(tmp_path / "fresh"), opts)
    async with Engine(model, tokenizer, kv=fresh) as e:
        first = e.submit(prompt, GREEDY)
        computed = (await first.result()).token_ids
        second = e.submit(prompt, GREEDY)
        attached = (await second.result()).token_ids
    fresh.close()
    assert first._req.prefix_hit == 0 and computed == child_tokens
    assert second._req.prefix_hit == (len(prompt) - 1) // 16 * 16
    assert out == attached


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_corrupt_stored_block_is_a_miss_and_the_request_recomputes(
    model, tokenizer, prompt, reference, tmp_path
):
    store = tmp_path / "store"
    out, _ = await _generate(model, tokenizer, offload(model, store), prompt)
    assert out == reference
    # Flip one byte of every third stored value (different blocks and layers) behind the
    # store's back.
    env = lmdb.open(str(store), max_dbs=3)
    db = env.open_db(b"blocks")
    with env.begin(write=True, db=db) as txn:
        items = [(bytes(k), bytearray(v)) for k, v in txn.cursor()][::3]
        for k, frame in items:
            frame[-1] ^= 0xFF
            txn.put(k, bytes(frame))
    env.close()
    key, frame = items[0]
    assert len(items) > 3
    with pytest.raises(Exception, match="checksum"):
        decode_frame(key, frame)
    kv = offload(model, store)
    out, report = await _generate(model, tokenizer, kv, prompt)
    assert out == reference  # never wrong KV: the request was recomputed
    # One recompute, not one per corrupt block; every corrupt value found was counted.
    assert report.kv.placement["disk_prefix_hits"]["requests"] == 1
    assert report.requests.preemptions == 1
    assert report.pool.counters.checksum_failures == len(items)
    with create_store("lmdb", path=store) as s:
        # The corrupt block was removed, and the recompute wrote the right one through again.
        assert s.get(key) is not None and s.verify().ok
