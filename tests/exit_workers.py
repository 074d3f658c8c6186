"""One rank of a 2-rank gloo run that ends in a given order; tests/test_exit.py starts one process per rank.

    python tests/exit_workers.py ORDER RANK SIZE PORT OUT

Every rank logs and commits ``STEPS`` steps through ``MetricBus(dist="torch")`` with a journal in ``OUT/journal``
(rank 0 also writes ``OUT/metrics.jsonl``), then ends as ``ORDER`` says:

* ``close-destroy``: ``bus.close()`` then ``destroy_process_group()`` (the documented order);
* ``destroy``: ``destroy_process_group()`` and no ``close()`` (the bus is closed at interpreter exit);
* ``destroy-close``: ``destroy_process_group()``, a ``commit()`` (refused), then ``bus.close()``, with records logged
  after the last commit;
* ``neither``: the script just ends;
* ``raise``: a ``ValueError`` inside ``with bus:`` on every rank at step ``RAISE_AT`` (exit code 1);
* ``raise-one``: the ``ValueError`` on rank 1 only; rank 0 runs into the next commit and gets an error there;
* ``close-one``: rank 0 calls ``bus.close()`` (then ``destroy_process_group()``); rank 1 logs once more and just
  ends, its bus still open (closed alone at interpreter exit);
* ``commit-one``: as ``close-one``, but rank 0 logs and commits once more before ``bus.close()``.

Rank 0 prints an error of ``close()`` or ``commit()`` as ``close: ...`` / ``commit: ...``, and each warning.
"""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch.distributed as tdist

from metricbus import Agg, DistributedError, MetricBus

STEPS = 12
RAISE_AT = 5
ORDERS = ("close-destroy", "destroy", "destroy-close", "neither", "raise", "raise-one", "close-one", "commit-one")


def log_step(bus: MetricBus, step: int, rank: int) -> None:
    """Two micro-batches of three metrics."""
    for micro in range(2):
        bus.log("loss", (step + 1) * (rank + 1) + micro / 4, agg=Agg(micro="sum", rank="mean"))
        bus.log("len", [float(step + micro), float(rank)], agg=["mean", "max"])
        bus.log("tokens", float(10 * rank + micro), agg="sum")


def train(bus: MetricBus, *, order: str, rank: int) -> None:
    """Log and commit every step; raise where the order says."""
    for step in range(STEPS):
        if step == RAISE_AT and (order == "raise" or (order == "raise-one" and rank == 1)):
            raise ValueError(f"rank {rank}: a bug in the training loop at step {step}")
        log_step(bus, step, rank)
        bus.commit(step=step)


def main(argv: list[str]) -> int:
    """Run one rank."""
    order, rank, size, port, out = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), Path(argv[4])
    if order not in ORDERS:
        raise SystemExit(f"unknown order {order!r}; use one of {', '.join(ORDERS)}")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                             timeout=timedelta(seconds=60))
    adapters = [f"jsonl:{out / 'metrics.jsonl'}"] if rank == 0 else []
    bus = MetricBus(dist="torch", adapters=adapters, journal=str(out / "journal"), strict=True)
    if order in ("raise", "raise-one"):
        with bus:
            train(bus, order=order, rank=rank)
        return 0
    train(bus, order=order, rank=rank)
    if order == "close-destroy":
        bus.close()
        tdist.destroy_process_group()
    elif order == "destroy":
        tdist.destroy_process_group()
    elif order in ("close-one", "commit-one") and rank == 1:
        log_step(bus, STEPS, rank)  # logged, never committed: the close at exit says so
    elif order in ("close-one", "commit-one"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if order == "commit-one":
                log_step(bus, STEPS, rank)
                try:
                    bus.commit(step=STEPS)
                except DistributedError as exc:  # the records stay buffered
                    print(f"commit: {exc}", flush=True)
            try:
                bus.close()
            except DistributedError as exc:
                print(f"close: {exc}", flush=True)
        for warning in caught:
            print(f"warning: {warning.message}", flush=True)
        tdist.destroy_process_group()
    elif order == "destroy-close":
        log_step(bus, STEPS, rank)  # logged, never committed: close() says so
        tdist.destroy_process_group()
        try:
            bus.commit(step=STEPS)
        except DistributedError as exc:  # the records stay buffered
            print(f"commit: {exc}", flush=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bus.close()
        for warning in caught:
            print(f"warning: {warning.message}", flush=True)
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
