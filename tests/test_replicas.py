"""`unikv serve --replicas`: two real replicas on a local Ray Serve, one compute thread each,
behind the HTTP front, with scripted temperature sensors (a file per replica rank).

Covers prefix affinity, a heat episode (cooling, the queue finishing, rejoining), a red
replica's share, and a replica killed mid-run (no request lost; the started stream ends with
an error event). The tests run in order on one deployment, each leaving it healthy."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")

from unikv.serving.app import Server, ServeSettings, create_app  # noqa: E402
from unikv.serving.grpc_api import serve_grpc  # noqa: E402
from unikv.serving.replicas import APP, DEPLOYMENT, Replicas, ReplicaSpec  # noqa: E402

from .test_serve import free_port, wait_until  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
LIMIT_C = 85.0  # the cpu profile's thermal_throttle_c
# A prompt of several 64-token blocks; each test varies its head so its prefix is new.
BODY = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(30))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(base URL, sensor directory, Replicas) of two replicas behind a front in a thread."""
    import uvicorn

    d = tmp_path_factory.mktemp("replicas")
    sensors = d / "sensors"
    sensors.mkdir()
    for rank in (0, 1):
        (sensors / str(rank)).write_text("40")
    cfg = d / "unikv.toml"
    # One request at a time per replica: a replica's other requests wait, not started.
    cfg.write_text('strategy = "full"\n[tiers.device]\ncapacity = "256MiB"\n'
                   "[scheduler]\nbatch_size = 1\nbatching_window_ms = 0\n"
                   "[thermal]\ninterval_s = 0.1\n")  # fmt: skip
    spec = ReplicaSpec(config=str(cfg), sensor=f"scripted:{sensors}", stats_period_s=0.2)
    reps = Replicas(spec, 2)
    client = reps.start()
    reps.wait_reports()

    async def make():
        return client

    server = Server(make, ServeSettings(max_waiting=64))
    serve_grpc(server, "127.0.0.1", 0)  # gRPC in front of the same replicas
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(create_app(server), host="127.0.0.1", port=port,
                                       log_level="warning"))  # fmt: skip
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    wait_until(lambda: uv.started, "the front to start")
    try:
        yield f"http://127.0.0.1:{port}", sensors, reps, server.services[0].port
    finally:
        uv.should_exit = True
        thread.join(60)
        reps.stop()


def complete(url: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    return r


def replicas(url: str) -> dict[str, dict]:
    return httpx.get(url + "/health", timeout=30).json()["replicas"]


def by_rank(url: str, rank: int) -> tuple[str, dict]:
    return next((n, r) for n, r in replicas(url).items() if r["rank"] == rank)


def heat(sensors: Path, rank: int, value) -> None:
    """Replace a replica's scripted reading atomically (a reader never sees half a file)."""
    tmp = sensors / f".{rank}.tmp"
    tmp.write_text(json.dumps(value) if isinstance(value, dict) else str(value))
    os.replace(tmp, sensors / str(rank))


@pytest.fixture(autouse=True)
def cool(cluster):
    """Every test starts with both replicas cool and green (a failed test leaves none hot)."""
    url, sensors, *_ = cluster
    for rank in (0, 1):
        heat(sensors, rank, 40)
    wait_until(lambda: all(not r["cooling"] and r["status"] != "red"
                           for r in replicas(url).values()), "both replicas cool", 60)  # fmt: skip


def test_second_request_with_the_prefix_lands_on_the_same_replica_and_hits(cluster):
    url, *_ = cluster
    first = complete(url, "Affinity. " + BODY)
    where = first.headers["x-unikv-replica"]
    hits_before = replicas(url)[where]["prefix_hits"]
    second = complete(url, "Affinity. " + BODY)
    assert second.headers["x-unikv-replica"] == where
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    wait_until(lambda: replicas(url)[where]["prefix_hits"] > hits_before, "the prefix hit report")


def test_logprobs_and_echo_come_back_from_a_replica_whole_and_streamed(cluster):
    """Issue 33: log-probabilities cross the replica boundary (pickled by Ray) as they do from
    one engine: whole, and per streamed piece."""
    url, *_ = cluster
    body = {"prompt": "Logprobs. " + BODY[:200], "max_tokens": 3, "temperature": 0,
            "logprobs": 1, "echo": True}  # fmt: skip
    whole = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert whole.status_code == 200, whole.text
    lp = whole.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) > 3
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:  # fmt: skip
        data = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    streamed = [t for d in data if d["choices"][0]["logprobs"]
                for t in d["choices"][0]["logprobs"]["tokens"]]  # fmt: skip
    assert streamed == lp["tokens"]


def test_heat_episode_cools_a_replica_and_it_rejoins(cluster):
    """A hot replica serves what it holds and takes nothing new until it cools, then rejoins
    (short prompts: routing by queue length, as with nothing cached)."""
    url, sensors, *_ = cluster
    name_a, _ = by_rank(url, 0)
    body = BODY[:160]
    # A long request on A, then A heats up: the request finishes; no new one goes to A.
    with httpx.Client(timeout=120) as http:
        warm = complete(url, "Heat. " + body)
        assert warm.headers["x-unikv-replica"] in (name_a, by_rank(url, 1)[0])
        heat(sensors, 0, LIMIT_C + 1)
        wait_until(lambda: replicas(url)[name_a]["cooling"], "replica A to enter cooling", 30)
        a = replicas(url)[name_a]
        assert a["batch_limit"] == max(1, a["max_batch"] // 2)
        view = http.get(url + "/health").json()
        assert view["status"] == "yellow" and any("cooling" in r for r in view["reasons"])
        served = {complete(url, f"Cool {i}. " + body).headers["x-unikv-replica"] for i in range(4)}
        assert name_a not in served
        metrics = http.get(url + "/metrics").text
        entered = f'unikv_replica_cooling_transitions_total{{direction="enter",replica="{name_a}"}}'
        assert f"{entered} 1.0" in metrics
        heat(sensors, 0, LIMIT_C - 20)
        wait_until(lambda: not replicas(url)[name_a]["cooling"], "replica A to leave cooling", 30)
        assert replicas(url)[name_a]["batch_limit"] == replicas(url)[name_a]["max_batch"]
        # Rejoined: new prompts reach A again (by queue length when nothing is cached).
        served = set()
        for i in range(6):
            served.add(complete(url, f"Back {i}. " + body).headers["x-unikv-replica"])
        assert name_a in served


def test_a_chip_that_keeps_cooling_gets_advice(cluster):
    """Two heat episodes on one replica: the advice names the replica and, at batch_size 1,
    one more replica (the rule is tested on scripted readings in tests/test_advice.py)."""
    url, sensors, *_ = cluster
    name_a, _ = by_rank(url, 0)
    for _ in range(2):
        heat(sensors, 0, LIMIT_C + 1)
        wait_until(lambda: replicas(url)[name_a]["cooling"], "replica A to enter cooling", 30)
        heat(sensors, 0, LIMIT_C - 20)
        wait_until(lambda: not replicas(url)[name_a]["cooling"], "replica A to cool down", 30)
    advice = [a for a in httpx.get(url + "/health", timeout=30).json()["advice"]
              if a["rule"] == "cooling"]  # fmt: skip
    assert len(advice) == 1 and name_a in advice[0]["measurement"]
    assert (advice[0]["key"], advice[0]["current"], advice[0]["suggested"]) == (
        "--replicas",
        "2",
        "3",
    )


def test_grpc_reaches_the_replicas(cluster):
    """`--replicas` behind gRPC: the same greedy answer as over HTTP, and health SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from unikv.serving import unikv_pb2 as pb
    from unikv.serving import unikv_pb2_grpc as pb_grpc

    url, _, _, grpc_port = cluster
    prompt = "Over gRPC. " + BODY
    http = complete(url, prompt, max_tokens=6).json()["choices"][0]["text"]
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        req = pb.GenerateRequest(prompt=prompt, max_tokens=6, temperature=0.0)
        parts = list(pb_grpc.GenerationStub(channel).Generate(req, timeout=120))
        assert "".join(p.text for p in parts) == http and parts[-1].completion_tokens == 6
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_red_replica_gets_only_its_share(cluster):
    url, sensors, *_ = cluster
    name_a, _ = by_rank(url, 0)
    # A holds a prefix every request below starts with: affinity alone would send all to A.
    prompt = "Share. " + BODY
    if complete(url, prompt).headers["x-unikv-replica"] != name_a:
        # It went to B: cool B for a moment, so that A computes (and caches) it too.
        name_b, _ = by_rank(url, 1)
        heat(sensors, 1, LIMIT_C + 1)
        wait_until(lambda: replicas(url)[name_b]["cooling"], "replica B to enter cooling", 30)
        assert complete(url, prompt).headers["x-unikv-replica"] == name_a
        heat(sensors, 1, 40)
        wait_until(lambda: not replicas(url)[name_b]["cooling"], "replica B to cool", 30)
    heat(sensors, 0, {"temp_c": 40, "health": "red"})
    wait_until(lambda: replicas(url)[name_a]["status"] == "red", "replica A to report red", 30)
    counts = {}
    n = 13
    for _ in range(n):
        where = complete(url, prompt, max_tokens=1).headers["x-unikv-replica"]
        counts[where] = counts.get(where, 0) + 1
    share = 0.3 / 1.3  # red weight over the sum of the weights
    assert counts.get(name_a, 0) <= round(share * n) + 1
    assert sum(counts.values()) == n
    heat(sensors, 0, 40)
    forced = "health forced by the scripted sensor"
    wait_until(lambda: forced not in replicas(url)[name_a]["reasons"], "A's own health", 30)
    assert replicas(url)[name_a]["status"] != "red", replicas(url)[name_a]


def test_killed_replica_loses_no_request(cluster):
    url, _, reps, _ = cluster
    prompt = "Kill. " + BODY
    victim = complete(url, prompt).headers["x-unikv-replica"]
    events: list[str] = []

    def stream() -> None:
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 200, "stream": True,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: len(events) >= 3, "the stream to start", 60)
    # Requests queued behind the stream on the victim (batch 1; same prefix: affinity).
    results: dict[int, httpx.Response] = {}

    def one(i: int) -> None:
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 2}
        results[i] = httpx.post(url + "/v1/completions", json=body, timeout=180)

    waiting = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for w in waiting:
        w.start()
    time.sleep(0.5)
    uid = victim.split("-", 1)[1]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#{DEPLOYMENT}#{uid}", namespace="serve"),
             no_restart=True)  # fmt: skip
    t.join(120)
    for w in waiting:
        w.join(180)
    assert events[-1] == "data: [DONE]"
    assert any('"error"' in e for e in events[-3:]), events[-3:]
    assert sorted(results) == [0, 1, 2]
    assert all(r.status_code == 200 for r in results.values()), [r.text for r in results.values()]
    # Ray Serve starts a replacement, which joins the rotation.
    wait_until(lambda: len(replicas(url)) == 2 and victim not in replicas(url),
               "the replacement replica", 180)  # fmt: skip
    metrics = httpx.get(url + "/metrics").text
    assert "unikv_router_lost_streams_total 1.0" in metrics
