"""Replay's windows merged in columns (``log_every > 1``, :mod:`metricbus.replay_windows`) emit the bits of the
scalar path and of the live bus, on hostile data, across shape changes mid-window and resumed segments."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metricbus import replay_windows
from tests.test_replay_fast import (
    FEW,
    FINITE,
    HOSTILE,
    bits,
    columnar,
    journals,
    many_ranks,
    records,
    replayed_as_live,
    rule_replays_alike,
    scalar,
    write,
)

EVERY = st.sampled_from([2, 3, 4])
MORE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODERATE = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=64)
WINDOWABLE = ["mean", "sum", "min", "max", "first", "last", "count", "mean,max,min", "sum,count", "first,last"]
Steps = list[list[dict[str, list[tuple[float, float | None]]]]]


@st.composite
def windowed(draw: st.DrawFn, values: st.SearchStrategy[float], *, workers: int, std: bool = False
             ) -> tuple[Steps, dict[str, str]]:
    """Longer runs of one shape (1-12 commits, so whole windows fit) of metrics whose windows merge in columns
    (``std``: also std, which one worker's columns merge), a shape change between runs, weights now and then."""
    names = [f"m{i}" for i in range(draw(st.integers(1, 4)))]
    rules = {name: draw(st.sampled_from([*WINDOWABLE, *(["std", "mean,std"] if std else [])])) for name in names}
    steps: Steps = []
    for _ in range(draw(st.integers(1, 3))):
        logged = [draw(st.lists(st.sampled_from(names), min_size=1, unique=True)) for _ in range(workers)]
        for _ in range(draw(st.integers(1, 12))):
            steps.append([{name: draw(records(values, weighted=True)) for name in mine} for mine in logged])
    return steps, rules


def merged_windows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the number of windows each run merged in columns (0: none, or the run fell back)."""
    real = replay_windows._merge
    counts: list[int] = []

    def merge(states: Any, starts: Any, log_every: int) -> Any:
        out = real(states, starts, log_every)
        counts.append(0 if out is None else len(starts))
        return out

    monkeypatch.setattr(replay_windows, "_merge", merge)
    return counts


@FEW
@given(journals(HOSTILE, weighted=True), EVERY)
def test_hostile_values_bitwise(case: Any, log_every: int) -> None:
    """NaN, inf, -0.0, huge and subnormal values, weights, names that come and go mid-window: columnar == scalar ==
    live, bit for bit."""
    steps, rules = case
    replayed_as_live(steps, rules, log_every=log_every)


@MORE
@given(st.integers(1, 4).flatmap(lambda n: st.tuples(windowed(HOSTILE, workers=n, std=n == 1), st.just(n))), EVERY)
def test_windows_merged_in_columns_bitwise(case: Any, log_every: int) -> None:
    """Metrics whose windows merge in columns, hostile values and weights, one to four workers (one: its own log,
    "P" frames): columnar == scalar == live."""
    (steps, rules), workers = case
    replayed_as_live(steps, rules, controller=workers > 1, log_every=log_every)


@MORE
@given(st.integers(1, 4).flatmap(lambda n: st.tuples(windowed(MODERATE, workers=n, std=n == 1), st.just(n))), EVERY)
def test_windows_of_finite_sums_bitwise(case: Any, log_every: int) -> None:
    """The same with values of moderate size (sums with a low part, seldom a third component: few windows fall
    back): columnar == scalar == live."""
    (steps, rules), workers = case
    replayed_as_live(steps, rules, controller=workers > 1, log_every=log_every)


@FEW
@given(journals(FINITE, max_workers=6), EVERY)
def test_finite_sums_with_remainders_bitwise(case: Any, log_every: int) -> None:
    """Finite values whose sums need a low part: columnar == scalar == live."""
    steps, rules = case
    replayed_as_live(steps, rules, log_every=log_every)


@FEW
@given(journals(HOSTILE, weighted=True, max_workers=1), EVERY)
def test_one_worker_bitwise(case: Any, log_every: int) -> None:
    """A one-rank journal ("P" frames, the live single-worker path; std merges its second moment in columns)."""
    steps, rules = case
    replayed_as_live(steps, rules, controller=False, log_every=log_every)


@FEW
@given(journals(FINITE, max_workers=3), EVERY, st.sampled_from(["sum", "mean,max,min", "max,first,last,count",
                                                                 "micro:sum,rank:mean", "step:mean", "m0=p90"]))
def test_rules_bitwise(case: Any, log_every: int, rule: str) -> None:
    """A --rule re-aggregation: columnar == scalar."""
    steps, rules = case
    rule_replays_alike(steps, rules, rule, log_every=log_every)


@pytest.mark.parametrize(("workers", "cut"), [(1, 7), (1, 9), (3, 7), (3, 8)])
def test_a_resumed_writer_starts_a_window_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int, cut: int
) -> None:
    """A run closed mid-window (its close emits the open window), then resumed: the replay's windows restart at the
    segment, as the live buses' did; most windows are merged in columns."""
    counts = merged_windows(monkeypatch)
    rng = np.random.default_rng(cut)
    rules = {"a": "mean", "b": "sum,max", "c": "min,first,last,count"}

    def steps(n: int) -> list[list[dict[str, list[tuple[float, float | None]]]]]:
        return [
            [{name: [(float(v), None) for v in rng.standard_normal(3)] for name in "abc"} for _ in range(workers)]
            for _ in range(n)
        ]

    path = tmp_path / "j"
    one = write(path, steps(cut), rules, controller=workers > 1, log_every=3)
    two = write(path, steps(20), rules, controller=workers > 1, log_every=3, resume=True, first=cut)
    got = columnar(path)
    assert got == scalar(path) == bits(one.rows + two.rows)
    assert sum(counts) >= (cut + 20) // 3 - 3


def test_long_runs_of_many_ranks_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs longer than one batch over many ranks, NaN and -0.0 sprinkled in: the windows are merged in columns
    (values over 40 orders of magnitude make sums the columns do not hold: those fall back, in the tests above)."""
    counts = merged_windows(monkeypatch)
    rules = {"a": "mean", "b": "sum,max", "c": "min,max", "d": "count,first,last"}
    steps = many_ranks(seed=11, steps=90, ranks=12, decades=3)
    live = write(tmp_path / "j", steps, rules, log_every=4)
    assert columnar(tmp_path / "j") == scalar(tmp_path / "j") == bits(live.rows)
    assert sum(counts) >= 90 // 4 - 2


class Step(NamedTuple):
    step: int
    starts_segment: bool


@pytest.mark.parametrize(
    ("segments", "pending", "log_every", "want"),
    [
        ([False] * 10, 0, 3, [0, 3, 6]),  # windows from the start; commit 9 starts the next one
        ([False] * 10, 1, 3, [2, 5]),  # two commits complete the open window
        ([False] * 10, 2, 3, [1, 4, 7]),
        ([True] + [False] * 9, 2, 3, [0, 3, 6]),  # a segment's start: the open window was emitted before it
        ([False] * 5 + [True] + [False] * 4, 0, 2, [0, 2, 5, 7]),  # commit 4 ends segment one's run alone
        ([False] * 2, 0, 3, []),
    ],
)
def test_which_commits_make_whole_windows(
    segments: list[bool], pending: int, log_every: int, want: list[int]
) -> None:
    commits = [Step(i, s) for i, s in enumerate(segments)]
    got = replay_windows._window_starts(commits, pending=pending, log_every=log_every)
    assert got.tolist() == want


@pytest.mark.parametrize("workers", [1, 3])
def test_windows_of_non_finite_states_take_the_scalar_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """Windows merged in columns whose states hold inf, -inf or NaN (a sum, a mean, a min): the values come from the
    scalar kind of the window's Summary, bit for bit the live bus's."""
    counts = merged_windows(monkeypatch)
    hostile = [float("inf"), float("-inf"), float("nan"), -0.0]
    steps = [
        [{"a": [(hostile[(step + rank) % 4] if step % 3 == 1 else float(step + rank), None)],
          "b": [(float(step), None), (hostile[step % 4] if step % 5 == 2 else 1.5, None)]} for rank in range(workers)]
        for step in range(40)
    ]
    rules = {"a": "mean,sum,min,max", "b": "sum,first,last,count"}
    live = write(tmp_path / "j", steps, rules, controller=workers > 1, log_every=2)
    got = columnar(tmp_path / "j")
    assert got == scalar(tmp_path / "j")
    assert got == bits(live.rows)
    assert sum(counts) >= 5
