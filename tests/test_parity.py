"""unikv's forward pass against transformers' LlamaForCausalLM on the same GGUF, in float32."""

import math

import pytest
import torch

from unikv.engine.evaluate import perplexity
from unikv.kvstrategies.kv import StepBatch

pytestmark = pytest.mark.slow


def _forward_all(model, kv, ids, seq_id=0):
    return model.forward(
        torch.tensor(ids), torch.arange(len(ids)), kv, StepBatch([seq_id], [len(ids)])
    )


def test_logits_match_reference(model, hf_model, tokenizer, english_text, new_kv):
    ids = tokenizer.encode(english_text)[:300]
    ours = _forward_all(model, new_kv(), ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-3


def test_packed_batch_equals_separate_runs(model, tokenizer, english_text, new_kv):
    """Three sequences of different lengths in one packed step give each its own logits."""
    ids = tokenizer.encode(english_text)
    seqs = [ids[:37], ids[100:181], ids[300:309]]
    alone = [_forward_all(model, new_kv(), s) for s in seqs]
    kv = new_kv()
    packed = model.forward(
        torch.tensor(sum(seqs, [])),
        torch.cat([torch.arange(len(s)) for s in seqs]),
        kv,
        StepBatch([10, 11, 12], [len(s) for s in seqs]),
    )
    start = 0
    for s, ref in zip(seqs, alone, strict=True):
        torch.testing.assert_close(packed[start : start + len(s)], ref, atol=1e-4, rtol=1e-4)
        start += len(s)
    assert [kv.stored_tokens(i) for i in (10, 11, 12)] == [len(s) for s in seqs]


def test_chunked_prefill_equals_one_pass(model, tokenizer, english_text, new_kv):
    """Feeding a prompt in chunks through the cache equals feeding it at once."""
    ids = tokenizer.encode(english_text)[:120]
    full = _forward_all(model, new_kv(), ids)
    kv = new_kv()
    outs = []
    for start in range(0, len(ids), 25):
        chunk = ids[start : start + 25]
        outs.append(
            model.forward(
                torch.tensor(chunk),
                torch.arange(start, start + len(chunk)),
                kv,
                StepBatch([0], [len(chunk)]),
            )
        )
    torch.testing.assert_close(torch.cat(outs), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "prompt",
    [
        "The history of the printing press begins",
        "<|im_start|>user\nList three facts about the Moon.<|im_end|>\n<|im_start|>assistant\n",
    ],
)
def test_greedy_continuation_matches_reference(model, hf_model, tokenizer, prompt, new_kv):
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        # Both stop at end-of-sequence; 40 tokens otherwise.
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
        ref = ref[0, len(ids) :].tolist()
    kv = new_kv()
    out, seq = [], list(ids)
    logits = model.forward(
        torch.tensor(seq), torch.arange(len(seq)), kv, StepBatch([0], [len(seq)])
    )
    for _ in range(40):
        tok = int(logits[-1].argmax())
        out.append(tok)
        if tok == tokenizer.eos_id:
            break
        pos = torch.tensor([len(seq)])
        seq.append(tok)
        logits = model.forward(torch.tensor([tok]), pos, kv, StepBatch([0], [1]))
    assert out == ref
    assert len(out) >= 32  # a real continuation, not an immediate stop


def _reference_ppl(hf_model, ids, prefill, chunk):
    """The protocol of docs/protocol.md through transformers' own DynamicCache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    nll, n = 0.0, 0
    with torch.no_grad():
        out = hf_model(torch.tensor([ids[:prefill]]), cache=cache, use_cache=True)
        logp = torch.log_softmax(out.logits[0, -1], -1)
        nll -= logp[ids[prefill]].item()
        n += 1
        for start in range(prefill, len(ids), chunk):
            chunk_ids = ids[start : start + chunk]
            out = hf_model(torch.tensor([chunk_ids]), cache=cache, use_cache=True)
            logp = torch.log_softmax(out.logits[0], -1)
            targets = ids[start + 1 : start + 1 + len(chunk_ids)]
            for row, t in enumerate(targets):
                nll -= logp[row, t].item()
                n += 1
    return math.exp(nll / n), n


def test_perplexity_through_cache_matches_reference(
    model, hf_model, tokenizer, english_text, new_kv
):
    ids = tokenizer.encode(english_text)[:512]
    ref_ppl, ref_n = _reference_ppl(hf_model, ids, prefill=256, chunk=16)
    res = perplexity(model, ids, new_kv(), prefill=256, chunk=16)
    assert res.scored == ref_n == len(ids) - 256
    assert abs(res.ppl - ref_ppl) / ref_ppl <= 1e-3
    assert res.kept_ratio == 1.0
    # float32 K and V: 32 bits per element, counted from the bytes actually stored.
    assert res.bits_per_element == pytest.approx(32.0)


def test_bfloat16_tracks_float32(loaded, model, tokenizer, english_text, new_kv):
    from unikv.engine.model import LlamaModel
    from unikv.kvstrategies.kv import ContiguousKVCache

    cfg, tensors, _ = loaded
    bf = LlamaModel(cfg, tensors, dtype=torch.bfloat16)
    ids = tokenizer.encode(english_text)[:200]
    kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    low = _forward_all(bf, kv, ids).float()
    high = _forward_all(model, new_kv(), ids)
    agree = (low.argmax(-1) == high.argmax(-1)).float().mean().item()
    assert (
        low.dtype == torch.float32 and kv.bytes_used() == len(ids) * cfg.num_layers * 2 * 3 * 64 * 2
    )
    assert agree >= 0.9
