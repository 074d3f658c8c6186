"""The rank level through export()/ingest(): rank order, continuation rule, absent workers, errors."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from metricbus import Agg, MetricBus, SpecError
from metricbus.errors import ClosedError, StepError
from metricbus.partial import Partial


def bus(**options: object) -> MetricBus:
    """A strict local bus with no adapters."""
    return MetricBus(dist=None, strict=True, **options)  # type: ignore[arg-type]


def worker_partial(records: dict[str, list[float]], **options: object) -> Partial:
    """A worker bus that logged ``records`` (one log call per value) and exported."""
    w = bus(**options)
    for name, xs in records.items():
        for x in xs:
            w.log(name, x)
    part = w.export()
    w.close()
    return part


def test_export_leaves_the_buffer_empty() -> None:
    """After export(), the worker's next commit has nothing to emit."""
    w = bus()
    w.log("a", 1.0)
    w.export()
    assert w.commit() == {}


def test_partials_are_picklable() -> None:
    """A Partial survives pickling (Ray returns it from a worker)."""
    part = worker_partial({"a": [1.0, 2.0]})
    d = bus()
    d.ingest([pickle.loads(pickle.dumps(part))])
    assert d.commit() == {"a": 1.5}


def test_mean_over_workers_is_the_record_mean() -> None:
    """mean at every level is the mean over all records, however they were split."""
    d = bus()
    d.ingest([worker_partial({"a": [1.0, 2.0, 3.0]}), worker_partial({"a": [10.0]})])
    assert d.commit() == {"a": 4.0}


def test_kind_change_makes_each_worker_one_unit_record() -> None:
    """Agg(micro='sum', rank='mean') is the mean over workers of each worker's sum."""
    rules = {"a": Agg(micro="sum", rank="mean")}
    d = bus(rules=rules)
    d.ingest([worker_partial({"a": [1.0, 2.0, 3.0]}, rules=rules), worker_partial({"a": [10.0]}, rules=rules)])
    assert d.commit() == {"a": 8.0}


def test_max_of_worker_means() -> None:
    """Agg(micro='mean', rank='max') is the largest per-worker mean."""
    rules = {"a": Agg(micro="mean", rank="max")}
    d = bus(rules=rules)
    d.ingest([worker_partial({"a": [1.0, 5.0]}, rules=rules), worker_partial({"a": [4.0]}, rules=rules)])
    assert d.commit() == {"a": 4.0}


def test_worker_without_the_metric_does_not_count() -> None:
    """A worker that did not log a metric is not a zero in the mean over workers."""
    rules = {"a": Agg(micro="sum", rank="mean")}
    d = bus(rules=rules)
    d.ingest([worker_partial({"a": [2.0]}, rules=rules), worker_partial({"b": [1.0]}, rules=rules)])
    assert d.commit() == {"a": 2.0, "b": 1.0}


def test_first_and_last_take_the_lowest_ranked_worker_that_has_them() -> None:
    """first/last across workers come from the lowest-ranked worker with the metric (ingest order)."""
    rules = {"f": "first", "l": "last"}
    d = bus(rules=rules)
    first_worker = worker_partial({"x": [0.0]}, rules=rules)
    d.ingest([first_worker, worker_partial({"f": [5.0, 6.0], "l": [5.0, 6.0]}, rules=rules)])
    d.ingest([worker_partial({"f": [7.0], "l": [7.0]}, rules=rules)])
    assert d.commit() == {"f": 5.0, "l": 6.0, "x": 0.0}


def test_drivers_own_records_rank_last() -> None:
    """The driver's own records count as one more worker, after every ingested partial."""
    rules = {"f": "first", "l": "last"}
    d = bus(rules=rules)
    d.log({"f": 1.0, "l": 1.0})
    d.ingest([worker_partial({"f": [2.0], "l": [2.0, 3.0]}, rules=rules)])
    assert d.commit() == {"f": 2.0, "l": 3.0}


def test_drivers_own_records_count_when_no_worker_has_the_metric() -> None:
    """A metric only the driver logged takes the driver's value."""
    rules = {"l": "last"}
    d = bus(rules=rules)
    d.log("l", [1.0, 4.0])
    d.ingest([worker_partial({"x": [2.0]}, rules=rules)])
    assert d.commit() == {"l": 4.0, "x": 2.0}


def test_driver_records_are_one_more_worker_in_the_rank_mean() -> None:
    """Under Agg(micro='sum', rank='mean'), the driver's own sum is one of the averaged workers."""
    rules = {"a": Agg(micro="sum", rank="mean")}
    d = bus(rules=rules)
    d.log("a", [1.0, 1.0])
    d.ingest([worker_partial({"a": [4.0]}, rules=rules)])
    assert d.commit() == {"a": 3.0}


def test_ingested_partials_apply_to_the_next_commit_only() -> None:
    """A partial is reduced once, at the next commit."""
    d = bus()
    d.ingest([worker_partial({"a": [1.0]})])
    assert d.commit() == {"a": 1.0}
    assert d.commit() == {}


def test_ingest_with_a_different_spec_names_both() -> None:
    """A partial whose spec differs from the driver's rule is a SpecError naming both; nothing is lost."""
    d = bus(rules={"a": "mean"})
    d.log("a", 3.0)
    with pytest.raises(SpecError) as info:
        d.ingest([worker_partial({"a": [1.0]}, rules={"a": "sum"})])
    assert "sum" in str(info.value)
    assert "mean" in str(info.value)
    assert d.commit() == {"a": 3.0}


def test_ingest_rejects_non_partials() -> None:
    """Anything but a Partial is a TypeError, and the good partials of the call are not taken either."""
    d = bus()
    with pytest.raises(TypeError, match="Partial"):
        d.ingest([worker_partial({"a": [1.0]}), {"a": 1.0}])  # type: ignore[list-item]
    assert d.commit() == {}


def test_worker_list_spec_reaches_the_driver() -> None:
    """List specs travel in the partial and are emitted as name/<kind> by the driver."""
    rules = {"len": ["mean", "max"]}
    d = bus(rules=rules)
    w = bus(rules=rules)
    w.log("len", np.array([1.0, 2.0, 9.0]))
    d.ingest([w.export()])
    d.log("len", 4.0)
    assert d.commit() == {"len/max": 9.0, "len/mean": 4.0}


def test_partials_kept_by_a_failed_commit_join_their_workers_next_ones(tmp_path: Path) -> None:
    """A driver's commit that raises StepError keeps its ingested partials worker by worker: the next commit joins
    worker i's with the i-th partial ingested after, as one process keeps its records (not two more workers at the
    rank level); the journal replays what was emitted."""
    from metricbus import StepError
    from metricbus.journal import read_journal
    from metricbus.replay import emitted

    rules = {"x": Agg(micro="sum", rank="mean"), "y": "sum"}
    ranks = [MetricBus(dist=None, rules=rules) for _ in range(2)]  # each rank one process: what the driver must give
    workers = [MetricBus(dist=None, rules=rules) for _ in range(2)]
    driver = MetricBus(dist=None, rules=rules, journal=str(tmp_path / "j"))
    plan = [(1, [1.0, 10.0]), (1, [2.0, 20.0]), (2, [3.0, 30.0])]  # the second commit at step 1 is refused
    live = []
    for step, values in plan:
        for bus in (*ranks, *workers):
            bus.log("x", values[(ranks + workers).index(bus) % 2])
        workers[1].log("y", 5.0)
        ranks[1].log("y", 5.0)
        driver.ingest([w.export() for w in workers])
        try:
            live.append((step, driver.commit(step)))
        except StepError:
            for bus in ranks:
                with pytest.raises(StepError):
                    bus.commit(step)
            continue
        alone = [bus.commit(step) for bus in ranks]
        assert live[-1][1]["x"] == (alone[0]["x"] + alone[1]["x"]) / 2
        assert live[-1][1]["y"] == alone[1]["y"]
    assert live == [(1, {"x": 5.5, "y": 5.0}), (2, {"x": 27.5, "y": 10.0})]
    driver.close()
    assert list(emitted(read_journal(tmp_path / "j"))) == live


def test_drop_ingested_forgets_a_skipped_steps_partials() -> None:
    """A driver ingests the critic's partials, then the actor's gather fails and the step is skipped: without
    drop_ingested() the next commit counted the critic's twice (critic/tokens 40.0 where 20.0 is due; found by
    the verl/Ray review)."""

    def critic() -> Partial:
        worker = MetricBus(dist=None, rules={"critic/tokens": "sum"})
        worker.log("critic/tokens", 10.0)
        part = worker.export()
        worker.close()
        return part

    driver = MetricBus(dist=None)
    driver.ingest([critic(), critic()])  # step 1's actor gather then raises: the step is skipped
    assert driver.drop_ingested() == 2
    driver.ingest([critic(), critic()])
    assert driver.commit(step=2) == {"critic/tokens": 20.0}
    driver.ingest([critic()])
    with pytest.raises(StepError):
        driver.commit(step=2)  # refused: its partial is kept for the next commit ...
    assert driver.drop_ingested() == 1  # ... unless dropped
    assert driver.commit(step=3) == {}
    driver.close()
    with pytest.raises(ClosedError):
        driver.drop_ingested()
