"""Review (second round) of closing and its options: a bad timeout given to an integration is refused where it is
given, not at the end of training."""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning")

from metricbus.errors import ConfigError
from metricbus.integrations.lightning import MetricBusLogger


@pytest.mark.parametrize("option", ["save_timeout_s", "close_timeout_s"])
@pytest.mark.parametrize("value", [-1, math.nan, "5", None, True])
def test_a_bad_logger_timeout_is_refused_at_construction(option: str, value: Any) -> None:
    """MetricBusLogger(close_timeout_s=-1) or (save_timeout_s='5') raises ConfigError naming it, before any fit."""
    with pytest.raises(ConfigError, match=rf"MetricBusLogger\({option}=.*{option} must be a number of seconds >= 0"):
        MetricBusLogger(adapters=[], **{option: value})


@pytest.mark.parametrize("value", [0, 2.5, math.inf])
def test_a_valid_logger_timeout_is_taken(value: float) -> None:
    """0, a float and math.inf (no bound) are valid timeouts of the logger."""
    MetricBusLogger(adapters=[], save_timeout_s=value, close_timeout_s=value)
