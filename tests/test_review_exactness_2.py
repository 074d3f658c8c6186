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
from metricbus.replay import emitted
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
