"""MetricBus semantics: kinds, windows, steps, close, missing metrics, NaN policies, and errors that lose nothing."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from metricbus import Agg, ClosedError, MetricBus, MetricTypeError, MetricValueError, StepError
from metricbus.testing import MemoryAdapter, capture


def bus(**options: object) -> MetricBus:
    """A strict local bus with no adapters."""
    return MetricBus(dist=None, strict=True, **options)  # type: ignore[arg-type]


DATA = [2.0, -1.0, 7.5, 0.25, 3.0]
REFERENCE = {
    "mean": float(np.mean(DATA)),
    "sum": float(np.sum(DATA)),
    "min": float(np.min(DATA)),
    "max": float(np.max(DATA)),
    "first": DATA[0],
    "last": DATA[-1],
    "count": float(len(DATA)),
    "std": float(np.std(DATA)),
}


@pytest.mark.parametrize("kind", sorted(REFERENCE))
def test_each_kind_matches_numpy(kind: str) -> None:
    """Each kind over one worker's records equals the numpy reference."""
    b = bus(rules={"m": kind})
    for x in DATA:
        b.log("m", x)
    assert b.commit()["m"] == pytest.approx(REFERENCE[kind], rel=1e-15)


def test_weighted_mean_and_std_match_numpy() -> None:
    """mean and std use the weights: sum(w*x)/sum(w) and the weighted population std."""
    x, w = np.array(DATA), np.array([1.0, 0.0, 3.0, 2.0, 0.5])
    b = bus()
    b.log("x", x, weight=w, agg=["mean", "std"])
    mean = np.average(x, weights=w)
    out = b.commit()
    assert out["x/mean"] == pytest.approx(mean, rel=1e-15)
    assert out["x/std"] == pytest.approx(math.sqrt(np.average((x - mean) ** 2, weights=w)), rel=1e-13)


def test_commit_returns_the_emitted_metrics_and_writes_adapters() -> None:
    """commit() returns what it hands to the adapters, labelled with the step."""
    with capture() as (b, mem):
        b.log("a", 1.0)
        out = b.commit(step=7)
    assert mem.rows == [(7, out)]
    assert out == {"a": 1.0}


def test_commit_without_step_counts_from_zero() -> None:
    """commit() without a step uses 0, then last + 1."""
    with capture() as (b, mem):
        for _ in range(3):
            b.log("a", 1.0)
            b.commit()
        b.log("a", 1.0)
        b.commit(step=10)
        b.log("a", 1.0)
        b.commit()
    assert [step for step, _ in mem.rows] == [0, 1, 2, 10, 11]


@pytest.mark.parametrize("step", [5, 4])
def test_commit_step_not_greater_than_last_is_an_error(step: int) -> None:
    """commit(step) with step <= last raises StepError; the pending records survive."""
    b = bus()
    b.log("a", 1.0)
    b.commit(step=5)
    b.log("a", 3.0)
    with pytest.raises(StepError, match=str(step)):
        b.commit(step=step)
    assert b.commit(step=6) == {"a": 3.0}


def test_commit_step_must_be_an_int() -> None:
    """A float or bool step is rejected."""
    with pytest.raises(StepError):
        bus().commit(step=1.5)  # type: ignore[arg-type]


def test_numpy_and_torch_integer_steps_are_their_int() -> None:
    """A numpy or torch integer (a loop over ``np.arange``, a step counter tensor) is taken as its int; booleans,
    non-integers and tensors of several values are a StepError naming the step, and the records stay buffered."""
    torch = pytest.importorskip("torch")
    b = bus()
    for i, step in enumerate([np.int64(3), np.uint8(4), np.array(5), torch.tensor(6), np.int32(7)]):
        b.log("a", float(i))
        assert b.commit(step=step) == {"a": float(i)}
        assert type(b._last_step) is int
        assert b._last_step == 3 + i
    for bad in [np.True_, np.array(True), torch.tensor(True), torch.tensor(8.0), np.float64(8), torch.tensor([8, 9])]:
        b.log("a", 10.0)
        with pytest.raises(StepError, match=r"commit step must be an int \(or a numpy or torch integer\), got "):
            b.commit(step=bad)
    assert b.commit(step=np.int64(8)) == {"a": 10.0}


def test_log_every_emits_every_nth_commit_labelled_with_its_step() -> None:
    """With log_every=3, commits 1-2 return {} and the 3rd emits the window under its own step."""
    with capture(log_every=3) as (b, mem):
        results = []
        for step, x in enumerate([1.0, 2.0, 6.0, 10.0]):
            b.log("a", x)
            results.append(b.commit(step=step))
    assert results[:2] == [{}, {}]
    assert results[2] == {"a": 3.0}
    assert mem.rows == [(2, {"a": 3.0}), (3, {"a": 10.0})]


def test_close_emits_the_partial_window() -> None:
    """close() commits pending records and emits an incomplete window under the last step."""
    mem = MemoryAdapter()
    b = MetricBus(adapters=[mem], log_every=4, dist=None, strict=True)
    b.log("a", 1.0)
    b.commit(step=3)
    b.log("a", 5.0)
    b.close()
    assert mem.rows == [(4, {"a": 3.0})]


def test_window_first_and_last_come_from_first_and_last_commit() -> None:
    """Across a window, first is the first commit's value and last the last commit's."""
    b = bus(log_every=3, rules={"f": "first", "l": "last"})
    for x in (4.0, 5.0, 6.0):
        b.log({"f": x, "l": x})
        out = b.commit()
    assert out == {"f": 4.0, "l": 6.0}


def test_window_merges_states_when_the_kind_does_not_change() -> None:
    """mean over a window is the record-level mean, not the mean of per-commit means."""
    b = bus(log_every=2)
    b.log("a", [1.0, 1.0, 1.0])
    b.commit()
    b.log("a", 5.0)
    assert b.commit() == {"a": 2.0}


def test_window_kind_change_averages_per_commit_results() -> None:
    """Agg(micro='sum', step='mean') is the mean over the window's commits of each commit's sum."""
    b = bus(log_every=2, rules={"a": Agg(micro="sum", step="mean")})
    b.log("a", [1.0, 2.0, 3.0])
    b.commit()
    b.log("a", 10.0)
    assert b.commit() == {"a": 8.0}


def test_metric_without_records_is_absent() -> None:
    """A metric not logged in a step is absent from that step's output (not 0, not NaN)."""
    with capture() as (b, mem):
        b.log({"a": 1.0, "b": 2.0})
        b.commit()
        b.log("a", 3.0)
        b.commit()
        b.log("a", np.array([]))
        b.commit()
    assert mem.rows == [(0, {"a": 1.0, "b": 2.0}), (1, {"a": 3.0})]


def test_commit_with_nothing_logged_emits_nothing() -> None:
    """An empty commit returns {} and writes no row."""
    with capture() as (b, mem):
        assert b.commit() == {}
    assert mem.rows == []


def test_nan_propagates_by_default() -> None:
    """A NaN record makes mean, sum, min and max NaN."""
    b = bus()
    b.log("loss", [1.0, math.nan], agg=["mean", "sum", "min", "max"])
    assert all(math.isnan(v) for v in b.commit().values())


def test_nan_ignore_drops_non_finite_records() -> None:
    """nan='ignore' on the bus drops NaN and inf records."""
    b = bus(nan="ignore")
    b.log("loss", [1.0, math.nan, math.inf, 3.0], agg=["mean", "count"])
    assert b.commit() == {"loss/count": 2.0, "loss/mean": 2.0}


def test_nan_ignore_with_only_nan_makes_the_metric_absent() -> None:
    """Under nan='ignore', a metric whose every record is NaN emits nothing."""
    b = bus(nan="ignore")
    b.log("loss", math.nan)
    assert b.commit() == {}


def test_nan_error_raises_and_keeps_earlier_records() -> None:
    """nan='error' raises MetricValueError naming the metric; earlier records are kept."""
    b = bus(nan="error")
    b.log("loss", 1.0)
    with pytest.raises(MetricValueError, match="'loss'"):
        b.log("loss", [2.0, math.nan])
    assert b.commit() == {"loss": 1.0}


def test_dict_call_with_one_bad_value_records_nothing() -> None:
    """A dict with one bad value raises TypeError naming it and records none of the dict's values."""
    b = bus()
    b.log("a", 1.0)
    with pytest.raises(TypeError, match="'b'"):
        b.log({"a": 100.0, "b": None, "c": 3.0})
    assert b.commit() == {"a": 1.0}


def test_log_after_close_is_an_error() -> None:
    """log, commit and export after close raise ClosedError."""
    b = bus()
    b.log("a", 1.0)
    b.close()
    for call in (lambda: b.log("a", 1.0), lambda: b.log("z", 2), b.commit, b.export):
        with pytest.raises(ClosedError):
            call()


def test_close_is_idempotent_and_emits_once() -> None:
    """Closing twice writes the pending step once."""
    mem = MemoryAdapter()
    b = MetricBus(adapters=[mem], dist=None, strict=True)
    b.log("a", 1.0)
    b.close()
    b.close()
    assert mem.rows == [(0, {"a": 1.0})]
    assert mem.status == "finished"


def test_context_manager_closes_with_failed_status_on_error() -> None:
    """An exception inside `with MetricBus(...)` closes the adapters with status 'failed'."""
    mem = MemoryAdapter()

    def train() -> None:
        with MetricBus(adapters=[mem], dist=None, strict=True) as b:
            b.log("a", 2.0)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train()
    assert mem.rows == [(0, {"a": 2.0})]
    assert mem.status == "failed"


def test_many_records_fold_exactly() -> None:
    """Records past the fold buffer (thousands) still give the exact sum and mean."""
    xs = [0.1 * i for i in range(5000)]
    b = bus()
    for x in xs:
        b.log("a", x, agg=["sum", "mean", "first", "last", "count"])
    out = b.commit()
    assert out["a/sum"] == math.fsum(xs)
    assert out["a/mean"] == float(sum(map(Fraction, xs)) / len(xs))  # the correctly rounded exact mean
    assert (out["a/first"], out["a/last"], out["a/count"]) == (xs[0], xs[-1], 5000.0)


def test_outputs_are_sorted_by_name() -> None:
    """Emitted metrics come in name order."""
    b = bus()
    b.log({"z": 1.0, "a": 2.0, "m": 3.0})
    assert list(b.commit()) == ["a", "m", "z"]


def test_log_every_must_be_positive() -> None:
    """log_every < 1 is a ValueError."""
    with pytest.raises(ValueError, match="log_every"):
        bus(log_every=0)


def test_rejected_call_does_not_fix_the_spec_of_a_new_name() -> None:
    """A first log of a name that fails leaves the name unseen: a later call may give it any spec."""
    b = bus()
    with pytest.raises(TypeError, match="'x'"):
        b.log("x", None, agg="sum")
    with pytest.raises(TypeError, match="'z'"):
        b.log({"y": 1.0, "z": "bad"}, agg="min")
    b.log("x", [1.0, 5.0], agg="max")
    b.log("y", [1.0, 5.0])
    assert b.commit() == {"x": 5.0, "y": 3.0}


def test_rejected_call_keeps_names_seen_before() -> None:
    """A failing dict call keeps the specs of names that were already known."""
    b = bus()
    b.log("a", 1.0, agg="sum")
    with pytest.raises(TypeError):
        b.log({"a": 2.0, "new": None})
    b.log("a", 2.0)
    assert b.commit() == {"a": 3.0}


def test_a_name_that_is_not_utf8_is_refused_at_log(tmp_path: Path) -> None:
    """A name with a lone surrogate (what 'surrogateescape' leaves) is a MetricTypeError naming it at log(), alone
    or in a dict; nothing else logged is lost and the journal reads back."""
    from metricbus.journal import read_journal
    from metricbus.replay import emitted

    b = MetricBus(dist=None, journal=str(tmp_path / "j"))
    b.log("loss", 2.0)
    for call in (lambda: b.log("bad\ud800", 1.5), lambda: b.log({"ok": 1.0, "bad\udcff": 2.0})):
        with pytest.raises(MetricTypeError, match=r"metric name 'bad\\ud[8c][0f]{2}' cannot be encoded as UTF-8"):
            call()
    b.log("naïve/λ", 3.0)
    assert b.commit(0) == {"loss": 2.0, "naïve/λ": 3.0}
    b.close()
    assert list(emitted(read_journal(tmp_path / "j"))) == [(0, {"loss": 2.0, "naïve/λ": 3.0})]
