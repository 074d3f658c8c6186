"""Replay's columnar path emits the bits of the scalar path (and of the live bus) on hostile data."""

from __future__ import annotations

import math
import struct
import warnings
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metricbus import MetricBus
from metricbus.column_kinds import divide_by_count
from metricbus.errors import SpecError
from metricbus.exact import divide_by_count as scalar_divide_by_count
from metricbus.journal import read_journal, stream_journal
from metricbus.replay import emitted, parse_rule, replay
from metricbus.spec import parse_spec_text
from metricbus.testing import MemoryAdapter

HOSTILE = st.one_of(
    st.floats(width=64),
    st.sampled_from([0.0, -0.0, 1.0, 3.0, 0.1, -0.1, 1e16, 1e-16, 1e308, -1e308, 5e-324, 2.0**-1022, 1e300,
                     float("inf"), float("-inf"), float("nan")]),
)
FINITE = st.floats(allow_nan=False, allow_infinity=False, width=64).filter(lambda x: abs(x) < 1e300)
SPECS = ["mean", "sum", "min", "max", "first", "last", "count", "std", "mean,max,min", "sum,count,std",
         "step:sum", "micro:sum,rank:mean", "micro:mean,step:p90", "p50"]
Rows = list[tuple[int, dict[str, bytes]]]


def bits(rows: Any) -> Rows:
    """Rows with every float as its 8 bytes (NaN == NaN, -0.0 != 0.0)."""
    return [(step, {k: struct.pack("<d", v) for k, v in m.items()}) for step, m in rows]


def scalar(path: Path, **options: Any) -> Rows:
    """The scalar path: a journal read whole has decoded commits, which never take the columnar path."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bits(emitted(read_journal(path), **options))


def columnar(path: Path, **options: Any) -> Rows:
    """The streaming replay, which takes the columnar path where a run of commits fits it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bits(emitted(stream_journal(path), **options))


def write(path: Path, steps: list[list[dict[str, list[tuple[float, float | None]]]]], rules: dict[str, str],
          *, controller: bool = True, log_every: int = 1, resume: bool = False, first: int = 0) -> MemoryAdapter:
    """Journal ``steps`` (per step, per worker: name -> records (value, weight)) through a driver's ingest (or
    one worker's own log when there is one worker and no controller), from step ``first`` (``resume``: a resumed
    writer of ``path``'s journal); returns what the live bus emitted."""
    mem = MemoryAdapter()
    specs = {name: parse_spec_text(text, metric=name) for name, text in rules.items()}
    with MetricBus(dist=None, rules=specs, adapters=[mem], journal=str(path), fsync="never", log_every=log_every,
                   resume=resume) as bus:
        for step, workers in enumerate(steps):
            if controller:
                partials = []
                for records in workers:
                    worker = MetricBus(dist=None, rules=specs)
                    _log(worker, records)
                    partials.append(worker.export())
                    worker.close()
                bus.ingest(partials)
            else:
                _log(bus, workers[0])
            bus.commit(first + step)
    return mem


def replayed_as_live(steps: Any, rules: dict[str, str], **options: Any) -> None:
    """Journal ``steps`` (``write``'s ``options``), then assert columnar == scalar == the live bus, bit for bit (NaNs
    included: every emitted NaN is ``math.nan``, metricbus.canonical)."""
    with TemporaryDirectory() as tmp:
        path = Path(tmp) / "j"
        live = bits(write(path, steps, rules, **options).rows)
        got = columnar(path)
        assert got == scalar(path)
        assert got == live


def rule_replays_alike(steps: Any, rules: dict[str, str], rule: str, **options: Any) -> None:
    """Journal ``steps`` (``write``'s ``options``), then assert the ``--rule`` re-aggregation ``rule``
    (``PATTERN=SPEC``, or a spec for every metric) gives columnar == scalar, or fails alike where the journal cannot
    serve it."""
    text = rule if "=" in rule else f"m*={rule}"
    with TemporaryDirectory() as tmp:
        path = Path(tmp) / "j"
        write(path, steps, rules, **options)
        try:
            want = scalar(path, rules=[parse_rule(text)])
        except SpecError:  # a rule the journal cannot serve (a quantile of records without a sketch) fails alike
            with pytest.raises(SpecError):
                columnar(path, rules=[parse_rule(text)])
            return
        assert columnar(path, rules=[parse_rule(text)]) == want


def _log(bus: MetricBus, records: dict[str, list[tuple[float, float | None]]]) -> None:
    for name, values in records.items():
        for value, weight in values:
            bus.log(name, value, weight=weight)


def records(values: st.SearchStrategy[float], weighted: bool) -> st.SearchStrategy[list[tuple[float, float | None]]]:
    """1-4 records of one metric, weighted sometimes."""
    weight = st.one_of(st.none(), st.sampled_from([0.5, 2.0, 3.0, 1e-3])) if weighted else st.none()
    return st.lists(st.tuples(values, weight), min_size=1, max_size=4)


@st.composite
def journals(draw: st.DrawFn, values: st.SearchStrategy[float], *, weighted: bool = False,
             max_workers: int = 4) -> tuple[list[list[dict[str, list[tuple[float, float | None]]]]], dict[str, str]]:
    """Steps of workers' records: one shape for a few commits, then another (names come and go)."""
    names = [f"m{i}" for i in range(draw(st.integers(1, 5)))]
    rules = {name: draw(st.sampled_from(SPECS)) for name in names}
    workers = draw(st.integers(1, max_workers))
    steps = []
    for _ in range(draw(st.integers(1, 3))):  # runs of one shape
        logged = [draw(st.lists(st.sampled_from(names), min_size=1, unique=True)) for _ in range(workers)]
        for _ in range(draw(st.integers(1, 4))):
            steps.append([{name: draw(records(values, weighted)) for name in mine} for mine in logged])
    return steps, rules


FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FEW
@given(journals(HOSTILE, weighted=True))
def test_hostile_values_bitwise(case: Any) -> None:
    """NaN, inf, -0.0, huge and subnormal values, weights: columnar == scalar == live, bit for bit."""
    steps, rules = case
    replayed_as_live(steps, rules)


def test_columnar_nans_are_math_nan() -> None:
    """NaNs with a payload and of both signs, and +inf meeting -inf, in runs long enough for the columnar path, one
    worker and several: every emitted NaN has math.nan's bits, as live."""
    payload = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_1234))[0]
    negative = struct.unpack("<d", struct.pack("<Q", 0xFFF8_0000_0000_0001))[0]
    for workers in (1, 3):
        steps = [[{"m0": [(payload if step % 3 else negative, None), (1.0, None)],
                   "m1": [(float("inf"), None), (float("-inf"), None)],
                   "m2": [(float(step), None)]} for _ in range(workers)] for step in range(40)]
        with TemporaryDirectory() as tmp:
            path = Path(tmp) / "j"
            live = bits(write(path, steps, {"m*": "mean,max,sum"}, controller=workers > 1).rows)
            got = columnar(path)
            nan = struct.pack("<d", math.nan)
            assert {b for _, row in got for b in row.values() if b[6:] in (b"\xf8\x7f", b"\xf8\xff")} == {nan}
            assert got == live


@FEW
@given(journals(FINITE, max_workers=6))
def test_finite_sums_with_remainders_bitwise(case: Any) -> None:
    """Finite values whose sums need a low part (lo != 0): the vectorized division and exact sums hold."""
    steps, rules = case
    replayed_as_live(steps, rules)


@FEW
@given(journals(HOSTILE, weighted=True, max_workers=1))
def test_one_worker_bitwise(case: Any) -> None:
    """A one-rank journal (the live single-worker path): columnar == scalar == live."""
    steps, rules = case
    replayed_as_live(steps, rules, controller=False)


@FEW
@given(journals(FINITE, max_workers=3), st.sampled_from(["sum", "mean,std", "max,first,last,count",
                                                          "micro:sum,rank:mean", "step:mean", "m0=p90"]))
def test_rules_bitwise(case: Any, rule: str) -> None:
    """A --rule re-aggregation: columnar == scalar."""
    steps, rules = case
    rule_replays_alike(steps, rules, rule)


def many_ranks(*, seed: int, steps: int, ranks: int, decades: int) -> list[list[dict[str, list[tuple[float, None]]]]]:
    """``steps`` commits of ``ranks`` workers logging metrics a..d (1-3 records each, values over ``2 * decades``
    orders of magnitude), a NaN and a -0.0 sprinkled in."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        workers = []
        for rank in range(ranks):
            values = rng.standard_normal(4) * 10.0 ** rng.integers(-decades, decades, 4)
            if step % 17 == 3 and rank == 5:
                values[0] = np.nan
            if step % 13 == 4 and rank == 2:
                values[1] = -0.0
            workers.append({name: [(float(v), None)] * (1 + rank % 3) for name, v in zip("abcd", values,
                                                                                         strict=True)})
        out.append(workers)
    return out


def test_many_commits_and_ranks_bitwise(tmp_path: Path) -> None:
    """Runs longer than one batch, over many ranks, with a few hostile values sprinkled in."""
    rules = {"a": "mean", "b": "sum,std", "c": "min,max", "d": "count,first,last"}
    steps = many_ranks(seed=7, steps=60, ranks=24, decades=20)
    live = write(tmp_path / "j", steps, rules)
    assert columnar(tmp_path / "j") == scalar(tmp_path / "j") == bits(live.rows)


def test_replay_into_an_adapter_equals_live(tmp_path: Path) -> None:
    """``replay`` (the streaming path) delivers the live steps."""
    steps = [[{"loss": [(0.1 * s + r, None), (1.0 / (s + 1), None)]} for r in range(3)] for s in range(40)]
    live = write(tmp_path / "j", steps, {"loss": "mean,std,max"})
    mem = MemoryAdapter()
    replay(tmp_path / "j", [mem])
    assert bits(mem.rows) == bits(live.rows)


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False), st.floats(allow_nan=False, allow_infinity=False),
       st.integers(1, 2**27))
def test_divide_by_count_matches_the_scalar_one(hi: float, lo: float, count: int) -> None:
    """Where the vectorized quick division settles a quotient, it is the scalar one's."""
    lo = lo * 2.0**-60 if abs(lo) >= abs(hi) * 2.0**-52 else lo  # a plausible remainder
    q, done = divide_by_count(np.array([hi]), np.array([lo]), np.array([float(count)]))
    want = scalar_divide_by_count(hi, lo, float(count))
    if done[0]:
        assert want is not None
        assert struct.pack("<d", q[0]) == struct.pack("<d", want)


def test_a_sum_beyond_the_double_range_is_inf_in_columns() -> None:
    """A state whose exact sum passes MAX holds ``total`` = MAX: the columnar ``sum`` leaves it to the scalar kind,
    which rounds it to inf, as live does (found by hypothesis: the columns emitted MAX)."""
    steps = [[{"m0": [(7.976931348623158e307, None), (1e308, None)]}]]
    replayed_as_live(steps, {"m0": "sum"}, controller=False)
