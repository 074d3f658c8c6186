"""ingest() and the nan= policy a metric ends up with: a worker's summary of NaN or ±inf records (kept under
nan='propagate') reaching a name whose policy is 'error' or 'ignore', and a driver's own records logged under another
policy than the one a worker's declaration brings, were reduced silently (the value NaN, no error; found by the
verl/Ray review). Now each is refused, naming the metric and the worker; the rest of the call is ingested."""

from __future__ import annotations

import math

import pytest

from metricbus import Agg, MetricBus
from metricbus.errors import MetricValueError, SpecError


def _export(*values: float, agg: Agg | None = None) -> object:
    worker = MetricBus(dist=None)
    for value in values:
        worker.log("a", value, agg=agg)
    worker.log("b", 1.0)
    part = worker.export()
    worker.close()
    return part


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_record_under_a_drivers_error_policy_is_an_error(bad: float) -> None:
    driver = MetricBus(dist=None, rules={"a": Agg("mean", nan="error")})
    good = _export(2.0)
    with pytest.raises(MetricValueError, match=r"partial 1 of this call: 'a': ingested worker 1's records of 'a' hold"):
        driver.ingest([good, _export(bad, 2.0)])
    # the rest of the call was taken: worker 0 whole, worker 1 without its 'a' (found by the integrations review:
    # one worker's NaN cost every worker's step)
    assert driver.commit(0) == {"a": 2.0, "b": 1.0}
    assert driver.commit(1) == {}
    driver.close()


def test_a_non_finite_record_under_a_drivers_ignore_policy_is_refused() -> None:
    driver = MetricBus(dist=None, rules={"a": Agg("mean", nan="ignore")})
    with pytest.raises(SpecError, match=r"'a' has nan='ignore' here, which cannot drop them"):
        driver.ingest([_export(math.nan, 2.0)])
    driver.close()


def test_workers_that_drop_them_themselves_are_taken() -> None:
    driver = MetricBus(dist=None, rules={"a": Agg("mean", nan="ignore")})
    driver.ingest([_export(math.nan, 2.0, agg=Agg("mean", nan="ignore")), _export(4.0)])
    assert driver.commit(0) == {"a": 3.0, "b": 1.0}
    driver.close()


def test_finite_records_under_another_policy_are_taken() -> None:
    driver = MetricBus(dist=None, rules={"a": Agg("mean", nan="error")})
    driver.ingest([_export(1.0, 2.0)])
    assert driver.commit(0) == {"a": 1.5, "b": 1.0}
    driver.close()


def test_a_declared_error_policy_finds_the_drivers_own_buffered_nan() -> None:
    """The driver's NaN was logged under 'propagate' and is still buffered; a worker declares nan='error' for it."""
    driver = MetricBus(dist=None)
    driver.log("a", math.nan)
    with pytest.raises(MetricValueError, match=r"this bus's own records of it hold a NaN or infinite value"):
        driver.ingest([_export(1.0, agg=Agg("mean", nan="error"))])
    assert math.isnan(driver.commit(0)["a"])  # its own record stays, under its own policy
    driver.close()


def test_a_declared_policy_cannot_reach_the_drivers_records_already_reduced() -> None:
    """300 records (folded into a summary at 256) logged under 'propagate', one NaN among them: a worker's
    nan='ignore' could not drop it any more (before: NaN emitted); a buffered one it drops
    (test_pipeline.py::test_an_adopted_nan_policy_applies_to_this_buses_records)."""
    driver = MetricBus(dist=None)
    driver.log("a", [math.nan, *range(299)])
    with pytest.raises(SpecError, match=r"records of it were already reduced here under nan='propagate'"):
        driver.ingest([_export(1.0, agg=Agg("mean", nan="ignore"))])
    driver.close()


def test_propagate_still_propagates() -> None:
    driver = MetricBus(dist=None)
    driver.ingest([_export(math.nan, 2.0)])
    assert math.isnan(driver.commit(0)["a"])
    driver.close()
