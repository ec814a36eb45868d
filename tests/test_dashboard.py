"""The `/dashboard` page in a real headless browser (Debian's chromium + chromedriver through
selenium): it loads, its ring shows the colour `/health` reports, and its numbers move under
load."""

from __future__ import annotations

import shutil

import httpx
import pytest

from .test_serve import live, post_in_background, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM and DRIVER):
        pytest.skip("chromium and chromium-driver are not installed (make test installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1200,800",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):  # fmt: skip
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    yield driver
    driver.quit()


def ring(browser) -> str:
    return browser.find_element("id", "ring").get_attribute("data-status")


def test_the_ring_follows_health_and_the_numbers_move_under_load(browser, model, tokenizer):
    with live(model, tokenizer, max_batch=1, max_waiting=2) as (url, server):
        browser.get(url + "/dashboard")
        assert browser.title.startswith("unikv")
        wait_until(lambda: ring(browser) == "green", "the ring to turn green")
        assert httpx.get(url + "/health", timeout=30).json()["status"] == "green"
        assert browser.find_element("id", "share").text == "100%"

        # Load: one running, one waiting of two allowed -> the queue is "filling" -> yellow.
        body = {"prompt": "Tell me a long story", "max_tokens": 120, "ignore_eos": True}
        clients = post_in_background(url, body, 2)
        wait_until(lambda: server.memory_report().requests.waiting == 1, "a waiting one")
        health = httpx.get(url + "/health", timeout=30).json()
        assert health["status"] == "yellow" and health["load_share"] == 0.8
        wait_until(lambda: ring(browser) == "yellow", "the ring to turn yellow")
        assert browser.find_element("id", "share").text == "80%"
        reasons = browser.find_element("id", "reasons").text
        assert "request queue filling" in reasons
        wait_until(lambda: browser.find_element("id", "inflight").text == "2", "in flight: 2")
        for c in clients:
            c.join(120)
        # Finished requests show up as throughput, and the ring goes back to green.
        wait_until(lambda: float(browser.find_element("id", "tput-now").text) > 0, "throughput")
        wait_until(lambda: ring(browser) == "green", "the ring to turn green again")


def test_the_advice_card_lists_what_to_change(browser, model, tokenizer, monkeypatch):
    from unikv.serving.advice import Advice

    with live(model, tokenizer, max_batch=1) as (url, server):
        browser.get(url + "/dashboard")
        wait_until(lambda: "nothing to change" in browser.find_element("id", "advice").text,
                   "the empty advice list")  # fmt: skip
        a = Advice("oom", "OOM predictor warnings in the last 5 minutes", 2, 1,
                   "[tiers.device] capacity", "256MiB", "512MiB",
                   "raise [tiers.device] capacity from 256MiB to 512MiB: <scripted>")  # fmt: skip
        monkeypatch.setattr(server, "advice", lambda: [a])
        wait_until(lambda: a.text in browser.find_element("id", "advice").text, "the advice")
