"""The recipes of docs_recipes.md, checked against numpy on the whole, unsplit data.

Each test simulates R workers (one ``MetricBus(dist=None)`` each, exported to a driver that ingests them: the same
rank-level reduction as torch.distributed) running K optimizer updates of M micro-batches per step, with unequal
token counts, and compares the emitted value with the quantity the recipe claims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from metricbus import Agg, MetricBus

LAYOUTS = [(1, 1, 1), (1, 3, 1), (2, 2, 2), (3, 2, 4), (4, 1, 3)]  # (R, M, K)
PRE_SCALED = Agg(micro="sum", update="mean", rank="mean")
REL = 1e-12


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of one rank in one update: per-token losses, clip flags, sequence lengths."""

    rank: int
    update: int
    losses: np.ndarray
    clipped: np.ndarray
    lengths: np.ndarray

    @property
    def n(self) -> int:
        """Tokens in the micro-batch."""
        return int(self.losses.size)


def make_step(ranks: int, micro: int, updates: int, *, seed: int) -> list[MicroBatch]:
    """A step's micro-batches, in (update, rank, micro) order, 1-3 sequences of 1-60 tokens each."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(updates):
        for r in range(ranks):
            for _ in range(micro):
                lengths = rng.integers(1, 61, size=int(rng.integers(1, 4)))
                n = int(lengths.sum())
                out.append(MicroBatch(r, k, rng.normal(0.5, 1.0, n), rng.random(n) < 0.2, lengths))
    return out


def reduce_step(ranks: int, updates: int, batches: list[MicroBatch],
                log: Callable[[MetricBus, MicroBatch], None]) -> dict[str, float]:
    """Log ``batches`` into one bus per rank, ``end_update()`` after each update, and commit on a driver."""
    workers = [MetricBus(dist=None, strict=True) for _ in range(ranks)]
    for k in range(updates):
        for r, bus in enumerate(workers):
            for batch in batches:
                if (batch.rank, batch.update) == (r, k):
                    log(bus, batch)
            bus.end_update()
    driver = MetricBus(dist=None, strict=True)
    driver.ingest([bus.export() for bus in workers])
    out = driver.commit(step=0)
    for bus in [*workers, driver]:
        bus.close()
    return out


def update_tokens(batches: list[MicroBatch]) -> dict[int, int]:
    """Tokens of each update over all ranks (verl's batch_num_tokens of the mini-batch)."""
    tokens: dict[int, int] = {}
    for b in batches:
        tokens[b.update] = tokens.get(b.update, 0) + b.n
    return tokens


Layout = tuple[int, int, int, list[MicroBatch]]


@pytest.fixture(params=LAYOUTS, ids=lambda p: "x".join(map(str, p)))
def layout(request: pytest.FixtureRequest) -> Layout:
    """(R, M, K, the step's micro-batches)."""
    ranks, micro, updates = request.param
    return ranks, micro, updates, make_step(ranks, micro, updates, seed=ranks * 100 + micro * 10 + updates)


def test_loss_pre_scaled_by_global_tokens(layout: Layout) -> None:
    """verl token-mean (sum / mini-batch tokens * dp_size) with PRE_SCALED: the mean over updates of each
    update's per-token loss; without the dp_size factor, rank="sum"; "sum" everywhere is off by R*K, "mean" by 1/M,
    no update boundaries (update="sum") by K."""
    ranks, micro, updates, batches = layout
    tokens = update_tokens(batches)

    def log(bus: MetricBus, b: MicroBatch) -> None:
        value = float(b.losses.sum()) / tokens[b.update] * ranks
        bus.log("pg_loss", value, agg=PRE_SCALED)
        bus.log("unscaled_by_dp", value / ranks, agg=Agg(micro="sum", update="mean", rank="sum"))
        bus.log("naive_sum", value, agg="sum")
        bus.log("naive_no_updates", value, agg=Agg(micro="sum", update="sum", rank="mean"))
        bus.log("naive_mean", value, agg="mean")

    out = reduce_step(ranks, updates, batches, log)
    per_update = [sum(b.losses.sum() for b in batches if b.update == k) / tokens[k] for k in range(updates)]
    truth = float(np.mean(per_update))
    assert out["pg_loss"] == pytest.approx(truth, rel=REL)
    assert out["unscaled_by_dp"] == pytest.approx(truth, rel=REL)
    assert out["naive_no_updates"] == pytest.approx(truth * updates, rel=REL)
    assert out["naive_sum"] == pytest.approx(truth * ranks * updates, rel=REL)
    assert out["naive_mean"] == pytest.approx(truth / micro, rel=REL)


def test_loss_divided_by_accumulation_steps(layout: Layout) -> None:
    """``loss / M`` (HF / Lightning) with PRE_SCALED: the mean of the micro-batch mean losses (what was optimized),
    which is not the token-weighted mean when token counts differ."""
    ranks, micro, updates, batches = layout

    def log(bus: MetricBus, b: MicroBatch) -> None:
        bus.log("loss", float(b.losses.mean()) / micro, agg=PRE_SCALED)

    out = reduce_step(ranks, updates, batches, log)
    assert out["loss"] == pytest.approx(float(np.mean([b.losses.mean() for b in batches])), rel=REL)
    token_mean = np.concatenate([b.losses for b in batches]).mean()
    if len(batches) > 1:
        assert abs(out["loss"] - token_mean) > 1e-6


def test_token_mean_with_weight(layout: Layout) -> None:
    """A local token mean logged with ``weight=n_tokens`` and "mean": the global token mean over the step."""
    ranks, _, updates, batches = layout

    def log(bus: MetricBus, b: MicroBatch) -> None:
        bus.log("entropy", float(b.losses.mean()), weight=b.n, agg="mean")

    out = reduce_step(ranks, updates, batches, log)
    assert out["entropy"] == pytest.approx(float(np.concatenate([b.losses for b in batches]).mean()), rel=REL)


def test_clip_fraction(layout: Layout) -> None:
    """The local clip fraction with ``weight=n_tokens`` and "mean": clipped tokens / all tokens of the step;
    the unweighted mean of micro-batch fractions is not."""
    ranks, _, updates, batches = layout

    def log(bus: MetricBus, b: MicroBatch) -> None:
        bus.log("pg_clipfrac", float(b.clipped.mean()), weight=b.n, agg="mean")
        bus.log("naive_clipfrac", float(b.clipped.mean()), agg="mean")

    out = reduce_step(ranks, updates, batches, log)
    truth = float(np.concatenate([b.clipped for b in batches]).mean())
    assert out["pg_clipfrac"] == pytest.approx(truth, rel=REL)
    unweighted = float(np.mean([b.clipped.mean() for b in batches]))
    assert out["naive_clipfrac"] == pytest.approx(unweighted, rel=REL)


def test_lengths(layout: Layout) -> None:
    """Per-sequence lengths logged as an array with ["mean", "max", "min"]: over every sequence of the step."""
    ranks, _, updates, batches = layout

    def log(bus: MetricBus, b: MicroBatch) -> None:
        bus.log("response_length", b.lengths.astype(float).tolist(), agg=["mean", "max", "min"])
        bus.log("batch/tokens", float(b.n), agg="sum")

    out = reduce_step(ranks, updates, batches, log)
    lengths = np.concatenate([b.lengths for b in batches])
    assert out["response_length/mean"] == pytest.approx(float(lengths.mean()), rel=REL)
    assert out["response_length/max"] == float(lengths.max())
    assert out["response_length/min"] == float(lengths.min())
    assert out["batch/tokens"] == float(lengths.sum())
