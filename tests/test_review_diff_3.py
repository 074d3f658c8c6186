"""Review of the diff 6550ff0..2b59382: Decimal values past the decimal context, request_timeout_s checked
where the Lightning integrations build their bus, and sync naming the rejected steps of an adapter that then failed."""

from __future__ import annotations

import decimal
import math
import warnings
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metricbus import MetricBus
from metricbus import replay as replay_module
from metricbus.errors import AdapterError, ConfigError, MetricValueError
from metricbus.replay import sync
from metricbus.testing import MemoryAdapter
from tests.test_gaps import Picky

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


# -- sync: an adapter stopped by an error after it had rejected steps ----------------------------------------------


class _Backend(Picky):
    """An adapter whose backend rejects some steps for good (ValueError) and is unreachable from ``down_at`` on."""

    name = "flaky"
    cursor_key = "flaky"

    def __init__(self, *, reject: set[int], down_at: int | None) -> None:
        super().__init__(reject=reject)
        self.down_at = down_at

    def write(self, *, step: int, metrics: Any) -> None:
        """Reject ``reject``; fail as a connection lost from ``down_at``; keep the others."""
        if step not in self.reject and self.down_at is not None and step >= self.down_at:
            raise ConnectionError("the backend went away")
        super().write(step=step, metrics=metrics)


def _journal(tmp_path: Path, steps: int) -> str:
    journal = str(tmp_path / "j")
    with MetricBus(dist=None, journal=journal) as bus:
        for step in range(steps):
            bus.log("x", float(step))
            bus.commit(step=step)
    return journal


def test_sync_names_the_rejected_steps_of_an_adapter_an_error_then_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1 rejected, then the backend down at step 3: the AdapterError says both; a later sync sends 1, 3, 4."""
    monkeypatch.setattr(replay_module, "SYNC_RETRY_BASE_S", 0.0)
    journal = _journal(tmp_path, 5)
    flaky = _Backend(reject={1}, down_at=3)
    with pytest.raises(AdapterError) as raised:
        sync(journal, [flaky])
    said = str(raised.value)
    assert "adapter 'flaky' failed (ConnectionError: the backend went away)" in said
    assert "after rejecting step 1 for good (ValueError: the backend rejects step 1), kept as gap" in said
    assert isinstance(raised.value.__cause__, ConnectionError)
    assert [s for s, _ in flaky.rows] == [0, 2]
    assert flaky.status == "failed"
    fixed = _Backend(reject=set(), down_at=None)
    assert sync(journal, [fixed]) == {"flaky": 3}
    assert [s for s, _ in fixed.rows] == [1, 3, 4]


def test_sync_with_one_adapter_stopped_by_an_error_alone_still_raises_that_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No step rejected: the adapter's own ConnectionError, as before."""
    monkeypatch.setattr(replay_module, "SYNC_RETRY_BASE_S", 0.0)
    journal = _journal(tmp_path, 3)
    with pytest.raises(ConnectionError, match="the backend went away"):
        sync(journal, [_Backend(reject=set(), down_at=2)])


# -- std in columns: the near-mean check without its own errstate ---------------------------------------------------


@pytest.mark.parametrize("x", [0.1, 1e160, 1e300, 1.7e308 / 20])
def test_a_constant_metric_summarised_in_columns_has_std_zero_without_a_warning(x: float) -> None:
    """Nine metrics of 20 equal records (one update, in columns), huge ones too: std 0.0, no numpy warning."""
    memory = MemoryAdapter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with MetricBus(dist=None, adapters=[memory], rules={"*": "std"}) as bus:
            for _ in range(20):
                bus.log({f"m{i}": x for i in range(9)})
            bus.commit(step=0)
    assert memory.rows == [(0, {f"m{i}": 0.0 for i in range(9)})]
