"""What tests/test_ray.py runs in Ray actors and gloo processes (module level, so both can import it).

A plan is verl's PPO actor update, R workers x K mini-batch updates x M micro-batches per step, with uneven token
counts: ``plan[step][rank][update]`` is a list of :class:`Micro`. Every path (Ray actors, torch.distributed ranks,
one process) logs a rank's micro-batches with :func:`log_update`, so they log the same doubles.
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

from metricbus import Agg, MetricBus
from metricbus.spec import SpecLike

RULES: dict[str, SpecLike] = {
    "actor/pg_loss": Agg(micro="sum", update="mean", rank="mean"),  # pre-scaled by the update's global tokens x R
    "actor/pg_clipfrac": "mean",  # a micro-batch's clipped fraction, weight=n_tokens: token-weighted
    "actor/grad_norm": Agg(micro="last", update="max", rank="max"),  # one value per update
    "response_length": ["mean", "max", "min"],  # each sequence's length is one record
    "batch/tokens": "sum",
}


@dataclass(frozen=True)
class Micro:
    """One micro-batch: its sequences' response lengths, the sum of its per-token losses, its clipped tokens."""

    lengths: tuple[int, ...]
    loss_sum: float
    clipped: int
    pg_loss: float  # verl's agg_loss "token-mean" with global batch info: loss_sum / update tokens * R

    @property
    def n(self) -> int:
        """Response tokens."""
        return sum(self.lengths)


Plan = list[list[list[list[Micro]]]]  # [step][rank][update] -> micro-batches


def make_plan(*, ranks: int, updates: int, micro: int, steps: int, seed: int = 0) -> Plan:
    """Random uneven micro-batches (1-3 sequences of 1-60 tokens); pg_loss pre-scaled as verl does."""
    rng = random.Random(seed)
    plan: Plan = []
    for _ in range(steps):
        raw = [[[tuple(rng.randint(1, 60) for _ in range(rng.randint(1, 3))) for _ in range(micro)]
                for _ in range(updates)] for _ in range(ranks)]  # fmt: skip
        step: list[list[list[Micro]]] = []
        for r in range(ranks):
            per_update = []
            for k in range(updates):
                tokens = sum(sum(lengths) for q in range(ranks) for lengths in raw[q][k])  # verl batch_num_tokens
                batches = []
                for lengths in raw[r][k]:
                    n = sum(lengths)
                    loss_sum = math.fsum(rng.gauss(0.4, 1.0) for _ in range(n))
                    clipped = sum(rng.random() < 0.2 for _ in range(n))
                    batches.append(Micro(lengths, loss_sum, clipped, loss_sum / tokens * ranks))
                per_update.append(batches)
            step.append(per_update)
        plan.append(step)
    return plan


def log_update(bus: MetricBus, batches: list[Micro]) -> None:
    """Log one optimizer update's micro-batches as a verl actor worker does, then mark the update's end."""
    for mb in batches:
        bus.log("actor/pg_loss", mb.pg_loss)
        bus.log("actor/pg_clipfrac", mb.clipped / mb.n, weight=mb.n)
        bus.log("response_length", list(mb.lengths))
        bus.log("batch/tokens", mb.n)
    bus.log("actor/grad_norm", math.sqrt(math.fsum(mb.loss_sum**2 for mb in batches)))  # once, after the update
    bus.end_update()


def log_rank(bus: MetricBus, plan: Plan, *, step: int, rank: int) -> None:
    """Log rank ``rank``'s K updates of ``step``."""
    for batches in plan[step][rank]:
        log_update(bus, batches)


def single_process(plan: Plan) -> list[dict[str, float]]:
    """One bus logs every worker's updates (each one update of its own) and commits each step."""
    bus = MetricBus(dist=None, strict=True, rules=RULES)
    rows = []
    for step in range(len(plan)):
        for rank in range(len(plan[step])):
            log_rank(bus, plan, step=step, rank=rank)
        rows.append(bus.commit(step=step))
    bus.close()
    return rows


@dataclass(frozen=True)
class Output:
    """verl's ``DataProto`` as far as metrics go: the worker's result carries them in ``meta_info``."""

    meta_info: dict[str, Any]


class PolicyWorker:
    """A verl-style actor worker (wrapped with ``ray.remote`` by the tests): its own bus, one call per step."""

    def __init__(self, rank: int, rules: dict[str, SpecLike] | None = None) -> None:
        self.rank = rank
        # no adapters: workers only reduce their micro-batches (``rules``: a misconfigured worker's own)
        self.bus = MetricBus(dist=None, rules=RULES if rules is None else rules)

    def update_actor(
        self, step: int, updates: list[list[Micro]], *, die_at: int | None = None, pause_s: float = 0.0
    ) -> dict[str, Any]:
        """Run K updates; return ``{"metrics": partial}`` like verl's ``meta_info``. ``die_at=k``: exit in update
        k, after logging its first micro-batch; ``pause_s``: sleep after the first micro-batch."""
        for k, batches in enumerate(updates):
            if die_at == k:
                self.bus.log("actor/pg_loss", batches[0].pg_loss)
                os._exit(1)  # the process dies mid-step, as an OOM-killed or crashed worker does
            if k == 0 and pause_s:
                time.sleep(pause_s)
            log_update(self.bus, batches)
        return {"metrics": self.bus.export(), "step": step}

    def update_actor_proto(self, step: int, updates: list[list[Micro]]) -> Output:
        """The same update, returned as a DataProto-like object with ``meta_info["metrics"]``."""
        return Output(meta_info=self.update_actor(step, updates))

    def legacy_metrics(self, step: int, updates: list[list[Micro]]) -> dict[str, Any]:
        """What a worker without metricbus returns: verl's per-micro-batch lists, no partial."""
        return {"metrics": {"actor/pg_loss": [mb.pg_loss for batches in updates for mb in batches]}, "step": step}

    def fail(self) -> None:
        """Raise inside the actor (the process stays alive)."""
        raise ValueError(f"rank {self.rank}: bad shard")


def gloo_worker(rank: int, size: int, port: int, plan: Plan, out: Any) -> None:
    """torch.distributed rank ``rank`` of ``size`` (gloo): log this rank's share of every step, commit each."""
    import torch.distributed as tdist

    from tests.dist_workers import init_gloo

    init_gloo(rank, size, port)
    try:
        bus = MetricBus(dist="torch", strict=True, rules=RULES)
        rows = []
        for step in range(len(plan)):
            log_rank(bus, plan, step=step, rank=rank)
            rows.append(bus.commit(step=step))
        bus.close()
        out.put((rank, rows))
    finally:
        tdist.destroy_process_group()
