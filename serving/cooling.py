"""The cooling rule: when a replica enters and leaves a cooling window, from its readings.

What lives here: `Cooling`, one replica's state machine over its temperature readings. What
does not: reading a sensor (`serving.sensors`), what cooling does to a replica (no new
requests, its queue finishes at half the batch size: the deployment and the router), the
options' validation (`settings.config.ThermalOptions`).

The rule, with `limit` the chip profile's `thermal_throttle_c`:

- `readings` consecutive readings at or above `limit - margin_c` start a cooling window (the
  `readings`-th of them is the "enter");
- while cooling, the first reading below `limit - hysteresis_c` ends it ("leave"); readings
  between the two thresholds keep the replica cooling, so it cannot flap at one temperature;
- a None reading (the sensor failed) changes nothing: it neither breaks nor extends a streak
  and neither starts nor ends a window. NOTE: a sensor that fails now and then must not reset
  a streak that is heading for the limit, nor count as a hot reading it never made; and a
  replica that loses its sensor while cooling stays cooling until a real reading says it
  cooled down (the failure is logged by the sensor).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from unikv.settings.config import ThermalOptions

log = logging.getLogger("unikv.cooling")

ENTER, LEAVE = "enter", "leave"


class Cooling:
    """One replica's cooling window: `observe` each reading, read `cooling`.

    Not thread-safe: one poll loop per replica calls `observe`.
    """

    def __init__(
        self,
        limit_c: float,
        margin_c: float = 3.0,
        readings: int = 3,
        hysteresis_c: float = 5.0,
        name: str = "replica",
    ) -> None:
        for key, value in (("limit_c", limit_c), ("margin_c", margin_c),
                           ("hysteresis_c", hysteresis_c)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"Cooling: {key} = {value!r}: expected degrees Celsius")
            if not math.isfinite(value) or (key != "limit_c" and value < 0):
                raise ValueError(f"Cooling: {key} = {value!r}: expected finite degrees >= 0")
        if isinstance(readings, bool) or not isinstance(readings, int) or readings < 1:
            raise ValueError(f"Cooling: readings = {readings!r}: expected an integer >= 1")
        if hysteresis_c < margin_c:
            # Same invariant as ThermalOptions: leaving above the entry threshold would let one
            # temperature leave and re-enter.
            raise ValueError(
                f"Cooling: hysteresis_c = {hysteresis_c:g} is below margin_c = {margin_c:g}: "
                "the replica would flap in and out of cooling"
            )
        self.limit_c = float(limit_c)
        self.margin_c = float(margin_c)
        self.readings = readings
        self.hysteresis_c = float(hysteresis_c)
        self.name = name
        self._cooling = False
        self._streak = 0  # consecutive readings >= enter_c while not cooling
        self._temperature: float | None = None
        self._transitions = {ENTER: 0, LEAVE: 0}

    @classmethod
    def from_options(
        cls, limit_c: float, options: ThermalOptions, name: str = "replica"
    ) -> Cooling:
        """A Cooling for a chip's `thermal_throttle_c` with a config's `[thermal]` options."""
        return cls(limit_c, options.margin_c, options.readings, options.hysteresis_c, name)

    @property
    def enter_c(self) -> float:
        """Readings at or above this count towards a cooling window."""
        return self.limit_c - self.margin_c

    @property
    def leave_c(self) -> float:
        """While cooling, a reading below this ends the window."""
        return self.limit_c - self.hysteresis_c

    @property
    def cooling(self) -> bool:
        """True inside a cooling window."""
        return self._cooling

    @property
    def temperature(self) -> float | None:
        """The last reading in °C (None readings do not replace it), None before the first."""
        return self._temperature

    @property
    def transitions(self) -> dict[str, int]:
        """How many windows started and ended: {"enter": n, "leave": n} (a copy)."""
        return dict(self._transitions)

    def observe(self, temp: float | None) -> str | None:
        """Take one reading: "enter" if it starts a cooling window, "leave" if it ends one,
        else None. A None reading changes nothing (see the module docstring)."""
        if temp is None:
            return None
        self._temperature = float(temp)
        if not self._cooling:
            if temp < self.enter_c:
                self._streak = 0
                return None
            self._streak += 1
            if self._streak < self.readings:
                return None
            self._cooling, self._streak = True, 0
            self._transitions[ENTER] += 1
            log.warning(
                "%s: entering a cooling window at %.1f °C: %d readings at or above %.1f °C "
                "(limit %.1f °C, margin %.1f °C); no new requests, half batch size",
                self.name, temp, self.readings, self.enter_c, self.limit_c, self.margin_c,
            )  # fmt: skip
            return ENTER
        if temp >= self.leave_c:
            return None
        self._cooling = False
        self._transitions[LEAVE] += 1
        log.info(
            "%s: leaving the cooling window at %.1f °C (below %.1f °C: limit %.1f - hysteresis "
            "%.1f)", self.name, temp, self.leave_c, self.limit_c, self.hysteresis_c,
        )  # fmt: skip
        return LEAVE
