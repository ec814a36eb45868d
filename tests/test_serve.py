"""`unikv serve` end to end: the official `openai` client and raw HTTP against live servers on
free ports, the real model loaded once per session (the servers share it)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from unikv import kvstrategies
from unikv.engine.engine import Engine
from unikv.serving.app import Server, ServeSettings, create_app
from unikv.settings.config import PoolConfig, TierConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_kv(model, blocks: int = 256):
    """The `full` strategy over a small device tier (blocks of 16 tokens)."""
    spec = model.kv_spec()
    page = kvstrategies.get("full").layout(spec, 16, {"dtype": None}).page_bytes
    tiers = (TierConfig("device", blocks * page),)
    return kvstrategies.create("full", spec, PoolConfig(tiers=tiers))


@contextlib.contextmanager
def live(model, tokenizer, max_batch: int = 8, grpc: bool = False, setup=None, **settings):
    """A server on a free port in a thread; yields (base URL, Server). `grpc`: the gRPC API
    too, on a free port (`server.services[0].port`); `setup(server)` runs before it starts
    (to add services)."""
    import uvicorn

    kv = small_kv(model)

    async def make() -> Engine:
        return Engine(model, tokenizer, kv=kv, max_batch=max_batch)

    server = Server(make, ServeSettings(**settings))
    if grpc:
        from unikv.serving.grpc_api import serve_grpc

        serve_grpc(server, "127.0.0.1", 0)
    if setup is not None:
        setup(server)
    port = free_port()
    cfg = uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(cfg)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        if not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        uv.should_exit = True
        thread.join(60)
        kv.close()


@pytest.fixture(scope="module")
def srv(model, tokenizer):
    with live(model, tokenizer) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    from openai import OpenAI

    return OpenAI(base_url=srv[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def post_in_background(url: str, body: dict, n: int) -> list[threading.Thread]:
    """`n` completion requests with `body`, each from a thread of its own, started (join
    them)."""
    clients = [threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=body,
                                                          timeout=120))
               for _ in range(n)]  # fmt: skip
    for c in clients:
        c.start()
    return clients


def wait_until(cond, what: str, limit: float = 60.0) -> None:
    """Poll `cond` until it holds (the suite's timeout guards a hang; this names the wait)."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.02)


def wait_serving(proc: subprocess.Popen, url: str, output, path: str = "/health") -> None:
    """Wait until the server process `proc` answers 200 on `path`; if it exits first, fail
    with `output()` (its log)."""

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"unikv serve exited:\n{output()}")
        try:
            return httpx.get(url + path, timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, f"{url}{path} to answer", limit=180)


# ---- the official client ---------------------------------------------------------------------


def test_completion_with_usage_and_stop(client, tokenizer):
    prompt = "The capital of France is"
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert r.usage.completion_tokens == 12 or r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    text = r.choices[0].text
    stop = text.strip().split()[0]
    s = client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    assert s.choices[0].finish_reason == "stop"
    assert stop not in s.choices[0].text and text.startswith(s.choices[0].text)


def test_streamed_completion_equals_whole_and_reports_usage(client):
    args = dict(model="smollm2", prompt="Once upon a time", max_tokens=16, temperature=0)
    whole = client.completions.create(**args)
    pieces, usage, finish = [], None, None
    for chunk in client.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_chat_multi_turn_streamed_and_not(client):
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Name another one."},
    ]
    r = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=10, temperature=0
    )
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    streamed = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_seed_reproduces_a_sampled_answer(client):
    args = dict(
        model="smollm2", prompt="My favourite food is", max_tokens=12, temperature=1.0, top_p=0.95
    )
    a = client.completions.create(**args, seed=7).choices[0].text
    b = client.completions.create(**args, seed=7).choices[0].text
    others = {client.completions.create(**args, seed=s).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1  # sampling does sample


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]


# ---- raw HTTP: the edges ---------------------------------------------------------------------


def test_unsupported_values_are_400_naming_the_field(srv):
    url = srv[0]
    for body, field in (
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "best_of": 2}, "best_of"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
        ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ):
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], err
        assert set(err) == {"message", "type", "param", "code"}
    for body, field in (
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "a"}]}, "messages"),
    ):
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    json_type = {"Content-Type": "application/json"}
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers=json_type, timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_openai_off_values_and_unknown_fields_are_accepted(srv, model, tokenizer, caplog):
    """Issue 33: what SDKs and frameworks send when a feature is unused (`logprobs: false`,
    `tools: []`, `tool_choice: "none"`, `response_format: text`), fields this server does not
    know (`store`, `metadata`, `service_tier`, a message's `refusal`) and the `developer`
    role answer 200 as OpenAI and vLLM do; the unknown ones are logged and named in a header.
    `--strict` refuses them; another model's name is a 404."""
    import logging

    url = srv[0]
    chat = {
        "model": "smollm2",
        "messages": [
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue.", "refusal": None},
            {"role": "user", "content": "Another?"},
        ],
        "max_tokens": 4, "temperature": 0, "logprobs": False, "top_logprobs": 0, "n": 1,
        "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
        "parallel_tool_calls": False, "presence_penalty": 0, "frequency_penalty": 0.0,
        "store": False, "metadata": {"team": "a"}, "service_tier": "auto", "user": "u1",
    }  # fmt: skip
    with caplog.at_level(logging.INFO, logger="unikv.serve"):
        r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    ignored = "store,metadata,service_tier,messages[2].refusal"
    assert r.headers["x-unikv-ignored-fields"] == ignored
    assert "ignored unknown request fields: store, metadata" in caplog.text
    # `developer` is the system role: the same answer as with `system`
    system = {**chat, "messages": [{"role": "system", "content": "Answer briefly."},
                                   *chat["messages"][1:]]}  # fmt: skip
    again = httpx.post(url + "/v1/chat/completions", json=system, timeout=60).json()
    assert again["choices"][0]["message"] == r.json()["choices"][0]["message"]
    body = {"prompt": "hi", "max_tokens": 2, "stream": True, "frobnicate": 1}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
        assert s.status_code == 200 and s.headers["x-unikv-ignored-fields"] == "frobnicate"
        assert "[DONE]" in s.read().decode()
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "model": "gpt-4o"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "smollm2" in r.json()["error"]["message"]
    with live(model, tokenizer, strict=True) as (strict_url, _):
        r = httpx.post(strict_url + "/v1/completions",
                       json={"prompt": "hi", "metadata": {}}, timeout=30)  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
        ok = {"prompt": "hi", "max_tokens": 1, "logprobs": None, "echo": False}
        assert httpx.post(strict_url + "/v1/completions", json=ok, timeout=60).status_code == 200


def test_cached_tokens_tokenize_detokenize_and_version(srv, tokenizer):
    """Issue 33: the prefix cache is the product, so usage says how many prompt tokens it
    served (`prompt_tokens_details.cached_tokens`); vLLM's /tokenize, /detokenize, /version."""
    url = srv[0]
    prompt = "The history of the printing press begins in China, " * 6
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
    second = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["usage"]
    n = len(tokenizer.encode(prompt))
    assert first["prompt_tokens"] == second["prompt_tokens"] == n
    assert first["prompt_tokens_details"]["cached_tokens"] < 16  # nothing cached yet
    # all but the last (partial) block of 16 tokens, and never the last token
    assert second["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    r = httpx.post(url + "/tokenize", json={"prompt": prompt}, timeout=30).json()
    assert r["tokens"] == tokenizer.encode(prompt) and r["count"] == n and r["max_model_len"] > n
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                      timeout=30).json()  # fmt: skip
    assert tokenizer.decode(chat["tokens"], skip_special=False).endswith("assistant\n")
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back == {"prompt": prompt}
    bad = httpx.post(url + "/detokenize", json={"tokens": [-1]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(url + "/tokenize", json={}, timeout=30).status_code == 400
    assert httpx.get(url + "/version", timeout=30).json()["version"]
    info = httpx.get(url + "/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == tokenizer.eos_token and info["model_max_length"] > n
    # a list of one token-id list is one prompt (lm-evaluation-harness sends it); two are refused
    ids = tokenizer.encode("The capital of France is")
    one, flat = (httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3,
                 "temperature": 0}, timeout=60).json() for prompt in ([ids], ids))  # fmt: skip
    assert one["choices"][0]["text"] == flat["choices"][0]["text"]
    two = httpx.post(url + "/v1/completions", json={"prompt": [ids, ids]}, timeout=30)
    assert two.status_code == 400 and two.json()["error"]["param"] == "prompt"


def test_hostile_bodies_answer_4xx_never_500(srv):
    """Issue 31: each of these answered 500 (or 200: a browser's text/plain POST, which needs
    no CORS preflight) before it was bounded where it enters."""
    url = srv[0]
    json_type = {"Content-Type": "application/json"}
    ok = b'{"prompt": "hi", "max_tokens": 1}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": ctype} if ctype else {}
        r = httpx.post(url + "/v1/completions", content=ok, headers=headers, timeout=30)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    cases = [
        (b"[" * 100_000, "nested deeper"),  # RecursionError in the parser
        (b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}", "nested deeper"),
        (b'{"prompt": "a\\ud800b", "max_tokens": 1}', "lone surrogate"),
        (b'{"prompt": "hi", "seed": 18446744073709551616}', "seed"),  # 2**64
        (b'{"prompt": "hi", "priority": 1' + b"0" * 310 + b"}", "priority"),
        (b'{"prompt": "hi", "priority": -1000000000000000}', "priority"),
    ]
    for raw, what in cases:
        r = httpx.post(url + "/v1/completions", content=raw, headers=json_type, timeout=30)
        assert r.status_code == 400, (raw[:60], r.status_code, r.text[:200])
        err = r.json()["error"]
        assert what in err["message"] or err["param"] == what, err
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                  "temperature": 1e-300}, timeout=60)  # fmt: skip
    assert r.status_code == 200  # greedy below vLLM's epsilon, not an overflow
    assert httpx.get(url + "/health", timeout=30).json()["status"] == "green"


def test_long_prompt_and_big_body_are_refused(srv, model):
    url = srv[0]
    ctx = model.cfg.context_length
    r = httpx.post(url + "/v1/completions", json={"prompt": [1] * ctx, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url + "/v1/completions", json={"prompt": "x" * (2 << 20)}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_api_key_is_required_and_compared(model, tokenizer):
    with live(model, tokenizer, api_key="s3cret") as (url, _):
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 401
        bad = {"Authorization": "Bearer wrong"}
        r = httpx.post(url + "/v1/completions", json=body, headers=bad, timeout=30)
        assert r.status_code == 401 and "s3cret" not in r.text
        good = {"Authorization": "Bearer s3cret"}
        assert (
            httpx.post(url + "/v1/completions", json=body, headers=good, timeout=60).status_code
            == 200
        )
        assert httpx.get(url + "/health", timeout=30).status_code == 200  # not behind the key


def test_hosts_metrics_and_slow_bodies(model, tokenizer):
    """Issue 31: an allow-list of Host names (against DNS rebinding), /metrics and /dashboard
    behind the key unless --public-metrics, and a body that trickles in past the read timeout
    answered 408 instead of holding a connection."""
    key = {"Authorization": "Bearer k"}
    with live(model, tokenizer, api_key="k", allowed_hosts=("localhost", "127.0.0.1"),
              read_timeout_s=0.5) as (url, _):  # fmt: skip
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        r = httpx.get(url + "/health", headers={"Host": "evil.example:8000"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "host_not_allowed"
        for path in ("/metrics", "/dashboard", "/dashboard/data"):
            assert httpx.get(url + path, timeout=30).status_code == 401, path
            assert httpx.get(url + path, headers=key, timeout=30).status_code == 200, path

        def trickle():
            yield b'{"prompt": "hi",'
            time.sleep(1.5)
            yield b' "max_tokens": 1}'

        headers = {**key, "Content-Type": "application/json"}
        r = httpx.post(url + "/v1/completions", content=trickle(), headers=headers, timeout=30)
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
    with live(model, tokenizer, api_key="k", public_metrics=True) as (url, _):
        assert httpx.get(url + "/metrics", timeout=30).status_code == 200
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi"}).status_code == 401


def test_full_queue_answers_429_with_retry_after(model, tokenizer):
    with live(model, tokenizer, max_batch=1, max_waiting=1) as (url, server):
        body = {"prompt": "Tell me a story", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(timeout=120) as c,
            c.stream("POST", url + "/v1/completions", json=body) as first,
        ):
            lines = first.iter_lines()  # kept: a dropped iterator would close the stream
            next(lines)  # running
            second = threading.Thread(
                target=lambda: httpx.post(
                    url + "/v1/completions", json={**body, "stream": False}, timeout=120
                )
            )
            second.start()
            wait_until(lambda: server.memory_report().requests.waiting == 1, "a waiting one")
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 429
            assert r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "queue_full"
        second.join(120)
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'unikv_requests_rejected_total{reason="queue_full"} 1.0' in metrics


def test_client_leaving_mid_stream_frees_its_kv(srv):
    url, server = srv
    body = {
        "prompt": "Count to one hundred:",
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert server.engine.kv.bytes_used() > 0
    # The stream was closed after a few chunks of 300: the request is cancelled, KV freed.
    wait_until(lambda: server.memory_report().requests.running == 0, "the cancel")
    assert server.engine.kv.bytes_used() == 0
    assert server.in_flight == 0


def test_health_is_liveness_and_ready_is_readiness(srv, monkeypatch):
    """Issue 33: `/health` answered 503 when red, so a Kubernetes liveness probe restarted the
    busiest instance. `/health` is 200 while the process serves; `/ready` is 503 when red."""
    from unikv.serving.health import HealthView

    url, server = srv
    assert httpx.get(url + "/ready", timeout=30).status_code == 200
    red = HealthView("red", 0.3, ("OOM predicted",), ())
    monkeypatch.setattr(server, "health", lambda: red)
    live_r, ready_r = httpx.get(url + "/health", timeout=30), httpx.get(url + "/ready", timeout=30)
    assert live_r.status_code == 200 and live_r.json()["status"] == "red"
    assert ready_r.status_code == 503 and ready_r.json()["reasons"] == ["OOM predicted"]


def test_health_metrics_and_dashboard_data(srv, client):
    url, _ = srv
    client.completions.create(model="smollm2", prompt="Hello", max_tokens=4)
    h = httpx.get(url + "/health", timeout=30)
    assert h.status_code == 200
    view = h.json()
    assert view["status"] == "green" and view["load_share"] == 1.0 and view["reasons"] == []
    text = httpx.get(url + "/metrics", timeout=30).text
    for name in (
        "unikv_requests_running",
        "unikv_requests_waiting",
        "unikv_requests_swapped",
        'unikv_kv_bytes{tier="device"}',
        'unikv_kv_usage_ratio{tier="device"}',
        "unikv_prefix_cache_queries_total",
        "unikv_prefix_cache_hits_total",
        "unikv_preemptions_total",
        "unikv_prompt_tokens_total",
        "unikv_generation_tokens_total",
        "unikv_time_to_first_token_seconds_bucket",
        "unikv_inter_token_latency_seconds_bucket",
        "unikv_e2e_request_latency_seconds_count",
        "unikv_health_status 0.0",
        "unikv_load_share_ratio 1.0",
    ):
        assert name in text, name
    data = httpx.get(url + "/dashboard/data", timeout=30).json()
    assert data["health"]["status"] == "green" and "device" in data["tiers"]
    assert any(p["tokens_per_s"] > 0 for p in data["series"])


# ---- the process: SIGTERM with requests in flight --------------------------------------------


def test_sigterm_finishes_running_requests_then_exits(tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unikv.cli",
            "serve",
            "--port",
            str(port),
            "--strategy",
            "full",
            "--grace",
            "60",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, url, proc.stdout.read)
        body = {
            "prompt": "Write a long story",
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
        }
        events = []
        with (
            httpx.Client(timeout=120) as c,
            c.stream("POST", url + "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            events.append(next(lines))
            proc.send_signal(signal.SIGTERM)
            events.extend(lines)
        data = [e[6:] for e in events if e.startswith("data: ")]
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # ran to its 40 tokens
        # uvicorn re-raises the signal after its graceful shutdown, as servers conventionally do.
        assert proc.wait(120) in (0, -signal.SIGTERM)
        assert "Finished server process" in proc.stdout.read()
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_logprobs_echo_n_and_the_vllm_sampling_fields(client, srv, tokenizer):
    """Issue 33: what clients reach for. `echo` + `logprobs` + `max_tokens: 0` scores a prompt
    (lm-evaluation-harness's log-likelihood request); `n` choices; chat `logprobs` with
    `top_logprobs`; vLLM's `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`."""
    url = srv[0]
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(prompt)
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)  # fmt: skip
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    again = client.completions.create(model="smollm2", prompt=prompt, max_tokens=0, echo=True,
                                      logprobs=1, temperature=0)  # fmt: skip
    assert again.choices[0].logprobs.token_logprobs == lp.token_logprobs  # cached or not
    # greedy continuation with logprobs: the chosen token is its own top alternative
    g = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, logprobs=2,
                                  temperature=0)  # fmt: skip
    glp = g.choices[0].logprobs
    assert "".join(glp.tokens) == g.choices[0].text and len(glp.tokens) == 4
    assert all(max(t, key=t.get) == tok for t, tok in zip(glp.top_logprobs, glp.tokens,
                                                          strict=True))  # fmt: skip
    # n choices: greedy ones agree; seeded samples reproduce choice by choice
    three = client.completions.create(model="smollm2", prompt=prompt, max_tokens=4, n=3,
                                      temperature=0)  # fmt: skip
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert len({c.text for c in three.choices}) == 1 and three.usage.completion_tokens == 12
    s1, s2 = (client.completions.create(model="smollm2", prompt=prompt, max_tokens=6, n=2,
                                        temperature=1.0, seed=7) for _ in range(2))  # fmt: skip
    assert [c.text for c in s1.choices] == [c.text for c in s2.choices]
    chat = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "repetition_penalty": 1.3,
            "min_p": 0.1, "min_tokens": 2, "stop_token_ids": [tokenizer.eos_id]}  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 2
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user",
                   "content": "hi"}], "top_logprobs": 2}, timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def _streamed(url: str, path: str, body: dict) -> tuple[list[dict], dict | None]:
    """The chunks of a streamed answer (parsed), and its usage chunk."""
    with httpx.stream("POST", url + path, json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=120) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    return [c for c in chunks if c["choices"]], chunks[-1]["usage"]


def _close(a, b, tol: float = 1e-4) -> bool:
    """Equal structure (lists, dicts, None), numbers within `tol`: the same log-probabilities
    computed in another batch."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    if isinstance(a, float | int) and isinstance(b, float | int):
        return abs(a - b) <= tol
    return a == b


def _merge_completion(chunks: list[dict], n: int) -> list[dict]:
    """Streamed completion chunks joined per choice: text and the logprobs lists."""
    out = [{"text": "", "tokens": [], "token_logprobs": [], "top_logprobs": [],
            "text_offset": [], "finish_reason": None} for _ in range(n)]  # fmt: skip
    for c in chunks:
        (ch,) = c["choices"]
        o = out[ch["index"]]
        o["text"] += ch["text"]
        o["finish_reason"] = ch["finish_reason"] or o["finish_reason"]
        for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            o[k] += (ch["logprobs"] or {}).get(k, [])
    return out


def test_n_logprobs_and_echo_stream_as_they_answer_whole(srv, tokenizer):
    """Issue 33: `n`, `logprobs` and `echo` streamed: each choice's chunks (interleaved, named
    by `index`) add up to the same text and log-probabilities as the answer that is not
    streamed, the echoed prompt first; chat streams `logprobs.content` per chunk."""
    url = srv[0]
    prompt = "The quick brown fox jumps over the lazy dog"
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 3,
            "logprobs": 2, "echo": True}  # fmt: skip
    whole = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
    chunks, usage = _streamed(url, "/v1/completions", body)
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2}
    # log-probabilities come with the pieces they belong to, not all at the end
    assert sum(1 for c in chunks if c["choices"][0]["logprobs"]) >= 3 * 3
    assert usage == whole["usage"]
    for got, want in zip(_merge_completion(chunks, 3), whole["choices"], strict=True):
        assert got["text"] == want["text"] and got["text"].startswith(prompt)
        assert got["finish_reason"] == want["finish_reason"]
        lp = want["logprobs"]
        assert got["tokens"] == lp["tokens"] and got["text_offset"] == lp["text_offset"]
        assert _close(got["token_logprobs"], lp["token_logprobs"])
        assert _close(got["top_logprobs"], lp["top_logprobs"])
    # max_tokens 0 with echo: the prompt's log-likelihood, streamed as one chunk
    ll = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    whole = httpx.post(url + "/v1/completions", json=ll, timeout=60).json()["choices"][0]
    (got,) = _merge_completion(_streamed(url, "/v1/completions", ll)[0], 1)
    assert got["text"] == prompt and got["token_logprobs"][0] is None
    assert _close(got["token_logprobs"], whole["logprobs"]["token_logprobs"])
    # chat: logprobs.content per chunk adds up to the whole answer's
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "n": 2}  # fmt: skip
    whole = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()
    chunks, _ = _streamed(url, "/v1/chat/completions", chat)
    for i, want in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        text = "".join(m["delta"].get("content") or "" for m in mine)
        content = [e for m in mine if m["logprobs"] for e in m["logprobs"]["content"]]
        assert text == want["message"]["content"]
        assert [e["token"] for e in content] == [e["token"] for e in want["logprobs"]["content"]]
        assert [e["logprob"] for e in content] == pytest.approx(
            [e["logprob"] for e in want["logprobs"]["content"]], abs=1e-5
        )


def test_langchain_and_the_async_openai_client(srv):
    """Issue 33: real clients no one here wrote. LangChain's ChatOpenAI (invoke and stream)
    and the official async client, streamed, against the live server."""
    import asyncio

    from langchain_openai import ChatOpenAI
    from openai import AsyncOpenAI

    url = srv[0]
    llm = ChatOpenAI(base_url=url + "/v1", api_key="unused", model="smollm2", temperature=0,
                     max_tokens=8, max_retries=0, timeout=120)  # fmt: skip
    whole = llm.invoke("Name a colour.")
    assert whole.content and whole.usage_metadata["output_tokens"] <= 8
    assert "".join(c.content for c in llm.stream("Name a colour.")) == whole.content

    async def streamed() -> str:
        client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        out = []
        stream = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8, temperature=0, stream=True,
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                out.append(chunk.choices[0].delta.content)
        await client.close()
        return "".join(out)

    assert asyncio.run(streamed()) == whole.content
