"""Single-controller logging, verl style: workers log into their own buses, the driver reduces their partials.

Each worker process (multiprocessing, or Ray actors when Ray is installed and ``--backend ray``/``auto``) computes
its shard of a step -- M micro-batches of sequences with unequal token counts -- and logs each micro-batch into its
own ``MetricBus(dist=None)``. It returns ``bus.export()``: a small picklable partial (a summary per metric, not the
records). The driver ``ingest()``s the workers' partials in worker order and ``commit()``s: the rank level of the
reduction happens there, with the same code as torch.distributed.

    python examples/single_controller.py --workers 4 --micro 2 --steps 5
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import multiprocessing as mp
import random
from typing import Any

from metricbus import Agg, MetricBus, Partial

# Declared once and shared by the workers and the driver (ingest() checks that both sides agree).
RULES = {
    "actor/pg_loss": Agg(micro="sum", rank="mean"),  # each micro value is pre-scaled: sum them, mean over workers
    "actor/pg_clipfrac": "mean",  # logged with weight=n_tokens: the token-weighted mean
    "response_length": ["mean", "max", "min"],
    "perf/tokens": "sum",
}


def shard_tokens(*, step: int, seed: int, workers: int, micro: int) -> list[list[list[int]]]:
    """Response lengths of every sequence, [worker][micro] -> lengths; a function of (seed, step) and the layout."""
    rng = random.Random(seed * 1_000_003 + step)
    return [[[rng.randint(4, 64) for _ in range(2)] for _ in range(micro)] for _ in range(workers)]


def token_losses(*, step: int, worker: int, micro: int, n: int) -> list[tuple[float, bool]]:
    """(per-token loss, clipped?) for one micro-batch's n tokens: deterministic fake PPO statistics."""
    rng = random.Random(hash((step, worker, micro)) & 0xFFFFFFFF)
    return [(rng.gauss(0.5 / (1 + step), 0.3), rng.random() < 0.15) for _ in range(n)]


def work(step: int, worker: int, lengths: list[list[int]], global_tokens: int, dp_size: int) -> Partial:
    """One worker's step: log each micro-batch into a private bus, return its exported partial."""
    bus = MetricBus(rules=RULES, dist=None)  # no adapters: a worker only reduces its micro-batches
    for m, seqs in enumerate(lengths):
        n = sum(seqs)
        toks = token_losses(step=step, worker=worker, micro=m, n=n)
        loss = sum(t for t, _ in toks) / global_tokens * dp_size  # verl agg_loss: global token-mean x dp_size
        bus.log("actor/pg_loss", loss)
        bus.log("actor/pg_clipfrac", sum(c for _, c in toks) / n, weight=n)  # a local token mean
        bus.log("response_length", seqs)
        bus.log("perf/tokens", n)
    part = bus.export()
    bus.close()
    return part


def _work_args(args: tuple[int, int, list[list[int]], int, int]) -> Partial:
    return work(*args)


def truth(*, step: int, shards: list[list[list[int]]]) -> dict[str, float]:
    """The true global per-token values, computed directly on all tokens."""
    losses, clips = [], []
    for w, worker in enumerate(shards):
        for m, seqs in enumerate(worker):
            toks = token_losses(step=step, worker=w, micro=m, n=sum(seqs))
            losses += [t for t, _ in toks]
            clips += [float(c) for _, c in toks]
    return {"actor/pg_loss": math.fsum(losses) / len(losses), "actor/pg_clipfrac": math.fsum(clips) / len(clips)}


class _RayPool:
    """Ray tasks with the same map() as a multiprocessing pool."""

    def __init__(self, workers: int) -> None:
        import ray

        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        self._ray = ray
        self._task = ray.remote(_work_args)

    def map(self, fn: Any, items: list[Any]) -> list[Partial]:
        return list(self._ray.get([self._task.remote(item) for item in items]))

    def close(self) -> None:
        self._ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Run the driver loop and print the driver's metrics next to the directly computed truth."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("auto", "mp", "ray"), default="auto")
    args = parser.parse_args(argv)

    use_ray = args.backend == "ray" or (args.backend == "auto" and importlib.util.find_spec("ray") is not None)
    pool: Any = _RayPool(args.workers) if use_ray else mp.get_context("spawn").Pool(args.workers)
    print(f"driver + {args.workers} {'Ray task' if use_ray else 'multiprocessing'} workers x {args.micro} "
          "micro-batches per step")
    worst = 0.0
    try:
        with MetricBus(adapters=["console"], rules=RULES, dist=None, strict=True) as driver:
            for step in range(args.steps):
                shards = shard_tokens(step=step, seed=args.seed, workers=args.workers, micro=args.micro)
                total = sum(sum(seqs) for worker in shards for seqs in worker)
                jobs = [(step, w, shards[w], total, args.workers) for w in range(args.workers)]
                parts = pool.map(_work_args, jobs)  # each a Partial, pickled back from the worker
                driver.ingest(parts)
                out = driver.commit(step=step)
                for key, want in truth(step=step, shards=shards).items():
                    worst = max(worst, abs(out[key] - want) / max(abs(want), 1e-300))
            last = out
    finally:
        pool.close()
    print("driver's last metrics:")
    for key, value in last.items():
        print(f"  {key:<22} {value:.12g}")
    print(f"max relative deviation from the directly computed global token means: {worst:.1e}")
    return 0 if worst <= 1e-12 else 1


if __name__ == "__main__":
    raise SystemExit(main())
