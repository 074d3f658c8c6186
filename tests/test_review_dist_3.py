"""Review of the rank level over torch.distributed (real gloo processes): ranks that disagree on what they call."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from tests.gloo_ranks import run_ranks

torch = pytest.importorskip("torch")


def _said(call: Any) -> Any:
    """What ``call()`` returned, or its exception's type name and message."""
    try:
        return call()
    except Exception as exc:  # (the test compares what each rank saw)
        return f"{type(exc).__name__}: {exc}"


def close_while_committing(rank: int, size: int, steady: int, rules: Any, new_name: bool) -> dict[str, Any]:
    """Rank 0 calls close() after ``steady`` commits while the others call commit() (with a name new to the
    agreed table where ``new_name``; ranks 1 and 2 declaring different specs for it), then commit() and close()."""
    from metricbus import MetricBus

    bus = MetricBus(dist="torch", rules=rules)
    for step in range(steady):
        bus.log("x", float(rank + step))
        bus.commit(step=step)
    bus.log("x", 2.0)
    got: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if rank == 0:
            got["close"] = _said(bus.close)
        else:
            if new_name:
                bus.log("y", 1.0, agg="sum" if rank == 1 else "max")
            got["commit"] = _said(lambda: bus.commit(step=steady))
            got["again"] = _said(lambda: bus.commit(step=steady + 1))
            got["close"] = _said(bus.close)
    got["warned"] = [str(w.message) for w in caught]
    got["closed"] = bus.closed
    return got


@pytest.mark.parametrize(
    ("steady", "rules", "size", "new_name"),
    [
        (0, None, 2, False),  # the first commit: the MAX pass alone
        (4, None, 2, False),  # steady: one all_reduce (one_pass)
        (20, {"x": ["max", "mean"]}, 2, False),  # the two all_reduces issued together
        (3, {"x": ["p50", "mean"]}, 2, False),  # sketched: two in a row
        (3, None, 3, True),  # a new name (the byte gather) whose specs the committing ranks disagree on
    ],
)
def test_close_on_one_rank_while_the_others_commit_raises_on_every_rank(
    steady: int, rules: Any, size: int, new_name: bool
) -> None:
    """close() on rank 0 while the others commit(): every rank raises DistributedError (no abort, no hang)."""
    results = run_ranks(close_while_committing, size, steady, rules, new_name)
    closer = results[0]
    assert closer["close"].startswith("DistributedError: close() on rank 0: another rank called commit() meanwhile")
    assert "the records of 'x' logged since the last commit were not committed" in closer["close"]
    assert closer["closed"]
    for rank in range(1, size):
        got = results[rank]
        assert got["commit"].startswith(f"DistributedError: commit(step={steady}) on rank {rank}: another rank "), got
        assert "The records stay buffered" in got["commit"]
        assert got["again"].startswith(f"DistributedError: commit(step={steady + 1}) on rank {rank}: another rank ")
        assert got["close"] is None  # closed alone: no collective, no hang
        assert got["closed"]
        assert any("records of " in w and "'x'" in w and "were not committed" in w for w in got["warned"])


def close_with_records_on_one_rank(rank: int, size: int, journal: str) -> list[Any]:
    """Two commits; then only rank 1 logs, and every rank calls close(): rank 1's record is committed everywhere."""
    from metricbus import MetricBus

    bus = MetricBus(dist="torch", journal=journal)
    rows = []
    for step in range(2):
        bus.log("x", float(rank))
        rows.append(bus.commit(step=step))
    if rank == 1:
        bus.log("late", 5.0)
    bus.close()
    return rows


def test_close_on_every_rank_commits_what_one_rank_has_left(tmp_path: Any) -> None:
    """close() on every rank, records left on rank 1 only: they are committed at the next step, on every rank."""
    from metricbus.journal import read_journal
    from metricbus.replay import emitted

    journal = str(tmp_path / "journal")
    results = run_ranks(close_with_records_on_one_rank, 2, journal)
    assert results[0] == results[1] == [{"x": 0.5}, {"x": 0.5}]
    assert list(emitted(read_journal(journal))) == [(0, {"x": 0.5}), (1, {"x": 0.5}), (2, {"late": 5.0})]


def close_with_nothing_left(rank: int, size: int, journal: str) -> int | None:
    """One commit, then close() on every rank with nothing left anywhere: no step is committed."""
    from metricbus import MetricBus

    bus = MetricBus(dist="torch", journal=journal)
    bus.log("x", float(rank))
    bus.commit(step=7)
    bus.close()
    return None


def test_close_on_every_rank_with_nothing_left_commits_no_step(tmp_path: Any) -> None:
    """close() on every rank with nothing left anywhere commits nothing: the journal ends at the last commit."""
    from metricbus.journal import read_journal
    from metricbus.replay import emitted

    journal = str(tmp_path / "journal")
    run_ranks(close_with_nothing_left, 2, journal)
    assert list(emitted(read_journal(journal))) == [(7, {"x": 0.5})]


def build_with(rank: int, size: int, option: str, values: list[Any]) -> str:
    """Build a bus whose ``option`` is ``values[rank]`` on each rank."""
    from metricbus import MetricBus

    return str(_said(lambda: MetricBus(dist="torch", **{option: values[rank]}).close()))


@pytest.mark.parametrize(
    ("option", "values"),
    [("nan", ["ignore", "propagate"]), ("log_every", [1, 2]), ("writer_rank", [0, 1])],
)
def test_bus_options_that_differ_across_ranks_raise_on_every_rank(option: str, values: list[Any]) -> None:
    """nan=, log_every= or writer_rank= that differ across ranks: DistributedError on every rank, naming both."""
    results = run_ranks(build_with, 2, option, values)
    for rank in range(2):
        assert results[rank].startswith(f"DistributedError: MetricBus({option}=...) differs across"), results[rank]
        assert f"{values[0]!r} on rank 0, {values[1]!r} on rank 1" in results[rank]


def test_bus_options_that_agree_build_onerun_ranks() -> None:
    """The same options on every rank: one run id (the writer's), no error."""
    results = run_ranks(run_id, 2)
    assert results[0] == results[1]


def run_id(rank: int, size: int) -> str:
    """This rank's bus's run id."""
    from metricbus import MetricBus

    bus = MetricBus(dist="torch", nan="ignore", log_every=3, writer_rank=1)
    bus.close()
    return bus.run.id
