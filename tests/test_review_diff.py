"""Review of the changes after af2e2f5: a refused commit re-opening its update, pending rewinds, the nan= checks of
ingest(), steps lost to damage in a rank file, drop_ingested(). One regression test per defect found."""

from __future__ import annotations

import math

import pytest

from metricbus import Agg, MetricBus
from metricbus.errors import MetricValueError, SpecError, StepError


def _declared_error(value: float) -> object:
    """A worker's export of 'a' declared Agg('mean', nan='error')."""
    worker = MetricBus(dist=None)
    worker.log("a", value, agg=Agg("mean", nan="error"))
    part = worker.export()
    worker.close()
    return part


def test_a_declared_policy_takes_the_drivers_finite_records_however_many_were_logged() -> None:
    """3 finite records buffered on the driver took a worker's nan='error'; 300 (folded into a summary at 256) were
    refused with SpecError 'already reduced here', as were 2 split by end_update() or kept by a refused commit:
    finite summaries fit any policy (a summary holding a NaN still cannot be checked or dropped)."""
    driver = MetricBus(dist=None)
    driver.log("a", [2.0] * 300)
    driver.ingest([_declared_error(1.0)])
    assert driver.commit(0) == {"a": (300 * 2.0 + 1.0) / 301}
    driver.log("a", 2.0)
    driver.close()

    driver = MetricBus(dist=None)
    driver.log("b", 0.0)
    driver.commit(0)
    driver.log({"a": 2.0, "b": 1.0})
    with pytest.raises(StepError):
        driver.commit(0)  # 'b' is at step 0 already: refused, its records put back (reduced)
    driver.log("a", 4.0)
    driver.end_update()
    driver.ingest([_declared_error(1.0)])
    assert driver.commit(1) == {"a": (2.0 + 4.0 + 1.0) / 3, "b": 1.0}
    with pytest.raises(MetricValueError, match="non-finite"):
        driver.log("a", math.nan)  # the adopted policy applies from now on
    driver.close()


def test_a_declared_policy_still_refuses_the_drivers_reduced_nan() -> None:
    """A NaN already in a summary: nan='error' is a MetricValueError, nan='ignore' a SpecError (it cannot drop it)."""
    for declared, error in (("error", MetricValueError), ("ignore", SpecError)):
        driver = MetricBus(dist=None)
        driver.log("a", [math.nan] + [2.0] * 299)
        worker = MetricBus(dist=None)
        worker.log("a", 1.0, agg=Agg("mean", nan=declared))  # type: ignore[arg-type]
        part = worker.export()
        worker.close()
        with pytest.raises(error):
            driver.ingest([part])
        assert math.isnan(driver.commit(0)["a"])
        driver.close()
