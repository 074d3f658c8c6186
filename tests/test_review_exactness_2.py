"""Exactness across splits and paths: the sign of a zero sum (IEEE 754: -0.0 only when every term is) and the
second moment merged across workers (a constant metric's std is exactly 0; near-constant data as precise as on one
worker), through worker buses, the driver's ingest, journal replay and real gloo ranks."""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus import MetricBus
from metricbus.journal import read_journal
from metricbus.rank_level import block_of, merge, merge_collective
from metricbus.replay import emitted
from metricbus.summary import Summary
from tests.gloo_ranks import run_ranks

RULES = {"x": ["sum", "mean"], "c*": ["mean", "std"]}
ZERO_TERMS = [-0.0, -0.0, 0.0, 1.5, -1.5]


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _ieee_sum(terms: list[float]) -> float:
    """The exact sum of ``terms``, correctly rounded, a zero being -0.0 only when every term is."""
    exact = sum(map(Fraction, terms), Fraction(0))
    if exact:
        return float(exact)
    return -0.0 if all(math.copysign(1.0, t) < 0.0 for t in terms) else 0.0


def _log(bus: MetricBus, name: str, updates: list[list[list[float]]], weights: float | None, how: str) -> None:
    """Log each update's calls (floats one by one, lists, numpy arrays or CPU tensors), an update boundary between
    updates."""
    for k, calls in enumerate(updates):
        if k:
            bus.end_update()
        for call in calls:
            w = None if weights is None else [weights] * len(call)
            if how == "floats" and w is None:
                for v in call:
                    bus.log(name, v)
            elif how == "numpy":
                bus.log(name, np.array(call), weight=None if w is None else np.array(w))
            elif how == "tensor":  # (these records' sums are exact in float64: the device's sums agree)
                import torch

                held = None if w is None else torch.tensor(w, dtype=torch.float64)
                bus.log(name, torch.tensor(call, dtype=torch.float64), weight=held)
            else:
                bus.log(name, call, weight=w)


def _through_ingest(shares: list[list[list[list[float]]]], weights: float | None, how: str, journal: str) -> Any:
    """Worker buses (one per share, ``dist=None``) exported and ingested by a journaled driver: (emitted, replayed)."""
    driver = MetricBus(dist=None, rules=RULES, journal=journal)
    parts = []
    for updates in shares:
        worker = MetricBus(dist=None, rules=RULES)
        _log(worker, "x", updates, weights, how)
        for i in range(9):  # other metrics: enough for the columns paths
            worker.log(f"c{i}", 1.0)
        parts.append(worker.export())
        worker.close()
    driver.ingest(parts)
    out = driver.commit(step=0)
    driver.close()
    replayed = next(metrics for _, metrics in emitted(read_journal(journal)))
    return out, replayed


call = st.lists(st.sampled_from(ZERO_TERMS), min_size=1, max_size=40)
shares = st.lists(st.lists(st.lists(call, min_size=1, max_size=3), min_size=1, max_size=3), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(
    shares=shares,
    weights=st.sampled_from([None, 2.0, 0.5]),
    how=st.sampled_from(["floats", "lists", "numpy", "tensor"]),
)
def test_a_zero_sum_has_ieee_sign_whatever_the_split(
    shares: list[list[list[list[float]]]], weights: float | None, how: str, tmp_path_factory: Any
) -> None:
    """sum and mean of records split into workers, updates and calls: -0.0 exactly when every term is."""
    records = [x for updates in shares for calls in updates for c in calls for x in c]
    journal = str(tmp_path_factory.mktemp("j") / "journal")
    out, replayed = _through_ingest(shares, weights, how, journal)
    w = 1.0 if weights is None else weights
    expected_mean = _ieee_sum([w * x for x in records]) / (w * len(records))
    for got in (out, replayed):
        assert _bits(got["x/sum"]) == _bits(_ieee_sum(records)), (records, got["x/sum"])
        assert _bits(got["x/mean"]) == _bits(expected_mean), (records, got["x/mean"])


def zeros_on_a_rank(rank: int, size: int, journal: str) -> dict[str, float]:
    """Each rank logs -0.0s (and +0.0s into "y"), in two updates; the emitted row."""
    bus = MetricBus(rules={"x": ["sum", "mean"], "y": ["sum", "mean"]}, journal=journal)
    bus.log("x", [-0.0] * (rank + 1))
    bus.log("y", -0.0)
    bus.end_update()
    bus.log("x", -0.0)
    bus.log("y", 0.0 if rank else -0.0)
    out = bus.commit(step=0)
    bus.close()
    return out


def test_zero_sums_on_gloo_ranks_follow_ieee(tmp_path: Path) -> None:
    """Real gloo ranks: a sum of -0.0s is -0.0, one +0.0 among them makes it +0.0; replay agrees."""
    journal = str(tmp_path / "journal")
    got = run_ranks(zeros_on_a_rank, 2, journal)
    for rank in range(2):
        assert {k: _bits(v) for k, v in got[rank].items()} == {
            "x/sum": _bits(-0.0), "x/mean": _bits(-0.0), "y/sum": _bits(0.0), "y/mean": _bits(0.0)
        }, got[rank]
    replayed = next(metrics for _, metrics in emitted(read_journal(journal)))
    assert {k: _bits(v) for k, v in replayed.items()} == {k: _bits(v) for k, v in got[0].items()}


CONSTANTS = [0.1, 1 / 3, 1e9 + 0.1, 7.123456789, 1e-5, 123456.789, -2.5e-300, 3e150]  # (mean² within the range)


def _constants_through_ingest(journal: str, weighted: bool) -> tuple[dict[str, float], dict[str, float]]:
    """Three worker buses log each constant (``c0``...) in shares of 3, 5 and 2 records; (emitted, replayed)."""
    driver = MetricBus(dist=None, rules=RULES, journal=journal)
    parts = []
    for share in (3, 5, 2):
        worker = MetricBus(dist=None, rules=RULES)
        for i, c in enumerate(CONSTANTS):
            worker.log(f"c{i}", [c] * share, weight=[0.3, 0.7, 1.1, 2.0, 0.1][:share] if weighted else None)
        parts.append(worker.export())
        worker.close()
    driver.ingest(parts)
    out = driver.commit(step=0)
    driver.close()
    return out, next(metrics for _, metrics in emitted(read_journal(journal)))


def test_a_constant_metric_has_std_zero_across_workers(tmp_path: Path) -> None:
    """A metric constant across ingested workers (weighted or not) has std exactly 0.0, replay too."""
    for weighted in (False, True):
        out, replayed = _constants_through_ingest(str(tmp_path / f"j{weighted}"), weighted)
        for got in (out, replayed):
            for i, c in enumerate(CONSTANTS):
                assert _bits(got[f"c{i}/std"]) == _bits(0.0), (c, weighted, got[f"c{i}/std"])
                assert got[f"c{i}/mean"] == c


def constants_on_a_rank(rank: int, size: int) -> dict[str, float]:
    """Each rank logs every constant, ``rank + 2`` records of each, in two updates; the emitted row."""
    bus = MetricBus(rules=RULES)
    for i, c in enumerate(CONSTANTS):
        bus.log(f"c{i}", [c] * (rank + 1))
    bus.end_update()
    for i, c in enumerate(CONSTANTS):
        bus.log(f"c{i}", c)
    out = bus.commit(step=0)
    bus.close()
    return out


def test_a_constant_metric_has_std_zero_on_gloo_ranks() -> None:
    """Real gloo ranks: a metric constant across ranks has std exactly 0.0 on every rank."""
    got = run_ranks(constants_on_a_rank, 3)
    for rank in range(3):
        assert {k: _bits(v) for k, v in got[rank].items() if k.endswith("/std")} == {
            f"c{i}/std": _bits(0.0) for i in range(len(CONSTANTS))
        }, got[rank]


def _exact_m2(shares: list[tuple[list[float], list[float]]]) -> tuple[Fraction, Fraction, Fraction]:
    """(m2, mean, W) of every share's weighted records, exactly."""
    pairs = [(Fraction(x), Fraction(w)) for xs, ws in shares for x, w in zip(xs, ws, strict=True)]
    weight = sum((w for _, w in pairs), Fraction(0))
    mean = sum((w * x for x, w in pairs), Fraction(0)) / weight
    return sum((w * (x - mean) ** 2 for x, w in pairs), Fraction(0)), mean, weight


@settings(max_examples=150, deadline=None)
@given(
    mean=st.sampled_from([0.0, 1.0, 1e6, -3e8, 1e9, 1e12, 1e100, 1e-100]),
    spread=st.sampled_from([1e-15, 1e-12, 1e-9, 1e-3, 1.0]),
    seed=st.integers(0, 2**32 - 1),
    workers=st.integers(2, 5),
    weighted=st.booleans(),
)
def test_the_merged_second_moment_is_as_exact_as_the_workers(
    mean: float, spread: float, seed: int, workers: int, weighted: bool
) -> None:
    """Across workers m2 is off by at most 2**-52 of it (its rounding) and 2**-140 of W·mean², beyond the
    workers' own m2 (README, Scale: precision); one process and the collectives' limbs agree bit for bit."""
    rng = np.random.default_rng(seed)
    scale = abs(mean) * spread or spread
    shares = []
    for _ in range(workers):
        n = int(rng.integers(1, 9))
        xs = (mean + scale * rng.standard_normal(n)).tolist()
        shares.append((xs, rng.random(n).tolist() if weighted else [1.0] * n))
    rows = [[Summary.of_batch(xs, ws if weighted else None)] for xs, ws in shares]
    block = block_of(rows, list(range(workers)), [True])
    merged, collective = merge(block)[0], merge_collective(block)[0]
    assert merged is not None
    assert collective is not None
    assert _bits(merged.m2) == _bits(collective.m2)
    exact, mu, weight = _exact_m2(shares)
    own = sum((Fraction(row[0].m2) - _exact_m2([share])[0] for row, share in zip(rows, shares, strict=True)),
              Fraction(0))  # the workers' own error, which the merge carries along
    bound = Fraction(2.0**-52) * abs(exact) + Fraction(2.0**-140) * (weight * mu * mu + exact)
    assert abs(Fraction(merged.m2) - exact - own) <= bound, (merged.m2, float(exact))
