"""Live (torch.distributed, R = 1, 2, 4, 8), the driver's ingest and journal replay emit the same bits.

The rank level is an exact merge in every path (see metricbus.rank_level), so the three agree bit for bit on the
same records split the same way, for every kind (quantiles and histograms included), lifted chains, weights,
several optimizer updates, values from 1e-300 to 1e300 and data with a large mean and a tiny spread. Seeds choose
the data and the split.
"""

from __future__ import annotations

import functools
import math
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from metricbus import Agg, MetricBus
from metricbus.histogram import Histogram
from metricbus.journal import read_journal
from metricbus.replay import emitted

RULES = {
    "loss": ["mean", "std", "min", "max", "first", "last", "count", "sum"],
    "pg_loss": Agg(micro="sum", update="mean", rank="mean"),
    "clip": Agg(micro="mean", rank="max"),
    "tight": ["mean", "std"],
    "wide": ["sum", "mean"],
    "tokens": "sum",
    "resp": ["mean", "p50", "p90", "p99", "hist"],  # distributions: sketches merge in the same collectives
    "adv": Agg(micro="mean", rank="p90"),
    "upd": Agg(micro="p90", update="p50", rank="mean"),
    "zero": ["min", "max", "mean"],  # tied -0.0 and +0.0 extremes: -0.0 is below (metricbus.signed_zero)
    # NaNs of both signs and with a payload, and infinities that meet: one NaN emitted (metricbus.canonical)
    "odd": ["mean", "sum", "min", "max", "first", "last", "std"],
}
ZEROS = (0.0, -0.0, 0.0, -0.0, 2.0, -2.0)
_NAN_BITS = struct.pack("<d", math.nan)
ODD = (1.0, 1.0, 1.0, math.inf, -math.inf, math.nan, struct.unpack("<d", bytes.fromhex("0100000000f8ffff"))[0])


def make_plan(seed: int, *, ranks: int, steps: int = 3) -> dict[str, Any]:
    """Per step and rank: a list of (update, name, values, weights or None)."""
    rng = random.Random(seed)
    plan: list[list[list[tuple[int, str, list[float], list[float] | None]]]] = []
    for _ in range(steps):
        per_rank = []
        for _ in range(ranks):
            records = []
            for update in range(rng.randint(1, 2)):
                for _ in range(rng.randint(1, 3)):  # micro-batches
                    n = rng.randint(1, 6)
                    records.append((update, "loss", [rng.gauss(0.0, 3.0) for _ in range(n)], None))
                    records.append((update, "pg_loss", [rng.uniform(-2, 2) / 7.0], None))
                    records.append((update, "clip", [rng.random() for _ in range(n)], [float(rng.randint(1, 9))] * n))
                    records.append((update, "tight", [1e6 + 1e-3 * rng.gauss(0, 1) for _ in range(n)], None))
                    records.append((update, "wide", [rng.choice((1e300, -1e-300, 1e-20, 3.0)) for _ in range(n)], None))
                    records.append((update, "tokens", [float(rng.randint(1, 512))], None))
                    records.append(
                        (update, "resp", [rng.lognormvariate(5, 1) * rng.choice((1, 1, -1, 0)) for _ in range(n)], None)
                    )
                    records.append((update, "adv", [rng.gauss(0.0, 1.0) for _ in range(n)], None))
                    records.append((update, "upd", [rng.expovariate(1.0) for _ in range(n)], None))
                    records.append((update, "zero", [rng.choice(ZEROS) for _ in range(n)], None))
                    records.append((update, "odd", [rng.choice(ODD) for _ in range(n)], None))
            if rng.random() < 0.3:
                records = [r for r in records if r[1] != "clip"]  # a rank without a metric
            per_rank.append(records)
        plan.append(per_rank)
    return {"steps": plan, "rules": RULES}


def log_share(bus: MetricBus, plan: dict[str, Any], *, step: int, rank: int, floats: bool = False) -> None:
    """Log rank ``rank``'s records of ``step``, with an update boundary between its updates (``floats``: each
    unweighted value logged as a float, so each update is held in columns)."""
    update = 0
    for k, name, values, weights in plan["steps"][step][rank]:
        if k != update:
            bus.end_update()
            update = k
        if floats and weights is None:
            for value in values:
                bus.log(name, value)
        else:
            bus.log(name, values, weight=weights)


def ingested(plan: dict[str, Any], *, ranks: int, journal: str | None = None) -> list[dict[str, float]]:
    """The same plan through worker buses, export() and a driver's ingest() (journaled when ``journal`` is given)."""
    driver = MetricBus(dist=None, rules=plan["rules"], journal=journal)
    rows = []
    for step in range(len(plan["steps"])):
        parts = []
        for rank in range(ranks):
            worker = MetricBus(dist=None, rules=plan["rules"])
            log_share(worker, plan, step=step, rank=rank)
            parts.append(worker.export())
            worker.close()
        driver.ingest(parts)
        rows.append(driver.commit(step=step))
    driver.close()
    return rows


def zero_extremes(plan: dict[str, Any], name: str) -> list[tuple[bytes, bytes]]:
    """Per step, the bits of ``name``'s min and max over every rank's records, -0.0 ordered below +0.0 (IEEE 754's
    totalOrder on these finite values): the reference the emitted ``min`` and ``max`` must equal."""

    from tests.test_signed_zero import total_order

    out = []
    for per_rank in plan["steps"]:
        values = [v for records in per_rank for _, n, vs, _ in records if n == name for v in vs]
        out.append((struct.pack("<d", min(values, key=total_order)), struct.pack("<d", max(values, key=total_order))))
    return out


def extremes_of(rows: list[dict[str, float]], name: str) -> list[tuple[bytes, bytes]]:
    """Per row, the bits of ``name``'s emitted min and max."""
    return [(struct.pack("<d", row[f"{name}/min"]), struct.pack("<d", row[f"{name}/max"])) for row in rows]


def bits(rows: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Each value's bits (a histogram's edges' bits and counts too); every NaN emitted must be ``math.nan``."""
    for row in rows:
        for name, value in row.items():
            assert not (isinstance(value, float) and math.isnan(value)) or struct.pack("<d", value) == _NAN_BITS, name
    return [{k: (struct.pack("<d", v), _histogram_bits(v)) for k, v in row.items()} for row in rows]


def _histogram_bits(value: float) -> Any:
    if not isinstance(value, Histogram):
        return None
    # the quantiles' bits: a NaN quantile, pickled across processes, is another object and unequal to itself
    quantiles = [(name, struct.pack("<d", q)) for name, q in value.quantiles]
    return [struct.pack("<d", e) for e in value.edges], value.counts, quantiles


@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_live_ingest_and_replay_agree_bit_for_bit(ranks: int, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from tests import dist_workers
    from tests.test_dist import _spawn

    plan = {**make_plan(1000 + ranks, ranks=ranks), "logger": "tests.test_bitwise:log_share"}
    journal = str(tmp_path / "journal")
    live = _spawn(dist_workers.updates_worker, ranks, plan, journal)
    rows = ingested(plan, ranks=ranks)
    expected = bits(rows)
    for rank in range(ranks):
        assert bits(live[rank]) == expected, rank
    assert bits([metrics for _, metrics in emitted(read_journal(journal))]) == expected
    assert extremes_of(rows, "zero") == zero_extremes(plan, "zero")


# every metric keeps its kind from the micro to the update level: a worker's updates merge in columns
MERGED_RULES = {
    "loss": "mean",
    "pg_loss": "sum",
    "tight": "std",
    "tokens": "sum",
    "resp": ["mean", "min", "max"],
    "adv": "std",
    "upd": ["first", "last", "count"],
    "zero": ["min", "max"],
}


log_floats = functools.partial(log_share, floats=True)


@pytest.mark.parametrize("ranks", [2, 4])
def test_updates_merged_in_columns_agree_bit_for_bit(ranks: int, tmp_path: Path) -> None:
    """Ranks logging floats one at a time, with update boundaries, under kinds whose update level merges the micro
    summaries (metricbus.update_columns merges them in columns): live, the driver's ingest of lists and replay of
    the live journal agree bit for bit."""
    pytest.importorskip("torch")
    from tests import dist_workers
    from tests.test_dist import _spawn

    made = make_plan(3000 + ranks, ranks=ranks, steps=6)
    # two metrics of each unweighted one (enough metrics for columns); "wide" left out: its records span too many
    # binades for the columns
    steps = [
        [
            [
                (k, f"{name}/{j}", [v * (j + 1) for v in values], None)
                for k, name, values, weights in records
                if weights is None and name != "wide"
                for j in range(2)
            ]
            for records in per_rank
        ]
        for per_rank in made["steps"]
    ]
    plan = {"steps": steps, "rules": {f"{name}/{j}": kind for name, kind in MERGED_RULES.items() for j in range(2)}}
    journal = str(tmp_path / "journal")
    live = _spawn(dist_workers.updates_worker, ranks, {**plan, "logger": "tests.test_bitwise:log_floats"}, journal)
    rows = ingested(plan, ranks=ranks)
    expected = bits(rows)
    for rank in range(ranks):
        assert bits(live[rank]) == expected, rank
    assert bits([metrics for _, metrics in emitted(read_journal(journal))]) == expected
    for j in range(2):
        assert extremes_of(rows, f"zero/{j}") == zero_extremes(plan, f"zero/{j}")


@pytest.mark.parametrize("seed", range(6))
def test_ingest_and_replay_agree_bit_for_bit_over_splits(seed: int, tmp_path: Path) -> None:
    """The driver journals what it ingests; replaying that journal gives the driver's bits, for several splits."""
    ranks = 1 + seed % 5
    plan = make_plan(seed, ranks=ranks)
    rows = ingested(plan, ranks=ranks, journal=str(tmp_path / "j"))
    assert bits(rows) == bits(ingested(plan, ranks=ranks))
    assert bits([m for _, m in emitted(read_journal(tmp_path / "j"))]) == bits(rows)
    assert extremes_of(rows, "zero") == zero_extremes(plan, "zero")


Records = list[tuple[int, str, list[float], list[float] | None]]


def _steady_steps(
    seed: int, *, ranks: int, steps: int, of_update: Callable[..., Records], of_rank: Callable[..., Records]
) -> list[list[Records]]:
    """Per step, per rank: 2 updates of 1-3 batches of 1-6 records each (``of_update(rng, step=, rank=, update=,
    n=)`` gives a batch's records), then ``of_rank(rng, step=, rank=)``'s."""
    rng = random.Random(seed)
    out = []
    for step in range(steps):
        per_rank = []
        for rank in range(ranks):
            records: Records = []
            for update in range(2):
                for _ in range(rng.randint(1, 3)):
                    records.extend(of_update(rng, step=step, rank=rank, update=update, n=rng.randint(1, 6)))
            records.extend(of_rank(rng, step=step, rank=rank))
            per_rank.append(records)
        out.append(per_rank)
    return out


def _guessed_plan(seed: int, *, ranks: int) -> dict[str, Any]:
    """8 steps of every rank logging the same metrics at steady scales, without distributions (their sums pass is
    never guessed); at step 4 rank 1's losses grow 2**30-fold and gain low bits (the guess misses), at step 6 rank 0
    lacks ``loss`` (its lowest rank moves), at step 7 it has it again; ``eval`` is logged at steps 0 and 5 only."""

    def of_update(rng: random.Random, *, step: int, rank: int, update: int, n: int) -> Records:
        records: Records = []
        loss = [rng.gauss(0.0, 3.0) for _ in range(n)]
        tight = [1e6 + 1e-3 * rng.gauss(0, 1) for _ in range(n)]
        if step == 4 and rank == 1:
            loss = [v * 2.0**30 + 2.0**-40 for v in loss]
            tight = [v * 2.0**30 for v in tight]
        if not (step == 6 and rank == 0):
            records.append((update, "loss", loss, None))
        records.append((update, "pg_loss", [rng.uniform(-2, 2) / 7.0], None))
        records.append((update, "clip", [rng.random() for _ in range(n)], [float(rng.randint(1, 9))] * n))
        records.append((update, "tight", tight, None))
        records.append((update, "tokens", [float(rng.randint(1, 512))], None))
        return records

    def of_rank(rng: random.Random, *, step: int, rank: int) -> Records:
        # agreed at step 0, absent on every rank until step 5: a slot the guess holds empty
        return [(0, "eval", [rng.gauss(0.0, 1.0)], None)] if step in {0, 5} else []

    steps = _steady_steps(seed, ranks=ranks, steps=8, of_update=of_update, of_rank=of_rank)
    rules = {name: RULES[name] for name in ("loss", "pg_loss", "clip", "tight", "tokens")} | {"eval": "mean"}
    return {"steps": steps, "rules": rules, "logger": "tests.test_bitwise:log_share"}


@pytest.mark.parametrize("ranks", [2, 4])
def test_guessed_sums_agree_bit_for_bit_hit_or_miss(ranks: int) -> None:
    """The sums pass laid out by the previous commit's maxima (metricbus.speculate): steady commits issue both
    all_reduces together; where the guess misses every rank runs one more sums pass; the values are the same bits
    as the driver's ingest."""
    pytest.importorskip("torch")
    from tests import dist_workers
    from tests.test_dist import _spawn

    plan = _guessed_plan(2000 + ranks, ranks=ranks)
    live = _spawn(dist_workers.guess_worker, ranks, plan)
    expected = bits(ingested(plan, ranks=ranks))
    for rank in range(ranks):
        rows, calls = live[rank]
        assert bits(rows) == expected, rank
        assert calls[2] == calls[3] == {"async": 2, "sync": 0}, calls  # guessed: both passes at once
        assert calls[4] == {"async": 2, "sync": 1}, calls  # values grew beyond the margin: the sums pass again
        assert calls[5] == {"async": 2, "sync": 1}, calls  # eval's slots were empty at step 4: zeros, then again
        assert calls[6] == {"async": 2, "sync": 1}, calls  # loss's lowest rank moved
        assert calls[7] == {"async": 2, "sync": 1}, calls  # and back


def _one_pass_plan(seed: int, *, ranks: int) -> dict[str, Any]:
    """32 steps of metrics no chain reads a merged min/max of (so a steady commit is one all_reduce,
    metricbus.one_pass), each a way the guess must be found to miss from the reduced checks alone: at step 4 rank
    1's losses grow 2**30-fold and gain low bits; ``eval`` is logged at steps 0 and 5 only; at step 6 rank 0 lacks
    ``loss``, at step 7 it has it again; ``late`` appears on rank 1 at step 8 (an agreement inside a one-pass
    commit); ``w`` has weights but at step 12 (a column guessed weighted has none, then weights in a column guessed
    unweighted)."""

    def of_update(rng: random.Random, *, step: int, rank: int, update: int, n: int) -> Records:
        records: Records = []
        loss = [rng.gauss(0.0, 3.0) for _ in range(n)]
        if step == 4 and rank == 1:
            loss = [v * 2.0**30 + 2.0**-40 for v in loss]
        if not (step == 6 and rank == 0):
            records.append((update, "loss", loss, None))
        records.append((update, "pg_loss", [rng.uniform(-2, 2) / 7.0], None))
        records.append((update, "clip", [rng.random() for _ in range(n)], [float(rng.randint(2, 9))] * n))
        weights = [1.0] * n if step == 12 else [float(rng.randint(2, 9)) for _ in range(n)]
        records.append((update, "w", [rng.uniform(0, 4) for _ in range(n)], weights))
        records.append((update, "tight", [1e6 + 1e-3 * rng.gauss(0, 1) for _ in range(n)], None))
        records.append((update, "tokens", [float(rng.randint(1, 512))], None))
        return records

    def of_rank(rng: random.Random, *, step: int, rank: int) -> Records:
        records: Records = [(0, "eval", [rng.gauss(0.0, 1.0)], None)] if step in {0, 5} else []
        if step >= 8 and rank == 1:
            records.append((0, "late", [rng.gauss(5.0, 1.0)], None))
        return records

    steps = _steady_steps(seed, ranks=ranks, steps=32, of_update=of_update, of_rank=of_rank)
    rules = {
        "loss": ["mean", "std", "first", "last", "count", "sum"],
        "pg_loss": RULES["pg_loss"],
        "clip": Agg(micro="mean", rank="mean"),
        "w": "mean",
        "tight": RULES["tight"],
        "tokens": RULES["tokens"],
        "eval": "mean",
        "late": "mean",
    }
    return {"steps": steps, "rules": rules, "logger": "tests.test_bitwise:log_share"}


@pytest.mark.parametrize("ranks", [2, 4])
def test_one_pass_commits_agree_bit_for_bit_hit_or_miss(ranks: int) -> None:
    """A steady commit of a layout without rank-level min/max is one all_reduce of the guessed sums and their
    checks; a miss found there costs the maxima pass and the sums pass again; a new metric costs the byte gather
    alone; every REFRESH-th one-pass commit agrees the maxima (both passes at once). The values are the same bits as
    the driver's ingest."""
    pytest.importorskip("torch")
    from metricbus import one_pass
    from tests import dist_workers
    from tests.test_dist import _spawn

    plan = _one_pass_plan(3000 + ranks, ranks=ranks)
    live = _spawn(dist_workers.guess_worker, ranks, plan)
    expected = bits(ingested(plan, ranks=ranks))
    one, again, first = {"async": 0, "sync": 1}, {"async": 0, "sync": 3}, {"async": 0, "sync": 2}
    refresh = 14 + one_pass.REFRESH
    want = [first, first, one, one, again, again, again, again, one, first, one, one, again, again]
    want += [{"async": 2, "sync": 0} if step == refresh else one for step in range(14, 32)]
    for rank in range(ranks):
        rows, calls = live[rank]
        assert bits(rows) == expected, rank
        assert calls == want, calls


def test_weights_arriving_in_a_speculated_commit(tmp_path: Path) -> None:
    """A metric read as ``max`` (so steady commits speculate) whose sum is 0 at one step and which is logged with
    weights at the next: the rank sends blank sums for the guess, every rank runs the sums pass again, and live,
    ingest and replay agree (found by a review fuzzer: an IndexError on the logging rank, gloo closed on the other)."""
    pytest.importorskip("torch")
    from tests import dist_workers
    from tests.test_dist import _spawn

    steps = [
        [[(0, "x", [1.0], None)], []],
        [[(0, "x", [-1.5, 1.5], None)], []],
        [[(0, "x", [0.0], [3.0])], []],
        [[(0, "x", [2.0], [1.0])], [(0, "x", [-0.0], None)]],
    ]
    plan = {"steps": steps, "rules": {"x": ["max", "mean"]}, "logger": "tests.test_bitwise:log_share"}
    journal = str(tmp_path / "journal")
    live = _spawn(dist_workers.updates_worker, 2, plan, journal)
    expected = bits(ingested(plan, ranks=2))
    assert bits(live[0]) == bits(live[1]) == expected
    assert bits([metrics for _, metrics in emitted(read_journal(journal))]) == expected
