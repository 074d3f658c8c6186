"""A trainer for the run-identity tests: ``python tests/identity_trainer.py CONFIG FIRST STOP SCALE [resume]``.

Commits steps FIRST..STOP-1 through a bus built from CONFIG (JSON), printing each step once ``commit()`` returned;
with ``resume`` the bus resumes the config's journal. Values: :func:`records` (the test computes the same).
"""

from __future__ import annotations

import sys
import time

from metricbus import MetricBus


def records(step: int, scale: float) -> dict[str, list[float]]:
    """The records each step logs: two micro-batches per metric."""
    return {"train/loss": [scale * step + 0.1, scale * step + 0.35], "train/acc": [1.0 / (step + 3), 0.5]}


def main(config: str, first: int, stop: int, scale: float, resume: bool) -> int:
    """Train, printing each committed step."""
    with MetricBus.from_config(config, resume=resume) as bus:
        for step in range(first, stop):
            for name, values in records(step, scale).items():
                for value in values:
                    bus.log(name, value)
            bus.commit(step)
            print(step, flush=True)
            time.sleep(0.002)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    raise SystemExit(main(args[0], int(args[1]), int(args[2]), float(args[3]), args[4:] == ["resume"]))
