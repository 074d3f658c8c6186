"""The distribution kinds through the bus (pNN, quantile(q), hist): the same bits under every split of the records
into log() calls, updates, commits of a window and ingested workers; kind changes across levels; journal replay."""

from __future__ import annotations

import math
import struct
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metricbus import Agg, MetricBus, SpecError
from metricbus.histogram import HIST_BINS, Histogram
from metricbus.kinds import canonical, quantile
from metricbus.replay import replay
from metricbus.sketch import ALPHA, TINY, Sketch
from metricbus.spec import parse_spec
from metricbus.testing import MemoryAdapter

SPEC = ["mean", "p50", "p90", "p99", "hist"]
QUANTILES = {"x/p50": 0.5, "x/p90": 0.9, "x/p99": 0.99}
DISTRIBUTIONS = ("lognormal", "normal", "pareto", "zero_heavy")
Rows = list[tuple[int, dict[str, float]]]


def bus(**options: Any) -> MetricBus:
    """A strict local bus with no adapters."""
    return MetricBus(dist=None, strict=True, **options)


def draw_data(kind: str, n: int, seed: int) -> np.ndarray:
    """``n`` records of one of DISTRIBUTIONS."""
    rng = np.random.default_rng(seed)
    table = {
        "lognormal": lambda: rng.lognormal(0.0, 2.0, n),
        "normal": lambda: rng.normal(-3.0, 10.0, n),
        "pareto": lambda: rng.pareto(0.8, n),
        "zero_heavy": lambda: np.where(rng.random(n) < 0.5, 0.0, rng.standard_cauchy(n)),
    }
    return table[kind]()


def bits(value: float) -> tuple[object, ...]:
    """A value's 8 bytes, and a histogram's edges, counts and quantiles as bytes too."""
    if isinstance(value, Histogram):
        return (struct.pack("<d", value), struct.pack(f"<{len(value.edges)}d", *value.edges), value.counts,
                tuple((name, struct.pack("<d", q)) for name, q in value.quantiles))  # fmt: skip
    return (struct.pack("<d", value),)


def all_bits(out: dict[str, float]) -> dict[str, tuple[object, ...]]:
    """Every emitted value as bits."""
    return {k: bits(v) for k, v in out.items()}


def log_pieces(b: MetricBus, values: np.ndarray, rng: np.random.Generator) -> None:
    """Log ``values`` cut into random pieces, each logged as Python floats, a list or a numpy array."""
    at = 0
    while at < len(values):
        piece = values[at : at + int(rng.integers(1, 8))]
        at += len(piece)
        form = int(rng.integers(3))
        if form == 0:
            for v in piece:
                b.log("x", float(v))
        elif form == 1:
            b.log("x", piece.tolist())
        else:
            b.log("x", piece.copy())


def shares(values: np.ndarray, parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    """``values`` dealt at random into ``parts`` shares (order kept within each; some may be empty)."""
    labels = rng.integers(0, parts, len(values))
    return [values[labels == p] for p in range(parts)]


def whole(values: np.ndarray) -> dict[str, float]:
    """One bus, one log() of every record, one commit."""
    b = bus(rules={"x": SPEC})
    b.log("x", values)
    return b.commit()


def with_updates(values: np.ndarray, rng: np.random.Generator) -> dict[str, float]:
    """One bus, the records cut into log() calls and up to 3 optimizer updates, one commit."""
    b = bus(rules={"x": SPEC})
    for share in shares(values, 3, rng):
        log_pieces(b, share, rng)
        b.end_update()
    return b.commit()


def windowed(values: np.ndarray, rng: np.random.Generator, commits: int) -> dict[str, float]:
    """One bus with ``log_every=commits``: the records cut across the window's commits; the emitted dict."""
    b = bus(rules={"x": SPEC}, log_every=commits)
    out: dict[str, float] = {}
    for c, share in enumerate(shares(values, commits, rng)):
        log_pieces(b, share, rng)
        out = b.commit()
        assert out == {} or c == commits - 1
    return out


def driven(values: np.ndarray, rng: np.random.Generator, commits: int, workers: int) -> dict[str, float]:
    """A driver with ``log_every=commits`` ingesting ``workers`` exported partials per commit (with updates)."""
    driver = bus(rules={"x": SPEC}, log_every=commits)
    pool = [bus(rules={"x": SPEC}) for _ in range(workers)]
    out: dict[str, float] = {}
    for commit_share in shares(values, commits, rng):
        for worker, share in zip(pool, shares(commit_share, workers, rng), strict=True):
            for update_share in shares(share, 2, rng):
                log_pieces(worker, update_share, rng)
                worker.end_update()
        driver.ingest([w.export() for w in pool])
        out = driver.commit()
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(DISTRIBUTIONS), st.integers(1, 400), st.integers(0, 2**32 - 1), st.integers(1, 3),
       st.integers(1, 4))  # fmt: skip
def test_quantiles_and_hist_are_the_same_bits_under_every_split(
    kind: str, n: int, seed: int, commits: int, workers: int
) -> None:
    """p50/p90/p99/hist/mean are bitwise equal across log() cuts, updates, window commits and ingested workers."""
    values = draw_data(kind, n, seed)
    rng = np.random.default_rng(seed + 1)
    reference = whole(values)
    for out in (with_updates(values, rng), windowed(values, rng, commits), driven(values, rng, commits, workers)):
        assert all_bits(out) == all_bits(reference)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(DISTRIBUTIONS), st.integers(1, 2000), st.integers(0, 2**32 - 1))
def test_emitted_quantiles_are_the_sketchs_and_within_alpha(kind: str, n: int, seed: int) -> None:
    """Each pNN is Sketch.of_values(all).quantile(q) exactly and within ALPHA of numpy's lower quantile."""
    values = draw_data(kind, n, seed)
    out = whole(values)
    sketch = Sketch.of_values(values)
    for name, q in QUANTILES.items():
        assert out[name] == sketch.quantile(q)
        true = float(np.quantile(values, q, method="lower"))
        assert abs(out[name] - true) <= ALPHA * abs(true) or (abs(true) < TINY and out[name] == 0.0)


def test_hist_emits_a_histogram_of_the_records() -> None:
    """'hist' emits a Histogram: float = records, the sketch's bins (at most HIST_BINS), its p50/p90/p99."""
    values = draw_data("lognormal", 1000, 5)
    h = whole(values)["x/hist"]
    assert isinstance(h, Histogram)
    sketch = Sketch.of_values(values)
    assert float(h) == 1000.0
    assert (h.edges, h.counts) == sketch.histogram(bins=HIST_BINS)
    assert 1 <= len(h.counts) <= HIST_BINS
    assert sum(h.counts) == 1000
    assert dict(h.quantiles) == {"p50": sketch.quantile(0.5), "p90": sketch.quantile(0.9), "p99": sketch.quantile(0.99)}


def test_a_nan_record_makes_the_quantiles_nan() -> None:
    """Under nan='propagate' a NaN record makes every pNN NaN; hist's number counts it, its bins hold the others."""
    out = whole(np.array([1.0, math.nan, 2.0, 3.0]))
    assert all(math.isnan(out[name]) for name in QUANTILES)
    assert float(out["x/hist"]) == 4.0
    assert sum(out["x/hist"].counts) == 3


def exact_mean(xs: list[float]) -> float:
    """The correctly rounded mean."""
    return float(sum(map(Fraction, xs), Fraction(0)) / len(xs))


worker_shares = st.lists(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=6), min_size=1, max_size=8)


def ingested(rules: dict[str, Any], per_worker: list[list[float]]) -> float:
    """A driver's x after ingesting one exported partial per worker (each worker logged its share)."""
    driver = bus(rules=rules)
    parts = []
    for share in per_worker:
        worker = bus(rules=rules)
        worker.log("x", share)
        parts.append(worker.export())
    driver.ingest(parts)
    return driver.commit()["x"]


@settings(max_examples=60, deadline=None)
@given(worker_shares)
def test_rank_p90_is_the_quantile_of_the_workers_means(per_worker: list[list[float]]) -> None:
    """Agg(micro='mean', rank='p90'): the lower 0.9 quantile (within ALPHA) of the workers' exact means."""
    got = ingested({"x": Agg(micro="mean", rank="p90")}, per_worker)
    means = np.array([exact_mean(share) for share in per_worker])
    assert got == Sketch.of_values(means).quantile(0.9)
    true = float(np.quantile(means, 0.9, method="lower"))
    assert abs(got - true) <= ALPHA * abs(true) or (abs(true) < TINY and got == 0.0)


@settings(max_examples=60, deadline=None)
@given(worker_shares)
def test_rank_mean_of_micro_p90_is_the_mean_of_each_workers_p90(per_worker: list[list[float]]) -> None:
    """Agg(micro='p90', rank='mean'): the exact mean over workers of each worker's p90."""
    got = ingested({"x": Agg(micro="p90", rank="mean")}, per_worker)
    assert got == exact_mean([Sketch.of_values(np.array(share)).quantile(0.9) for share in per_worker])


STEPS, LOG_EVERY = 5, 2


def journaled_run(journal: Path) -> tuple[MemoryAdapter, list[list[float]]]:
    """A run with a journal: 'lat' under SPEC, 'loss' under plain mean; returns the live rows and loss records."""
    live = MemoryAdapter()
    rng = np.random.default_rng(11)
    losses = []
    rules = {"lat": SPEC, "loss": "mean"}
    with bus(rules=rules, adapters=[live], log_every=LOG_EVERY, journal=str(journal)) as b:
        for step in range(STEPS):
            loss = rng.normal(1.0, 0.5, int(rng.integers(1, 6))).tolist()
            losses.append(loss)
            b.log("loss", loss)
            b.log("lat", rng.lognormal(0.0, 1.0, 50))
            b.end_update()
            b.log("lat", rng.lognormal(1.0, 1.0, 30).tolist())
            b.commit(step)
    return live, losses


def row_bits(rows: Rows) -> list[tuple[int, dict[str, tuple[object, ...]]]]:
    """Rows with every value as bits (histograms with their bins)."""
    return [(step, all_bits(metrics)) for step, metrics in rows]


def test_journal_replays_to_identical_rows(tmp_path: Path) -> None:
    """Replaying the journal gives the live rows bit for bit, histograms included."""
    live, _ = journaled_run(tmp_path / "j")
    again = MemoryAdapter()
    replay(tmp_path / "j", [again])
    assert row_bits(again.rows) == row_bits(live.rows)
    assert isinstance(again.rows[0][1]["lat/hist"], Histogram)
    assert [step for step, _ in live.rows] == [1, 3, 4]


def test_replay_asking_a_quantile_of_records_without_a_sketch_names_the_metric(tmp_path: Path) -> None:
    """A rule 'p50' for a metric journaled under 'mean' is a SpecError naming it (no sketch was kept)."""
    journaled_run(tmp_path / "j")
    with pytest.raises(SpecError, match="'loss'"):
        replay(tmp_path / "j", [MemoryAdapter()], rules=[("loss", parse_spec("p50", metric="loss"))])


def test_replay_step_p50_of_commit_means_works_without_a_sketch(tmp_path: Path) -> None:
    """Agg(micro='mean', step='p50') on a 'mean' metric: the lower median of the window's commit means."""
    _, losses = journaled_run(tmp_path / "j")
    again = MemoryAdapter()
    replay(tmp_path / "j", [again], rules=[("loss", parse_spec(Agg(micro="mean", step="p50"), metric="loss"))])
    means = [exact_mean(loss) for loss in losses]
    windows = [means[0:2], means[2:4], means[4:5]]
    expected = [Sketch.of_values(np.array(w)).quantile(0.5) for w in windows]
    assert again.series("loss") == list(zip([1, 3, 4], expected, strict=True))
    for got, window in zip(expected, windows, strict=True):
        true = float(np.quantile(window, 0.5, method="lower"))
        assert abs(got - true) <= ALPHA * abs(true)


@pytest.mark.parametrize("kind", ["p101", "quantile(1.5)", "p-1", "quantile(x)", "q50"])
def test_unknown_distribution_kinds_name_the_metric(kind: str) -> None:
    """An invalid percentile or fraction is a SpecError naming the metric, on declaration."""
    with pytest.raises(SpecError, match="'latency'"):
        parse_spec(kind, metric="latency")
    with pytest.raises(SpecError, match="'latency'"):
        bus().define("latency", ["mean", kind])


def test_hist_followed_by_another_kind_is_a_spec_error() -> None:
    """'hist' at a level followed by a different kind is a SpecError naming the metric; hist above hist is fine."""
    with pytest.raises(SpecError, match="'latency'"):
        parse_spec(Agg(micro="hist", rank="mean"), metric="latency")
    with pytest.raises(SpecError, match="'latency'"):
        bus().define("latency", Agg(micro="hist", update="hist", step="p50"))
    assert parse_spec(Agg(micro="hist"), metric="latency").chains[0].step == "hist"


def test_quantile_kind_names() -> None:
    """quantile(0.95) is 'p95'; 'quantile(0.999)' canonicalises to 'p99.9'; quantile() rejects q outside [0, 1]."""
    assert quantile(0.95) == "p95"
    assert quantile(0.5) == "p50"
    assert canonical("quantile(0.999)") == "p99.9"
    assert canonical("p99.90") == "p99.9"
    assert parse_spec("quantile(0.999)", metric="x").chains[0].micro == "p99.9"
    with pytest.raises(ValueError, match="quantile"):
        quantile(1.5)


def test_quantile_kinds_are_emitted_under_their_canonical_names() -> None:
    """A spec list with quantile(0.95) and p99.9 emits x/p95 and x/p99.9, equal to the sketch's quantiles."""
    values = draw_data("lognormal", 500, 3)
    b = bus(rules={"x": ["mean", quantile(0.95), "quantile(0.999)"]})
    b.log("x", values)
    out = b.commit()
    sketch = Sketch.of_values(values)
    assert out == {"x/mean": pytest.approx(values.mean()), "x/p95": sketch.quantile(0.95),
                   "x/p99.9": sketch.quantile(0.999)}  # fmt: skip


def test_a_tensor_logged_to_a_distribution_is_bucketed_like_an_array() -> None:
    """A torch tensor logged to a quantile metric gives the bits the same values give as a numpy array."""
    torch = pytest.importorskip("torch")
    values = np.random.default_rng(3).lognormal(2.0, 1.0, 300)
    rows = []
    for as_tensor in (True, False):
        bus = MetricBus(adapters=[], dist=None, strict=True)
        bus.define("x", ["p50", "p99", "hist"])
        bus.log("x", torch.tensor(values) if as_tensor else values)
        rows.append(all_bits(bus.commit()))
        bus.close()
    assert rows[0] == rows[1]


def test_a_pickled_partial_keeps_its_sketches() -> None:
    """export() -> pickle -> ingest() (how Ray ships partials) gives the quantiles of the unpickled path."""
    import pickle

    rows = []
    for shipped in (True, False):
        driver = MetricBus(adapters=[], dist=None, strict=True)
        parts = []
        for w in range(3):
            worker = MetricBus(adapters=[], dist=None, rules={"x": ["mean", "p90", "hist"]})
            worker.log("x", np.random.default_rng(w).lognormal(0.0, 1.0, 50))
            part = worker.export()
            parts.append(pickle.loads(pickle.dumps(part)) if shipped else part)
            worker.close()
        driver.ingest(parts)
        rows.append(all_bits(driver.commit()))
        driver.close()
    assert rows[0] == rows[1]


def test_declaring_a_distribution_after_records_were_reduced_is_refused() -> None:
    """A spec that needs the records' sketch, declared after a fold reduced some records without one, is a SpecError
    naming the metric (a quantile of part of the records would be wrong)."""
    bus = MetricBus(adapters=[], dist=None, strict=True)
    for i in range(300):  # past one fold of the default spec
        bus.log("x", float(i))
    with pytest.raises(SpecError, match="'x'"):
        bus.log("x", 1.0, agg=["mean", "p50"])
    bus.close(status="failed")


def test_a_default_that_gives_way_to_a_driver_declaration_gives_nan_quantiles() -> None:
    """Workers that logged 'x' under the default spec kept no sketch: a driver declaring 'x' with p50 emits NaN for
    p50 (its records' distribution is unknown), never the quantile of part of them, and still the exact mean."""
    driver = MetricBus(adapters=[], dist=None, strict=True, rules={"x": ["mean", "p50"]})
    parts = []
    for w in range(2):
        worker = MetricBus(adapters=[], dist=None)
        worker.log("x", [1.0 + w, 2.0 + w])
        parts.append(worker.export())
        worker.close()
    driver.ingest(parts)
    out = driver.commit()
    driver.close()
    assert out["x/mean"] == 2.0
    assert math.isnan(out["x/p50"])


def test_a_config_file_declares_distribution_kinds() -> None:
    """A config's metrics section takes quantile(q), pNN and hist like any kind."""
    bus = MetricBus.from_config({"metrics": {"x": ["mean", "quantile(0.9)", "p99.9", "hist"]}, "adapters": []})
    bus.log("x", [1.0, 2.0, 3.0, 4.0])
    out = bus.commit()
    bus.close()
    assert sorted(out) == ["x/hist", "x/mean", "x/p90", "x/p99.9"]
    assert isinstance(out["x/hist"], Histogram)
    assert float(out["x/hist"]) == 4.0


def test_declaring_a_distribution_after_an_ended_update_or_tensor_records_is_refused() -> None:
    """Records of an update already ended, or tensor records, were reduced without a sketch: a later declaration
    of a distribution kind is a SpecError naming the metric, and the records stay under their spec."""
    torch = pytest.importorskip("torch")
    bus = MetricBus(adapters=[], dist=None, strict=True)
    bus.log("x", 1.0)
    bus.end_update()
    with pytest.raises(SpecError, match=r"'x'.*1 of its records"):
        bus.log("x", 2.0, agg="p90")
    bus.log("y", torch.tensor([1.0, 2.0]))
    with pytest.raises(SpecError, match=r"'y'.*tensor records"):
        bus.log("y", 2.0, agg=["mean", "p50"])
    assert bus.commit() == {"x": 1.0, "y": 1.5}
    bus.close()


def test_long_percentiles_keep_every_digit() -> None:
    """p99.99999 is not rounded to p100: its name keeps its digits and it reads rank floor(0.9999999 * (n - 1))."""
    from metricbus.kinds import canonical

    assert canonical("p99.99999") == canonical("quantile(0.9999999)") == "p99.99999"
    assert canonical("quantile(1e-7)") == "p0.00001"
    values = np.concatenate([np.ones(10**5), [1000.0]])
    bus = MetricBus(adapters=[], dist=None, strict=True)
    bus.log("x", values, agg=["p99.99999", "p100"])
    out = bus.commit()
    bus.close()
    assert out["x/p99.99999"] == Sketch.of_values(values).quantile(0.9999999) == Sketch.of_value(1.0).quantile(0.5)
    assert out["x/p100"] == Sketch.of_value(1000.0).quantile(0.5)


def test_a_replay_rule_the_journal_cannot_serve_is_a_usage_error(tmp_path: Path) -> None:
    """metricbus replay --rule 'loss=p90' on a journal of a plain-mean 'loss' exits 2 naming it, before any
    backend opens (the target jsonl file is not created)."""
    from metricbus.cli import main

    bus = MetricBus(adapters=[], dist=None, journal=str(tmp_path / "j"))
    bus.log("loss", 1.0)
    bus.commit()
    bus.close()
    target = tmp_path / "out.jsonl"
    assert main(["replay", str(tmp_path / "j"), "--to", f"jsonl:{target}", "--rule", "loss=p90"]) == 2
    assert not target.exists()
