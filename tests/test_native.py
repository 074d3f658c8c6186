"""The compiled loops (metricbus/_speedups.c) give the bits of the numpy code they stand for, or leave it the call.

Every other test runs with them (``make test`` builds them); here each is checked against the Python code it
replaces, on random data and at the edges, and a bus with and without them emits the same bits.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import struct
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import metricbus
from metricbus import MetricBus, accumulate, collect, micro_columns, native, rank_level, summary_arrays
from metricbus.accumulate import PlainBuffers
from metricbus.micro_columns import MicroUpdate, Segments, summarize_joined
from metricbus.summary import NEAR
from metricbus.testing import MemoryAdapter

speedups = native.speedups
_USERS = (accumulate, collect, micro_columns, summary_arrays, rank_level)  # every module that calls it
needs_speedups = pytest.mark.skipif(speedups is None, reason="metricbus._speedups not built or turned off")


@contextlib.contextmanager
def _numpy_only() -> Iterator[None]:
    """Inside: every caller runs its numpy code, as without the compiled module."""
    saved = [module.speedups for module in _USERS]
    for module in _USERS:
        module.speedups = None
    try:
        yield
    finally:
        for module, held in zip(_USERS, saved, strict=True):
            module.speedups = held


def _with_and_without(run: Callable[[], Any]) -> tuple[Any, Any]:
    """``run()`` with the compiled module, then with numpy's code alone."""
    compiled = run()
    with _numpy_only():
        return compiled, run()


@pytest.fixture
def pure() -> Iterator[None]:
    """The numpy code only, as without the compiled module."""
    with _numpy_only():
        yield


def test_built_here() -> None:
    """``make test`` builds the module: a failed build must not pass unnoticed (the numpy code would hide it)."""
    if os.environ.get("METRICBUS_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("METRICBUS_PURE_PYTHON is set")
    assert speedups is not None, "metricbus._speedups did not build or load (pip install -e . compiles it)"


def test_pure_python_switch() -> None:
    code = "from metricbus import native; print(native.speedups is None)"
    built = importlib.util.find_spec("metricbus._speedups") is not None
    for value, expected in (("1", "True"), ("0", str(not built))):
        env = {**os.environ, "METRICBUS_PURE_PYTHON": value}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert done.stdout.strip() == expected


def test_other_version_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    stale = types.ModuleType("metricbus._speedups")
    stale.ABI = native.ABI + 1  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "metricbus._speedups", stale)
    monkeypatch.setattr(metricbus, "_speedups", stale, raising=False)
    monkeypatch.delenv("METRICBUS_PURE_PYTHON", raising=False)
    assert native._load() is None


# -- columns --------------------------------------------------------------------------------------------------


def _both(sizes: list[int], flat: Any) -> tuple[Any, Any]:
    """The micro update of ``flat`` split by ``sizes`` with the compiled loop and with numpy's code."""
    names = [f"m{i}" for i in range(len(sizes))]
    segments = Segments(sizes)
    return _with_and_without(lambda: summarize_joined(names, segments, flat, {}))


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, MicroUpdate):
        assert a.names == b.names
        assert a.fields.tobytes() == b.fields.tobytes()
        assert not a.fields.flags.writeable
    assert list(a) == list(b)
    for name in a:
        assert np.array(a[name][:12]).tobytes() == np.array(b[name][:12]).tobytes(), name


_VALUES = {
    "normal": lambda rng, n: rng.standard_normal(n),
    "quarters": lambda rng, n: rng.integers(-8, 8, n) * 0.25,
    "near mean": lambda rng, n: 1e6 + rng.standard_normal(n) * 1e-3,
    "wide": lambda rng, n: rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n),
    "lognormal": lambda rng, n: rng.lognormal(0.0, 2.0, n),
    "equal": lambda rng, n: np.full(n, 0.1),
    "zeros": lambda rng, n: np.where(rng.random(n) < 0.5, 0.0, rng.standard_normal(n)),
    "huge": lambda rng, n: rng.standard_normal(n) * 1e200,
}


@needs_speedups
@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    k=st.integers(8, 40),
    longest=st.sampled_from([1, 2, 9, 17, 129, 300]),
    kind=st.sampled_from(sorted(_VALUES)),
)
def test_columns_match_numpy(seed: int, k: int, longest: int, kind: str) -> None:
    """Sizes across numpy's pairwise-sum blocks (8, 128): the same bits, m2 included."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, longest + 1, size=k).tolist()
    flat = _VALUES[kind](rng, sum(sizes)).astype(np.float64)
    _same(*_both(sizes, flat))


@needs_speedups
@pytest.mark.parametrize(
    ("special", "reason"),
    [(float("nan"), 1), (float("inf"), 1), (-0.0, 2), (1e300, 3), (2.0**501, 3)],
)
def test_columns_leave_the_rare_cases_to_numpy(special: float, reason: int) -> None:
    """A NaN, an infinity, a -0.0 or a large magnitude: the compiled loop declines, numpy's code decides."""
    assert speedups is not None
    sizes = [3] * 10
    flat = np.arange(30, dtype=np.float64) * 0.5
    flat[13] = special
    fields = np.empty((12, 10))
    assert speedups.columns(flat, Segments(sizes).sizes, fields, NEAR) == reason
    _same(*_both(sizes, flat))


@needs_speedups
def test_columns_unsettled_and_near_mean() -> None:
    assert speedups is not None
    sizes = [2] * 8
    wide = np.array([1.0, 1e-300] * 8)  # a sum of more than two components
    assert speedups.columns(wide, Segments(sizes).sizes, np.empty((12, 8)), NEAR) == 4
    _same(*_both(sizes, wide))
    near = np.array([1e6, 1e6 + 2.0**-30] * 8)  # a spread tiny next to the mean
    assert speedups.columns(near, Segments(sizes).sizes, np.empty((12, 8)), NEAR) == 5
    _same(*_both(sizes, near))


@needs_speedups
def test_columns_refuse_bad_arguments() -> None:
    assert speedups is not None
    sizes = Segments([2, 2]).sizes
    with pytest.raises(ValueError, match="sum\\(sizes\\)"):
        speedups.columns(np.zeros(3), sizes, np.empty((12, 2)), NEAR)
    with pytest.raises(ValueError, match="12 x len"):
        speedups.columns(np.zeros(4), sizes, np.empty((11, 2)), NEAR)
    with pytest.raises(ValueError, match="at least 1"):
        speedups.columns(np.zeros(4), np.array([4, 0], dtype=np.intp), np.empty((12, 2)), NEAR)
    with pytest.raises((BufferError, TypeError, ValueError)):  # a strided view: no contiguous buffer
        speedups.columns(np.zeros(4), sizes, np.empty((12, 4))[:, ::2], NEAR)


# -- take_plain -------------------------------------------------------------------------------------------------


def _take_both(buffers: list[list[Any]]) -> tuple[Any, Any, list[list[Any]], list[list[Any]]]:
    copies = [list(b) for b in buffers]
    names = tuple(f"m{i}" for i in range(len(buffers)))
    sources = iter((buffers, copies))  # the first run takes from ``buffers``, the second from ``copies``
    compiled, numpy_only = _with_and_without(lambda: PlainBuffers(names, next(sources)).take())
    return compiled, numpy_only, buffers, copies


@needs_speedups
def test_take_plain_matches_python() -> None:
    rng = np.random.default_rng(3)
    buffers: list[list[Any]] = [rng.standard_normal(int(n)).tolist() for n in rng.integers(0, 5, 30)]
    buffers[4] = []
    buffers[5] = [np.float64(2.5), 1.0]  # a float subclass: its value
    compiled, numpy_only, left, left_too = _take_both(buffers)
    assert compiled == numpy_only
    assert left == left_too == [[] for _ in range(30)]


@needs_speedups
def test_take_plain_declines_a_non_float() -> None:
    assert speedups is not None
    buffers: list[list[Any]] = [[1.0, 2.0], [3.0, 4]]
    assert speedups.take_plain(buffers) is None
    assert buffers == [[1.0, 2.0], [3.0, 4]]  # untouched
    compiled, numpy_only, _, _ = _take_both(buffers)
    assert compiled == numpy_only
    with pytest.raises(TypeError, match="list of lists"):
        speedups.take_plain([(1.0,)])  # type: ignore[list-item]


# -- append_dict ------------------------------------------------------------------------------------------------


@needs_speedups
def test_append_dict_all_or_nothing() -> None:
    assert speedups is not None
    fast: dict[str, list[float]] = {"a": [0.5], "b": [], "c": []}
    assert speedups.append_dict({"a": 1.0, "b": 2.0}, fast) == 2
    assert fast == {"a": [0.5, 1.0], "b": [2.0], "c": []}
    for metrics in ({"a": 1.0, "b": 2}, {"a": 1.0, "x": 2.0}, {"a": 1.0, 3: 2.0}, {"a": np.float64(1.0)}, {}):
        assert speedups.append_dict(metrics, fast) == -1
    assert fast == {"a": [0.5, 1.0], "b": [2.0], "c": []}
    many = {f"m{i}": [] for i in range(40)}  # more keys than the stack holds
    assert speedups.append_dict({f"m{i}": float(i) for i in range(40)}, many) == 1
    assert list(many.values()) == [[float(i)] for i in range(40)]


# -- a bus with and without ------------------------------------------------------------------------------------


def _run(seed: int) -> list[dict[str, float]]:
    rng = np.random.default_rng(seed)
    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], dist=None)
    bus.define("spread", ["mean", "std", "min", "max", "first", "last", "sum", "count"])
    bus.define("lengths", ["mean", "std", "min", "max", "sum"])
    names = [f"metric/{i}" for i in range(12)]
    for step in range(30):
        for update in range(1 + step % 3):
            for name in names:
                for x in (rng.standard_normal(1 + (step + update) % 4) * 10.0 ** int(rng.integers(-5, 5))).tolist():
                    bus.log(name, x)
            bus.log({"dict/a": float(rng.random()), "dict/b": 0.25 * step, "spread": float(rng.random())})
            if step == 7:
                bus.log("metric/0", -0.0)
            if step == 11:
                bus.log("metric/1", float("nan"))
            bus.log("spread", [1e6, 1e6 + 2.0**-30])
            bus.log({"one key": float(rng.random())})
            bus.log("lengths", rng.lognormal(3.0, 1.0, 40 + step))
            bus.end_update()
        bus.commit()
    bus.close()
    return [{k: float(v) for k, v in row.items()} for _, row in memory.rows]


def _bits(rows: list[dict[str, float]]) -> list[dict[str, bytes]]:
    return [{k: np.float64(v).tobytes() for k, v in row.items()} for row in rows]


@needs_speedups
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bus_emits_the_same_bits(seed: int) -> None:
    compiled, numpy_only = _with_and_without(lambda: _run(seed))
    assert _bits(compiled) == _bits(numpy_only)


@needs_speedups
def test_dicts_from_threads_lose_nothing() -> None:
    """log(dict) from four threads while the main thread commits: every record is committed once."""
    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], dist=None)
    bus.define("n", "sum")
    bus.define("v", "sum")
    bus.log({"n": 0.0, "v": 0.0})
    go = threading.Barrier(5)

    def worker() -> None:
        go.wait()
        for _ in range(20_000):
            bus.log({"n": 1.0, "v": 0.5})

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    go.wait()
    while any(thread.is_alive() for thread in threads):
        bus.commit()
    for thread in threads:
        thread.join()
    bus.commit()
    bus.close()
    assert sum(row["n"] for _, row in memory.rows if "n" in row) == 80_000
    assert sum(row["v"] for _, row in memory.rows if "v" in row) == 40_000


def test_pure_fixture_runs_numpy(pure: None) -> None:
    """Without the compiled module (the fixture), the same run works through numpy's code."""
    assert all(module.speedups is None for module in _USERS)
    assert _bits(_run(5))


# -- finite_nonzero ---------------------------------------------------------------------------------------------


@needs_speedups
def test_finite_nonzero_matches_numpy() -> None:
    from metricbus import rank_level

    rng = np.random.default_rng(7)
    rows = (1, 3, 5, 8, 9)
    for special in (None, 0.0, -0.0, float("nan"), float("inf"), -float("inf"), 5e-324):
        fields = rng.standard_normal((12, 3, 7))
        fields[0] = 0.0  # a row not checked
        if special is not None:
            fields[8, 2, 6] = special
        expected = rank_level._all_finite_nonzero(fields[list(rows)])
        assert speedups is not None
        assert speedups.finite_nonzero(fields, rows, 12) is expected
        assert rank_level._ordinary(fields) is expected
    with pytest.raises(IndexError):
        speedups.finite_nonzero(np.ones((12, 2)), (12,), 12)
    with pytest.raises(ValueError, match="equal length"):
        speedups.finite_nonzero(np.ones(25), (1,), 12)


# -- array_parts ------------------------------------------------------------------------------------------------


def _block_both(values: Any) -> tuple[Any, Any]:
    return _with_and_without(lambda: summary_arrays._of_block(values))


def _summary_bits(s: Any) -> tuple[Any, ...]:
    return (*(np.float64(x).tobytes() for x in s[:12]), tuple(tuple(map(float.hex, p)) for p in s.rest))


_ARRAYS = {
    **_VALUES,
    "subnormal": lambda rng, n: rng.standard_normal(n) * 5e-324 * 1000,
    "signed zeros": lambda rng, n: np.where(rng.random(n) < 0.5, -0.0, np.where(rng.random(n) < 0.5, 0.0, 1.5)),
    "negative zeros": lambda rng, n: np.full(n, -0.0),
    "all zero": lambda rng, n: np.zeros(n),
    "negative": lambda rng, n: -rng.lognormal(3.0, 1.0, n),
    "near max": lambda rng, n: rng.standard_normal(n) * 1e300,
    "with nan": lambda rng, n: np.where(rng.random(n) < 0.01, np.nan, rng.standard_normal(n)),
    "with inf": lambda rng, n: np.where(rng.random(n) < 0.01, np.inf, rng.standard_normal(n)),
    "2**700": lambda rng, n: rng.standard_normal(n) * 2.0**700,
}


@needs_speedups
@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.sampled_from([17, 18, 1024, 1025, 4096, 20480, 32768]),
    kind=st.sampled_from(sorted(_ARRAYS)),
)
def test_array_parts_match_numpy(seed: int, n: int, kind: str) -> None:
    """An array block's Summary, the exact sum's components and the signed zeros included: the same bits."""
    rng = np.random.default_rng(seed)
    values = np.ascontiguousarray(_ARRAYS[kind](rng, n), dtype=np.float64)
    compiled, numpy_only = _block_both(values)
    assert _summary_bits(compiled) == _summary_bits(numpy_only)


@needs_speedups
def test_array_parts_declines_what_the_list_path_takes() -> None:
    assert speedups is not None
    for values in ([1.0, np.nan], [1.0, np.inf], [np.finfo(float).max, 1.0], [0.0, -0.0], [2.0**961, 1.0]):
        assert speedups.array_parts(np.array(values)) is None
    lowest, highest, sums = speedups.array_parts(np.array([-0.0, 0.0, 2.5]))  # type: ignore[misc]
    assert (np.float64(lowest).tobytes(), highest) == (np.float64(-0.0).tobytes(), 2.5)
    assert sum(sums) == 2.5


# -- the review's cases -----------------------------------------------------------------------------------------


@needs_speedups
@pytest.mark.parametrize("seed", range(8))
def test_dict_shapes_sharing_a_name_fold_alike(seed: int) -> None:
    """Two dict shapes share ``a``: its buffer is folded when it reaches FOLD_AT on both paths, so its std is the
    same bits (the Python path once let it hold FOLD_AT records per shape)."""

    def run() -> list[dict[str, float]]:
        rng = np.random.default_rng(seed)
        memory = MemoryAdapter()
        bus = MetricBus(adapters=[memory], dist=None)
        bus.define("a", ["mean", "std", "sum", "count"])
        for x in rng.standard_normal(400).tolist():
            bus.log({"a": x, "b": 1.0})
            bus.log({"a": x * 3.0, "c": 2.0})
        bus.commit()
        bus.close()
        return [row for _, row in memory.rows]

    compiled, numpy_only = _with_and_without(run)
    assert _bits(compiled) == _bits(numpy_only)


@needs_speedups
def test_take_plain_takes_what_it_counted_whatever_a_finalizer_does() -> None:
    """A collection during the call (a finalizer appending, as another thread's log() could) never makes the
    records and the counts disagree, and loses nothing (the review's reproducer crashed or lost records)."""
    import gc

    assert speedups is not None
    extra = 100_000
    buffer = [1.0, 2.0]

    class Finalizer:
        def __del__(self) -> None:
            buffer.extend([3.0] * extra)

    saved = gc.get_threshold()
    gc.collect()
    gc.set_threshold(2)
    try:
        cycle = Finalizer()
        cycle.self = cycle  # type: ignore[attr-defined]
        del cycle
        taken = speedups.take_plain([buffer])
    finally:
        gc.set_threshold(*saved)
        gc.collect()
    assert taken is not None
    counts, records = taken
    assert counts == [len(records) // 8]
    assert counts[0] + len(buffer) in (2, 2 + extra)
    assert struct.unpack(f"{counts[0]}d", records)[:2] == (1.0, 2.0)


@needs_speedups
def test_append_dict_survives_a_key_whose_eq_changes_the_dict() -> None:
    """A str subclass's key in ``fast`` runs __eq__ during the lookups: a dict changed by it gets nothing appended
    (the review's reproducer wrote past the end of the buffers)."""
    assert speedups is not None
    metrics: dict[str, float] = {"loss": 1.0, "other": 2.0}

    class Name(str):
        __hash__ = str.__hash__

        def __eq__(self, other: object) -> bool:
            for i in range(40):
                metrics[f"grown{i}"] = 0.0
            return str.__eq__(self, other)

    fast: dict[str, list[float]] = {Name("loss"): [], "other": []}
    assert speedups.append_dict(metrics, fast) == -1
    assert list(fast.values()) == [[], []]


@needs_speedups
def test_one_key_dicts_take_the_validated_path() -> None:
    assert speedups is not None
    fast: dict[str, list[float]] = {"a": []}
    assert speedups.append_dict({"a": 1.0}, fast) == -1
    assert fast == {"a": []}
