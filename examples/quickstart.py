"""A small example: two gradient-accumulation micro-batches per step, logged through the console adapter."""

from __future__ import annotations

import random

from metricbus.adapters.console import ConsoleAdapter

from metricbus import Agg, MetricBus


def main(*, steps: int = 5, seed: int = 0) -> dict[str, float]:
    """Log a few fake training steps and return the last emitted metrics."""
    rng = random.Random(seed)
    last: dict[str, float] = {}
    rules = {"loss": Agg(micro="sum", rank="mean"), "response_length": ["mean", "max", "min"]}
    with MetricBus(adapters=[ConsoleAdapter()], rules=rules, dist=None) as bus:
        for step in range(steps):
            tokens = [rng.randint(50, 200) for _ in range(2)]
            total = sum(tokens)
            for n in tokens:
                bus.log("loss", rng.random() * n / total)  # pre-scaled by global tokens: sum over micro-batches
                bus.log("clipfrac", rng.random() * 0.2, weight=n)  # token-weighted mean
                bus.log("response_length", [rng.randint(1, 64) for _ in range(4)])
            last = bus.commit(step=step)
    return last


if __name__ == "__main__":
    main()
