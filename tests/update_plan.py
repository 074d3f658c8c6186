"""A data plan with several optimizer updates per step, logged the same way by every path the tests compare.

``plan["steps"][s][r][k]`` is rank r's update k of step s: a list of micro-batches, each a list of
``(name, value, weight)`` records. Values are pre-scaled like verl's ``pg_loss`` (by each mini-batch's global
token count times the number of ranks), token means carry their token counts as weights.
"""

from __future__ import annotations

import random
from typing import Any

from metricbus import Agg, MetricBus

RULES = {
    "pg_loss": Agg(micro="sum", update="mean", rank="mean"),
    "clipfrac": "mean",
    "update_max": Agg(micro="mean", update="max", rank="max"),
    "len": ["mean", "max", "min", "count"],
    "kl": Agg(micro="sum", update="sum", rank="sum", step="mean"),
}


def make_plan(*, ranks: int, updates: int, micro: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """Random uneven token counts; the loss of each micro-batch pre-scaled by its mini-batch's global tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        tokens = [[[rng.randint(1, 40) for _ in range(micro)] for _ in range(updates)] for _ in range(ranks)]
        step = []
        for r in range(ranks):
            per_update = []
            for k in range(updates):
                global_tokens = sum(tokens[q][k][m] for q in range(ranks) for m in range(micro))
                batches = []
                for m in range(micro):
                    n = tokens[r][k][m]
                    token_losses = [rng.uniform(-2.0, 3.0) for _ in range(n)]
                    clip = sum(rng.random() < 0.2 for _ in range(n)) / n
                    batches.append([
                        ("pg_loss", sum(token_losses) / global_tokens * ranks, None),
                        ("clipfrac", clip, float(n)),
                        ("update_max", rng.uniform(0, 1), None),
                        ("len", float(n), None),
                        ("kl", rng.uniform(-1e-3, 1e-3), None),
                    ])
                per_update.append(batches)
            step.append(per_update)
        out.append(step)
    return {"steps": out, "rules": RULES}


def log_rank(bus: MetricBus, plan: dict[str, Any], *, step: int, rank: int) -> None:
    """Log rank ``rank``'s updates of ``step`` into ``bus``, marking each update's end."""
    for batches in plan["steps"][step][rank]:
        for records in batches:
            for name, value, weight in records:
                bus.log(name, value, weight=weight)
        bus.end_update()
