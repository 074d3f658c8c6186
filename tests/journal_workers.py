"""Processes the journal tests start: a crash child and gloo ranks. Data is deterministic so parents can rebuild it.

``python tests/journal_workers.py crash JOURNAL FSYNC``: logs and commits forever, printing each step (flushed)
after its ``commit()`` returned, until it is killed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

RULES = {"loss": "mean", "tokens": "sum", "grad/*": ["mean", "max", "std"], "pg_loss": "mean"}
N_MICRO = 4


def values(step: int, rank: int, micro: int) -> dict[str, float]:
    """What worker ``rank`` logs in micro-batch ``micro`` of ``step`` (awkward floats, on purpose)."""
    base = (step + 1) * 0.1 + rank / 7 + micro / 3
    return {
        "loss": base / 3.0,
        "tokens": float((step * 13 + rank * 5 + micro) % 17 + 1),
        "grad/norm": base * base * 1e-3 + 1e8,
        "pg_loss": -base / (micro + 1),
    }


def log_step(bus: Any, step: int, rank: int) -> None:
    """Log one step's micro-batches of ``rank`` into ``bus`` (pg_loss is logged more often on even ranks)."""
    for micro in range(N_MICRO + (rank % 2 == 0)):
        for name, value in values(step, rank, micro).items():
            bus.log(name, value)


def crash_child(journal: str, fsync: str) -> None:
    """Log and commit until killed; print each step after commit() returned."""
    from metricbus import MetricBus

    bus = MetricBus(dist=None, rules=RULES, journal=journal, fsync=fsync)
    out = sys.stdout
    step = 0
    while True:
        for metric in range(40):  # enough entries that a commit's write is a few KiB
            bus.log(f"extra/{metric}", step + metric / 10)
        log_step(bus, step, 0)
        bus.commit(step)
        out.write(f"{step}\n")
        out.flush()
        step += 1


def gloo_rank(rank: int, world: int, init_file: str, journal: str, live_path: str, steps: int) -> None:  # noqa: PLR0917 (mp.spawn passes positionals)
    """One torch.distributed rank: log, commit ``steps`` times, journaling; rank 0 writes live values to jsonl."""
    import torch.distributed as dist
    from metricbus.adapters.jsonl import JsonlAdapter

    from metricbus import MetricBus

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        bus = MetricBus(dist="torch", rules=RULES, journal=journal, log_every=3,
                        adapters=[JsonlAdapter(path=live_path)], strict=True)
        for step in range(steps):
            log_step(bus, step, rank)
            bus.commit()
        bus.close()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if sys.argv[1] == "crash":
        crash_child(sys.argv[2], sys.argv[3])
