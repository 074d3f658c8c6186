"""Review of the verl and Ray paths: regressions for what a verl user on Ray ran into."""

from __future__ import annotations

import math
from typing import Any

import pytest

from metricbus import MetricBus
from metricbus.integrations.ray import gather_partials

TIMEOUT_S = 120


def _partial(value: float) -> Any:
    bus = MetricBus(dist=None)
    bus.log("actor/pg_loss", value)
    part = bus.export()
    bus.close()
    return part


@pytest.mark.parametrize("timeout_s", [math.inf, 1e300, 1e18])
def test_gather_partials_with_an_unbounded_timeout_waits_without_overflow(ray_cluster: Any, timeout_s: float) -> None:
    """timeout_s=math.inf (or any wait Ray cannot express in int64 ms) means no bound, not Ray's OverflowError."""
    part = _partial(1.5)
    ref = ray_cluster.put(part)
    assert gather_partials({"actor_0": ref}, timeout_s=timeout_s) == [part]


def test_gather_partials_refuses_a_boolean_timeout() -> None:
    """timeout_s=True is not one second: it is refused like any other value that is no number of seconds."""
    with pytest.raises(ValueError, match=r"timeout_s=True; use a number of seconds >= 0, or None"):
        gather_partials([_partial(1.0)], timeout_s=True)
