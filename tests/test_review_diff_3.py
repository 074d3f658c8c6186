"""Review of the diff 6550ff0..2b59382: Decimal values past the decimal context, request_timeout_s checked
where the Lightning integrations build their bus, and sync naming the rejected steps of an adapter that then failed."""

from __future__ import annotations

import decimal
import math
from decimal import Decimal
from typing import Any

import numpy as np
import pytest

from metricbus import MetricBus
from metricbus.errors import MetricValueError
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
