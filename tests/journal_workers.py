"""Processes the journal tests start: a crash child and gloo ranks. Data is deterministic so parents can rebuild it.

``python tests/journal_workers.py crash JOURNAL FSYNC``: logs and commits forever, printing each step (flushed)
after its ``commit()`` returned, until it is killed.

``python tests/journal_workers.py hold JOURNAL``: commits steps 0-2 with :func:`fault_values`, prints ``ready``
and keeps the journal open (its writer's lock held) until stdin closes or it is killed.

``python tests/journal_workers.py efbig JOURNAL``: commits steps 0-14 with :func:`fault_values` under an
``RLIMIT_FSIZE`` that makes step 5's journal write fail part-way (EFBIG; SIGXFSZ ignored), lifted after it; prints
one JSON line: the error of each commit that raised, the file size before step 5, and what the adapter got.
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


def fault_values(step: int) -> list[tuple[str, float]]:
    """The records the fault tests log at ``step``: "loss" twice, and "acc" from step 5 on (a new metric there)."""
    out = [("loss", step * 0.5), ("loss", step * 0.5 + 1.25)]
    if step >= 5:
        out.append(("acc", step / 8))
    return out


def hold_child(journal: str) -> None:
    """Commit steps 0-2, say ``ready``, and hold the journal open until stdin is closed."""
    from metricbus import MetricBus

    bus = MetricBus(dist=None, journal=journal)
    for step in range(3):
        for name, value in fault_values(step):
            bus.log(name, value)
        bus.commit(step)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.read()
    bus.close()


def efbig_child(journal: str) -> None:
    """Commit steps 0-14; step 5's journal write hits RLIMIT_FSIZE 20 bytes in. Print errors, size and rows."""
    import json
    import resource
    import signal

    from metricbus import MetricBus
    from metricbus.errors import JournalError
    from metricbus.journal import rank_file, stage
    from metricbus.testing import MemoryAdapter

    stage.STAGED = False  # each commit written with its own os.write, so step 5's is the one that fails
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    memory = MemoryAdapter()
    bus = MetricBus(dist=None, journal=journal, adapters=[memory], strict=True)
    errors: dict[int, str] = {}
    size = 0
    for step in range(15):
        if step == 5:
            size = rank_file(journal, 0).stat().st_size
            resource.setrlimit(resource.RLIMIT_FSIZE, (size + 20, hard))
        for name, value in fault_values(step):
            bus.log(name, value)
        try:
            bus.commit(step)
        except JournalError as exc:
            errors[step] = str(exc)
        if step == 5:
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    bus.close()
    print(json.dumps({"errors": errors, "size": size, "rows": memory.rows}))


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
    elif sys.argv[1] == "hold":
        hold_child(sys.argv[2])
    elif sys.argv[1] == "efbig":
        efbig_child(sys.argv[2])


def journal_as_a_forked_child(bus: Any, step: int, values: list[tuple[str, float]]) -> None:
    """In a child of ``os.fork()``: write ``step`` (``values`` logged) to ``bus``'s journal as its commit would. The
    bus's own ``commit()`` refuses in a forked child (its copy is closed there); the journal's handling of a child
    that writes to the file it shares with its parent (fsync thread, cut bytes) is tested underneath it."""
    from metricbus import MetricBus

    scratch = MetricBus(dist=None)
    for name, value in values:
        scratch.log(name, value)
    bus._sink.record(step=step, entries=[(0, scratch.export())])
