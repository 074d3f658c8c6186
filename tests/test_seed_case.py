"""The seed's worked case (verl PR "fix: Engine Metric Aggregation"): 2 workers x 2 micro-batches, unequal tokens.

verl's ``agg_loss`` scales each micro-batch loss by dp_size / global tokens, so the per-micro-batch values must be
summed within a worker and averaged across workers; ``pg_clipfrac`` is a per-micro-batch token fraction and must be
token-weighted. Averaging everything divides the loss by the number of micro-batches M; summing everything
multiplies it by the number of ranks R.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from metricbus import Agg, MetricBus
from metricbus.partial import Partial

DP_SIZE = 2
MICRO_BATCHES = 2
TOKENS = [[130, 7], [41, 300]]  # tokens[worker][micro-batch]: deliberately unequal
RULES = {"actor/pg_loss": Agg(micro="sum", rank="mean"), "actor/*clipfrac*": "mean"}


@pytest.fixture
def token_losses() -> list[list[np.ndarray]]:
    """Per-token losses for each worker's micro-batches."""
    rng = np.random.default_rng(2024)
    return [[rng.normal(0.3, 1.0, n) for n in worker] for worker in TOKENS]


@pytest.fixture
def token_clipped() -> list[list[np.ndarray]]:
    """Per-token clip indicators (0/1) for each worker's micro-batches, with very different rates."""
    rng = np.random.default_rng(7)
    rates = [[0.9, 0.05], [0.5, 0.1]]
    return [
        [(rng.random(n) < p).astype(np.float64) for n, p in zip(worker, r, strict=True)]
        for worker, r in zip(TOKENS, rates, strict=True)
    ]


def global_tokens() -> int:
    """Tokens over every worker and micro-batch."""
    return sum(sum(worker) for worker in TOKENS)


def micro_losses(token_losses: list[list[np.ndarray]]) -> list[list[float]]:
    """verl agg_loss style: sum of the micro-batch's per-token losses / global tokens * dp_size."""
    g = global_tokens()
    return [[float(np.sum(mb)) / g * DP_SIZE for mb in worker] for worker in token_losses]


def run_workers(token_losses: list[list[np.ndarray]], token_clipped: list[list[np.ndarray]]) -> dict[str, float]:
    """Each worker logs its micro-batches and exports; a driver ingests both and commits."""
    losses = micro_losses(token_losses)
    parts: list[Partial] = []
    for w in range(DP_SIZE):
        worker = MetricBus(rules=RULES, dist=None, strict=True)
        for m in range(MICRO_BATCHES):
            clipped = token_clipped[w][m]
            worker.log("actor/pg_loss", losses[w][m])
            worker.log("actor/pg_clipfrac", float(np.mean(clipped)), weight=clipped.size)
        parts.append(worker.export())
        worker.close()
    driver = MetricBus(rules=RULES, dist=None, strict=True)
    driver.ingest(parts)
    out = driver.commit(step=1)
    driver.close()
    return out


def test_pre_scaled_pg_loss_is_the_global_per_token_mean(
    token_losses: list[list[np.ndarray]], token_clipped: list[list[np.ndarray]]
) -> None:
    """Agg(micro='sum', rank='mean') of the pre-scaled micro-batch losses equals the true per-token mean."""
    true_mean = float(np.mean(np.concatenate([mb for worker in token_losses for mb in worker])))
    assert run_workers(token_losses, token_clipped)["actor/pg_loss"] == pytest.approx(true_mean, rel=1e-12)


def test_token_weighted_clipfrac_is_the_token_fraction(
    token_losses: list[list[np.ndarray]], token_clipped: list[list[np.ndarray]]
) -> None:
    """pg_clipfrac logged with weight=n_tokens is the fraction of all tokens clipped."""
    all_clipped = np.concatenate([mb for worker in token_clipped for mb in worker])
    assert run_workers(token_losses, token_clipped)["actor/pg_clipfrac"] == pytest.approx(
        float(np.mean(all_clipped)), rel=1e-12
    )


def test_token_weighted_clipfrac_differs_from_mean_of_micro_batch_means(
    token_losses: list[list[np.ndarray]], token_clipped: list[list[np.ndarray]]
) -> None:
    """verl's mean of micro-batch means is a different (wrong) number for unequal token counts."""
    mean_of_means = float(np.mean([np.mean(mb) for worker in token_clipped for mb in worker]))
    got = run_workers(token_losses, token_clipped)["actor/pg_clipfrac"]
    assert not math.isclose(got, mean_of_means, rel_tol=1e-3)


def test_naive_mean_divides_the_loss_by_the_number_of_micro_batches(token_losses: list[list[np.ndarray]]) -> None:
    """Averaging the pre-scaled losses over every micro-batch gives true mean / M."""
    true_mean = float(np.mean(np.concatenate([mb for worker in token_losses for mb in worker])))
    flat = [x for worker in micro_losses(token_losses) for x in worker]
    bus = MetricBus(dist=None, strict=True)
    bus.log("actor/pg_loss", flat, agg="mean")
    naive = bus.commit()["actor/pg_loss"]
    assert naive == pytest.approx(float(np.mean(flat)), rel=1e-12)
    assert naive == pytest.approx(true_mean / MICRO_BATCHES, rel=1e-12)


def test_sum_everywhere_multiplies_the_loss_by_the_number_of_ranks(token_losses: list[list[np.ndarray]]) -> None:
    """Summing the pre-scaled losses over micro-batches and workers gives true mean x R."""
    true_mean = float(np.mean(np.concatenate([mb for worker in token_losses for mb in worker])))
    losses = micro_losses(token_losses)
    driver = MetricBus(rules={"actor/pg_loss": "sum"}, dist=None, strict=True)
    parts = []
    for w in range(DP_SIZE):
        worker = MetricBus(rules={"actor/pg_loss": "sum"}, dist=None, strict=True)
        for x in losses[w]:
            worker.log("actor/pg_loss", x)
        parts.append(worker.export())
    driver.ingest(parts)
    assert driver.commit()["actor/pg_loss"] == pytest.approx(true_mean * DP_SIZE, rel=1e-12)
