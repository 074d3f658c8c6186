"""Tensors logged on the device: no host sync in log(), exact stats at commit."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from metricbus import MetricBus  # noqa: E402
from metricbus.errors import MetricValueError  # noqa: E402

SYNCS = ("item", "cpu", "tolist", "__float__", "__bool__", "__int__", "numpy")


@pytest.fixture
def no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make every host-sync call on a tensor raise."""

    def fail(*_a: object, **_k: object) -> None:
        raise AssertionError("host sync in log()")

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, fail)
    yield
    monkeypatch.undo()


def test_log_tensors_never_syncs(no_host_sync: None) -> None:
    """log() of 0-d/n-d tensors of many dtypes, tensor and scalar weights, touches no host-sync call."""
    bus = MetricBus(dist=None)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.float64):
        bus.log("x", torch.ones(3, dtype=dtype))
    bus.log("y", torch.tensor(2.0), weight=torch.tensor(3.0))
    bus.log("y", torch.arange(4.0).reshape(2, 2), weight=0.5)
    bus.log("n", torch.tensor([1.0, float("nan")]), agg="max")


def test_tensor_stats_match_host_reference() -> None:
    """Every kind from tensors equals the same records logged as floats."""
    values = [3.0, -1.0, 2.5, 7.0, 0.25, 4.0]
    for kind in ("mean", "sum", "min", "max", "count", "std", "first", "last"):
        dev, host = MetricBus(dist=None), MetricBus(dist=None)
        dev.log("x", torch.tensor(values[:2]), agg=kind)
        dev.log("x", torch.tensor(values[2:]).reshape(2, 2), agg=kind)
        host.log("x", values, agg=kind)
        assert math.isclose(dev.commit()["x"], host.commit()["x"], rel_tol=1e-12), kind


def test_weighted_and_nan() -> None:
    """Tensor weights weigh the mean; NaN propagates into max; ignore masks it."""
    bus = MetricBus(dist=None)
    bus.log("w", torch.tensor([1.0, 3.0]), weight=torch.tensor([3.0, 1.0]))
    bus.log("m", torch.tensor([1.0, float("nan")]), agg="max")
    bus.log("i", torch.tensor([1.0, float("nan"), 3.0]), agg="mean")
    out = bus.commit()
    assert out["w"] == 1.5
    assert math.isnan(out["m"])
    assert math.isnan(out["i"])
    ignore = MetricBus(dist=None, nan="ignore")
    ignore.log("i", torch.tensor([1.0, float("nan"), 3.0]))
    assert ignore.commit()["i"] == 2.0


def test_bad_tensor_weight_raises_at_commit() -> None:
    """A negative tensor weight is reported at commit, naming the metric."""
    bus = MetricBus(dist=None)
    bus.log("w", torch.tensor([1.0]), weight=torch.tensor([-1.0]))
    with pytest.raises(MetricValueError, match="'w'"):
        bus.commit()
