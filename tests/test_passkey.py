"""The passkey protocol: prompt construction (no model needed) and a wrong answer scored 0."""

import re

import pytest

from unikv.engine.passkey import DEPTHS, QUESTION, needle, passkey, passkey_prompt


@pytest.mark.slow
@pytest.mark.parametrize("depth", DEPTHS)
def test_prompt_has_the_needle_at_its_depth_and_ends_with_the_question(tokenizer, depth):
    ids = passkey_prompt(tokenizer, 600, depth, 54321)
    assert 560 <= len(ids) <= 600
    text = tokenizer.decode(ids)
    assert text.endswith(QUESTION) and text.count("54321") == 2
    at = text.index(needle(54321).strip()) / len(text)
    assert abs(at - depth) < 0.1  # at the depth, on a sentence boundary
    assert re.search(re.escape(needle(54321).strip()) + r" [A-Z]", text)  # a whole sentence follows


@pytest.mark.slow
def test_a_cache_that_forgets_fails_and_bad_sizes_are_errors(model, tokenizer, new_kv):
    class Forgetful:
        """A cache that keeps only the newest 48 tokens: the needle is gone by the question."""

        def __init__(self):
            self.kv = new_kv()

        def __getattr__(self, name):
            return getattr(self.kv, name)

        def attend(self, layer, q):
            kv = self.kv
            for sid in kv._batch.seq_ids:
                n = kv._len[sid] + kv._batch.query_lens[kv._batch.seq_ids.index(sid)]
                keep = max(0, n - 48)
                kv._k[sid][layer, :, :keep] = 0
                kv._v[sid][layer, :, :keep] = 0
            return kv.attend(layer, q)

    res = passkey(model, tokenizer, Forgetful(), 256, 3)
    assert res.accuracy == 0.0 and res.samples == 3
    with pytest.raises(ValueError, match="at least 128"):
        passkey_prompt(tokenizer, 100, 0.5, 11111)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        passkey(model, tokenizer, new_kv(), 9000, 1)
