"""One `unikv` logger tree, configured once by the CLI: level from --log-level or
$UNIKV_LOG_LEVEL, text or JSON lines, always on stderr (stdout is the answer)."""

import json
import logging

import pytest

from unikv.cli.main import build_parser
from unikv.settings.logs import configure_logging


def test_json_lines_on_stderr_at_the_chosen_level(capsys):
    assert configure_logging("debug", "json") == "DEBUG"
    logging.getLogger("unikv.engine.engine").debug("step %d took %s", 3, "20 ms")
    out, err = capsys.readouterr()
    assert out == ""
    line = json.loads(err.strip().splitlines()[-1])
    assert line["level"] == "DEBUG" and line["logger"] == "unikv.engine.engine"
    assert line["message"] == "step 3 took 20 ms" and line["time"]
    configure_logging("info")  # configured again: replaced, not a second handler
    logging.getLogger("unikv.serve").info("once")
    assert capsys.readouterr().err.count("once") == 1


def test_the_environment_sets_the_level_and_text_lines_name_time_level_logger(monkeypatch, capsys):
    monkeypatch.setenv("UNIKV_LOG_LEVEL", "warning")
    assert configure_logging() == "WARNING"
    logging.getLogger("unikv.kernels.operators").info("hidden")
    logging.getLogger("unikv.kernels.operators").warning("shown")
    err = capsys.readouterr().err
    assert "hidden" not in err
    assert " WARNING unikv.kernels.operators: shown" in err
    monkeypatch.setenv("UNIKV_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="UNIKV_LOG_LEVEL"):
        configure_logging()


def test_the_flags_go_before_or_after_the_command():
    parser = build_parser()
    a = parser.parse_args(["serve", "--log-level", "debug", "--log-format", "json"])
    assert a.log_level == "DEBUG" and a.log_format == "json"
    b = parser.parse_args(["--log-level", "error", "serve"])
    assert b.log_level == "ERROR" and b.log_format == "text"
    c = parser.parse_args(["serve", "--threads", "1", "--device", "cpu", "--strict"])
    assert c.log_level is None and c.threads == 1 and c.strict
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--log-level", "chatty"])
