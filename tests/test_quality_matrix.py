"""benchmarks/quality_matrix.py without a model: method specs, llama-perplexity's output, the
tables and the chart from a small results dict."""

import json

import pytest

from benchmarks.peers import parse_perplexity
from benchmarks.quality_matrix import HALF, PROTOCOL, Method, _changes, _passkey_rows, plot, render

# The end of `llama-perplexity ... --chunks 1` (llama.cpp from llama-cpp-python 0.3.36).
LLAMA_OUTPUT = """\
0.13.806.293 I perplexity: tokenizing the input ..
0.13.865.520 I perplexity: tokenization took 59.214 ms
0.13.865.584 I perplexity: calculating perplexity over 1 chunks, n_ctx=512, batch_size=512, n_seq=1
0.25.492.623 I perplexity: 11.63 seconds per pass - ETA 0.18 minutes
[1]16.6178,
0.25.597.072 I Final estimate: PPL = 16.6178 +/- 2.60820
"""


def test_llama_perplexity_final_estimate_is_parsed_and_its_absence_is_an_error():
    assert parse_perplexity(LLAMA_OUTPUT) == pytest.approx(16.6178)
    with pytest.raises(ValueError, match="no 'Final estimate'"):
        parse_perplexity("main: error: failed to load model\n")


def test_method_specs_take_a_name_and_json_options():
    assert Method.parse("full") == Method("full", "full")
    assert Method.parse("int8+resident+all") == Method("int8+resident+all", "int8+resident+all")
    m = Method.parse('s50:learned_prune:{"scorer": "streaming", "kept_ratio": 0.5}')
    assert m == Method("s50", "learned_prune", {"scorer": "streaming", "kept_ratio": 0.5})
    assert Method.parse('learned_prune:{"kept_ratio": 0.59}').options == {"kept_ratio": 0.59}
    with pytest.raises(ValueError, match="not JSON"):
        Method.parse("x:learned_prune:{kept: 1}")
    with pytest.raises(ValueError, match="expected SPEC"):
        Method.parse("a:b:c")


def _results() -> dict:
    texts = ["A", "B"]
    ppl = []

    def add(figure, method, ref, group, values, bits):
        for t, v in zip(texts, values, strict=True):
            ppl.append(
                {
                    "figure": figure,
                    "method": method,
                    "reference": ref,
                    "group": group,
                    "text": t,
                    "ppl": v,
                    "bits": bits,
                    "kept": None,
                    "seconds": 1.0,
                }
            )

    add(PROTOCOL, "full", "full", "unikv", [10.0, 20.0], 32.0)
    add(PROTOCOL, "hybrid", "full", "unikv", [10.1, 19.9], 4.4)
    add(PROTOCOL, "quanto int2", "full", "transformers", [80.0, 170.0], 3.0)  # clipped bars
    add(HALF, "full", "full", "unikv", [9.0, 18.0], 32.0)
    add(HALF, "llama.cpp f16", "full", "llama.cpp", [9.0, 18.0], 16.0)
    add(HALF, "llama.cpp q4_0", "llama.cpp f16", "llama.cpp", [9.9, 18.9], 4.5)
    passkey = [
        {
            "method": m,
            "text": t,
            "length": 1024,
            "accuracy": acc,
            "samples": 3,
            "by_depth": {"10%": acc, "50%": 1.0, "90%": 1.0},
            "kept": 1.0,
            "seconds": 1.0,
        }
        for m, acc in (("full", 1.0), ("hybrid", 0.0))
        for t in texts
    ]
    methods = [
        {"name": "full", "spec": "full", "options": None},
        {"name": "hybrid", "spec": "hybrid_fp16_int4", "options": {"bits": 4}},
    ]
    config = {
        "tokens": 2048,
        "prefill": 256,
        "chunk": 16,
        "passkey_lengths": [1024],
        "passkey_samples": 3,
        "seed": 0,
        "threads": 1,
        "texts": texts,
        "methods": methods,
        "half_methods": ["full"],
    }
    return {"config": config, "ppl": ppl, "passkey": passkey, "skipped": ["a peer, and why"]}


def test_changes_are_against_each_rows_own_reference():
    rows = {r["method"]: r for r in _changes(_results(), PROTOCOL)}
    assert set(rows) == {"hybrid", "quanto int2"}  # full is the reference, not a row
    assert rows["hybrid"]["change"]["A"] == pytest.approx(1.0)
    assert rows["hybrid"]["worst"] == pytest.approx(1.0)
    assert rows["hybrid"]["mean"] == pytest.approx((1.0 - 0.5) / 2)
    half = {r["method"]: r for r in _changes(_results(), HALF)}
    assert half["llama.cpp q4_0"]["change"]["B"] == pytest.approx(5.0)  # against llama.cpp f16
    assert half["llama.cpp f16"]["change"]["A"] == pytest.approx(0.0)  # against unikv's full
    pk = {r["method"]: r for r in _passkey_rows(_results())}
    assert pk["hybrid"]["mean"] == 0.0 and pk["hybrid"]["depth"]["50%"] == 1.0


def test_render_prints_every_table_and_one_json_line(capsys):
    render(_results())
    out = capsys.readouterr().out
    assert "DESIGN protocol" in out and "second half" in out and "Passkey" in out
    assert "+1.00%" in out and "skipped: a peer, and why" in out
    line = json.loads(out.strip().splitlines()[-1])
    assert line["benchmark"] == "quality_matrix" and line["results"]["config"]["tokens"] == 2048


def test_chart_is_written(tmp_path):
    path = tmp_path / "chart.png"
    plot(_results(), path, clip=12.0)
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_a_text_filler_surrounds_the_needle_with_whole_sentences(tokenizer):
    from unikv.engine.passkey import QUESTION, needle, passkey_prompt

    text = "See Node.js for more.\nThe stream ends here. A new emitter starts.\n" * 3  # short
    for depth in (0.1, 0.5, 0.9):
        ids = passkey_prompt(tokenizer, 600, depth, 54321, filler=text)
        assert 540 <= len(ids) <= 600
        out = tokenizer.decode(ids)
        assert out.endswith(QUESTION) and out.count("Node.js") >= 3  # the short text repeated
        assert "Node." + needle(54321) not in out  # never inside "Node.js"
        assert out[: out.index(needle(54321))].endswith(".")  # after a sentence's period
    with pytest.raises(ValueError, match="filler text is empty"):
        passkey_prompt(tokenizer, 600, 0.5, 54321, filler="  \n")
