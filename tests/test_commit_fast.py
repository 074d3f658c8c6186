"""A commit's fast paths: the plain buffers taken together, the exact sums by extraction, the emit shortcuts and the
delivery queue give what the one-at-a-time paths give, bit for bit, and lose no record logged meanwhile."""

from __future__ import annotations

import math
import queue
import struct
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus import MetricBus, accumulate
from metricbus.accumulate import FOLD_AT, PlainBuffers
from metricbus.delivery_worker import Bounded
from metricbus.micro_columns import COLUMNS_FROM, summarize
from metricbus.summary import Summary
from metricbus.testing import MemoryAdapter

ALL = ["mean", "sum", "min", "max", "first", "last", "count", "std"]
NAMES = [f"m{i:03d}" for i in range(3 * COLUMNS_FROM)]


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


def expected(records: list[float]) -> dict[str, float]:
    """What one metric with every kind emits for ``records`` (one update, one worker), from ``Summary.of_batch``."""
    s = Summary.of_batch(records, None)
    return {"count": float(s.count), "first": s.first, "last": s.last, "max": s.max, "mean": s.mean(),
            "min": s.min, "sum": s.sum(), "std": s.std()}  # fmt: skip


def log_each(bus: MetricBus, logged: dict[str, list[float]]) -> None:
    """``log(name, x)`` of every record, metric by metric."""
    for name, records in logged.items():
        for x in records:
            bus.log(name, x)


def assert_emits(out: dict[str, float], logged: dict[str, list[float]]) -> None:
    """``out`` holds each metric's kinds as ``expected`` says: bit for bit, std within a few ulps."""
    assert sorted(out) == sorted(f"{name}/{kind}" for name in logged for kind in ALL)
    for name, records in logged.items():
        for kind, want in expected(records).items():
            got = out[f"{name}/{kind}"]
            if kind == "std":
                assert got == pytest.approx(want, rel=1e-13, nan_ok=True), (name, records)
            else:
                assert bits(got) == bits(want) or (math.isnan(got) and math.isnan(want)), (name, kind, records)


def test_commits_of_the_same_metrics_equal_of_batch() -> None:
    """Commit after commit of the same metrics (the cached buffers and layout), random and binary values."""
    rng = np.random.default_rng(7)
    b = MetricBus(dist=None, strict=True, rules={"m*": ALL})
    for step in range(6):
        logged = {name: (rng.standard_normal(8) * 10.0 ** rng.integers(-3, 4)).tolist() for name in NAMES}
        if step % 2:
            logged = {name: [0.25 * j for j in range(8)] for name in NAMES}
        log_each(b, logged)
        assert_emits(b.commit(), logged)
    b.close()


def test_touched_metrics_keep_log_order_between_plain_commits() -> None:
    """A metric also logged by the validated path (an int, a list, an array, past FOLD_AT) in some commits only."""
    b = MetricBus(dist=None, strict=True, rules={"m*": ALL})
    for step in range(5):
        logged: dict[str, list[float]] = {name: [float(i), 0.5, -float(step)] for i, name in enumerate(NAMES)}
        log_each(b, logged)
        special = NAMES[3]
        if step == 1:
            b.log(special, 7)  # an int: the validated path
            logged[special].append(7.0)
        elif step == 2:
            b.log(special, np.array([1.5, -2.5]))
            logged[special] += [1.5, -2.5]
        elif step == 3:
            extra = [float(j) * 0.125 for j in range(FOLD_AT + 10)]  # folded on the way
            for x in extra:
                b.log(special, x)
            logged[special] += extra
        b.log(special, 3.25)
        logged[special].append(3.25)
        assert_emits(b.commit(), logged)
    b.close()


def test_metrics_that_come_and_go() -> None:
    """Commits whose metrics are a changing subset of those seen (some buffers empty), and new names."""
    b = MetricBus(dist=None, strict=True, rules={"m*": ALL})
    for step in range(6):
        names = NAMES[step % 3 :: 1 + step % 2] + ([f"m_new{step}"] if step > 2 else [])
        logged = {name: [step + 0.5, float(len(name))] for name in names}
        log_each(b, logged)
        assert_emits(b.commit(), logged)
    b.close()


def test_records_logged_by_other_threads_during_commits_are_kept() -> None:
    """Threads log floats without a lock while the main thread commits: every record is committed exactly once."""
    b = MetricBus(dist=None, strict=True, rules={"m*": ["sum", "count"]})
    per_thread = 3000
    stop = threading.Event()

    def logger(offset: int) -> None:
        for i in range(per_thread):
            b.log(NAMES[(offset + i) % len(NAMES)], 1.0)
        stop.set()

    for name in NAMES:  # known names: the lock-free path
        b.log(name, 0.0)
    b.commit()
    threads = [threading.Thread(target=logger, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    total = 0.0
    count = 0.0
    while any(t.is_alive() for t in threads):
        out = b.commit()
        total += sum(v for k, v in out.items() if k.endswith("/sum"))
        count += sum(v for k, v in out.items() if k.endswith("/count"))
    for t in threads:
        t.join()
    out = b.commit()
    total += sum(v for k, v in out.items() if k.endswith("/sum"))
    count += sum(v for k, v in out.items() if k.endswith("/count"))
    b.close()
    assert stop.is_set()
    assert (total, count) == (3.0 * per_thread, 3.0 * per_thread)


class _LateLength(list[float]):
    """A buffer whose first length is read before one more record arrives (as if appended by another thread)."""

    def __init__(self, values: list[float]) -> None:
        super().__init__(values)
        self.calls = 0

    def __len__(self) -> int:
        self.calls += 1
        n = super().__len__()
        return n - 1 if self.calls == 1 else n


def test_plain_buffers_leave_records_appended_after_their_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record beyond a buffer's count stays in the buffer, and the taken records are in log order (the Python
    code's case: the compiled take_plain holds the GIL from the counts to the deletions, so none can arrive)."""
    monkeypatch.setattr(accumulate, "speedups", None)
    late = _LateLength([1.0, 2.0, 3.0])
    buffers = PlainBuffers(("a", "b", "c"), [[0.5], late, []])
    names, counts, records = buffers.take()
    assert names == ("a", "b")
    assert counts == [1, 2]
    assert struct.unpack("3d", records) == (0.5, 1.0, 2.0)
    assert list(late) == [3.0]


SPAN = st.integers(min_value=-1074, max_value=1010)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.tuples(st.floats(-1.0, 1.0, allow_subnormal=True), SPAN), min_size=1, max_size=30),
                min_size=COLUMNS_FROM, max_size=COLUMNS_FROM + 4))  # fmt: skip
def test_exact_sums_over_any_span_equal_of_batch(rows: list[list[tuple[float, int]]]) -> None:
    """Records spread over any range of binades (one or two extractions, or fsum): of_batch's fields."""
    chunks = [[math.ldexp(m, e) if math.isfinite(math.ldexp(m, e)) else m for m, e in row] for row in rows]
    names = [f"m{i}" for i in range(len(chunks))]
    update = summarize(names, [list(c) for c in chunks], {})
    for name, chunk in zip(names, chunks, strict=True):
        got, want = update[name], Summary.of_batch(chunk, None)
        for i, (x, y) in enumerate(zip(got, want, strict=True)):
            if i == 7:
                assert x == pytest.approx(y, rel=1e-12, nan_ok=True)
            elif isinstance(x, float):
                assert bits(x) == bits(y) or (math.isnan(x) and math.isnan(y)), (i, chunk)
            else:
                assert x == y


def test_means_of_odd_and_power_of_two_counts_are_exact() -> None:
    """The emitted mean of remainders over counts that are and are not powers of two."""
    rng = np.random.default_rng(11)
    b = MetricBus(dist=None, strict=True, rules={"m*": ["mean"]})
    logged = {name: rng.standard_normal(1 + i % 17).tolist() for i, name in enumerate(NAMES)}
    for name, records in logged.items():
        for x in records:
            b.log(name, x)
    out = b.commit()
    b.close()
    for name, records in logged.items():
        assert bits(out[f"{name}/mean"]) == bits(Summary.of_batch(records, None).mean())


def test_bounded_queue_is_fifo_and_bounded() -> None:
    """Items come out in order; a full queue refuses, or waits for a get."""
    q = Bounded(2)
    q.put_nowait(1)  # type: ignore[arg-type]
    q.put_nowait(2)  # type: ignore[arg-type]
    with pytest.raises(queue.Full):
        q.put_nowait(3)  # type: ignore[arg-type]
    with pytest.raises(queue.Full):
        q.put(3, timeout=0.01)  # type: ignore[arg-type]
    threading.Timer(0.05, q.get_nowait).start()
    q.put(3, timeout=5.0)  # type: ignore[arg-type]  # room once the timer took one
    assert [q.get(timeout=1.0), q.get_nowait()] == [2, 3]
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)


def test_a_bus_with_an_adapter_delivers_every_step() -> None:
    """Steps through the delivery queue arrive in order, each with every metric."""
    mem = MemoryAdapter()
    b = MetricBus(adapters=[mem], dist=None, strict=True, queue_size=2)
    for step in range(20):
        for name in NAMES:
            b.log(name, float(step))
        b.commit()
    b.close()
    assert [s for s, _ in mem.rows] == list(range(20))
    assert all(row == dict.fromkeys(NAMES, float(s)) for s, row in mem.rows)
