"""The mapping an adapter's ``write`` receives (``metricbus.step_metrics.StepMetrics``): shared by every adapter,
read-only, copied and pickled as a plain dict."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from metricbus import MetricBus
from metricbus.step_metrics import StepMetrics
from metricbus.testing import MemoryAdapter

CHANGES: list[Callable[[Any], object]] = [
    lambda m: m.__setitem__("x", 1.0),
    lambda m: m.__delitem__("a"),
    lambda m: m.clear(),
    lambda m: m.pop("a"),
    lambda m: m.popitem(),
    lambda m: m.setdefault("x", 1.0),
    lambda m: m.update(x=1.0),
    lambda m: m.__ior__({"x": 1.0}),
]


@pytest.mark.parametrize("change", CHANGES)
def test_every_change_is_refused_and_changes_nothing(change: Callable[[Any], object]) -> None:
    metrics = StepMetrics({"a": 1.0, "b": 2.0})
    with pytest.raises(TypeError, match=r"read-only: copy them with dict\(metrics\)"):
        change(metrics)
    assert metrics == {"a": 1.0, "b": 2.0}


def test_copies_and_pickles_are_plain_dicts_that_change() -> None:
    metrics = StepMetrics({"a": 1.0})
    for other in (dict(metrics), metrics.copy(), copy.copy(metrics), pickle.loads(pickle.dumps(metrics)), metrics | {}):
        assert type(other) is dict
        assert other == {"a": 1.0}
        other["b"] = 2.0


class _Changer(MemoryAdapter):
    """Tries to change the step it is given, keeps what happened."""

    name = "changer"

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[str] = []

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        try:
            metrics["loss"] = -1.0  # type: ignore[index]
        except TypeError as exc:
            self.errors.append(str(exc))
        super().write(step=step, metrics=metrics)


def test_an_adapter_cannot_change_what_another_adapter_receives() -> None:
    changer, other = _Changer(), MemoryAdapter()
    bus = MetricBus(adapters=[changer, other], dist=None, strict=True)
    bus.log("loss", 0.5)
    bus.commit()
    bus.close()
    assert changer.errors
    assert "read-only" in changer.errors[0]
    assert other.rows == [(0, {"loss": 0.5})]
    assert changer.rows == [(0, {"loss": 0.5})]
