"""The update level: several optimizer updates per step (micro-batch -> update -> rank -> step)."""

from __future__ import annotations

import math
import socket
import warnings
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from metricbus import Agg, MetricBus
from metricbus.journal import read_journal
from metricbus.replay import emitted
from tests.update_plan import log_rank, make_plan

R, K, M, STEPS = 2, 2, 3, 3


def bus(**options: Any) -> MetricBus:
    """A strict local bus with no adapters."""
    return MetricBus(dist=None, strict=True, **options)


def single_controller(plan: dict[str, Any], *, journal: str | None = None) -> list[dict[str, float]]:
    """R worker buses export each step; a driver ingests them in rank order and commits."""
    driver = bus(journal=journal)  # no rules: the driver adopts the workers' declared specs
    workers = [bus(rules=plan["rules"]) for _ in range(R)]
    rows = []
    for step in range(STEPS):
        parts = []
        for rank, worker in enumerate(workers):
            log_rank(worker, plan, step=step, rank=rank)
            parts.append(worker.export())
        driver.ingest(parts)
        rows.append(driver.commit(step=step))
    driver.close()
    return rows


def true_pg_loss(plan: dict[str, Any], step: int) -> float:
    """The mean over the step's mini-batches of each mini-batch's global token-mean loss (exact)."""
    per_update = [
        sum(
            (Fraction(v) for r in range(R) for batch in plan["steps"][step][r][k] for n, v, _ in batch
             if n == "pg_loss"),
            Fraction(0),
        ) / R
        for k in range(K)
    ]
    return float(sum(per_update, Fraction(0)) / K)


def test_no_boundary_is_one_update_per_commit() -> None:
    """Without end_update() a commit is one update, so Agg(micro='sum', rank='mean') is unchanged."""
    b = bus(rules={"x": Agg(micro="sum", update="mean", rank="mean")})
    for v in (1.0, 2.0, 3.0):
        b.log("x", v)
    assert b.commit() == {"x": 6.0}


def test_pg_loss_is_the_true_loss_with_two_updates() -> None:
    """Pre-scaled pg_loss with K=2 updates: sum within an update, mean over updates and ranks = the truth."""
    plan = make_plan(ranks=R, updates=K, micro=M, steps=STEPS)
    rows = single_controller(plan)
    for step, row in enumerate(rows):
        assert math.isclose(row["pg_loss"], true_pg_loss(plan, step), rel_tol=1e-15)


def test_without_the_update_level_the_loss_is_k_times_the_truth() -> None:
    """The old spec sums over all K x M micro-batches: K times the true loss (the bug the level fixes)."""
    plan = make_plan(ranks=R, updates=K, micro=M, steps=1)
    b = bus(rules={"pg_loss": Agg(micro="sum", rank="mean")})
    parts = []
    for rank in range(R):
        w = bus()
        log_rank(w, plan, step=0, rank=rank)
        parts.append(w.export())
    b.ingest(parts)
    got = b.commit()["pg_loss"]
    assert math.isclose(got / true_pg_loss(plan, 0), K, rel_tol=1e-12)


def test_a_kind_change_at_the_update_level_lifts_each_update() -> None:
    """Agg(micro='mean', update='max'): the largest of the updates' means on each worker."""
    b = bus(rules={"x": Agg(micro="mean", update="max", rank="mean")})
    for v in (1.0, 3.0):  # update 0: mean 2
        b.log("x", v)
    b.end_update()
    b.log("x", 5.0)  # update 1: mean 5
    b.log("x", 7.0)  # update 1: mean 6
    assert b.commit() == {"x": 6.0}


def test_the_update_context_manager_ends_the_update() -> None:
    """``with bus.update():`` marks the boundary like end_update()."""
    b = bus(rules={"x": Agg(micro="sum", update="mean")})
    with b.update():
        b.log("x", 1.0)
        b.log("x", 2.0)
    with b.update():
        b.log("x", 5.0)
    assert b.commit() == {"x": 4.0}


def test_a_metric_absent_from_an_update_does_not_count_there() -> None:
    """An update without records of a metric is not a zero in its mean over updates."""
    b = bus(rules={"x": Agg(micro="sum", update="mean")})
    b.log("x", 4.0)
    b.end_update()
    b.log("y", 1.0)
    b.end_update()
    assert b.commit() == {"x": 4.0, "y": 1.0}


def test_list_specs_mix_levels() -> None:
    """A list spec with and without a kind change at the update level reads the right states."""
    b = bus(rules={"x": ["sum", Agg(micro="sum", update="mean")]})
    b.log("x", [1.0, 2.0])
    b.end_update()
    b.log("x", [3.0])
    b.end_update()
    assert b.commit() == {"x/mean": 3.0, "x/sum": 6.0}


def test_replay_of_a_journal_with_updates_is_bitwise_live(tmp_path: Path) -> None:
    """Replay reduces the journaled per-update summaries with the live code: the same floats, bit for bit."""
    plan = make_plan(ranks=R, updates=K, micro=M, steps=STEPS)
    live = single_controller(plan, journal=str(tmp_path / "j"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replayed = [metrics for _, metrics in emitted(read_journal(tmp_path / "j"))]
    assert replayed == live


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_torch_distributed_equals_single_controller_and_replay_bitwise(tmp_path: Path) -> None:
    """R gloo processes, each with K updates per step: the same floats as export/ingest and as replay."""
    torch = pytest.importorskip("torch")
    from tests import dist_workers

    plan = make_plan(ranks=R, updates=K, micro=M, steps=STEPS)
    expected = single_controller(plan)
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    journal = str(tmp_path / "dist")
    procs = [
        ctx.Process(target=dist_workers.updates_worker, args=(r, R, port, plan, journal, out)) for r in range(R)
    ]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in range(R))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert results[0] == expected
    assert results[1] == expected
    replayed = [metrics for _, metrics in emitted(read_journal(journal))]
    assert replayed == expected
