"""Health reports per period (serving.reports): a short run of a real server writes the JSON and
the HTML page, with requests by outcome, percentiles, memory and its slope, a scripted
sensor's temperatures, health transitions and advice; the page renders in headless Chromium
with its charts. Plus the period parser, the statistics and the CLI's flags."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from unikv.serving.advice import Advice
from unikv.serving.reports import Reporter, parse_period, percentile, slope_per_hour, svg_chart
from unikv.serving.sensors import ScriptedSensor

from .test_dashboard import browser  # noqa: F401  (the module's headless Chromium)
from .test_serve import live, post_in_background, wait_until


def test_periods_parse_with_units_and_bad_ones_are_named():
    assert parse_period("1h") == 3600 and parse_period("15m") == 900
    assert parse_period("90s") == 90 and parse_period("2") == 2 and parse_period("1d") == 86400
    for bad in ("", "1 week", "0.5s", "-1h", "h"):
        with pytest.raises(ValueError, match="report period"):
            parse_period(bad)


def test_percentiles_and_slopes():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(i) for i in range(100)], 0.99) == 98.0
    assert slope_per_hour([(0.0, 10.0)]) is None
    assert slope_per_hour([(0.0, 10.0), (1800.0, 20.0), (3600.0, 30.0)]) == pytest.approx(20.0)


def test_a_chart_is_inline_svg_with_one_line_per_series():
    svg = svg_chart("t", {"a": [(0.0, 1.0), (1.0, 2.0)], "b": [(0.0, 3.0), (1.0, 1.0)]}, "°C")
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 and "max 3 °C" in svg
    assert "no samples" in svg_chart("t", {"a": []}, "")


def test_the_cli_checks_the_report_flags_before_loading(tmp_path):
    from unikv.cli.main import main

    assert main(["serve", "--report-dir", str(tmp_path), "--report-every", "soon"]) == 2
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["serve", "--report-dir", str(blocker / "reports")]) == 74  # EX_IOERR
    assert main(["serve", "--sensor", "none"]) == 2  # a sensor needs replicas or reports


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_short_run_writes_a_report_that_renders_with_its_charts(
    model,
    tokenizer,
    tmp_path,
    browser,  # noqa: F811  (the fixture imported from test_dashboard)
):
    sensor = ScriptedSensor([55.0, 61.5, 64.0, 62.0])
    reporters: list[Reporter] = []

    def setup(server):
        reporters.append(Reporter(server, tmp_path, every_s=3.0, sample_s=0.25, sensor=sensor))
        server.services.append(reporters[0])

    with live(model, tokenizer, max_batch=1, max_waiting=2, setup=setup) as (url, server):
        advice = Advice("preemptions", "requests paused for memory in the last 5 minutes", 7, 5,
                        "[scheduler] batch_size", "8", "4", "lower [scheduler] batch_size from "
                        "8 to 4: scripted for this test")  # fmt: skip
        server.advice = lambda: [advice]  # the rules are tested on real counters elsewhere
        body = {"prompt": "Tell me a story", "max_tokens": 32, "ignore_eos": True}
        clients = post_in_background(url, body, 2)
        # One running, one waiting of two allowed: the queue is filling -> yellow.
        wait_until(lambda: server.memory_report().requests.waiting >= 1, "a waiting request")
        bad = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400
        for c in clients:
            c.join(120)
        wait_until(lambda: reporters[0].written, "the first report", 30)
    first = json.loads(reporters[0].written[0].read_text())
    total = [json.loads(p.read_text()) for p in reporters[0].written]  # the last at shutdown
    assert sum(r["requests"].get("ok", 0) for r in total) == 2
    assert sum(r["requests"].get("invalid", 0) for r in total) == 1
    r = next(r for r in total if r["finished"])
    assert r["ttft_s"]["p50"] > 0 and r["latency_s"]["p99"] >= r["latency_s"]["p50"] > 0
    assert r["tokens_per_s"] > 0 and r["output_tokens"] >= 32
    assert r["rss_mib"]["last"] > 0 and r["device_usage_pct"]["max"] > 0
    assert r["rss_mib"]["slope_mib_per_h"] is not None
    # Each report covers its own window of samples: the scripted peak is in one of them (on a
    # slow machine the run's first report can close before the requests finish).
    assert max(x["temperatures_c"]["cpu"]["max"] for x in total) == 64.0
    assert r["temperatures_c"]["cpu"]["max"] in (55.0, 61.5, 64.0, 62.0)
    assert [a["key"] for a in first["advice"]] == ["[scheduler] batch_size"]  # once per change
    assert first["advice"][0]["times"] > 1
    assert first["health_transitions"][0]["to"] == "green"
    statuses = [t["to"] for r in total for t in r["health_transitions"]]
    assert "yellow" in statuses  # the queue filled while both requests were in flight

    page = reporters[0].written[0].with_suffix(".html")
    browser.get(page.as_uri())
    assert browser.title.startswith("unikv report")
    charts = browser.find_elements("css selector", "svg.chart")
    assert len(charts) == 4
    drawn = {c.get_attribute("aria-label"): len(c.find_elements("css selector", "polyline"))
             for c in charts}  # fmt: skip
    assert drawn["device tier usage"] == 1 and drawn["RSS"] == 1 and drawn["temperature"] == 1
    assert all(c.size["width"] > 300 for c in charts)  # laid out, not collapsed
    assert "lower [scheduler] batch_size from 8 to 4" in browser.find_element("id", "advice").text
    shot = os.environ.get("UNIKV_REPORT_SCREENSHOT")  # docs/report.png is made this way
    if shot:
        browser.save_screenshot(str(Path(shot).resolve()))
