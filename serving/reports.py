"""Health reports per period: `unikv serve --report-dir DIR [--report-every 1h]`.

What lives here: `Reporter`, a service of the `serving.app.Server` (started once the engine is
up, stopped before it closes, like the gRPC server) that samples the server every
`sample_s` and, at the end of each period (and at shutdown, for the part-period), writes two
files named after the period's start, `report-YYYYmmddTHHMMSSZ.json` and `.html`:

- requests by outcome (ok, failed, invalid, rejected, cancelled), TTFT and latency p50 / p99,
  output tokens/s;
- the device tier's usage and its slope (points per hour), the server's RSS and its slope
  (MiB per hour): a least-squares fit over the period's samples;
- temperatures per chip (the replicas' sensors, or the one given to the reporter);
- health transitions (time, from, to, the reasons) and the advice given (`serving.advice`),
  each piece once, with when it was first and last seen.

The HTML page is self-contained: numbers, tables and the charts as inline SVG (no script, no
network). What does not live here: the readings themselves (the server, its engine, the
sensors), the advice rules.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_PERIOD_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_period(text: str) -> float:
    """Seconds from "90s", "15m", "1h", "1d" or a bare number of seconds (>= 1 s)."""
    m = _PERIOD_RE.match(str(text))
    if not m:
        raise ValueError(f"report period {text!r}: expected a number with s, m, h or d (e.g. 1h)")
    seconds = float(m.group(1)) * _UNIT_S[(m.group(2) or "s").lower()]
    if seconds < 1:
        raise ValueError(f"report period {text!r}: at least 1 s")
    return seconds


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (time s, value) points, per hour; None under two points."""
    if len(points) < 2 or points[-1][0] - points[0][0] <= 0:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    cov = sum((t - mt) * (v - mv) for t, v in points)
    return cov / var * 3600.0 if var else None


@dataclass(slots=True)
class Sample:
    """The server at one time."""

    t: float
    status: str
    device_usage: float | None
    kv_bytes: int
    rss_bytes: int
    running: int
    waiting: int
    temperatures: dict[str, float] = field(default_factory=dict)


class Reporter:
    """Samples `server` every `sample_s` and writes a report to `directory` every `every_s`."""

    def __init__(self, server, directory: str | Path, every_s: float = 3600.0,
                 sample_s: float | None = None, sensor=None, sensor_kind: str | None = None,
                 clock=time.time) -> None:  # fmt: skip
        if not every_s > 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self.server, self.dir, self.every_s = server, Path(directory), every_s
        self.sample_s = sample_s if sample_s is not None else min(60.0, max(1.0, every_s / 120))
        # `sensor`: a reading source; else, for one engine, the sensor `sensor_kind` names (the
        # config's [thermal] sensor when None) is opened at start. Replicas report their own.
        self.sensor, self.sensor_kind, self.clock = sensor, sensor_kind, clock
        self.written: list[Path] = []  # the JSON files written so far
        self._status: str | None = None  # the health colour last sampled (across periods)
        self._task: asyncio.Task | None = None
        self._begin(clock())

    def _begin(self, now: float) -> None:
        self.start_t = now
        self.samples: list[Sample] = []
        self.transitions: list[dict[str, Any]] = []
        # (rule, key, suggested value) -> the advice, when first and last seen, how often
        self.advice: dict[str, dict[str, Any]] = {}
        self._outcomes0 = dict(self.server.outcomes)

    async def start(self) -> None:
        """Check the directory is writable and start sampling."""
        self.dir.mkdir(parents=True, exist_ok=True)
        probe = self.dir / ".unikv-write-test"
        probe.write_text("")
        probe.unlink()
        built = getattr(self.server.engine, "built", None)  # one engine (not replicas)
        if self.sensor is None and built is not None:
            from .sensors import open_sensor

            kind = self.sensor_kind or built.config.thermal.sensor
            self.sensor = open_sensor(kind, built.profile, "cpu")
        self._begin(self.clock())
        await self.tick(write=False)  # the state at start: the first transition is from "start"
        self._task = asyncio.get_running_loop().create_task(self._run())
        log.info("reports every %g s in %s", self.every_s, self.dir)

    async def stop(self, grace: float | None = None) -> None:
        """Stop sampling; write the part-period's report."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        await self.tick(write=False)
        self.write()

    async def tick(self, write: bool = True) -> None:
        """One sample (the sensor read off the event loop, the rest on it: the advisor and the
        health view belong to the loop's thread), and the report if the period is over."""
        temp = await asyncio.to_thread(self.sensor.read) if self.sensor is not None else None
        self.sample(temp)
        if write and self.clock() - self.start_t >= self.every_s:
            self.write()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.sample_s)
            try:
                await self.tick()
            except Exception as e:  # a failed reading or write: say so, keep reporting
                log.warning("report not updated: %s", e)

    # ---- readings ----------------------------------------------------------------------------

    def sample(self, sensor_c: float | None = None) -> Sample:
        """Read the server now (health, memory, RSS, the replicas' temperatures and the
        reporter's own sensor's reading `sensor_c`) and its advice."""
        now = self.clock()
        view = self.server.health()
        mem = self.server.memory_report()
        pool = mem.pool if mem is not None else None
        temps: dict[str, float] = {}
        for name, r in ((mem.replicas or {}) if mem is not None else {}).items():
            if r.get("temperature_c") is not None:
                temps[name] = float(r["temperature_c"])
        if sensor_c is not None:
            temps["cpu"] = float(sensor_c)
        counts = mem.requests if mem is not None else None
        s = Sample(
            t=now, status=view.status,
            device_usage=pool.usage("device") if pool is not None else None,
            kv_bytes=mem.kv_bytes_used if mem is not None else 0, rss_bytes=rss_bytes(),
            running=counts.running if counts else 0, waiting=counts.waiting if counts else 0,
            temperatures=temps,
        )  # fmt: skip
        self.samples.append(s)
        if view.status != self._status:
            self.transitions.append({"t": now, "from": self._status, "to": view.status,
                                     "reasons": list(view.reasons)})  # fmt: skip
            self._status = view.status
        for a in self.server.advice():  # one entry per change advised, its latest words
            seen = self.advice.setdefault(f"{a.rule} {a.key} {a.suggested}",
                                          {"first_t": now, "times": 0})  # fmt: skip
            seen |= a.as_dict() | {"last_t": now, "times": seen["times"] + 1}
        return s

    # ---- the report ------------------------------------------------------------------------

    def summary(self, end_t: float) -> dict[str, Any]:
        """The period's report as a JSON-serializable dict."""
        finished = [x for x in self.server.timings if self.start_t <= x[0] < end_t]
        ttfts = [x[1] for x in finished if x[1] is not None]
        lats = [x[2] for x in finished]
        tokens = sum(x[3] for x in finished)
        now_out = dict(self.server.outcomes)
        outcomes = {k: v - self._outcomes0.get(k, 0) for k, v in now_out.items()}
        span = max(end_t - self.start_t, 1e-9)
        usage = [(s.t, 100.0 * s.device_usage) for s in self.samples if s.device_usage is not None]
        rss = [(s.t, s.rss_bytes / 2**20) for s in self.samples if s.rss_bytes]
        chips = sorted({c for s in self.samples for c in s.temperatures})
        return {
            "start": _iso(self.start_t), "end": _iso(end_t), "seconds": round(span, 3),
            "requests": {k: v for k, v in sorted(outcomes.items()) if v},
            "finished": len(finished),
            "ttft_s": {"p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99)},
            "latency_s": {"p50": percentile(lats, 0.5), "p99": percentile(lats, 0.99)},
            "output_tokens": tokens, "tokens_per_s": tokens / span,
            "device_usage_pct": {"last": usage[-1][1] if usage else None,
                                 "max": max((u for _, u in usage), default=None),
                                 "slope_pp_per_h": slope_per_hour(usage)},
            "rss_mib": {"last": rss[-1][1] if rss else None,
                        "max": max((r for _, r in rss), default=None),
                        "slope_mib_per_h": slope_per_hour(rss)},
            "temperatures_c": {c: {"last": _last(self.samples, c), "max": max(
                s.temperatures[c] for s in self.samples if c in s.temperatures)} for c in chips},
            "health_transitions": [t | {"t": _iso(t["t"])} for t in self.transitions],
            "advice": [a | {"first_t": _iso(a["first_t"]), "last_t": _iso(a["last_t"])}
                       for a in self.advice.values()],
            "samples": [asdict(s) for s in self.samples],
        }  # fmt: skip

    def write(self) -> Path:
        """Write the period's JSON and HTML; start the next period. Returns the JSON's path."""
        end = self.clock()
        report = self.summary(end)
        stem = "report-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.start_t))
        path = self.dir / f"{stem}.json"
        _atomic_write(path, json.dumps(report, indent=1, default=str))
        _atomic_write(self.dir / f"{stem}.html", render_html(report))
        self.written.append(path)
        log.info("report written: %s", path)
        self._begin(end)
        return path


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _last(samples: list[Sample], chip: str) -> float | None:
    return next((s.temperatures[chip] for s in reversed(samples) if chip in s.temperatures), None)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


# ---- the HTML page ----------------------------------------------------------------------------

_COLOURS = {"green": "#2e9d46", "yellow": "#e0b000", "red": "#d33"}


def svg_chart(title: str, series: dict[str, list[tuple[float, float]]], unit: str,
              width: int = 420, height: int = 140, x_unit: str = "min") -> str:  # fmt: skip
    """A line chart as inline SVG: one polyline per series over a shared time axis (its first
    and last value labelled, in `x_unit`)."""
    pad = 28
    pts = [p for s in series.values() for p in s]
    head = f'<svg class="chart" role="img" aria-label="{html.escape(title)}" width="{width}" ' \
           f'height="{height}" xmlns="http://www.w3.org/2000/svg">'  # fmt: skip
    if not pts:
        return head + f'<text x="{pad}" y="{height // 2}" font-size="12" fill="#999">' \
                      f"{html.escape(title)}: no samples</text></svg>"  # fmt: skip
    t0, t1 = min(p[0] for p in pts), max(p[0] for p in pts)
    lo, hi = min(0.0, min(p[1] for p in pts)), max(p[1] for p in pts)
    hi = hi if hi > lo else lo + 1.0

    def x(t: float) -> float:
        return pad + (width - 2 * pad) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)

    def y(v: float) -> float:
        return height - pad - (height - 2 * pad) * (v - lo) / (hi - lo)

    palette = ("#4a7bd0", "#d0704a", "#2e9d46", "#8a4ad0")
    lines = [
        f'<polyline class="series" data-name="{html.escape(name)}" fill="none" '
        f'stroke="{palette[i % len(palette)]}" stroke-width="2" points="'
        + " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in s) + '"/>'
        for i, (name, s) in enumerate(series.items()) if s
    ]  # fmt: skip
    legend = " · ".join(html.escape(n) for n, s in series.items() if s)
    return (head + f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
            f'stroke="#ccc"/><text x="{pad}" y="14" font-size="11" fill="#777">'
            f"{html.escape(title)} (max {hi:.3g} {html.escape(unit)}) {legend}</text>"
            f'<text x="{pad}" y="{height - 8}" font-size="10" fill="#999">{t0:g}</text>'
            f'<text x="{width - pad}" y="{height - 8}" font-size="10" fill="#999" '
            f'text-anchor="end">{t1:.3g} {html.escape(x_unit)}</text>'
            + "".join(lines) + "</svg>")  # fmt: skip


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return html.escape(str(v))


def render_html(r: dict[str, Any]) -> str:
    """The report as one self-contained HTML page."""
    samples = r["samples"]
    t0 = samples[0]["t"] if samples else 0.0
    minutes = [(s["t"] - t0) / 60 for s in samples]
    usage = [(m, 100 * s["device_usage"]) for m, s in zip(minutes, samples, strict=True)
             if s["device_usage"] is not None]  # fmt: skip
    rss = [(m, s["rss_bytes"] / 2**20) for m, s in zip(minutes, samples, strict=True)]
    chips = sorted({c for s in samples for c in s["temperatures"]})
    temps = {c: [(m, s["temperatures"][c]) for m, s in zip(minutes, samples, strict=True)
                 if c in s["temperatures"]] for c in chips}  # fmt: skip
    queue = {
        "running": [(m, s["running"]) for m, s in zip(minutes, samples, strict=True)],
        "waiting": [(m, s["waiting"]) for m, s in zip(minutes, samples, strict=True)],
    }
    status = samples[-1]["status"] if samples else "unknown"
    req_rows = (
        "".join(f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>" for k, v in r["requests"].items())
        or "<tr><td>none</td><td>0</td></tr>"
    )
    trans = (
        "".join(
            f"<li>{html.escape(t['t'])}: {html.escape(t['from'] or 'start')} → "
            f'<b style="color:{_COLOURS.get(t["to"], "#222")}">{html.escape(t["to"])}</b>'
            f"{' — ' + html.escape('; '.join(t['reasons'])) if t['reasons'] else ''}</li>"
            for t in r["health_transitions"]
        )
        or "<li>none</li>"
    )
    advice = (
        "".join(
            f'<li>{html.escape(a["text"])} <span class="muted">(seen {a["times"]}×, '
            f"{html.escape(a['first_t'])} to {html.escape(a['last_t'])})</span></li>"
            for a in r["advice"]
        )
        or "<li>nothing to change</li>"
    )
    u, m = r["device_usage_pct"], r["rss_mib"]
    temp_rows = "".join(f"<tr><td>{html.escape(c)}</td><td>{_fmt(t['last'])} °C</td>"
                        f"<td>{_fmt(t['max'])} °C</td></tr>"
                        for c, t in r["temperatures_c"].items()) or \
        "<tr><td colspan=3>no sensor</td></tr>"  # fmt: skip
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>unikv report {html.escape(r["start"])}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fafafa; }}
.row {{ display: flex; gap: 24px; flex-wrap: wrap; align-items: flex-start; }}
.card {{ background: #fff; border: 1px solid #ddd; border-radius: 8px; padding: 12px 16px; }}
td {{ padding: 2px 12px 2px 0; }} .muted {{ color: #777; font-size: 12px; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 15px; margin: 0 0 6px; }}
</style></head><body>
<h1>unikv serve — report <span class="muted">{html.escape(r["start"])} to
{html.escape(r["end"])} ({r["seconds"] / 60:.1f} min)</span></h1>
<p id="status">health at the end: <b style="color:{_COLOURS.get(status, "#222")}">{status}</b></p>
<div class="row">
<div class="card"><h2>Requests by outcome</h2><table id="requests">{req_rows}</table>
<p>TTFT p50 / p99: {_fmt(r["ttft_s"]["p50"])} / {_fmt(r["ttft_s"]["p99"])} s<br>
latency p50 / p99: {_fmt(r["latency_s"]["p50"])} / {_fmt(r["latency_s"]["p99"])} s<br>
output tokens/s: {_fmt(r["tokens_per_s"])} ({r["output_tokens"]} tokens)</p></div>
<div class="card"><h2>Memory</h2>
<p>device tier: {_fmt(u["last"])}% now, max {_fmt(u["max"])}%, slope
{_fmt(u["slope_pp_per_h"])} points/h<br>RSS: {_fmt(m["last"])} MiB now, max {_fmt(m["max"])}
MiB, slope {_fmt(m["slope_mib_per_h"])} MiB/h</p></div>
<div class="card"><h2>Temperatures</h2><table>{temp_rows}</table></div>
</div>
<div class="row" style="margin-top:16px">
<div class="card">{svg_chart("device tier usage", {"device": usage}, "%")}</div>
<div class="card">{svg_chart("RSS", {"rss": rss}, "MiB")}</div>
<div class="card">{svg_chart("requests", queue, "")}</div>
<div class="card">{svg_chart("temperature", temps, "°C")}</div>
</div>
<div class="row" style="margin-top:16px">
<div class="card"><h2>Health transitions</h2><ul id="transitions">{trans}</ul></div>
<div class="card"><h2>Advice given</h2><ul id="advice">{advice}</ul></div>
</div>
<p class="muted">time axis: minutes from the period's first sample; {len(samples)} samples.</p>
</body></html>
"""
