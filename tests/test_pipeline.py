"""One pipeline for every path: spec adoption, output collisions, replay windows, failures, threads, imports."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

import metricbus
from metricbus import Agg, MetricBus, MetricValueError, SpecError
from metricbus.journal import read_journal
from metricbus.replay import emitted, parse_steps
from metricbus.testing import MemoryAdapter


def bus(**options: Any) -> MetricBus:
    """A strict local bus."""
    return MetricBus(dist=None, strict=True, **options)


def exported(records: dict[str, list[float]], **log_options: Any) -> metricbus.Partial:
    """A worker bus that logged ``records`` with ``log_options`` and exported them."""
    w = bus()
    for name, values in records.items():
        w.log(name, values, **log_options)
    part = w.export()
    w.close()
    return part


# -- 1. single-controller specs ---------------------------------------------------------------------------------


def test_the_driver_adopts_a_workers_explicit_spec() -> None:
    """A worker's agg= travels with its partial; a driver with no rule for the name uses it."""
    d = bus()
    d.ingest([exported({"m_sum": [1.0, 2.0]}, agg="sum"), exported({"m_sum": [4.0]}, agg="sum")])
    assert d.commit() == {"m_sum": 7.0}
    assert str(d.spec_of("m_sum")) == "sum"


def test_the_driver_adopts_a_workers_rule() -> None:
    """A spec a worker got from its own rules is a declaration too."""
    w = bus(rules={"loss": Agg(micro="sum", rank="mean")})
    w.log("loss", [1.0, 2.0])
    d = bus()
    d.ingest([w.export()])
    w.log("loss", [5.0])
    d.ingest([w.export()])
    assert d.commit() == {"loss": 4.0}


def test_a_workers_default_gives_way_to_the_drivers_rule() -> None:
    """A worker that only had the default does not conflict with the driver's rule."""
    d = bus(rules={"x": "sum"})
    d.ingest([exported({"x": [1.0, 2.0]})])
    assert d.commit() == {"x": 3.0}


def test_a_default_gives_way_to_another_workers_declaration() -> None:
    """One worker logs with the default, another declares: the declaration wins, in either order."""
    d = bus()
    d.ingest([exported({"x": [1.0]}), exported({"x": [2.0]}, agg="sum")])
    assert d.commit() == {"x": 3.0}


def test_the_drivers_rule_against_a_workers_declaration_is_an_error() -> None:
    """The driver's own rule and a worker's declaration differ: SpecError naming both and where they came from."""
    d = bus(rules={"x": "max"})
    with pytest.raises(SpecError) as err:
        d.ingest([exported({"x": [1.0]}, agg="sum")])
    text = str(err.value)
    assert "'x'" in text
    assert "max" in text
    assert "sum" in text
    assert "rule 'x'" in text
    assert "ingested worker 0" in text


def test_two_workers_disagreeing_is_an_error_naming_both_and_the_first_is_taken() -> None:
    """Two workers declare different specs: SpecError naming both workers and the refused partial; the first
    worker's spec settles it and its records are taken (the rest of a call is never lost to one bad metric)."""
    d = bus()
    d.log("own", 1.0)
    with pytest.raises(SpecError, match=r"partial 1 of this call: 'x': .*worker 0.*ingested worker 1"):
        d.ingest([exported({"x": [1.0]}, agg="sum"), exported({"x": [2.0]}, agg="mean")])
    assert d.commit() == {"own": 1.0, "x": 1.0}


def test_the_drivers_explicit_spec_against_a_worker_is_an_error() -> None:
    """The driver logged the name with agg=; a worker declaring another spec is refused."""
    d = bus()
    d.log("x", 1.0, agg="max")
    with pytest.raises(SpecError, match=r"agg= in log\(\) on this bus"):
        d.ingest([exported({"x": [1.0]}, agg="sum")])


# -- 2. output collisions ---------------------------------------------------------------------------------------


def test_an_ingested_collision_is_an_error() -> None:
    """A worker's x/mean against the driver's x as [mean, max]: an error, never one merged series."""
    d = bus()
    d.log("x", 1.0, agg=["mean", "max"])
    with pytest.raises(SpecError, match="x/mean"):
        d.ingest([exported({"x/mean": [2.0]})])


# -- 3. replay windows ------------------------------------------------------------------------------------------


def test_replay_steps_filter_what_is_emitted_not_what_is_reduced(tmp_path: Path) -> None:
    """log_every=3: live emits (2, 1.0), (5, 4.0), (6, 6.0); replay --steps 1: emits the same windows."""
    mem = MemoryAdapter()
    b = bus(adapters=[mem], log_every=3, journal=str(tmp_path / "j"))
    for step in range(7):
        b.log("x", float(step))
        b.commit(step=step)
    b.close()
    assert mem.rows == [(2, {"x": 1.0}), (5, {"x": 4.0}), (6, {"x": 6.0})]
    journal = read_journal(tmp_path / "j")
    assert list(emitted(journal)) == mem.rows
    assert list(emitted(journal, steps=parse_steps("1:"))) == mem.rows
    assert list(emitted(journal, steps=parse_steps("3:"))) == [(5, {"x": 4.0}), (6, {"x": 6.0})]
    assert list(emitted(journal, steps=parse_steps(":3"))) == [(2, {"x": 1.0})]


# -- 5. failures while reducing one metric ------------------------------------------------------------------------


def test_overflowing_records_are_valid() -> None:
    """[1e155, -1e155]: a finite sum and mean, std = inf; later commits still reach the adapter."""
    mem = MemoryAdapter()
    b = bus(adapters=[mem], rules={"x": ["sum", "mean", "std"]})
    b.log("x", [1e155, -1e155])
    assert b.commit() == {"x/mean": 0.0, "x/std": float("inf"), "x/sum": 0.0}
    b.log("x", 1.0)
    b.commit()
    b.close()
    assert len(mem.rows) == 2


def test_a_negative_tensor_weight_loses_only_that_metric() -> None:
    """A negative tensor weight is found at commit: the other metrics commit, the bus stays usable."""
    torch = pytest.importorskip("torch")
    mem = MemoryAdapter()
    b = bus(adapters=[mem])
    b.log("good", 1.0)
    b.log("bad", torch.tensor([1.0, 2.0]), weight=torch.tensor([1.0, -1.0]))
    with pytest.raises(MetricValueError, match=r"'bad'.*negative.*committed without them"):
        b.commit(step=0)
    assert b.last_step == 0
    b.log("good", 2.0)
    assert b.commit(step=1) == {"good": 2.0}
    b.close()
    assert mem.rows == [(0, {"good": 1.0}), (1, {"good": 2.0})]


def test_a_device_nan_under_error_loses_only_that_metric() -> None:
    """nan='error' for a tensor is checked at commit: that metric is dropped, the others commit."""
    torch = pytest.importorskip("torch")
    b = bus(rules={"strict": Agg(nan="error")})
    b.log("ok", torch.tensor([1.0, 3.0]))
    b.log("strict", torch.tensor([float("nan")]))
    with pytest.raises(MetricValueError, match="'strict'"):
        b.commit()
    b.log("strict", torch.tensor([1.0]))
    assert b.commit() == {"strict": 1.0}


def test_a_meta_tensor_is_rejected_at_log() -> None:
    """A tensor on the meta device holds no data: MetricValueError at log(), nothing recorded."""
    torch = pytest.importorskip("torch")
    b = bus()
    with pytest.raises(MetricValueError, match=r"meta.*'m'"):
        b.log("m", torch.empty(3, device="meta"))
    with pytest.raises(MetricValueError, match=r"weight on the 'meta' device for 'w'"):
        b.log("w", torch.ones(3), weight=torch.empty(3, device="meta"))
    assert b.commit() == {}


def test_export_with_a_bad_device_metric_keeps_the_others() -> None:
    """export() refuses the bad metric and keeps the good ones for the next export."""
    torch = pytest.importorskip("torch")
    w = bus()
    w.log("good", 1.0)
    w.log("bad", torch.tensor([1.0]), weight=torch.tensor([-1.0]))
    with pytest.raises(MetricValueError, match="'bad'"):
        w.export()
    part = w.export()
    assert [name for name, _, _ in part] == ["good"]


# -- 6. threads -------------------------------------------------------------------------------------------------


def test_four_threads_logging_lose_nothing() -> None:
    """4 threads x 20,000 records into one bus: every record counted, the sum exact."""
    b = bus(rules={"x": ["count", "sum"], "w": ["count", "mean"]})
    per_thread = 20_000

    def work(t: int) -> None:
        for i in range(per_thread):
            b.log("x", float(i % 7))
            if i % 50 == 0:
                b.log("w", float(t), weight=2.0)
                b.log({"d": 1.0})

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = b.commit()
    assert out["x/count"] == 4 * per_thread
    assert out["x/sum"] == 4 * sum(float(i % 7) for i in range(per_thread))
    assert out["w/count"] == 4 * per_thread // 50
    assert out["d"] == 1.0


def test_logging_while_another_thread_commits_delivers_each_record_once() -> None:
    """A logging thread and a committing thread: the committed counts add up to what was logged."""
    mem = MemoryAdapter()
    b = bus(adapters=[mem], rules={"x": "count"})
    done = threading.Event()
    logged = 50_000

    def produce() -> None:
        for i in range(logged):
            b.log("x", float(i))
        done.set()

    def consume() -> None:
        while not done.is_set():
            b.commit()

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    b.close()
    assert sum(metrics.get("x", 0.0) for _, metrics in mem.rows) == logged


def test_two_committing_threads_write_increasing_steps_once() -> None:
    """Commits are serialized: two threads committing yield strictly increasing, distinct steps, every record once."""
    mem = MemoryAdapter()
    b = bus(adapters=[mem], rules={"x": "count"})

    def work() -> None:
        for _ in range(500):
            b.log("x", 1.0)
            b.commit()

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    b.close()
    steps = [step for step, _ in mem.rows]
    assert steps == sorted(set(steps))
    assert sum(metrics["x"] for _, metrics in mem.rows) == 1000  # a commit that found nothing emits nothing


# -- 7. errors importable ---------------------------------------------------------------------------------------


def test_every_error_is_importable_from_the_package() -> None:
    """Every class in metricbus.errors is exported from metricbus."""
    from metricbus import errors

    for name in dir(errors):
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, (Exception, Warning)) and obj.__module__ == errors.__name__:
            assert getattr(metricbus, name) is obj, name


def test_a_step_beyond_int64_is_a_step_error_and_keeps_the_records(tmp_path: Path) -> None:
    """commit(step=2**63) with a journal: StepError (not struct.error), the records stay for the next commit."""
    from metricbus import StepError

    b = bus(journal=str(tmp_path / "j"))
    b.log("x", 1.0)
    with pytest.raises(StepError, match="int64"):
        b.commit(step=2**63)
    assert b.commit(step=2**63 - 1) == {"x": 1.0}
    b.close()
    assert [step for step, _ in emitted(read_journal(tmp_path / "j"))] == [2**63 - 1]


def test_close_emits_the_window_even_when_the_last_commit_rejects_a_metric() -> None:
    """close() with log_every=5: a bad tensor metric in the final commit does not lose the window's rows."""
    torch = pytest.importorskip("torch")
    mem = MemoryAdapter()
    b = MetricBus(dist=None, adapters=[mem], log_every=5)
    b.log("a", 1.0)
    b.commit()
    b.log("a", 3.0)
    b.commit()
    b.log("a", 5.0)
    b.log("t", torch.tensor([1.0]), weight=torch.tensor([-1.0]))
    with pytest.raises(MetricValueError, match="'t'"):
        b.close()
    assert mem.rows == [(2, {"a": 3.0})]


def test_this_buses_default_gives_way_to_its_own_declaration_before_the_first_commit() -> None:
    """log('x', 1.0) then log('x', 2.0, agg='sum') before any commit: x is a sum; after a commit it is fixed."""
    b = bus()
    b.log("x", 1.0)
    b.log("x", 2.0, agg="sum")
    assert b.commit() == {"x": 3.0}
    c = bus()
    c.log("y", 1.0)
    c.commit()
    with pytest.raises(SpecError, match="'y'"):
        c.log("y", 2.0, agg="sum")


def test_an_adopted_nan_policy_applies_to_this_buses_records() -> None:
    """A worker declares nan='ignore' for x: the driver's own NaN records of x are ignored too."""
    d = bus()
    d.log("x", float("nan"))
    d.ingest([exported({"x": [1.0]}, agg=Agg(nan="ignore"))])
    assert d.commit() == {"x": 1.0}
    d.log("x", float("nan"))
    d.log("x", 3.0)
    assert d.commit() == {"x": 3.0}


def test_a_rejected_call_introducing_a_name_never_exposes_its_buffer_to_other_threads() -> None:
    """A thread spamming log(name, float) on names a rejected dict call introduces: no lost record, no crash."""
    b = bus(rules={"x*": "count"})
    current = ["x0"]
    stop = threading.Event()
    errors: list[BaseException] = []
    counts: dict[str, int] = {}

    def spam() -> None:
        while not stop.is_set():
            name = current[0]
            try:
                b.log(name, 1.0)
                counts[name] = counts.get(name, 0) + 1
            except SpecError:
                pass  # the name was not introduced yet (its dict call is being validated)
            except BaseException as exc:
                errors.append(exc)
                return

    thread = threading.Thread(target=spam)
    thread.start()
    bad = [0.0] * 20_000 + [None]
    for i in range(100):
        current[0] = f"x{i + 1}"
        with pytest.raises(metricbus.MetricTypeError):
            b.log({current[0]: 1.0, "bad": bad})
    stop.set()
    thread.join()
    assert errors == []
    out = b.commit()
    assert {name: int(v) for name, v in out.items()} == counts
