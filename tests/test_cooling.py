"""Tests of serving.cooling: the enter/leave sequence on scripted readings, hysteresis, None
readings, the transition counts and logs, and building from [thermal] options."""

from __future__ import annotations

import logging

import pytest

from unikv.serving.cooling import Cooling
from unikv.serving.sensors import ScriptedSensor
from unikv.settings.config import ThermalOptions

pytestmark = pytest.mark.timeout(10)

LIMIT = 80.0  # margin 3: readings >= 77 count; hysteresis 5: cooling ends below 75


def run(cooling: Cooling, readings: list[float | None]) -> list[str | None]:
    return [cooling.observe(t) for t in readings]


def test_two_hot_readings_then_a_cool_one_do_not_cool() -> None:
    c = Cooling(LIMIT)
    assert run(c, [78, 79, 76, 78, 79]) == [None] * 5  # the cool reading reset the streak
    assert not c.cooling and c.transitions == {"enter": 0, "leave": 0}


def test_the_exact_enter_leave_sequence() -> None:
    c = Cooling(LIMIT, name="replica-a")
    # three at limit - margin or above: enter on the third; limit - 4 and limit - 5 stay
    # cooling (not below limit - hysteresis); limit - 5.1 leaves.
    readings = [77, 78, 77.5, LIMIT - 4, LIMIT - 5, LIMIT - 5.1]
    assert run(c, readings) == [None, None, "enter", None, None, "leave"]
    assert not c.cooling and c.temperature == pytest.approx(74.9)
    assert c.transitions == {"enter": 1, "leave": 1}


def test_cooling_state_along_the_way() -> None:
    c = Cooling(LIMIT)
    states = []
    for t in [77, 77, 77, 76, 90, 75, 74.99, 77, 77]:
        c.observe(t)
        states.append(c.cooling)
    assert states == [False, False, True, True, True, True, False, False, False]
    assert c.observe(77) == "enter"  # a fresh streak of three after leaving
    assert c.transitions == {"enter": 2, "leave": 1}


def test_hysteresis_and_readings_settings() -> None:
    c = Cooling(LIMIT, margin_c=1.0, readings=1, hysteresis_c=10.0)
    assert run(c, [78.9, 79, 71, 70.1, 69.9]) == [None, "enter", None, None, "leave"]
    # hysteresis == margin: leaving and entering thresholds meet, still no flapping at one
    # temperature (79 enters, 79 stays, 78.9 leaves).
    c = Cooling(LIMIT, margin_c=1.0, readings=1, hysteresis_c=1.0)
    assert run(c, [79, 79, 78.9, 79]) == ["enter", None, "leave", "enter"]


def test_none_readings_neither_break_nor_extend_a_streak() -> None:
    c = Cooling(LIMIT)
    assert run(c, [78, None, 78, None, None]) == [None] * 5
    assert not c.cooling and c.temperature == 78.0  # None keeps the last reading
    assert c.observe(78) == "enter"  # the third real hot reading
    assert run(c, [None] * 10) == [None] * 10
    assert c.cooling  # a lost sensor does not end a window
    assert c.observe(70) == "leave"
    assert Cooling(LIMIT).temperature is None


def test_transitions_are_a_copy_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    c = Cooling(LIMIT, name="replica-a")
    with caplog.at_level(logging.INFO, logger="unikv.cooling"):
        run(c, [78, 78, 79.5, 70])
    c.transitions["enter"] = 99
    assert c.transitions == {"enter": 1, "leave": 1}
    (enter, leave) = caplog.records
    assert enter.levelno == logging.WARNING and enter.name == "unikv.cooling"
    assert all(
        s in enter.getMessage() for s in ("replica-a", "79.5 °C", "limit 80.0", "margin 3.0")
    )
    assert leave.levelno == logging.INFO and "70.0 °C" in leave.getMessage()


def test_from_options_and_a_scripted_sensor() -> None:
    options = ThermalOptions(margin_c=2.0, readings=2, hysteresis_c=4.0)
    c = Cooling.from_options(85.0, options)
    assert (c.limit_c, c.margin_c, c.readings, c.hysteresis_c) == (85.0, 2.0, 2, 4.0)
    assert (c.enter_c, c.leave_c) == (83.0, 81.0)
    sensor = ScriptedSensor([80, 83, 84, 82, 80.9])
    assert [c.observe(sensor.read()) for _ in range(5)] == [None, None, "enter", None, "leave"]
    assert Cooling.from_options(80, ThermalOptions()).readings == 3


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"limit_c": "hot"}, "limit_c = 'hot'"),
        ({"limit_c": float("nan")}, "limit_c = nan"),
        ({"limit_c": 80, "margin_c": -1}, "margin_c = -1"),
        ({"limit_c": 80, "readings": 0}, "readings = 0"),
        ({"limit_c": 80, "readings": 2.0}, "readings = 2.0"),
        ({"limit_c": 80, "margin_c": 6, "hysteresis_c": 5}, "would flap"),
    ],
)
def test_invalid_settings(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match="Cooling") as exc:
        Cooling(**kwargs)
    assert fragment in str(exc.value)
