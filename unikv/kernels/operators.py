"""The per-device kernel registry and the operator circuit breaker.

What lives here: `Implementation` (one way to compute one op, with the device types it is for and
`available(device, owner)` saying whether this device and build offer it), `register` /
`implementations` / `choose` (the registry: per op, entries in preference order), `Breaker` (the
dispatcher for one op: calls the first healthy implementation, switches to the next when one
raises or runs slow, re-probes after a cool-down) and `OperatorSet` (the breakers of one owner: a
model or a KV strategy, and what they report). What does not: the implementations themselves.
The attention entries live beside the strategy they attend for (`kvstrategies.hybrid`), the
matmul / norm / rope entries in the engine (`engine.linear`), so this module imports no kernel.

It sits in `kvstrategies/` because that is the lowest layer with an op (attention); the engine
registers its own ops into the same registry.

The fallback rule (docs/kernels.md): an implementation that raises is switched to the next
implementation of its op and the call is re-run there, so the caller still gets a correct answer
(unless it raised `NotMine`: the failure is the call's, its error goes to the caller as it is).
With `BreakerSettings.switch_slow` (off by default, so that one command on one machine always
computes with the same kernels and gives the same numbers), an implementation whose latency over a
window (median of `window` timed calls, each divided by its budget for that shape) exceeds its
budget by more than `tolerance` (15%) is switched the same way (its own answer is still returned),
unless the next implementation's own budget for that shape is slower still. A switch for slowness
is a trial: the next implementation's first window is timed against the slow one's budgets, and if
it is not faster than the slow one was by more than `tolerance` (a machine-wide slowdown: another
process on the cores, a throttled chip), the slow one is put back at once and its budgets are
scaled to the pace it ran at (counted as a `rebase`): a busy machine is no reason to run a slower
kernel. The budget is the implementation's own median latency over its first `calibration` timed
calls of each shape bucket (after one warm-up call): measured when the model first runs, at load or
warm-up. Each transition is logged once and counted. After `cooldown_s` the switched-off
implementation is re-probed: it serves again, timed on every call, and is restored after a window
back within budget (or switched off again). The last implementation (the reference) is never
switched off: if it raises, the error goes to the caller, and the implementations that raised on
the same call before it are put back (the call was at fault, not they).

Timing is injectable (`clock`) so tests never read the wall clock. Overhead, measured with a
micro-benchmark (200,000 calls of a no-op through a healthy breaker against direct calls, 2
cores, Python 3.11): about 0.25 us per call (one counter and one branch; one call in `every`,
16, is timed with two clock reads). A SmolLM2 decode step makes about 250 op calls, so the
breaker adds about 0.06 ms to a 20-40 ms step (0.2-0.3%).

NOTE: not thread-safe: the engine runs every op on its one compute thread (engine.compute).
On CUDA the timed calls synchronize the device first, so latency is the kernel's, not its launch;
while a CUDA graph is being captured (engine.graphs) no call is timed.
"""

from __future__ import annotations

import logging
import statistics
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)


class Implementation(ABC):
    """One way to compute one op. `devices` are the torch device types it is registered for
    ("*": any, for a reference written in plain torch)."""

    op: str = ""
    name: str = ""
    devices: tuple[str, ...] = ("cpu",)

    def available(self, device: torch.device, owner: Any = None) -> str | None:
        """None when `device` (and `owner`, e.g. the strategy with its compiled kernel) offers
        this implementation, else the reason it does not."""
        return None

    @abstractmethod
    def __call__(self, *args: Any) -> Any:
        """Compute the op."""


class NotMine(Exception):
    """Raised by an implementation for a failure that is the call's, not its own (the KV cache it
    called into refused, say): the breaker re-raises `error` to the caller and switches nothing
    (running the call again on the next implementation would repeat what the first one did
    before the failure)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class FnImplementation(Implementation):
    """An implementation made of a plain function (and an optional availability check)."""

    def __init__(
        self,
        op: str,
        name: str,
        fn: Callable[..., Any],
        devices: Sequence[str] = ("cpu",),
        available: Callable[[torch.device, Any], str | None] | None = None,
    ) -> None:
        self.op, self.name, self.fn, self.devices = op, name, fn, tuple(devices)
        self._available = available
        self.__call__ = fn  # type: ignore[method-assign]  # no extra frame per call

    def available(self, device: torch.device, owner: Any = None) -> str | None:
        return None if self._available is None else self._available(device, owner)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


# op -> [(preference, order registered, implementation)], lower preference first.
_REGISTRY: dict[str, list[tuple[int, int, Implementation]]] = {}
# op -> the name of its reference implementation (the one every other must agree with).
_REFERENCE: dict[str, str] = {}


def register(impl: Implementation, preference: int = 100, reference: bool = False) -> None:
    """Add `impl` to its op's entries (lower `preference` is tried first; the reference entry
    must be available on every device it lists and is what tests compare the others with)."""
    if not impl.op or not impl.name:
        raise ValueError(f"an implementation needs an op and a name, got {impl.op!r}/{impl.name!r}")
    entries = _REGISTRY.setdefault(impl.op, [])
    if any(e[2].name == impl.name for e in entries):
        raise ValueError(f"op {impl.op!r} already has an implementation named {impl.name!r}")
    entries.append((preference, len(entries), impl))
    entries.sort(key=lambda e: e[:2])
    if reference:
        _REFERENCE[impl.op] = impl.name


def ops() -> list[str]:
    """Every op with a registered implementation."""
    return sorted(_REGISTRY)


def implementations(op: str, device_type: str | None = None) -> list[Implementation]:
    """The entries of `op` in preference order (only those for `device_type`, if given)."""
    if op not in _REGISTRY:
        raise ValueError(f"unknown op {op!r}; registered: {', '.join(ops())}")
    return [
        e[2]
        for e in _REGISTRY[op]
        if device_type is None or device_type in e[2].devices or "*" in e[2].devices
    ]


def reference(op: str) -> Implementation:
    """The reference entry of `op`."""
    name = _REFERENCE.get(op)
    impl = next((i for i in implementations(op) if i.name == name), None)
    if impl is None:
        raise RuntimeError(f"op {op!r} has no reference implementation")
    return impl


def choose(op: str, device: torch.device | str, owner: Any = None) -> tuple[list, dict]:
    """(the entries of `op` this device and build offer, in preference order; the reasons the
    others are left out, by name). Raises if none is available."""
    device = torch.device(device)
    chosen, skipped = [], {}
    for impl in implementations(op, device.type):
        reason = impl.available(device, owner)
        if reason is None:
            chosen.append(impl)
        else:
            skipped[impl.name] = reason
    if not chosen:
        raise RuntimeError(f"no implementation of {op!r} runs on {device} ({skipped or 'none'})")
    return chosen, skipped


def shape_key(args: tuple) -> tuple:
    """The default latency bucket of a call: each tensor's shape with its first dimension
    rounded up to a power of two; other arguments by identity (e.g. a weight object)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((1 << max(a.shape[0] - 1, 0).bit_length(), *a.shape[1:]) if a.dim() else ())
        elif isinstance(a, int | float | str | bool) or a is None:
            key.append(a)
        else:
            key.append(id(a))
    return tuple(key)


# Shape keys a breaker remembers per implementation (budgets, and calibration samples). Attention
# calls key on the sequence's length, so a server meets new keys for as long as it runs: the
# oldest are forgotten (issue 31's soak: unbounded, these maps grew the process ~1 GiB an hour).
MAX_KEYS = 256

# Bumped whenever any breaker changes the implementation it serves with: a caller that built
# something for the implementations active at one moment (engine/fused.py's description of the
# layers for one native call) checks this one number instead of every breaker, per step.
_switches = 0


def switches() -> int:
    """How many times any breaker has changed its serving implementation so far."""
    return _switches


def _bound(d: dict) -> None:
    """Forget `d`'s oldest entries beyond MAX_KEYS (dicts keep insertion order)."""
    while len(d) > MAX_KEYS:
        del d[next(iter(d))]


@dataclass(slots=True)
class BreakerSettings:
    """How a breaker times and judges (defaults for serving; tests shrink them)."""

    every: int = 16  # time one call in this many (the others run untimed)
    window: int = 16  # timed calls judged together
    calibration: int = 5  # timed calls (after one warm-up) that set a shape's budget
    tolerance: float = 0.15  # slower than budget by more than this: switched off
    cooldown_s: float = 30.0  # switched off this long before it is re-probed
    # Switch an implementation off for running slow (not only for raising). Off by default:
    # entries differ in their last bits (sum order, activation rounding), so a switch made
    # because the machine was busy at that moment would make the same command give other
    # numbers on another run. With it off, the choice is a function of the machine, the build
    # and the config alone.
    switch_slow: bool = False

    def __post_init__(self) -> None:
        if self.every < 1 or self.window < 1 or self.calibration < 1:
            raise ValueError(f"every, window and calibration must be >= 1, got {self}")
        if self.tolerance < 0 or self.cooldown_s < 0:
            raise ValueError(f"tolerance and cooldown_s must be >= 0, got {self}")


@dataclass(slots=True)
class _State:
    """What a breaker knows of one implementation."""

    impl: Implementation
    budgets: dict = field(default_factory=dict)  # shape key -> seconds (median at calibration)
    samples: dict = field(default_factory=dict)  # shape key -> calibration samples so far
    window: deque = field(default_factory=deque)  # latency / budget of the last timed calls
    open_until: float | None = None  # switched off until then (None: in service)
    probing: bool = False
    fallbacks: int = 0  # times switched off
    restores: int = 0
    rebases: int = 0  # times put back because the next was no faster (budgets scaled)
    failures: int = 0  # calls that raised
    reason: str = ""  # why it was last switched off


class Breaker:
    """Dispatch one op to the first healthy implementation of a preference-ordered list."""

    def __init__(
        self,
        op: str,
        impls: Sequence[Implementation],
        settings: BreakerSettings | None = None,
        clock: Callable[[], float] = time.perf_counter,
        key: Callable[[tuple], tuple] = shape_key,
        device: torch.device | str = "cpu",
    ) -> None:
        if not impls:
            raise ValueError(f"op {op!r}: a breaker needs at least one implementation")
        self.op, self._clock, self._key = op, clock, key
        self.settings = settings or BreakerSettings()
        self._states = [_State(i) for i in impls]
        for s in self._states:
            s.window = deque(maxlen=self.settings.window)
        self._sync = torch.device(device).type == "cuda"
        self._active = 0
        self._fn = impls[0].__call__
        self._countdown = self.settings.every
        self._degraded = False  # some implementation is switched off or on probation
        # A switch for slowness on trial: (slow implementation, its slow ratio, the next's
        # latencies over the slow one's budgets).
        self._trial: tuple[int, float, list[float]] | None = None

    @property
    def active(self) -> Implementation:
        """The implementation serving now."""
        return self._states[self._active].impl

    def __call__(self, *args: Any) -> Any:
        n = self._countdown - 1
        if n and not self._degraded:  # the fast path: untimed, one counter and one branch
            self._countdown = n
            try:
                return self._fn(*args)
            except Exception as e:
                return self._failed(self._active, e, args)
        self._countdown = self.settings.every
        return self._timed(args)

    def _timed(self, args: tuple) -> Any:
        self._select()
        i = self._active
        if self._sync and torch.cuda.is_current_stream_capturing():
            # inside a CUDA graph's capture (engine.graphs) nothing may synchronize, and the
            # clock would time the recording, not the kernels: the call is served untimed
            try:
                return self._fn(*args)
            except Exception as e:
                return self._failed(i, e, args)
        if self._sync:
            torch.cuda.synchronize()
        t0 = self._clock()
        try:
            out = self._fn(*args)
        except Exception as e:
            return self._failed(i, e, args)
        if self._sync:
            torch.cuda.synchronize()
        self._observe(i, self._key(args), self._clock() - t0)
        return out

    def _select(self) -> None:
        """Serve from the first implementation in service, or one whose cool-down is over."""
        if not self._degraded:
            return
        now = self._clock()
        for i, s in enumerate(self._states):
            if s.open_until is not None and now >= s.open_until:
                s.open_until, s.probing = None, True
                s.window.clear()
                log.info("operator %s: re-probing %s after its cool-down", self.op, s.impl.name)
            if s.open_until is None:
                self._use(i)
                break
        self._degraded = any(s.open_until is not None or s.probing for s in self._states)

    def _use(self, i: int) -> None:
        global _switches
        if i != self._active:
            _switches += 1
        self._active, self._fn = i, self._states[i].impl.__call__

    def _observe(self, i: int, key: tuple, dt: float) -> None:
        s, cfg = self._states[i], self.settings
        if self._trial is not None and self._judge_trial(i, key, dt):
            return
        budget = s.budgets.get(key)
        if budget is None:
            got = s.samples.get(key)
            if got is None:
                got = s.samples[key] = []
                _bound(s.samples)
            got.append(dt)
            if len(got) > cfg.calibration:  # the first is a warm-up (lazy packing, caches)
                s.budgets[key] = statistics.median(got[1:])
                del s.samples[key]
                _bound(s.budgets)
            return
        s.window.append(dt / budget if budget > 0 else 1.0)
        if len(s.window) < cfg.window:
            return
        ratio = statistics.median(s.window)
        if not cfg.switch_slow:  # a slow call is no reason to switch: only failures are
            s.window.clear()
            if s.probing:  # re-probed after raising, and a window went through: restored
                self._restore(s, ratio)
            return
        slower_next = ratio > 1 + cfg.tolerance and self._next_is_slower(i, key, ratio * budget)
        if ratio > 1 + cfg.tolerance and not slower_next:
            why = f"{ratio:.2f}x its calibrated latency over {cfg.window} calls"
            if self._switch_off(i, why, trial=True):
                self._trial = (i, ratio, [])
            return
        s.window.clear()  # judged: the next window starts afresh
        if s.probing:  # within budget, or slow but still faster than the next: back in service
            self._restore(s, ratio)

    def _restore(self, s: _State, ratio: float) -> None:
        s.probing = False
        s.restores += 1
        self._degraded = any(t.open_until is not None or t.probing for t in self._states)
        log.warning("operator %s: %s restored (%.2fx its budget)", self.op, s.impl.name, ratio)

    def _judge_trial(self, j: int, key: tuple, dt: float) -> bool:
        """Time the implementation j that replaced a slow one against the slow one's budgets;
        after a window, put the slow one back if j is no faster. True when the trial ended."""
        slow, ratio, seen = self._trial
        if j == slow:
            self._trial = None
            return False
        budget = self._states[slow].budgets.get(key)
        if budget is None or key in self._states[j].samples:  # no yardstick, or j's warm-up
            return False
        seen.append(dt / budget)
        if len(seen) < self.settings.window:
            return False
        self._trial = None
        mine = statistics.median(seen)
        # The switch stands only if the next is faster than the slow one was by more than the
        # tolerance: on a busy machine both run slow, and a next implementation of another
        # numeric class (e.g. bf16 activations after gemv.c's float32) must not win by noise.
        if mine * (1 + self.settings.tolerance) < ratio:
            slow_impl = self._states[slow]
            log.warning(
                "operator %s: %s switched off (%s); %s is faster (%.2fx of its budget)",
                self.op, slow_impl.impl.name, slow_impl.reason, self._states[j].impl.name, mine,
            )  # fmt: skip
            return False
        s = self._states[slow]
        s.open_until, s.probing, s.reason = None, False, ""
        s.rebases += 1
        s.budgets = {k: b * ratio for k, b in s.budgets.items()}
        s.window.clear()
        self._degraded = any(t.open_until is not None or t.probing for t in self._states)
        self._use(slow)
        log.info(
            "operator %s: %s is no faster (%.2fx of %s's budget, %s ran at %.2fx): %s is back, "
            "its budgets scaled to the machine's pace",
            self.op, self._states[j].impl.name, mine, s.impl.name, s.impl.name, ratio, s.impl.name,
        )  # fmt: skip
        return True

    def _next_is_slower(self, i: int, key: tuple, latency: float) -> bool:
        """Whether the implementation a slow i would hand over to is known (by its own budget
        for this shape) to take longer than i takes now: a machine-wide slowdown is no reason
        to switch to a slower kernel."""
        nxt = next((t for t in self._states[i + 1 :] if t.open_until is None), None)
        budget = None if nxt is None else nxt.budgets.get(key)
        return budget is not None and budget >= latency

    def _switch_off(self, i: int, reason: str, trial: bool = False) -> bool:
        """Take implementation i out of service (False if it is the last one). A switch on
        trial (for slowness) is logged at INFO: a busy machine trips it, and the trial undoes
        it; it is logged as a warning once the trial confirms it (`_judge_trial`)."""
        s = self._states[i]
        if i == len(self._states) - 1:
            return False
        s.open_until = self._clock() + self.settings.cooldown_s
        s.probing, s.reason = False, reason
        s.fallbacks += 1
        s.window.clear()
        self._degraded = True
        nxt = next(j for j in range(i + 1, len(self._states)) if self._states[j].open_until is None)
        self._use(nxt)
        log.log(
            logging.INFO if trial else logging.WARNING,
            "operator %s: %s switched off (%s)%s; using %s", self.op, s.impl.name, reason,
            ", on trial" if trial else "", self._states[nxt].impl.name,
        )  # fmt: skip
        return True

    def _failed(self, i: int, e: Exception, args: tuple) -> Any:
        """Implementation i raised on `args`: switch it off and re-run the call on the next.
        If every later implementation raises too (the reference included), the arguments are
        at fault, not i: i is put back as it was and the reference's error goes to the caller
        (one bad call, say a position past the model's RoPE table, must not switch a kernel
        off for every later call)."""
        if isinstance(e, NotMine):
            raise e.error
        s = self._states[i]
        before = (s.open_until, s.probing, s.reason, s.fallbacks, self._degraded, self._active)
        s.failures += 1
        if not self._switch_off(i, f"raised {type(e).__name__}: {e}"):
            raise e
        try:
            return self._timed(args)
        except Exception:
            s.open_until, s.probing, s.reason, s.fallbacks, self._degraded, active = before
            s.failures -= 1
            self._use(active)
            log.info("operator %s: every implementation refused the call (%s raised %s: %s); "
                     "%s kept in service", self.op, s.impl.name, type(e).__name__, e,
                     s.impl.name)  # fmt: skip
            raise

    def report(self) -> dict:
        """The active implementation, the candidates, and each one's fallback counts."""
        out: dict[str, Any] = {
            "active": self.active.name,
            "candidates": [s.impl.name for s in self._states],
            "fallbacks": sum(s.fallbacks for s in self._states),
            "restores": sum(s.restores for s in self._states),
            "rebases": sum(s.rebases for s in self._states),
        }
        off = [s for s in self._states if s.open_until is not None]
        if off:
            out["switched_off"] = {s.impl.name: s.reason for s in off}
        # A health problem is an implementation that failed; one switched off for being slower
        # than a faster alternative is the registry adapting (reported above, counted, logged),
        # and on a busy machine would keep the health view yellow for nothing.
        broken = [s for s in off if s.reason.startswith("raised")]
        if broken:
            out["problem"] = f"operator {self.op}: " + "; ".join(
                f"{s.impl.name} switched off ({s.reason}), using {self.active.name}" for s in broken
            )
        return out


class OperatorSet:
    """The breakers of one owner (a model, a KV strategy) on one device, built on first use."""

    def __init__(
        self,
        device: torch.device | str = "cpu",
        owner: Any = None,
        settings: BreakerSettings | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.device, self.owner = torch.device(device), owner
        self.settings, self.clock = settings, clock
        self._breakers: dict[str, Breaker] = {}
        self.skipped: dict[str, dict[str, str]] = {}

    def __getitem__(self, op: str) -> Breaker:
        b = self._breakers.get(op)
        if b is None:
            impls, self.skipped[op] = choose(op, self.device, self.owner)
            b = self._breakers[op] = Breaker(
                op, impls, self.settings, self.clock, device=self.device
            )
        return b

    def serving(self) -> dict[str, str]:
        """Per op built so far: the name of the implementation serving it now."""
        return {op: b.active.name for op, b in self._breakers.items()}

    def report(self) -> dict:
        """Per op: the active implementation, the candidates, fallback counts (and the ones
        this device or build does not offer, with why)."""
        out = {}
        for op, b in sorted(self._breakers.items()):
            out[op] = b.report()
            if self.skipped.get(op):
                out[op]["unavailable"] = dict(self.skipped[op])
        return out

    def problems(self) -> list[str]:
        """One sentence per op that runs on a fallback now (for the health view)."""
        return [r["problem"] for r in self.report().values() if "problem" in r]


def summary(report: dict) -> str:
    """One line of a kernels report: "op=impl, ..." with the switched-off ones marked."""
    parts = []
    for op, r in sorted(report.items()):
        mark = f" (fallback, {r['fallbacks']}x)" if "switched_off" in r else ""
        parts.append(f"{op}={r['active']}{mark}")
    return ", ".join(parts)
