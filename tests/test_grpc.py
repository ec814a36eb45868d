"""`unikv serve --grpc-port`: the gRPC API beside HTTP, one engine behind both, driven with the
generated client (streaming, deadlines, errors, the key, health, reflection)."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from unikv.memory.health import HealthView
from unikv.serving import unikv_pb2 as pb
from unikv.serving import unikv_pb2_grpc as pb_grpc

from .test_serve import live, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def both(model, tokenizer):
    """(HTTP URL, Server, gRPC channel) of one server."""
    with live(model, tokenizer, grpc=True) as (url, server):
        channel = grpc.insecure_channel(f"127.0.0.1:{server.services[0].port}")
        yield url, server, channel
        channel.close()


def stub(channel) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(channel)


def test_generate_streams_the_http_answer(both):
    url, _, channel = both
    req = pb.GenerateRequest(prompt=PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    parts = list(stub(channel).Generate(req, timeout=120))
    last = parts[-1]
    assert last.finish_reason == "length" and last.completion_tokens == 12
    assert last.prompt_tokens > 0 and len(parts) >= 2  # pieces, then the summary
    text = "".join(x.text for x in parts)
    http = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "smollm2", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}).json()  # fmt: skip
    assert text == http["choices"][0]["text"]  # one engine, the same greedy answer
    ids = stub(channel).Tokenize(pb.TokenizeRequest(prompt=PROMPT), timeout=30).ids
    by_ids = list(
        stub(channel).Generate(
            pb.GenerateRequest(
                prompt_ids=pb.TokenIds(ids=ids), max_tokens=12, temperature=0.0, ignore_eos=True
            )
        )
    )
    assert "".join(x.text for x in by_ids) == text
    models = stub(channel).Models(pb.ModelsRequest(), timeout=30).models
    assert [m.id for m in models] == ["smollm2"] and models[0].max_model_len == 8192


@pytest.mark.parametrize(
    ("fields", "says"),
    [({"prompt": PROMPT, "temperature": -1.0}, "temperature"),
     ({"prompt": PROMPT, "top_p": 2.0}, "top_p"),
     ({"prompt": PROMPT, "max_tokens": 10**6}, "max_tokens"),
     ({"prompt": "   "}, "prompt is empty"),
     ({}, "prompt or prompt_ids is required"),
     ({"prompt_ids": pb.TokenIds(ids=[10**6])}, "token"),
     ({"prompt": PROMPT, "priority": 10**15}, "priority")],
)  # fmt: skip
def test_bad_fields_are_invalid_argument(both, fields, says):
    with pytest.raises(grpc.RpcError) as info:
        list(stub(both[2]).Generate(pb.GenerateRequest(**fields), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in info.value.details()


def test_a_deadline_cancels_the_request_and_frees_its_kv(both):
    _, server, channel = both
    req = pb.GenerateRequest(prompt=PROMPT, max_tokens=2000, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as info:
        for _ in stub(channel).Generate(req, timeout=1.0):
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: server.memory_report().requests.running == 0, "the cancel")
    wait_until(lambda: server.engine.kv.bytes_used() == 0, "the KV freed")
    assert server.in_flight == 0


def test_health_follows_readiness_and_reflection_lists_the_services(both, monkeypatch):
    _, server, channel = both
    check = health_pb2_grpc.HealthStub(channel).Check
    serving = health_pb2.HealthCheckResponse.SERVING
    for name in ("", "unikv.v1.Generation"):
        assert check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == serving
    red = HealthView("red", 0.0, ("scripted for the test",), ())
    monkeypatch.setattr(server, "health", lambda: red)

    def not_serving() -> bool:
        status = check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
        return status == health_pb2.HealthCheckResponse.NOT_SERVING

    wait_until(not_serving, "NOT_SERVING while red", limit=10)
    monkeypatch.undo()
    wait_until(lambda: not not_serving(), "SERVING again", limit=10)
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(
        refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
    )
    names = {s.name for s in answer.list_services_response.service}
    assert {"unikv.v1.Generation", "grpc.health.v1.Health"} <= names


def test_the_key_is_call_metadata(model, tokenizer):
    with (
        live(model, tokenizer, grpc=True, api_key="sekret") as (_, server),
        grpc.insecure_channel(f"127.0.0.1:{server.services[0].port}") as channel,
    ):
        req = pb.TokenizeRequest(prompt=PROMPT)
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub(channel).Tokenize(req, timeout=10, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = stub(channel).Tokenize(req, timeout=10, metadata=(("authorization", "Bearer sekret"),))
        assert len(ok.ids) > 0
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # open, as /health
        assert stub(channel).Advise(pb.AdviseRequest(), timeout=10).status == "green"  # open too


def test_the_generated_code_is_the_protos(tmp_path):
    tools = pytest.importorskip("grpc_tools.protoc")
    src = ROOT / "serving"
    assert (
        tools.main(
            [
                "protoc",
                f"-I{src}",
                f"--python_out={tmp_path}",
                f"--grpc_python_out={tmp_path}",
                str(src / "unikv.proto"),
            ]
        )
        == 0
    )
    for name in ("unikv_pb2.py", "unikv_pb2_grpc.py"):
        got = (tmp_path / name).read_text()
        committed = (src / name).read_text()
        assert _code(got) == _code(committed), f"serving/{name} is stale: run `make grpc`"


# The generator stamps its own version into the code (a banner, the oldest grpcio and protobuf
# runtimes it accepts); a new patch release of grpcio-tools changes those and nothing else.
_STAMPS = (
    (re.compile(r"^# Protobuf Python Version: .*$", re.M), "# Protobuf Python Version: V"),
    (re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M), "GRPC_GENERATED_VERSION = V"),
    (
        re.compile(
            r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)[\d,\s]*"
        ),
        r"\1 V, ",
    ),
)


def _code(text: str) -> str:
    """Generated code without its version stamps and the package-relative import fix-up."""
    for pattern, placeholder in _STAMPS:
        text = pattern.sub(placeholder, text)
    return text.replace("from . import unikv_pb2", "import unikv_pb2")


def test_advice_reaches_health_grpc_and_the_cli(both, monkeypatch, capsys):
    """The same advice on /health, over gRPC's Advise (open without the key, like /health) and
    from `unikv advise --url` (exit code 1 when there is advice, 0 when none). Which advice the
    rules give is tested on real counters in tests/test_advice.py; here one is scripted."""
    from unikv.cli.main import main
    from unikv.serving.advice import Advice

    url, server, channel = both
    assert main(["advise", "--url", url]) == 0
    assert "advice: nothing to change" in capsys.readouterr().out
    a = Advice("batching_window", "share of admission windows that closed by time", 0.9, 0.8,
               "[scheduler] batching_window_ms", "50", "25",
               "lower [scheduler] batching_window_ms from 50 to 25: scripted")  # fmt: skip
    monkeypatch.setattr(server, "advice", lambda: [a])
    body = httpx.get(url + "/health", timeout=30).json()
    assert body["advice"] == [a.as_dict()]
    reply = stub(channel).Advise(pb.AdviseRequest(), timeout=30)
    assert reply.status == body["status"]
    assert [(x.key, x.current, x.suggested, x.text) for x in reply.advice] == [
        (a.key, a.current, a.suggested, a.text)]  # fmt: skip
    assert reply.advice[0].value == pytest.approx(0.9)
    assert main(["advise", "--url", url]) == 1
    out = capsys.readouterr().out
    assert "[scheduler] batching_window_ms: 50 -> 25" in out and a.text in out
    assert main(["advise", "--url", url, "--json"]) == 1
    assert '"advice"' in capsys.readouterr().out
    assert main(["advise", "--url", "http://127.0.0.1:9", "--timeout", "2"]) == 2
