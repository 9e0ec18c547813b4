"""``AIKG_TEST_TIME_SCALE``: one factor for every deadline the tests wait under."""

from __future__ import annotations

import pytest

from tests.helpers import TIME_SCALE, _time_scale, scaled


@pytest.mark.parametrize(("raw", "factor"), [(None, 1.0), ("", 1.0), (" 2 ", 2.0), ("0.5", 0.5)])
def test_the_factor_is_read_as_a_positive_number(raw: str | None, factor: float) -> None:
    assert _time_scale(raw) == factor


@pytest.mark.parametrize("raw", ["fast", "0", "-1", "nan", "inf"])
def test_a_bad_factor_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match="AIKG_TEST_TIME_SCALE"):
        _time_scale(raw)


def test_the_ini_timeout_is_scaled(request: pytest.FixtureRequest) -> None:
    ini = float(request.config.getini("timeout"))
    assert request.node.get_closest_marker("timeout").args[0] == scaled(ini)


@pytest.mark.timeout(40)
def test_a_timeout_mark_is_scaled(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("timeout").args[0] == 40 * TIME_SCALE
