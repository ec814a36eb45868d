"""Issue 33: real clients no one here wrote, against a real `unikv serve` (a subprocess):
LiteLLM's `completion` (plain and streamed) and `text_completion`, and lm-evaluation-harness's
`local-completions` model running a multiple-choice log-likelihood task from a local file. The
official `openai` SDK and LangChain are in test_serve.py.

Each client runs in a process of its own, offline and behind tests/_no_network.py's guard (its
`sitecustomize`): nothing reaches the network; the harness, run with its defaults, reads the
tokenizer from the server (`/tokenizer_info`) and sends token-id prompts (no hub)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.test_serve import free_port, wait_serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2"  # the served name (`--served-model-name` defaults to `--model`)

# Simple facts, a few of which a 135M model gets right: the harness's accuracy is a number, and
# what the test checks is that each of its log-likelihoods is the server's. After no answer here
# is the model's greedy next token EOS (the last test's case, which the harness misscores now).
FACTS = [
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four"], 1),
    ("What colour is the sky on a clear day?", ["green", "red", "blue"], 2),
    ("Which animal says moo?", ["a cow", "a cat"], 0),
    ("What is two plus two?", ["three", "five", "four"], 2),
    ("Which animal barks?", ["a fish", "a dog", "a bird"], 1),
    ("What do bees make?", ["honey", "milk", "wool"], 0),
    ("What is the opposite of hot?", ["loud", "cold"], 1),
    ("How many days are there in a week?", ["seven", "ten", "five"], 0),
    ("What do you call frozen water?", ["steam", "ice", "sand"], 1),
]

TASK_YAML = """\
task: unikv_facts
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@contextlib.contextmanager
def unikv_serve(log: Path, *args: str):
    """`unikv serve` in a subprocess on a free port (single-threaded, its output in `log`);
    yields its base URL, and terminates it (and waits) afterwards."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "unikv.cli", "serve", "--port", str(port), *args]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, url, lambda: log.read_text()[-4000:])
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with unikv_serve(tmp_path_factory.mktemp("serve") / "serve.log", "--strategy", "full") as url:
        yield url


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def score(url: str, context: str, continuation: str) -> tuple[float, bool]:
    """The log-likelihood of `continuation` after `context` asked of the server directly (the
    prompt scored with echo + logprobs and no generated token), and whether every continuation
    token is the greedy one: what the harness reports for a request."""
    ctx = httpx.post(url + "/tokenize", json={"prompt": context, "add_special_tokens": False})
    n = ctx.json()["count"]
    r = post(url, "/v1/completions", {"prompt": context + continuation, "max_tokens": 0,
                                      "echo": True, "logprobs": 1, "temperature": 0})  # fmt: skip
    lp = r["choices"][0]["logprobs"]
    assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) == (len(lp["tokens"]), 0)
    assert 0 < n < len(lp["tokens"])
    cont = lp["token_logprobs"][n:]
    tops = lp["top_logprobs"][n:]
    greedy = all(t == max(top.values()) for t, top in zip(cont, tops, strict=True))
    return sum(cont), greedy


# ---- the clients' processes ------------------------------------------------------------------


def client_env(tmp: Path) -> tuple[dict[str, str], Path]:
    """The environment a client process runs in: offline (no hub, no LiteLLM cost-map
    download), single-threaded, and with tests/_no_network.py as its sitecustomize; returns it
    and the file in which the guard writes what it refused."""
    site = tmp / "site"
    site.mkdir()
    shutil.copy(ROOT / "tests" / "_no_network.py", site / "sitecustomize.py")
    refused = tmp / "refused.txt"
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "UNIKV_NO_NETWORK_LOG": str(refused),
        "HF_HOME": str(tmp / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    return env, refused


def refused_by_guard(refused: Path) -> list[str]:
    return refused.read_text().splitlines() if refused.exists() else []


# ---- LiteLLM ---------------------------------------------------------------------------------


def test_litellm_completion_streamed_and_text_equal_the_server(server, tmp_path):
    """LiteLLM's `completion` (whole and streamed) and `text_completion` through its
    OpenAI-compatible provider answer what the server answers the same requests directly."""
    request = {"messages": [{"role": "user", "content": "Name a colour."}],
               "prompt": "The capital of France is", "max_tokens": 8}  # fmt: skip
    env, refused = client_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_litellm_client.py"), server, MODEL,
         json.dumps(request)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert refused_by_guard(refused) == []
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    greedy = {"temperature": 0, "max_tokens": request["max_tokens"]}
    chat = post(server, "/v1/chat/completions", {"messages": request["messages"], **greedy})
    text = post(server, "/v1/completions", {"prompt": request["prompt"], **greedy})
    for answer, direct, body in (
        (got["chat"], chat, chat["choices"][0]["message"]["content"]),
        (got["stream"], chat, chat["choices"][0]["message"]["content"]),
        (got["text"], text, text["choices"][0]["text"]),
    ):
        assert body and answer["text"] == body
        assert answer["finish_reason"] == direct["choices"][0]["finish_reason"]
        assert answer["usage"] == {k: direct["usage"][k] for k in answer["usage"]}


# ---- lm-evaluation-harness -------------------------------------------------------------------


def lm_eval(tmp: Path, model_args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the `lm_eval` command line on the facts task (written to `tmp`), offline and behind
    the network guard; returns the finished process and what the guard refused."""
    data, tasks = tmp / "facts.jsonl", tmp / "tasks"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in FACTS))  # fmt: skip
    tasks.mkdir()
    (tasks / "unikv_facts.yaml").write_text(TASK_YAML.format(data=json.dumps(str(data))))
    env, refused = client_env(tmp)
    cmd = [
        sys.executable, "-m", "lm_eval",
        "--model", "local-completions",
        "--model_args", model_args,
        "--tasks", "unikv_facts",
        "--include_path", str(tasks),
        "--output_path", str(tmp / "out"),
        "--log_samples",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    return proc, refused_by_guard(refused)


def check_harness_run(tmp: Path, server: str, proc: subprocess.CompletedProcess) -> None:
    """The harness finished, and each log-likelihood (and greedy flag) it reports is what the
    server answers to the same context and continuation asked directly; so is its accuracy."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (results,) = (tmp / "out").rglob("results_*.json")
    (samples,) = (tmp / "out").rglob("samples_unikv_facts_*.jsonl")
    acc = json.loads(results.read_text())["results"]["unikv_facts"]["acc,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert sorted(r["doc_id"] for r in rows) == list(range(len(FACTS)))
    right = 0
    for row in rows:
        question, choices, answer = FACTS[row["doc_id"]]
        lls = []
        for i, choice in enumerate(choices):
            args = row["arguments"][f"gen_args_{i}"]
            context, continuation = args["arg_0"], args["arg_1"]
            assert (context, continuation) == (f"Question: {question}\nAnswer:", " " + choice)
            ll, greedy = row["resps"][i][0]
            want, want_greedy = score(server, context, continuation)
            assert float(ll) == pytest.approx(want, abs=1e-4), (question, choice)
            assert greedy == str(want_greedy), (question, choice)
            lls.append(want)
        picked = max(range(len(lls)), key=lls.__getitem__)
        assert row["acc"] == float(picked == answer)
        right += picked == answer
    assert acc == pytest.approx(right / len(FACTS))


def test_lm_eval_with_its_defaults_needs_no_local_tokenizer(server, tmp_path):
    """`local-completions` as a user first tries it (no tokenizer given, token-id requests):
    every log-likelihood it reports is the server's own for that context and continuation."""
    model_args = f"model={MODEL},base_url={server}/v1/completions,num_concurrent=1,max_retries=1"
    proc, refused = lm_eval(tmp_path, model_args)
    assert refused == []
    check_harness_run(tmp_path, server, proc)


def test_lm_eval_scores_a_continuation_the_model_would_end_on(server):
    """The harness's own request and parser for a question of the facts task's kind whose
    answer the model would end its text on (its greedy next token is EOS): the harness's sum
    must still be the continuation's log-likelihood."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    context, continuation = "Question: Which planet do we live on?\nAnswer:", " Earth"
    # The harness's payload (LocalCompletionsAPI._create_payload, generate=False).
    body = {"prompt": context + continuation, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    r = post(server, "/v1/completions", body)
    if r["choices"][0]["finish_reason"] != "stop":
        pytest.skip("the model's next token here is no longer EOS: pick another continuation")
    n = httpx.post(server + "/tokenize", json={"prompt": context, "add_special_tokens": False})
    ((harness, _),) = LocalCompletionsAPI.parse_logprobs(r, ctxlens=[n.json()["count"]])
    assert harness == pytest.approx(score(server, context, continuation)[0], abs=1e-4)
