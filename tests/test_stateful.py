"""A bus driven by random interleavings of valid and refused calls: every emitted value is the exact reference of
the valid records alone, every refusal names its metric and loses nothing, and replay of the journal emits the
same bits as the live bus.

The calls: ``log()`` of floats, lists, numpy arrays and dicts (weighted or not), refused ``log()`` calls (None,
strings, ragged lists, negative or NaN weights, unknown kinds, a dict with one bad value), ``end_update()``,
``commit()`` with the next step, with a step already used (refused, records kept) or without one; under
``log_every`` 1 or 3, with a journal."""

from __future__ import annotations

import math
import os
import struct
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from metricbus.adapters.jsonl import JsonlAdapter, read_jsonl
from test_exact import rounded

from metricbus import Agg, MetricBus
from metricbus.errors import MetricTypeError, MetricValueError, SpecError, StepError
from metricbus.replay import replay, sync
from metricbus.spec import SpecLike
from metricbus.testing import MemoryAdapter

RULES: dict[str, SpecLike] = {
    "b": "sum",
    "c": ["min", "max", "count"],
    "d": Agg(micro="sum", update="mean"),
}
NAMES = ("a", "b", "c", "d")
WEIGHTED = ("a",)  # the weight matters only to "a" (mean); the others ignore it

finite = st.floats(allow_nan=False, allow_infinity=False)
moderate = st.floats(min_value=-1e6, max_value=1e6).filter(lambda x: x == 0.0 or abs(x) > 1e-200)
weights = st.sampled_from([0.5, 1.0, 2.0, 3.0])
values = st.lists(finite, min_size=1, max_size=6)
BAD_VALUES: list[Any] = [None, "1.0", [1.0, [2.0]], object(), 1 + 2j]


def _bits(x: float) -> bytes:
    return b"nan" if math.isnan(x) else struct.pack("<d", x)


def _all_negative_zeros(records: list[tuple[float, float]]) -> bool:
    return all(x == 0.0 and math.copysign(1.0, x) < 0 for x, _ in records)


def _check(out: dict[str, float], expected: dict[str, float], window: Updates) -> None:
    """``out`` is ``expected`` bit for bit; a sum or mean of records that are all -0.0 is -0.0 (IEEE's sign, README,
    Semantics: "exactness")."""
    assert set(out) == set(expected)
    for name, value in expected.items():
        base = name.split("/")[0]
        records = [r for update in window for r in update.get(base, [])]
        if value == 0.0 and base in ("a", "b", "d", "x") and _all_negative_zeros(records):
            assert _bits(out[name]) == _bits(-0.0), (name, out[name])
        else:
            assert _bits(out[name]) == _bits(value), (name, out[name], value)


def _order(x: float) -> tuple[float, int]:
    """IEEE 754 totalOrder on non-NaN doubles: -0.0 below +0.0."""
    return (x, 0 if math.copysign(1.0, x) < 0 else 1)


Updates = list[dict[str, list[tuple[float, float]]]]


def expected_of(updates: Updates, e_kind: str | None = None) -> dict[str, float]:
    """The exact reference of ``updates`` (per name, its (x, w) records), under RULES; ``e``: max or min."""
    out: dict[str, float] = {}
    records = {name: [r for update in updates for r in update.get(name, [])] for name in (*NAMES, "e")}
    if records["a"]:
        weight = sum(Fraction(w) for _, w in records["a"])
        out["a"] = rounded(sum((Fraction(x) * Fraction(w) for x, w in records["a"]), Fraction(0)) / weight)
    if records["b"]:
        out["b"] = rounded(sum((Fraction(x) for x, _ in records["b"]), Fraction(0)))
    if records["c"]:
        xs = [x for x, _ in records["c"]]
        out["c/min"], out["c/max"] = min(xs, key=_order), max(xs, key=_order)
        out["c/count"] = float(len(xs))
    sums = [
        rounded(sum((Fraction(x) for x, _ in update["d"]), Fraction(0))) for update in updates if "d" in update
    ]
    if sums:
        if any(math.isinf(s) for s in sums):
            out["d"] = math.fsum(sums) if len({s for s in sums if math.isinf(s)}) == 1 else math.nan
        else:
            out["d"] = rounded(sum(map(Fraction, sums), Fraction(0)) / len(sums))
    if records["e"]:
        xs = [x for x, _ in records["e"]]
        out["e"] = (max if e_kind == "max" else min)(xs, key=_order)
    return out


class BusMachine(RuleBasedStateMachine):
    """One bus; the reference keeps, per name, the (value, weight) records of each update of the open window."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.mem = MemoryAdapter()
        self.bus: MetricBus | None = None
        self.every = 1
        self.step = -1  # the last committed step
        self.commits_in_window = 0
        self.window: Updates = [{}]  # the window's updates (committed or open): name -> its (x, w) records
        self.expected_rows: list[tuple[int, dict[str, float]]] = []
        self.pending = False  # records logged since the last commit
        self.step_names: set[str] = set()  # the names emitted at the last step (log_every 1)

    @initialize(every=st.sampled_from([1, 3]))
    def start(self, every: int) -> None:
        self.every = every
        self.bus = MetricBus(
            adapters=[self.mem], rules=RULES, log_every=every, journal=str(Path(self.tmp.name) / "j")
        )

    # -- valid calls ------------------------------------------------------------------------------------------

    def _record(self, name: str, xs: list[float], ws: list[float] | None) -> None:
        held = self.window[-1].setdefault(name, [])
        held.extend(zip(xs, ws or [1.0] * len(xs), strict=True))
        self.pending = True

    @rule(name=st.sampled_from(NAMES), x=finite)
    def log_float(self, name: str, x: float) -> None:
        assert self.bus is not None
        if name in WEIGHTED and not (x == 0.0 or abs(x) > 1e-200):
            x = 1.0
        self.bus.log(name, x)
        self._record(name, [x], None)

    @rule(name=st.sampled_from(NAMES), xs=values, as_array=st.booleans())
    def log_many(self, name: str, xs: list[float], as_array: bool) -> None:
        assert self.bus is not None
        if name in WEIGHTED:
            xs = [x if x == 0.0 or abs(x) > 1e-200 else 1.0 for x in xs]
        self.bus.log(name, np.array(xs) if as_array else xs)
        self._record(name, xs, None)

    @rule(xs=st.lists(moderate, min_size=1, max_size=4), w=weights)
    def log_weighted(self, xs: list[float], w: float) -> None:
        assert self.bus is not None
        self.bus.log("a", xs, weight=w)
        self._record("a", xs, [w] * len(xs))

    @rule(picked=st.dictionaries(st.sampled_from(NAMES), moderate, min_size=1, max_size=4))
    def log_dict(self, picked: dict[str, float]) -> None:
        assert self.bus is not None
        self.bus.log(picked)
        for name, x in picked.items():
            self._record(name, [x], None)

    @rule()
    def end_update(self) -> None:
        assert self.bus is not None
        self.bus.end_update()
        if self.window[-1]:
            self.window.append({})

    @rule(explicit=st.booleans())
    def commit(self, explicit: bool) -> None:
        assert self.bus is not None
        step = self.step + 1
        out = self.bus.commit(step) if explicit else self.bus.commit()
        self._committed(step, out)

    def _committed(self, step: int, out: dict[str, float]) -> None:
        if step != self.step:
            self.step_names = set()
        self.step = step
        self.pending = False
        self.commits_in_window += 1
        if self.window[-1]:
            self.window.append({})  # a commit ends the open update
        if self.commits_in_window == self.every:
            expected = self._expected()
            _check(out, expected, self.window)
            if expected:
                self.expected_rows.append((step, expected))
            self.step_names |= {name.split("/")[0] for name in expected}
            self.window, self.commits_in_window = [{}], 0
        else:
            assert out == {}

    @precondition(lambda self: self.step >= 0 and self.every == 1)
    @rule()
    def commit_the_same_step(self) -> None:
        """A second commit at a step: fine with other names, a StepError naming a name already emitted there."""
        assert self.bus is not None
        again = sorted(self.step_names & {name for update in self.window for name in update})
        if again:
            with pytest.raises(StepError, match=repr(again[0])):
                self.bus.commit(self.step)
            return
        self._committed(self.step, self.bus.commit(self.step))

    # -- refused calls: they name the metric and change nothing -------------------------------------------------

    @rule(name=st.sampled_from(NAMES), bad=st.sampled_from(BAD_VALUES))
    def log_bad_value(self, name: str, bad: Any) -> None:
        assert self.bus is not None
        with pytest.raises(MetricTypeError, match=repr(name)):
            self.bus.log(name, bad)

    @rule(w=st.sampled_from([-1.0, math.nan, [1.0, 2.0, 3.0]]))
    def log_bad_weight(self, w: Any) -> None:
        assert self.bus is not None
        with pytest.raises(MetricValueError, match="'a'"):
            self.bus.log("a", [1.0, 2.0], weight=w)

    @rule(name=st.sampled_from(NAMES))
    def log_bad_kind(self, name: str) -> None:
        assert self.bus is not None
        with pytest.raises(SpecError, match=repr(name)):
            self.bus.log(name, 1.0, agg="median-ish")

    @rule(good=st.sampled_from(NAMES), bad=st.sampled_from(NAMES), value=st.sampled_from(BAD_VALUES))
    def log_dict_with_a_bad_value(self, good: str, bad: str, value: Any) -> None:
        assert self.bus is not None
        if good == bad:
            return
        with pytest.raises(MetricTypeError, match=repr(bad)):
            self.bus.log({good: 1.0, bad: value})

    @precondition(lambda self: self.step >= 1)
    @rule()
    def commit_a_step_below_the_last(self) -> None:
        assert self.bus is not None
        with pytest.raises(StepError):
            self.bus.commit(self.step - 1)

    # -- the reference ------------------------------------------------------------------------------------------

    def _expected(self) -> dict[str, float]:
        return expected_of(self.window)

    @invariant()
    def nothing_emitted_twice(self) -> None:
        steps = [step for step, _ in self.mem.rows]
        assert steps == sorted(steps)
        for step in set(steps):
            names = [name for s, row in self.mem.rows if s == step for name in row]
            assert len(names) == len(set(names))

    def teardown(self) -> None:
        try:
            if self.bus is not None:
                self.bus.close()
                if self.pending:  # close() commits the records logged since the last commit, as the next step
                    self.step, self.commits_in_window = self.step + 1, self.commits_in_window + 1
                if self.commits_in_window:  # then emits the open window at its last step
                    expected = self._expected()
                    _check(self.mem.rows[-1][1] if expected else {}, expected, self.window)
                    if expected:
                        self.expected_rows.append((self.step, expected))
                live = [(s, {k: _bits(v) for k, v in row.items()}) for s, row in self.mem.rows]
                assert [s for s, _ in live] == [s for s, _ in self.expected_rows]
                for (_, row), (_, expected) in zip(self.mem.rows, self.expected_rows, strict=True):
                    assert set(row) == set(expected)
                replayed = MemoryAdapter()
                replay(Path(self.tmp.name) / "j", [replayed])
                assert [(s, {k: _bits(v) for k, v in row.items()}) for s, row in replayed.rows] == live
        finally:
            self.tmp.cleanup()


def _settings(*, share: int, steps: int) -> settings:
    """A machine's settings: ``MB_EXAMPLES`` (60; 3,000 before a change here, ~90 s a machine) over ``share``."""
    return settings(
        max_examples=int(os.environ.get("MB_EXAMPLES", "60")) // share,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


BusMachine.TestCase.settings = _settings(share=1, steps=40)
TestBus = BusMachine.TestCase


def test_a_refused_commit_leaves_the_open_update_open() -> None:
    """Records logged before and after a refused commit are one update, as if the commit had not been tried
    (found by the machine above: ``Agg(micro="sum", update="mean")`` gave 0.5, the mean of two updates' sums)."""
    mem = MemoryAdapter()
    with MetricBus(adapters=[mem], rules=RULES) as bus:
        bus.log("a", 0.0)
        bus.commit(0)
        bus.log({"a": 1.0, "d": 1.0})
        with pytest.raises(StepError, match="'a'"):
            bus.commit(0)  # 'a' is already at step 0: refused, the records stay
        bus.log("d", 0.0)
        assert bus.commit(1) == {"a": 1.0, "d": 1.0}
        bus.log("d", 2.0)
        with pytest.raises(StepError):
            bus.commit(0)
        bus.end_update()  # an update ended after the refusal stays a boundary
        bus.log("d", 4.0)
        assert bus.commit(2) == {"d": 3.0}


def test_a_refused_export_leaves_the_open_update_open() -> None:
    torch = pytest.importorskip("torch")
    worker = MetricBus(rules=RULES)
    worker.log("d", 1.0)
    worker.log("a", torch.tensor([1.0, -1.0]), weight=torch.tensor([1.0, -1.0]))  # found at export: refused
    with pytest.raises(MetricValueError, match="'a'"):
        worker.export()
    worker.log("d", 2.0)
    driver = MetricBus(rules=RULES)
    driver.ingest([worker.export()])
    assert driver.commit(0) == {"d": 3.0}
    worker.close()
    driver.close()


class DriverMachine(RuleBasedStateMachine):
    """Three workers export, a driver ingests (in any order, any subset) and commits, with its own records too;
    workers declare ``e`` as max or min (the first declaration ingested wins: in a batch that disagrees, each partial
    declaring the other kind is taken without its ``e``, and the SpecError names ``e``); refused calls on either side
    lose nothing else."""

    workers_n = 3

    def __init__(self) -> None:
        super().__init__()
        self.mem = MemoryAdapter()
        self.driver = MetricBus(adapters=[self.mem], rules=RULES)
        self.workers = [MetricBus(rules=RULES) for _ in range(self.workers_n)]
        self.open: list[Updates] = [[{}] for _ in range(self.workers_n)]  # each worker's updates not exported
        self.e_kinds: list[str | None] = [None] * self.workers_n  # each worker's declaration of e
        self.partials: list[tuple[Any, Updates, str | None]] = []  # exported, not ingested: (partial, updates, e)
        self.ingested: Updates = []
        self.own: Updates = [{}]  # the driver's own records
        self.e_kind: str | None = None  # the driver's adopted spec of e
        self.step = -1

    @rule(i=st.integers(0, workers_n - 1), name=st.sampled_from(NAMES), xs=st.lists(moderate, min_size=1, max_size=4))
    def worker_logs(self, i: int, name: str, xs: list[float]) -> None:
        self.workers[i].log(name, xs)
        self.open[i][-1].setdefault(name, []).extend((x, 1.0) for x in xs)

    @rule(i=st.integers(0, workers_n - 1), kind=st.sampled_from(["max", "min"]), x=moderate)
    def worker_declares_e(self, i: int, kind: str, x: float) -> None:
        if self.e_kinds[i] not in (None, kind):
            with pytest.raises(SpecError, match="'e'"):
                self.workers[i].log("e", x, agg=kind)
            return
        self.workers[i].log("e", x, agg=kind)
        self.e_kinds[i] = kind
        self.open[i][-1].setdefault("e", []).append((x, 1.0))

    @rule(i=st.integers(0, workers_n - 1), bad=st.sampled_from(BAD_VALUES))
    def worker_logs_a_bad_value(self, i: int, bad: Any) -> None:
        with pytest.raises(MetricTypeError, match="'b'"):
            self.workers[i].log("b", bad)

    @rule(i=st.integers(0, workers_n - 1))
    def worker_ends_an_update(self, i: int) -> None:
        self.workers[i].end_update()
        if self.open[i][-1]:
            self.open[i].append({})

    @rule(i=st.integers(0, workers_n - 1))
    def worker_exports(self, i: int) -> None:
        updates = [u for u in self.open[i] if u]
        e = self.e_kinds[i] if any("e" in u for u in updates) else None
        self.partials.append((self.workers[i].export(), updates, e))
        self.open[i] = [{}]

    @rule(name=st.sampled_from(NAMES), x=moderate)
    def driver_logs(self, name: str, x: float) -> None:
        self.driver.log(name, x)
        self.own[-1].setdefault(name, []).append((x, 1.0))

    @precondition(lambda self: bool(self.partials))
    @rule(data=st.data())
    def driver_ingests(self, data: st.DataObject) -> None:
        picked = data.draw(st.lists(st.sampled_from(range(len(self.partials))), min_size=1, unique=True))
        batch = [self.partials[k] for k in picked]
        kinds = {e for _, _, e in batch if e is not None} | ({self.e_kind} if self.e_kind else set())
        if len(kinds) > 1:  # the rest of the call is taken: each partial whose 'e' differs from the settled kind
            with pytest.raises(SpecError, match="'e'"):  # (the bus's, else the first partial's) without its 'e'
                self.driver.ingest([p for p, _, _ in batch])
        else:
            self.driver.ingest([p for p, _, _ in batch])
        for _, updates, e in batch:
            if e is not None and self.e_kind is None:
                self.e_kind = e
            refused = e is not None and e != self.e_kind
            self.ingested.extend(
                [kept for u in updates if (kept := {n: r for n, r in u.items() if n != "e"})] if refused else updates
            )
        self.partials = [p for k, p in enumerate(self.partials) if k not in picked]

    @precondition(lambda self: bool(self.partials))
    @rule()
    def driver_ingests_a_bad_batch(self) -> None:
        with pytest.raises(MetricTypeError):
            self.driver.ingest([self.partials[0][0], {"b": 1.0}])

    @rule()
    def driver_commits(self) -> None:
        self.step += 1
        out = self.driver.commit(self.step)
        updates = [*self.ingested, *(u for u in self.own if u)]
        expected = expected_of(updates, self.e_kind)
        _check(out, expected, updates)
        self.ingested, self.own = [], [{}]

    @precondition(lambda self: self.step >= 1)
    @rule()
    def driver_commits_a_step_below_the_last(self) -> None:
        with pytest.raises(StepError):
            self.driver.commit(self.step - 1)  # the ingested partials and the open update stay as they were

    def teardown(self) -> None:
        for bus in (*self.workers, self.driver):
            bus.close()


DriverMachine.TestCase.settings = _settings(share=2, steps=40)
TestDriver = DriverMachine.TestCase


class RunMachine(RuleBasedStateMachine):
    """One journal, several runs resumed from it (``resume=True``), each from a checkpoint step at or below the
    last one, or after it, with the jsonl adapter or without it, under ``log_every`` 1, 2 or 3: replay of the
    journal, and the jsonl file after ``sync``, hold the one timeline (steps below a resume's first step from before
    it, from there on its own; a window never spans two segments: the last one a resume cut short is emitted at its
    last step kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.journal = Path(self.tmp.name) / "j"
        self.jsonl = Path(self.tmp.name) / "metrics.jsonl"
        self.bus: MetricBus | None = None
        self.every = 1
        self.segments: list[tuple[int, list[tuple[int, list[float]]]]] = []  # per resumed run: start, commits
        self.last = -1  # the last step journaled
        self.start_at: int | None = None  # the step the next commit takes (a resumed run's first)
        self.in_window = 0  # commits of this run's open window

    @initialize(every=st.sampled_from([1, 2, 3]))
    def start(self, every: int) -> None:
        self.every = every

    @rule(back=st.integers(-2, 3), with_adapter=st.booleans())
    def restart(self, back: int, with_adapter: bool) -> None:
        if self.bus is not None:
            self.bus.close()
        adapters = [JsonlAdapter(path=self.jsonl)] if with_adapter else []
        self.bus = MetricBus(journal=str(self.journal), resume=True, adapters=adapters, log_every=self.every)
        self.start_at = max(0, self.last + 1 - back)
        self.in_window = 0

    @precondition(lambda self: self.bus is not None)
    @rule(xs=st.lists(moderate, min_size=1, max_size=4))
    def commit(self, xs: list[float]) -> None:
        assert self.bus is not None
        step = self.last + 1 if self.start_at is None else self.start_at
        if self.start_at is not None:
            self.segments.append((step, []))
            self.start_at = None
        self.bus.log("x", xs)
        out = self.bus.commit(step)
        commits = self.segments[-1][1]
        commits.append((step, xs))
        self.in_window += 1
        if self.in_window == self.every:
            window = [x for _, records in commits[-self.every :] for x in records]
            _check(out, {"x": _mean(window)}, [{"x": [(x, 1.0) for x in window]}])
            self.in_window = 0
        else:
            assert out == {}
        self.last = step

    def _timeline(self) -> list[tuple[int, dict[str, bytes]]]:
        """What replay emits: each segment's commits below every later segment's start, in windows of
        ``every`` counted from the segment's first commit, the last one emitted where the kept commits end."""
        rows: list[tuple[int, list[float]]] = []
        for k, (_, commits) in enumerate(self.segments):
            limit = min((start for start, _ in self.segments[k + 1 :]), default=None)
            kept = [(step, xs) for step, xs in commits if limit is None or step < limit]
            for i in range(0, len(kept), self.every):
                window = kept[i : i + self.every]
                rows.append((window[-1][0], [x for _, xs in window for x in xs]))
        return [(step, {"x": _bits(_mean(xs))}) for step, xs in sorted(rows, key=lambda r: r[0])]

    def teardown(self) -> None:
        try:
            if self.bus is None:
                return
            self.bus.close()
            timeline = self._timeline()
            replayed = MemoryAdapter()
            replay(self.journal, [replayed])
            got = [(s, {k: _bits(v) for k, v in row.items()}) for s, row in replayed.rows]
            assert _signless(got) == _signless(timeline)
            sync(self.journal, [JsonlAdapter(path=self.jsonl)])
            rows = read_jsonl(self.jsonl) if self.jsonl.exists() else []
            assert [(s, {k: _bits(v) for k, v in row.items()}) for s, row in rows] == got
        finally:
            self.tmp.cleanup()


def _mean(xs: list[float]) -> float:
    return rounded(sum(map(Fraction, xs), Fraction(0)) / len(xs))


def _signless(rows: list[tuple[int, dict[str, bytes]]]) -> list[tuple[int, dict[str, bytes]]]:
    """The rows with -0.0 read as +0.0 (a mean of -0.0 records alone may be either: README, exactness)."""
    negative_zero = struct.pack("<d", -0.0)
    return [(s, {k: _bits(0.0) if v == negative_zero else v for k, v in row.items()}) for s, row in rows]


RunMachine.TestCase.settings = _settings(share=2, steps=25)
TestRuns = RunMachine.TestCase
