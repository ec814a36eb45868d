"""The engine on the unified memory pool: preemption (recompute and swap), prefix sharing,
capacity limits, and the transformers Cache adapter."""

import asyncio

import pytest
import torch

from unikv import kvstrategies
from unikv.engine.engine import Engine
from unikv.engine.sampling import SamplingParams
from unikv.settings.config import PoolConfig, TierConfig

from .conftest import make_english

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def spec_of(model):
    return model.kv_spec()


def pool_kv(model, device_blocks, host_blocks=0):
    spec = spec_of(model)
    page = kvstrategies.get("full").layout(spec, 16, {"dtype": None}).page_bytes
    tiers = [TierConfig("device", device_blocks * page)]
    if host_blocks:
        tiers.append(TierConfig("host", host_blocks * page))
    return kvstrategies.create("full", spec, PoolConfig(tiers=tuple(tiers)))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    text = make_english(60, seed=11)
    ids = tokenizer.encode(text)
    return [ids[i * 40 : i * 40 + 90 + 10 * i] for i in range(6)]


@pytest.fixture(scope="module")
def unconstrained(model, tokenizer, prompts):
    async def run():
        async with Engine(model, tokenizer) as e:
            return [
                c.token_ids for c in await asyncio.gather(*(e.generate(p, GREEDY) for p in prompts))
            ]

    return asyncio.run(run())


@pytest.mark.parametrize("host_blocks", [0, 64], ids=["recompute", "swap"])
async def test_preemption_changes_no_output(model, tokenizer, prompts, unconstrained, host_blocks):
    # 6 requests need ~6 x 8 blocks at the end; the device tier holds 24: preemption is a must.
    kv = pool_kv(model, device_blocks=24, host_blocks=host_blocks)
    async with Engine(model, tokenizer, kv=kv) as e:
        outs = await asyncio.gather(*(e.generate(p, GREEDY) for p in prompts))
        report = e.memory_report()
    assert [c.token_ids for c in outs] == unconstrained
    assert report.requests.preemptions > 0 and report.pool.counters.preemptions > 0
    moves = report.pool.counters.moves
    assert bool(moves) == bool(host_blocks)  # swapping moved blocks; recompute did not
    assert kv.pool.allocators["device"].num_used == 0


async def test_prompt_larger_than_device_tier_is_refused(model, tokenizer, prompts):
    kv = pool_kv(model, device_blocks=4)  # 64 tokens
    async with Engine(model, tokenizer, kv=kv) as e:
        with pytest.raises(ValueError, match="device tier holds KV for 64 tokens"):
            await e.generate(prompts[0])
        # A request that outgrows the whole tier while generating ends with "length".
        c = await e.generate(prompts[0][:40], SamplingParams(max_new_tokens=200, ignore_eos=True))
        assert c.finish_reason == "length" and 40 + len(c.token_ids) <= 65


async def test_shared_prefix_skips_prefill_and_changes_nothing(model, tokenizer, prompts):
    prompt = prompts[5]  # 140 tokens: 8 full blocks
    kv = pool_kv(model, device_blocks=64)
    async with Engine(model, tokenizer, kv=kv) as e:
        first = e.submit(prompt, GREEDY)
        a = await first.result()
        second = e.submit(prompt, GREEDY)
        b = await second.result()
        other = e.submit(prompt[:100] + prompts[0][:30], GREEDY)
        await other.result()
    assert first._req.prefix_hit == 0
    assert second._req.prefix_hit == (len(prompt) - 1) // 16 * 16
    assert other._req.prefix_hit == 96  # the 6 full blocks the two prompts share
    assert a.token_ids == b.token_ids
    assert kv.pool.snapshot().prefix.hits >= 8 + 6


def test_transformers_cache_adapter_matches_dynamic_cache(hf_model, tokenizer, prompts):
    from transformers import DynamicCache

    from unikv.kvstrategies.hf_cache import StrategyCache

    c = hf_model.config
    spec = kvstrategies.KVSpec(
        c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads
    )
    ids = torch.tensor([prompts[1]])
    with torch.no_grad():  # the reference, once: greedy decoding is deterministic
        ref = hf_model.generate(ids, max_new_tokens=16, do_sample=False, cache=DynamicCache())
    for name in kvstrategies.available():
        strategy = kvstrategies.create(name, spec)
        cache = StrategyCache(strategy, c.num_hidden_layers)
        with torch.no_grad():
            ours = hf_model.generate(ids, max_new_tokens=16, do_sample=False, cache=cache)
        if kvstrategies.get(name).lossless:
            assert ours.tolist() == ref.tolist()
        assert strategy.stored_tokens(0) > 0
        cache.free()
        assert strategy.pool.allocators["device"].num_used == 0


async def test_create_picks_strategy_from_config(tmp_path, model):
    cfg = tmp_path / "pool.toml"
    cfg.write_text('strategy = "full"\nchip = "kunpeng920"\n[tiers.device]\ncapacity = "64MiB"\n')
    e = await Engine.create("smollm2", config=str(cfg))
    try:
        assert e.kv_choice.startswith("full (configured strategy 'full'; chip kunpeng920)")
        assert e.kv.pool.capacity_tokens() == (64 << 20) // e.kv.pool.layout.page_bytes * 16
        c = await e.generate("Hello", SamplingParams(max_new_tokens=2, ignore_eos=True))
        assert len(c.token_ids) == 2
    finally:
        await e.close()
