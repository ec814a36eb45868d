"""One `unikv` logger tree, configured once by the CLI: level from --log-level or
$UNIKV_LOG_LEVEL, text or JSON lines, always on stderr (stdout is the answer)."""

import json
import logging

import pytest

from unikv.engine import cli as engine_cli
from unikv.serving import cli as serving_cli


@pytest.fixture(autouse=True)
def _restore():
    root = logging.getLogger("unikv")
    saved = root.handlers[:], root.level, root.propagate
    yield
    root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]


def test_json_lines_on_stderr_at_the_chosen_level(capsys):
    assert engine_cli.configure_logging("debug", "json") == "DEBUG"
    logging.getLogger("unikv.engine.engine").debug("step %d took %s", 3, "20 ms")
    out, err = capsys.readouterr()
    assert out == ""
    line = json.loads(err.strip().splitlines()[-1])
    assert line["level"] == "DEBUG" and line["logger"] == "unikv.engine.engine"
    assert line["message"] == "step 3 took 20 ms" and line["time"]
    engine_cli.configure_logging("info")  # configured again: replaced, not a second handler
    logging.getLogger("unikv.serve").info("once")
    assert capsys.readouterr().err.count("once") == 1


def test_the_environment_sets_the_level_and_text_lines_name_time_level_logger(monkeypatch, capsys):
    monkeypatch.setenv("UNIKV_LOG_LEVEL", "warning")
    assert engine_cli.configure_logging() == "WARNING"
    logging.getLogger("unikv.kvstrategies.operators").info("hidden")
    logging.getLogger("unikv.kvstrategies.operators").warning("shown")
    err = capsys.readouterr().err
    assert "hidden" not in err
    assert " WARNING unikv.kvstrategies.operators: shown" in err
    monkeypatch.setenv("UNIKV_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="UNIKV_LOG_LEVEL"):
        engine_cli.configure_logging()


def test_the_flags_go_before_or_after_the_command():
    parser = engine_cli.build_parser({"serve": (serving_cli.add_serve, serving_cli.run_serve)})
    a = parser.parse_args(["serve", "--log-level", "debug", "--log-format", "json"])
    assert a.log_level == "DEBUG" and a.log_format == "json"
    b = parser.parse_args(["--log-level", "error", "serve"])
    assert b.log_level == "ERROR" and b.log_format == "text"
    c = parser.parse_args(["serve", "--threads", "1", "--device", "cpu", "--strict"])
    assert c.log_level is None and c.threads == 1 and c.strict
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--log-level", "chatty"])
