"""Single-controller logging, verl style: a driver, Ray worker actors, K mini-batch updates per step.

As in verl's ``RayPPOTrainer``, the driver hands each actor worker its shard of a step's batch; each worker runs K
optimizer updates (mini-batches) of M gradient-accumulation micro-batches and returns its metrics inside its result
dict (verl: ``DataProto(meta_info={"metrics": ...})``). Here each worker logs every micro-batch into its own
``MetricBus(dist=None)`` -- ``pg_loss`` pre-scaled by the update's global token count x R like verl's ``agg_loss``,
the clip fraction with ``weight=n_tokens``, the response lengths -- calls ``end_update()`` after each update, and
returns ``{"metrics": bus.export(), ...}``. The driver gathers the results in worker order with
``metricbus.integrations.ray.gather_partials`` (a worker that died, raised or hung is named, and nothing of that
step is ingested), ``ingest()``s them and ``commit()``s: the rank level of the reduction happens there, with the
same code as torch.distributed.

``--compare`` prints, next to the exact values, verl-style naive reductions of the same per-micro-batch values.
Ray is an extra (``pip install 'metricbus[ray]'``); without it (or with ``--backend mp``) the same worker class
runs in multiprocessing processes.

    python examples/single_controller.py --workers 4 --micro 2 --updates 2 --steps 3 --compare
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import multiprocessing as mp
import os
import random
from dataclasses import dataclass
from typing import Any

from metricbus import Agg, MetricBus
from metricbus.integrations.ray import gather_partials
from metricbus.spec import SpecLike

# Declared by the workers; the driver has no rules and adopts what the partials carry.
RULES: dict[str, SpecLike] = {
    "actor/pg_loss": Agg(micro="sum", update="mean", rank="mean"),  # pre-scaled: sum an update's micro-batches
    "actor/pg_clipfrac": "mean",  # logged with weight=n_tokens: the token-weighted mean
    "response_length": ["mean", "max", "min"],  # each sequence's length is one record
    "perf/tokens": "sum",
}
GATHER_TIMEOUT_S = 600.0  # a step's update_actor calls must finish within this; a dead worker is reported at once


@dataclass(frozen=True)
class Shard:
    """One worker's part of a step: response lengths [update][micro-batch][sequence], and each update's tokens
    over all workers (verl's ``batch_num_tokens``, the normalizer of its token-mean loss)."""

    step: int
    lengths: list[list[list[int]]]
    update_tokens: list[int]


def make_shards(*, step: int, seed: int, workers: int, updates: int, micro: int) -> list[Shard]:
    """The step's batch cut into worker shards: 2 sequences of 4-64 tokens per micro-batch."""
    rng = random.Random(seed * 1_000_003 + step)
    lengths = [[[[rng.randint(4, 64) for _ in range(2)] for _ in range(micro)] for _ in range(updates)]
               for _ in range(workers)]  # fmt: skip
    tokens = [sum(sum(seqs) for w in lengths for seqs in w[k]) for k in range(updates)]
    return [Shard(step, lengths[w], tokens) for w in range(workers)]


def token_stats(*, step: int, update: int, worker: int, micro: int, n: int) -> list[tuple[float, bool]]:
    """(per-token loss, clipped?) for one micro-batch's n tokens: a deterministic stand-in for the forward pass."""
    rng = random.Random(f"{step}/{update}/{worker}/{micro}")
    return [(rng.gauss(0.5 / (1 + step), 0.3), rng.random() < 0.15) for _ in range(n)]


class ActorWorker:
    """verl's actor worker, reduced to its metrics: its own bus, one ``update_actor()`` call per step."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.bus = MetricBus(rules=RULES, dist=None)  # no adapters: a worker only reduces its micro-batches

    def update_actor(self, shard: Shard) -> dict[str, Any]:
        """K updates of M micro-batches; returns verl's result dict with the exported partial under "metrics"."""
        lists: dict[str, list[list[float]]] = {"actor/pg_loss": [], "actor/pg_clipfrac": []}  # for --compare
        for k, micro_batches in enumerate(shard.lengths):
            for per_update in lists.values():
                per_update.append([])
            for m, seqs in enumerate(micro_batches):
                n = sum(seqs)
                toks = token_stats(step=shard.step, update=k, worker=self.rank, micro=m, n=n)
                loss = math.fsum(t for t, _ in toks) / shard.update_tokens[k] * self.world_size  # verl agg_loss
                clipfrac = sum(c for _, c in toks) / n  # a local token mean
                self.bus.log("actor/pg_loss", loss)
                self.bus.log("actor/pg_clipfrac", clipfrac, weight=n)
                self.bus.log("response_length", seqs)
                self.bus.log("perf/tokens", n)
                lists["actor/pg_loss"][-1].append(loss)
                lists["actor/pg_clipfrac"][-1].append(clipfrac)
            self.bus.end_update()  # after optimizer.step()
        return {"metrics": self.bus.export(), "micro_values": lists}

    def close(self) -> None:
        """Close the worker's bus."""
        self.bus.close()


def _update_actor(args: tuple[int, int, Shard]) -> dict[str, Any]:
    """The multiprocessing fallback's task: a worker for one call."""
    rank, world_size, shard = args
    worker = ActorWorker(rank, world_size)
    try:
        return worker.update_actor(shard)
    finally:
        worker.close()


class RayWorkers:
    """R Ray actors on a local Ray; ``update_actor`` returns each worker's result ref, by worker name."""

    def __init__(self, workers: int) -> None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        import ray

        cpus = os.cpu_count() or 1
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)  # never a cluster
        share = min(1.0, math.floor(100 * cpus / workers) / 100)  # more actors than CPUs: a fraction each
        actor = ray.remote(num_cpus=share)(ActorWorker)
        self._ray = ray
        self.actors: list[Any] = [actor.remote(rank, workers) for rank in range(workers)]

    def update_actor(self, shards: list[Shard]) -> dict[str, Any]:
        pairs = zip(self.actors, shards, strict=True)
        return {f"actor_{r}": actor.update_actor.remote(shard) for r, (actor, shard) in enumerate(pairs)}

    def values(self, results: dict[str, Any]) -> list[dict[str, Any]]:
        return list(self._ray.get(list(results.values())))

    def close(self) -> None:
        self._ray.shutdown()


class ProcessWorkers:
    """The fallback without Ray: the same worker class in multiprocessing processes."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool = mp.get_context("spawn").Pool(workers)

    def update_actor(self, shards: list[Shard]) -> dict[str, Any]:
        jobs = [(r, self.workers, s) for r, s in enumerate(shards)]
        return {f"worker_{r}": out for r, out in enumerate(self._pool.map(_update_actor, jobs))}

    def values(self, results: dict[str, Any]) -> list[dict[str, Any]]:
        return list(results.values())

    def close(self) -> None:
        self._pool.close()
        self._pool.join()


def truth(shards: list[Shard]) -> dict[str, float]:
    """The step's true values, computed directly on all of its tokens."""
    per_update, clipped, tokens, lengths = [], 0, 0, []
    for k, update_tokens in enumerate(shards[0].update_tokens):
        losses = []
        for w, shard in enumerate(shards):
            for m, seqs in enumerate(shard.lengths[k]):
                toks = token_stats(step=shard.step, update=k, worker=w, micro=m, n=sum(seqs))
                losses += [t for t, _ in toks]
                clipped += sum(c for _, c in toks)
                tokens += len(toks)
                lengths += seqs
        per_update.append(math.fsum(losses) / update_tokens)
    return {"actor/pg_loss": math.fsum(per_update) / len(per_update), "actor/pg_clipfrac": clipped / tokens,
            "response_length/mean": sum(lengths) / len(lengths)}  # fmt: skip


def naive(outputs: list[dict[str, Any]]) -> list[tuple[str, float, str, str]]:
    """verl-style reductions of the workers' per-micro-batch values: (metric, value, how, expected factor)."""
    loss = [out["micro_values"]["actor/pg_loss"] for out in outputs]  # [worker][update][micro]
    clip = [out["micro_values"]["actor/pg_clipfrac"] for out in outputs]
    flat = [x for worker in loss for update in worker for x in update]
    updates = len(loss[0])
    per_update = [math.fsum(x for worker in loss for x in worker[k]) for k in range(updates)]
    per_worker = [math.fsum(x for update in worker for x in update) for worker in loss]
    clips = [x for worker in clip for update in worker for x in update]
    return [
        ("actor/pg_loss", math.fsum(flat) / len(flat), "mean of all micro-batch values (reduce_metrics)", "1/M"),
        ("actor/pg_loss", math.fsum(per_update) / updates, "sum over micro-batches and workers, mean over updates",
         "R"),
        ("actor/pg_loss", math.fsum(per_worker) / len(loss), "sum over micro-batches and updates, mean over workers",
         "K"),
        ("actor/pg_clipfrac", math.fsum(clips) / len(clips), "mean of micro-batch fractions", "~1"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the driver loop; print the last step's exact metrics (and the naive ones with --compare)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, help="R: worker actors (verl's data-parallel size)")
    parser.add_argument("--micro", type=int, default=2, help="M: micro-batches per update")
    parser.add_argument("--updates", type=int, default=2, help="K: optimizer updates (mini-batches) per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("auto", "mp", "ray"), default="auto")
    parser.add_argument("--compare", action="store_true", help="print verl-style naive reductions next to them")
    args = parser.parse_args(argv)
    for name in ("workers", "micro", "updates", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")

    has_ray = importlib.util.find_spec("ray") is not None
    if args.backend == "ray" and not has_ray:
        parser.error("--backend ray needs Ray: pip install 'metricbus[ray]'")
    use_ray = args.backend == "ray" or (args.backend == "auto" and has_ray)
    workers: RayWorkers | ProcessWorkers = RayWorkers(args.workers) if use_ray else ProcessWorkers(args.workers)
    kind = "Ray actor" if use_ray else "multiprocessing"
    print(f"driver + {args.workers} {kind} workers; per step and worker: {args.updates} updates x {args.micro} "
          "micro-batches")  # fmt: skip
    worst = 0.0
    try:
        with MetricBus(adapters=["console"], dist=None, strict=True) as driver:  # no rules: adopts the workers'
            for step in range(args.steps):
                shards = make_shards(step=step, seed=args.seed, workers=args.workers, updates=args.updates,
                                     micro=args.micro)  # fmt: skip
                results = workers.update_actor(shards)  # {worker name: result (a Ray ref, or the dict)}
                driver.ingest(gather_partials(results, timeout_s=GATHER_TIMEOUT_S))
                out = driver.commit(step=step)
                for key, want in truth(shards).items():
                    worst = max(worst, abs(out[key] - want) / abs(want))
            outputs = workers.values(results) if args.compare else []
    finally:
        workers.close()
    print(f"step {step}, exact (metricbus):")
    for key, value in out.items():
        print(f"  {key:<22} {value!r}")
    if args.compare:
        print(f"step {step}, verl-style naive reductions of the same micro-batch values:")
        print(f"  {'metric':<18} {'naive':>12}  {'naive/exact':>11}  factor  how "
              f"(R={args.workers}, M={args.micro}, K={args.updates})")  # fmt: skip
        for key, value, how, factor in naive(outputs):
            print(f"  {key:<18} {value:>12.6g}  {value / out[key]:>11.4f}  {factor:>6}  {how}")
    print(f"max relative deviation from the directly computed global token means: {worst:.1e}")
    return 0 if worst <= 1e-12 else 1


if __name__ == "__main__":
    raise SystemExit(main())
