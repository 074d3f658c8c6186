"""Review of the Ray single-controller path: one actor's bad partial no longer costs every actor's step."""

from __future__ import annotations

import math
from typing import Any

import pytest

from metricbus import MetricBus
from metricbus.errors import SpecError
from metricbus.integrations.ray import gather_partials
from tests.ray_workers import RULES, PolicyWorker, make_plan

TIMEOUT_S = 120


def test_one_actors_misdeclared_metric_is_left_out_and_the_others_are_ingested(ray_cluster: Any) -> None:
    """Actor 1 declares pg_clipfrac "sum" (the others "mean"): its pg_clipfrac is refused, named with its partial's
    index; every other record of the three actors is committed, equal to the step's truth."""
    plan = make_plan(ranks=3, updates=2, micro=2, steps=1, seed=7)
    cls = ray_cluster.remote(num_cpus=0)(PolicyWorker)
    workers = [cls.remote(r, {**RULES, "actor/pg_clipfrac": "sum"} if r == 1 else None) for r in range(3)]
    try:
        refs = {f"actor_{r}": w.update_actor.remote(0, plan[0][r]) for r, w in enumerate(workers)}
        driver = MetricBus(dist=None, strict=True)
        with pytest.raises(SpecError, match=r"(?s)could not be taken.*partial 1 of this call: 'actor/pg_clipfrac'"):
            driver.ingest(gather_partials(refs, timeout_s=TIMEOUT_S))
        row = driver.commit(step=0)
        driver.close()
    finally:
        for w in workers:
            ray_cluster.kill(w)
    step = plan[0]
    lengths = [n for rank in step for update in rank for mb in update for n in mb.lengths]
    assert row["batch/tokens"] == sum(lengths)
    assert row["response_length/max"] == max(lengths)
    assert row["response_length/mean"] == pytest.approx(math.fsum(lengths) / len(lengths), rel=1e-12)
    updates = len(step[0])
    per_update = [
        math.fsum(mb.loss_sum for rank in step for mb in rank[k]) / sum(mb.n for rank in step for mb in rank[k])
        for k in range(updates)
    ]
    assert row["actor/pg_loss"] == pytest.approx(math.fsum(per_update) / updates, rel=1e-12)
    good = [mb for r in (0, 2) for update in step[r] for mb in update]  # actor 1's clip fractions were refused
    clipfrac = sum(mb.clipped for mb in good) / sum(mb.n for mb in good)
    assert row["actor/pg_clipfrac"] == pytest.approx(clipfrac, rel=1e-12)
