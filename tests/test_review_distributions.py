"""Adversarial review of the distribution kinds (pNN, quantile(q), hist): the README's guarantee against numpy over
the whole range (zeros, subnormals, -0.0, ±inf, NaN under each policy, beyond ±2**64), and the same bits under every
split and path (log() calls, updates, window commits, ingested partials, journal replay, gloo ranks)."""

from __future__ import annotations

import math
import random
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metricbus import Agg, MetricBus, quantile
from metricbus.errors import SpecError
from metricbus.histogram import Histogram
from metricbus.journal import read_journal
from metricbus.replay import emitted
from metricbus.sketch import ALPHA, HUGE, MAX_KEY, MAX_KEYS, TINY, Sketch, lower_of, value_of
from tests.test_bitwise import ingested

SPECIALS = (0.0, -0.0, 5e-324, -5e-324, TINY, TINY / 2, HUGE, -HUGE, 1e308, -1e308, math.inf, -math.inf, 1.0, -1.0)
OUTER = value_of(2240)  # what a record of magnitude HUGE or more is reported as
# distribution kinds at every level, lifted both ways, with NaN propagated and ignored
RULES: dict[str, Any] = {
    "d": ["mean", "min", "max", "p50", "p90", "p99", "quantile(0.001)", "hist"],
    "d_ignore": Agg(micro="p90", nan="ignore"),
    "rank_p90": Agg(micro="mean", rank="p90"),
    "micro_p90": Agg(micro="p90", rank="mean"),
    "chain": Agg(micro="p50", update="p90", rank="p99", step="hist"),
    "upd_hist": Agg(micro="max", update="hist"),
}
NAMES = tuple(RULES)
_NAN_BITS = struct.pack("<d", math.nan)


def value_bits(value: float) -> tuple[object, ...]:
    """A value's bits; a histogram's edges and quantiles as bits too (a NaN quantile that crossed a process is
    another object, so tuples of floats would not compare equal)."""
    if not isinstance(value, Histogram):
        return (struct.pack("<d", value),)
    quantiles = tuple((name, struct.pack("<d", q)) for name, q in value.quantiles)
    return struct.pack("<d", value), struct.pack(f"<{len(value.edges)}d", *value.edges), value.counts, quantiles


def bits(rows: list[dict[str, float]]) -> list[dict[str, tuple[object, ...]]]:
    """Every value of every row as bits; every emitted NaN, a histogram's quantiles included, is math.nan."""
    out = [{name: value_bits(value) for name, value in row.items()} for row in rows]
    for row in rows:
        for name, value in row.items():
            quantiles = [q for _, q in value.quantiles] if isinstance(value, Histogram) else []
            for v in (float(value), *quantiles):
                assert not math.isnan(v) or struct.pack("<d", v) == _NAN_BITS, name
    return out


def _special_value(rng: random.Random) -> float:
    if rng.random() < 0.35:
        return rng.choice((*SPECIALS, math.nan))
    return rng.lognormvariate(0.0, 4.0) * rng.choice((1.0, -1.0))


def special_plan(seed: int, *, ranks: int, steps: int = 3) -> dict[str, Any]:
    """tests.test_bitwise's plan layout (per step and rank: (update, name, values, None)) with special values."""
    rng = random.Random(seed)
    plan = []
    for _ in range(steps):
        per_rank = []
        for _ in range(ranks):
            records = [
                (update, name, [_special_value(rng) for _ in range(rng.randint(1, 5))], None)
                for update in range(rng.randint(1, 2))
                for _ in range(rng.randint(1, 3))
                for name in NAMES
                if rng.random() < 0.85  # some ranks and updates lack a metric
            ]
            per_rank.append(records)
        plan.append(per_rank)
    return {"steps": plan, "rules": RULES, "logger": "tests.test_bitwise:log_share"}


def test_gloo_ranks_ingest_and_replay_agree_on_special_values(tmp_path: Path) -> None:
    """Three gloo ranks logging zeros, subnormals, ±2**64, ±inf and NaN into distribution kinds at every level
    emit the driver's ingest bits, and so does replay of their journal."""
    pytest.importorskip("torch")
    from tests import dist_workers
    from tests.test_dist import _spawn

    ranks = 3
    plan = special_plan(7, ranks=ranks)
    journal = str(tmp_path / "journal")
    live = _spawn(dist_workers.updates_worker, ranks, plan, journal)
    expected = bits(ingested(plan, ranks=ranks))
    for rank in range(ranks):
        assert bits(live[rank]) == expected, rank
    assert bits([metrics for _, metrics in emitted(read_journal(journal))]) == expected


def reference(values: list[float], q: float, nan: str) -> float:
    """What the README promises for pNN before the 1% (numpy's lower quantile, the range's clamps)."""
    x = np.array(values, dtype=np.float64)
    if nan == "ignore":
        x = x[np.isfinite(x)]
    elif np.isnan(x).any():
        return math.nan
    if not x.size:
        return math.nan  # absent
    k = float(np.quantile(x, q, method="lower"))
    if abs(k) < TINY:
        return 0.0
    if math.isfinite(k) and abs(k) >= HUGE:
        return math.copysign(OUTER, k)
    return k


def within(got: float, want: float) -> bool:
    """``got`` is ``want`` (NaN, ±inf, 0, the outer bucket) or within ALPHA of it (and a few ulps of rounding of the
    bucket's bounds: a record at a bucket's edge is reported ALPHA·(1 + ~1e-14) away)."""
    if math.isnan(want) or want in (0.0, math.inf, -math.inf) or abs(want) == OUTER:
        return struct.pack("<d", got) == struct.pack("<d", want + 0.0)
    return abs(got - want) <= ALPHA * abs(want) * (1 + 1e-13)


any_float = st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)
QS = (0.0, 0.001, 0.29, 0.5, 0.9, 0.99, 0.999, 1.0)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(any_float, st.sampled_from(SPECIALS)), min_size=1, max_size=40),
       st.sampled_from(("propagate", "ignore")))  # fmt: skip
def test_quantiles_keep_the_guarantee_over_every_double(values: list[float], nan: str) -> None:
    """Every pNN of any doubles (subnormals, -0.0, ±2**64 and beyond, ±inf, NaN) is numpy's lower quantile within
    ALPHA, 0 below 2**-64, the outer bucket beyond 2**64, ±inf, or NaN, under nan='propagate' and 'ignore'."""
    spec = [quantile(q) for q in QS]
    b = MetricBus(dist=None, strict=True, adapters=[], nan=nan)  # type: ignore[arg-type]
    b.define("x", spec)
    b.log("x", values)
    out = b.commit()
    b.close()
    for q, kind in zip(QS, spec, strict=True):
        want = reference(values, q, nan)
        if math.isnan(want) and nan == "ignore":
            assert out == {}
            continue
        assert within(out[f"x/{kind}"], want), (kind, out[f"x/{kind}"], want)


SPLIT_SPEC = ["mean", "min", "max", "p0", "p50", "p90", "p99", "p100", "hist"]


def _bus(nan: str, **options: Any) -> MetricBus:
    """A strict local bus logging ``x`` under SPLIT_SPEC with the ``nan`` policy."""
    return MetricBus(dist=None, strict=True, adapters=[], rules={"x": SPLIT_SPEC}, nan=nan, **options)  # type: ignore[arg-type]


def _log_cut(b: MetricBus, values: list[float], rng: random.Random) -> None:
    """``values`` in random log() calls: floats one by one, lists, numpy arrays of float64, float32 where exact."""
    at = 0
    while at < len(values):
        piece = values[at : at + rng.randint(1, 4)]
        at += len(piece)
        form = rng.randrange(4)
        if form == 0:
            for v in piece:
                b.log("x", v)
        elif form == 1:
            b.log("x", piece)
        else:
            with np.errstate(over="ignore", under="ignore"):
                narrow = np.array(piece, dtype=np.float32)
            exact = form == 3 and narrow.astype(np.float64).tolist() == piece
            b.log("x", narrow if exact else np.array(piece))


def _deal(values: list[float], parts: int, rng: random.Random) -> list[list[float]]:
    labels = [rng.randrange(parts) for _ in values]
    return [[v for v, label in zip(values, labels, strict=True) if label == p] for p in range(parts)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(any_float, st.sampled_from(SPECIALS)), min_size=1, max_size=30),
       st.sampled_from(("propagate", "ignore")), st.integers(0, 2**32 - 1),
       st.integers(1, 3), st.integers(1, 3))  # fmt: skip
def test_every_split_and_path_gives_the_same_bits_with_special_values(
    values: list[float], nan: str, seed: int, commits: int, workers: int
) -> None:
    """Special values (NaN, ±inf, -0.0, subnormals, beyond 2**64) cut into log() calls, updates, window commits and
    ingested workers give the bits of one log() of them all; so does replay of the driver's journal."""
    rng = random.Random(seed)
    with _bus(nan) as whole:
        whole.log("x", values)
        reference = bits([whole.commit()])
    folder = tempfile.TemporaryDirectory()
    journal = Path(folder.name) / "journal"
    driver = _bus(nan, log_every=commits, journal=str(journal))
    out: dict[str, float] = {}
    for share in _deal(values, commits, rng):
        parts = []
        for worker_share in _deal(share, workers, rng):
            with _bus(nan) as worker:
                for update in _deal(worker_share, 2, rng):
                    _log_cut(worker, update, rng)
                    worker.end_update()
                parts.append(worker.export())
        driver.ingest(parts)
        out = driver.commit()
    driver.close()
    with folder:
        replayed = bits([metrics for _, metrics in emitted(read_journal(journal))])
    kept = [v for v in values if math.isfinite(v) or nan == "propagate"]
    if kept and all(struct.pack("<d", v) == struct.pack("<d", -0.0) for v in kept):
        for row in (*reference, *replayed, out):  # the README's one exception: a mean of -0.0s may be +0.0 by split
            row.pop("x/mean", None)
    assert bits([out]) == reference
    assert replayed[-1:] == ([] if reference == [{}] else reference)


EDGE_DATA: dict[str, list[float]] = {
    "zeros": [0.0, -0.0, 5e-324, -TINY / 2],
    "nan_only": [math.nan],
    "inf_only": [math.inf, -math.inf],
    "inf_mixed": [math.inf, 1.0, 2.0, -math.inf],
    "huge": [HUGE, -HUGE, 1e300, -1e300, 3.0],
    "wide": [TINY, HUGE / 2, -TINY, -HUGE / 2, 0.0, *np.geomspace(TINY, HUGE / 2, 200).tolist()],
    "one": [3.0],
}


@pytest.mark.filterwarnings("ignore:MLflow has no histograms")
def test_edge_histograms_through_jsonl_tensorboard_and_mlflow(tmp_path: Path, sqlite_uri: str) -> None:
    """Histograms of zeros, NaN only, ±inf, beyond 2**64 and the whole range: read_jsonl gives them back bit for
    bit, TensorBoard's reader gives their right edges and counts, MLflow their p50/p90/p99 exactly (±inf as sqlite
    keeps it: ±max double)."""
    from metricbus.adapters.jsonl import JsonlAdapter, read_jsonl
    from metricbus.adapters.mlflow import MlflowAdapter
    from metricbus.adapters.tensorboard import TensorBoardAdapter
    from mlflow.tracking import MlflowClient
    from tb_reader import histogram_points, legacy_accumulator

    mlflow = MlflowAdapter(tracking_uri=sqlite_uri)
    adapters = [JsonlAdapter(path=tmp_path / "m.jsonl"), TensorBoardAdapter(log_dir=tmp_path / "tb"), mlflow]
    with MetricBus(dist=None, strict=True, adapters=adapters, rules={"*": "hist"}) as b:
        for name, values in EDGE_DATA.items():
            b.log(name, values)
        out = b.commit(0)
    for name, values in EDGE_DATA.items():
        h = out[name]
        assert isinstance(h, Histogram)
        assert float(h) == len(values)
        assert sum(h.counts) == len(values) - sum(math.isnan(v) for v in values) or not h.counts
        assert len(h.counts) <= 64
    [(step, back)] = read_jsonl(tmp_path / "m.jsonl")
    assert step == 0
    assert bits([back]) == bits([out])
    acc = legacy_accumulator(tmp_path / "tb")
    for name in EDGE_DATA:
        h = out[name]
        assert isinstance(h, Histogram)
        assert histogram_points(acc, name) == [(0, list(h.edges[1:]), [float(c) for c in h.counts])]
    client = MlflowClient(tracking_uri=sqlite_uri)
    assert mlflow.run_id is not None
    held = client.get_run(mlflow.run_id).data.metrics
    for name in EDGE_DATA:
        h = out[name]
        assert isinstance(h, Histogram)
        for suffix, q in h.quantiles:
            stored = q if math.isnan(q) else max(-sys.float_info.max, min(sys.float_info.max, q))  # sqlite clamps inf
            assert struct.pack("<d", held[f"{name}/{suffix}"]) == struct.pack("<d", stored), (name, suffix)


@pytest.mark.parametrize(
    ("q", "kind"),
    [(np.float32(0.9), "p90"), (np.float16(0.5), "p50"), (np.float64(0.999), "p99.9"), (np.int64(1), "p100"),
     (np.int8(0), "p0"), (np.float32(0.95), "p95")],
)  # fmt: skip
def test_quantile_takes_numpy_scalars(q: Any, kind: str) -> None:
    """quantile() of a numpy scalar is the decimal it prints as; before, every numpy scalar but float64 was refused
    with "quantile(q) takes 0 <= q <= 1, got np.float32(0.9)", a q that is in range."""
    assert quantile(q) == kind


@pytest.mark.parametrize("q", [np.float32(1.5), np.float32(math.nan), True, "0.5", -0.1])
def test_quantile_refuses_what_is_no_fraction(q: Any) -> None:
    """A q out of range, NaN, a bool or a string is a ValueError that says what is valid."""
    with pytest.raises(ValueError, match=r"takes a real number 0 <= q <= 1"):
        quantile(q)


def test_memory_stays_within_two_times_4480_counts_at_any_spread() -> None:
    """Records from 2**-80 to 2**80 of both signs (and ±inf, NaN, zeros) keep at most MAX_KEYS counts per sign,
    also after merging with another such sketch, through the bus's export."""
    rng = np.random.default_rng(5)
    x = np.exp2(rng.uniform(-80, 80, 50_000)) * rng.choice((-1.0, 1.0), 50_000)
    x = np.concatenate((x, [TINY, -TINY, HUGE, -HUGE, math.inf, -math.inf, 0.0, -0.0, 5e-324]))
    sketch = Sketch.of_values(x).merge(Sketch.of_values(-x))
    assert (len(sketch.pos), len(sketch.neg)) == (MAX_KEYS, MAX_KEYS)
    assert sketch.count == 2 * len(x)


def test_a_late_distribution_declaration_says_the_records_were_logged_under_a_spec_without_a_sketch() -> None:
    """define() with p50 after two records logged under the default is refused naming the metric, the records and
    the spec they were logged under; before, it said they "were reduced without one" (they were only buffered: the
    check itself folded them) and named no spec."""
    from metricbus import SpecError

    b = MetricBus(dist=None, strict=True, adapters=[])
    b.log("x", 1.0)
    b.log("x", 2.0)
    logged = r"'x' is declared \[mean, p50\].*after 2 of its records were logged under mean, which keeps no sketch"
    with pytest.raises(SpecError, match=logged):
        b.define("x", ["mean", "p50"])
    assert b.commit() == {"x": 1.5}
    b.close()


@pytest.mark.parametrize(
    ("records", "edges", "counts"),
    [
        ([math.inf, math.inf], (lower_of(MAX_KEY), 2.0**64), (2,)),
        ([-math.inf], (-(2.0**64), -lower_of(MAX_KEY)), (1,)),
        ([math.inf, -math.inf, math.inf], (-(2.0**64), -lower_of(MAX_KEY), lower_of(MAX_KEY), 2.0**64), (1, 0, 2)),
    ],
)
def test_a_histogram_of_infinite_records_alone_has_their_bins(
    records: list[float], edges: tuple[float, ...], counts: tuple[int, ...]
) -> None:
    """±inf records with no finite one had no bin (an empty TensorBoard histogram); they count in a bin of the
    outermost bucket of their sign, as they count in the outermost bins next to finite records."""
    with MetricBus() as bus:
        bus.log("h", records, agg="hist")
        out = bus.commit()["h"]
    assert isinstance(out, Histogram)
    assert (out.edges, out.counts) == (edges, counts)


def test_hist_followed_by_another_kind_names_the_level_that_wrote_it() -> None:
    with pytest.raises(SpecError) as caught:
        MetricBus().define("m", Agg(micro="hist", rank="p50"))
    assert str(caught.value).startswith(
        "'hist' at the micro level of 'm' (kept by the update level) is followed by 'p50' at the rank level;"
    )
