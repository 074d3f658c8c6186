"""SIGKILL at random points: every step whose commit() returned is replayed, and none is invented."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

from metricbus import MetricBus
from metricbus.journal import JournalWarning, read_journal
from metricbus.replay import emitted
from metricbus.testing import MemoryAdapter
from tests.journal_workers import RULES, log_step

TRIALS = 24
WORKERS = Path(__file__).with_name("journal_workers.py")


def reference(steps: int) -> list[tuple[int, dict[str, float]]]:
    """What the child emits for steps 0..steps-1, computed in this process."""
    mem = MemoryAdapter()
    with MetricBus(dist=None, rules=RULES, adapters=[mem], strict=True) as bus:
        for step in range(steps):
            for metric in range(40):
                bus.log(f"extra/{metric}", step + metric / 10)
            log_step(bus, step, 0)
            bus.commit(step)
    return mem.rows


def kill_at_random(journal: Path, fsync: str, delay_s: float) -> list[int]:
    """Start the crash child, SIGKILL it after ``delay_s`` seconds, return the steps it reported committed."""
    child = subprocess.Popen([sys.executable, str(WORKERS), "crash", str(journal), fsync],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    first = child.stdout.readline()  # wait until the child is logging, then let it run a random while
    time.sleep(delay_s)
    os.kill(child.pid, signal.SIGKILL)
    rest = child.stdout.read()
    child.wait()
    return [int(line) for line in (first + rest).split()]


def test_sigkill_loses_no_returned_commit_and_invents_none(tmp_path: Path) -> None:
    """Over many random kills, the replay holds exactly the reported steps (plus at most the one in flight)."""
    rng = random.Random(1234)
    deadline = time.monotonic() + 50
    longest = 0
    trials = 0
    results = []
    for trial in range(TRIALS):
        if time.monotonic() > deadline:
            break
        fsync = ("interval", "commit", "never")[trial % 3]
        journal = tmp_path / f"j{trial}"
        printed = kill_at_random(journal, fsync, rng.uniform(0.0, 0.3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", JournalWarning)  # a kill inside a write may tear the last record
            rows = list(emitted(read_journal(journal)))
        results.append((printed, rows))
        longest = max(longest, len(rows))
        trials += 1
    assert trials >= 20
    want = reference(longest + 1)
    for printed, rows in results:
        steps = [step for step, _ in rows]
        assert steps == list(range(len(steps)))  # contiguous from 0: nothing invented, nothing skipped
        assert set(printed) <= set(steps)  # every returned commit survived
        assert len(steps) <= len(printed) + 1  # at most the commit that was returning when killed
        assert rows == want[: len(rows)]  # and every replayed value is the one the child logged
    assert max(len(p) for p, _ in results) > 50  # kills landed well inside the logging loop
