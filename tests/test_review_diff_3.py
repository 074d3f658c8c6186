"""Review of the diff 6550ff0..2b59382: Decimal values past the decimal context, request_timeout_s checked
where the Lightning integrations build their bus, and sync naming the rejected steps of an adapter that then failed."""

from __future__ import annotations

import decimal
import math
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metricbus import MetricBus
from metricbus.errors import ConfigError, MetricValueError
from metricbus.testing import MemoryAdapter

# -- Decimal values whose arithmetic the decimal context would trap ----------------------------------------------


def _logged(value: Any, weight: Any = None) -> tuple[BaseException | None, list[tuple[int, dict[str, float]]]]:
    """Log ``value`` as 'm' after 'before' (1.0); the error raised (or None) and the committed rows."""
    memory = MemoryAdapter()
    raised = None
    with MetricBus(dist=None, adapters=[memory]) as bus:
        bus.log("before", 1.0)
        try:
            bus.log("m", value, weight=weight)
        except Exception as exc:  # the test reads it
            raised = exc
        bus.commit(step=0)
    return raised, memory.rows


@pytest.mark.parametrize(
    ("value", "weight"),
    [
        (Decimal("1e9999999"), None),
        (Decimal("-1e99999999999"), None),
        ([1.0, Decimal("1e9999999")], None),
        (np.array([Decimal("2"), Decimal("-1e9999999")], dtype=object), None),
        (1.0, Decimal("1e9999999")),
        ([1.0, 2.0], [Decimal("1"), Decimal("1e9999999")]),
    ],
)
def test_decimal_beyond_the_context_exponent_is_a_metric_value_error(value: Any, weight: Any) -> None:
    """A Decimal past the context's Emax: MetricValueError naming the metric (not decimal.Overflow); 'before' kept."""
    raised, rows = _logged(value, weight)
    assert isinstance(raised, MetricValueError), raised
    assert "'m'" in str(raised)
    assert "beyond the double range" in str(raised)
    assert rows == [(0, {"before": 1.0})]


def test_decimal_under_a_trapping_context_is_its_nearest_double_or_refused() -> None:
    """Inexact/FloatOperation trapped, prec 3: Decimal('1.23456789') logs 1.23456789; 1.23456789e400 refused by name."""
    with decimal.localcontext() as ctx:
        ctx.prec = 3
        ctx.traps[decimal.Inexact] = True
        ctx.traps[decimal.FloatOperation] = True
        raised, rows = _logged(Decimal("1.23456789"), Decimal("0.5"))
        assert raised is None
        assert rows == [(0, {"before": 1.0, "m": 1.23456789})]
        raised, rows = _logged([Decimal("1.23456789e400")])
        assert isinstance(raised, MetricValueError)
        assert "'m'" in str(raised)
        assert rows == [(0, {"before": 1.0})]
        raised, rows = _logged(Decimal("-Infinity"))
        assert raised is None
        assert rows == [(0, {"before": 1.0, "m": -math.inf})]


# -- request_timeout_s: refused where the bus options are checked, not only where the bus is built -----------------


class _Timed(MemoryAdapter):
    """A memory adapter exposing a ``request_timeout_s``."""

    name = "timed"

    def __init__(self, request_timeout_s: Any) -> None:
        super().__init__()
        self.request_timeout_s = request_timeout_s


@pytest.mark.parametrize(
    ("limit", "shown"), [(math.nan, "nan"), (10**400, "inf"), (30, "30")], ids=["nan", "huge-int", "equal"]
)
def test_a_request_timeout_that_is_not_below_write_timeout_is_refused_nan_and_huge_ints_too(
    limit: Any, shown: str
) -> None:
    """NaN, an int beyond the double range, or equal: a ConfigError naming the adapter (not OverflowError)."""
    with pytest.raises(ConfigError, match=rf"adapters\[0\] \(timed\): request_timeout_s={shown} s must be below"):
        MetricBus(dist=None, adapters=[_Timed(limit)])


@pytest.mark.parametrize("limit", [None, "60", 29.5])
def test_a_request_timeout_below_or_not_a_number_is_left_to_the_adapter(limit: Any) -> None:
    """None, a string, or below write_timeout_s: the bus builds."""
    MetricBus(dist=None, adapters=[_Timed(limit)]).close()


def test_lightning_callback_and_logger_refuse_a_request_timeout_at_construction(tmp_path: Path) -> None:
    """MetricBusCallback/MetricBusLogger: refused when constructed (object or spec), not at setup or mid-fit."""
    pytest.importorskip("mlflow")
    pytest.importorskip("pytorch_lightning")
    from metricbus.adapters.mlflow import MlflowAdapter

    from metricbus.integrations.lightning import MetricBusCallback, MetricBusLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    built = MlflowAdapter(tracking_uri=uri, request_timeout_s=60)
    spec = {"type": "mlflow", "tracking_uri": uri, "request_timeout_s": 60}
    for adapter in (built, spec):
        for integration in (MetricBusCallback, MetricBusLogger):
            with pytest.raises(ConfigError, match=r"request_timeout_s=60 s must be below the bus's write_timeout_s"):
                integration(adapters=[adapter])
    MetricBusLogger(adapters=[MlflowAdapter(tracking_uri=uri, request_timeout_s=5)])  # below: constructed
    assert not (tmp_path / "mlflow.db").exists()
