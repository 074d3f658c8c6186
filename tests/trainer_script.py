"""A tiny trainer that logs through metricbus; the backend comes only from its config file.

Run as ``python tests/trainer_script.py --config CONFIG`` (YAML, TOML or JSON). ``train(bus)`` is importable so a
test can run the same loop in-process against a MemoryAdapter.
"""

from __future__ import annotations

import argparse
import random

from metricbus import MetricBus

STEPS = 25
MICRO_BATCHES = 4

# The metric rules every config of the test shares (the YAML/TOML/JSON forms are written from this).
METRICS = {
    "actor/pg_loss": {"micro": "sum", "rank": "mean"},
    "response_length": ["mean", "max", "min"],
    "critic/*": "mean",
    "perf/tokens": "sum",
}


def train(bus: MetricBus, *, steps: int = STEPS) -> None:
    """A deterministic loop: several micro-batches per step, weighted and unweighted records, varied magnitudes."""
    rng = random.Random(20261202)
    for _ in range(steps):
        for _ in range(MICRO_BATCHES):
            bus.log("actor/pg_loss", rng.gauss(0.0, 1.0) / 3.0)
            bus.log("response_length", float(rng.randint(10, 500)))
            bus.log("critic/vf_loss", rng.random() * 1e-3, weight=float(rng.randint(1, 8)))
            bus.log({"perf/tokens": float(rng.randint(100, 10_000)), "perf/lr": 1e-6 * (1 + rng.random())})
            bus.log("critic/value_big", 1e10 + rng.random())
        bus.commit()


def main(argv: list[str] | None = None) -> int:
    """Build the bus from ``--config`` and train."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="metricbus config file (.yaml, .toml, .json)")
    args = parser.parse_args(argv)
    with MetricBus.from_config(args.config) as bus:
        train(bus)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
