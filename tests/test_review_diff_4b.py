"""Review of the diff 059c06a..8c480a0: commit(only=...) with ingested partials, and under torch.distributed."""

from __future__ import annotations

import random
import subprocess
import sys
from typing import Any

import pytest

from metricbus import MetricBus, MetricValueError, SpecError, StepError
from metricbus.journal import read_journal
from metricbus.replay import emitted
from tests.gloo_ranks import run_ranks
from tests.test_exit import ROOT


def test_commit_only_keeps_the_ingested_partials_other_names() -> None:
    """commit(only=...) commits the ingested partials' records of those names alone; their others wait."""
    worker, driver = MetricBus(dist=None), MetricBus(dist=None)
    worker.log("train/loss", 1.0)
    worker.log("train/loss", 3.0)
    driver.ingest([worker.export()])
    driver.log("eval/acc", 0.5)
    assert driver.commit(1, only=["eval/acc"]) == {"eval/acc": 0.5}
    worker.log("train/loss", 8.0)
    driver.ingest([worker.export()])
    assert driver.commit(2) == {"train/loss": 4.0}  # one worker's three records: (1 + 3 + 8) / 3
    driver.close()
    worker.close()


def test_commit_only_refused_puts_every_record_back() -> None:
    """A commit(only=...) refused (a name already committed at its step) keeps its own and ingested records whole."""
    worker, driver = MetricBus(dist=None, rules={"*": "sum"}), MetricBus(dist=None, rules={"*": "sum"})
    driver.log("eval", 1.0)
    assert driver.commit(1, only=["eval"]) == {"eval": 1.0}
    worker.log("eval", 2.0)
    worker.log("train", 3.0)
    driver.ingest([worker.export()])
    driver.log("eval", 4.0)
    with pytest.raises(StepError, match="already committed"):
        driver.commit(1, only=["eval"])
    assert driver.commit(2) == {"eval": 6.0, "train": 3.0}
    driver.close()
    worker.close()


def test_ingest_refuses_again_a_partial_partly_taken_by_a_refused_call() -> None:
    """A partial whose refused metric was left out by ingest() is refused when ingested again (its other records
    would count twice)."""
    first, second, driver = MetricBus(dist=None), MetricBus(dist=None), MetricBus(dist=None)
    first.log("x", 1.0, agg="sum")
    first.log("y", 2.0, agg="sum")
    second.log("x", 5.0, agg="max")
    second.log("y", 3.0, agg="sum")
    exported = [first.export(), second.export()]
    with pytest.raises(SpecError, match="partial 1 of this call: 'x'"):
        driver.ingest(exported)
    with pytest.raises(MetricValueError, match="same Partial object"):
        driver.ingest([exported[1]])
    assert driver.commit(1) == {"x": 1.0, "y": 5.0}
    driver.close()
    for bus in (first, second):
        bus.close()


def test_ingest_refuses_again_a_partial_a_commit_only_took_part_of() -> None:
    """A partial whose names a commit(only=...) took part of is refused when ingested again before its rest is
    committed."""
    worker, driver = MetricBus(dist=None), MetricBus(dist=None)
    worker.log("train", 1.0)
    worker.log("eval", 2.0)
    exported = worker.export()
    driver.ingest([exported])
    assert driver.commit(1, only=["eval"]) == {"eval": 2.0}
    with pytest.raises(MetricValueError, match="same Partial object"):
        driver.ingest([exported])
    assert driver.commit(2) == {"train": 1.0}
    driver.close()
    worker.close()


def _sums_through_only(seed: int, journal: str) -> tuple[dict[str, float], dict[str, float], list[Any]]:
    """Random logs on a driver and two workers, ingests and commits with and without only= (some refused)."""
    rnd = random.Random(seed)
    rules = {"*": "sum"}
    bus = MetricBus(dist=None, journal=journal, rules=rules)
    workers = [MetricBus(dist=None, rules=rules) for _ in range(rnd.randint(0, 2))]
    logged: dict[str, float] = {}
    live: list[Any] = []
    step = 0
    for _ in range(rnd.randint(3, 10)):
        for _ in range(rnd.randint(0, 6)):
            target = rnd.choice([bus, *workers])
            name, value = rnd.choice("abcd"), float(rnd.randint(1, 9))
            target.log(name, value)
            logged[name] = logged.get(name, 0.0) + value
            if rnd.random() < 0.2:
                target.end_update()
        if workers and rnd.random() < 0.6:
            bus.ingest([w.export() for w in workers])
        step += rnd.randint(0, 1)
        try:
            out = bus.commit(step, only=rnd.choice([None, {"a"}, {"b", "c"}, set()]))
        except StepError:
            continue
        if out:
            live.append((step, out))
    left = [part for w in workers if len(part := w.export())]
    if left:
        bus.ingest(left)
    bus.close()
    for w in workers:
        w.close()
    replayed = list(emitted(read_journal(journal)))
    got: dict[str, float] = {}
    for _, metrics in replayed:
        for name, value in metrics.items():
            got[name] = got.get(name, 0.0) + value
    assert replayed[: len(live)] == live
    return logged, got, replayed


@pytest.mark.parametrize("seed", range(40))
def test_commit_only_loses_and_repeats_nothing(tmp_path: Any, seed: int) -> None:
    """Every record logged or ingested is emitted once, live and replayed alike, whatever only= commits split it."""
    logged, got, _ = _sums_through_only(seed, str(tmp_path / "j"))
    assert got == logged


def only_with_a_rejected_other(rank: int, size: int) -> list[Any]:
    """Each rank logs 'a' and a tensor of 'b' (NaN on rank 1, nan='error'), commits only 'a', then 'b' again."""
    import torch

    bus = MetricBus(dist="torch", rules={"a": "sum", "b": "sum"}, nan="error")
    bus.log("a", 1.0)
    bus.log("b", torch.tensor(float("nan")) if rank == 1 else torch.tensor(10.0))
    said: list[Any] = []
    try:
        said.append(bus.commit(1, only=["a"]))
    except MetricValueError as exc:
        said.append(type(exc).__name__)
    bus.log("b", torch.tensor(1.0))
    said.append(bus.commit(2))
    bus.close()
    return said


def test_commit_only_drops_a_metric_another_rank_rejected_on_every_rank() -> None:
    """A metric whose device records one rank rejects at a commit(only=...) is dropped on every rank (as a commit
    drops it), not kept by the others for the next step's value."""
    pytest.importorskip("torch")
    results = run_ranks(only_with_a_rejected_other, 2)
    assert results == {0: ["MetricValueError", {"b": 2.0}], 1: ["MetricValueError", {"b": 2.0}]}


FORK_DURING_CLOSE = """
import os, sys, threading
from metricbus import ClosedError, MetricBus
from metricbus.testing import MemoryAdapter

draining, release = threading.Event(), threading.Event()

class Slow(MemoryAdapter):
    def close(self, *, status):
        draining.set()
        release.wait()
        super().close(status=status)

bus = MetricBus(dist=None, adapters=[Slow()])
bus.log("loss", 1.0)
bus.commit(step=0)
closing = threading.Thread(target=bus.close)
closing.start()
draining.wait()  # close() holds the bus's lock, past setting closed, while the adapter drains
assert bus.closed
pid = os.fork()
if pid == 0:
    import signal
    signal.alarm(60)  # a child that hangs ends itself (the test sees its exit status), not left behind
    said = []
    for call in (lambda: bus.commit(step=1), bus.export, lambda: bus.ingest([]), bus.drop_ingested):
        try:
            call()
        except ClosedError:
            said.append("closed")
    bus.close()
    os._exit(0 if said == ["closed"] * 4 else 3)
release.set()
closing.join()
_, status = os.waitpid(pid, 0)
print(f"child exit {os.waitstatus_to_exitcode(status)}", flush=True)
"""


def test_a_child_forked_while_close_drains_raises_instead_of_hanging() -> None:
    """A fork while another thread's close() drains the adapters (the bus closed, its lock held): the child's commit(),
    export(), ingest() and drop_ingested() raise ClosedError instead of waiting for ever on the parent's lock."""
    done = subprocess.run([sys.executable, "-c", FORK_DURING_CLOSE], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["child exit 0"]


GUARDED_FORK = """
import os, threading
from metricbus import MetricBus, shutdown

first = MetricBus(dist=None)  # no journal, adapters or collectives: guarded, not tracked
held, release = threading.Event(), threading.Event()

def hold():  # a parent thread inside the exit table at the fork (building or closing another bus)
    with shutdown._lock:
        held.set()
        release.wait()

thread = threading.Thread(target=hold)
thread.start()
held.wait()
pid = os.fork()
if pid == 0:
    import signal
    signal.alarm(60)
    bus = MetricBus(dist=None)  # the child's own bus
    bus.log("x", 1.0)
    ok = bus.commit(step=0) == {"x": 1.0}
    bus.close()
    os._exit(0 if ok else 3)
release.set()
thread.join()
_, status = os.waitpid(pid, 0)
print(f"child exit {os.waitstatus_to_exitcode(status)}", flush=True)
first.close()
"""


def test_a_child_of_a_process_with_only_guarded_buses_builds_its_own_bus() -> None:
    """A fork while a parent thread holds the exit table's lock, where every bus is guarded (none tracked): the
    child builds, uses and closes a bus of its own instead of waiting for ever on that lock."""
    done = subprocess.run([sys.executable, "-c", GUARDED_FORK], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["child exit 0"]
