"""A script that ends without close() still delivers every committed step: the bus is closed at interpreter exit."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

from metricbus.adapters.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
from metricbus import MetricBus
bus = MetricBus(dist=None, adapters=["jsonl:{path}"], strict=True)
for step in range(50):
    bus.log("loss", float(step), agg="mean")
    bus.commit(step=step)
bus.log("loss", 99.0)  # logged after the last commit: committed at exit, as close() does
if sys.argv[1] == "raise":
    raise RuntimeError("the training loop failed")
"""


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "m.jsonl"
    code = SCRIPT.format(path=path)
    return subprocess.run([sys.executable, "-c", code, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)


def test_script_that_just_ends_delivers_every_step(tmp_path: Path) -> None:
    """No close(), no with: all 50 steps and the pending records reach the jsonl; exit 0."""
    done = _run(tmp_path, "end")
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(tmp_path / "m.jsonl")
    assert [step for step, _ in rows] == [*range(50), 50]
    assert rows[-1][1] == {"loss": 99.0}


def test_script_that_raises_outside_with_delivers_every_step(tmp_path: Path) -> None:
    """An uncaught exception and no close(): exit 1 with the traceback, every committed step in the jsonl."""
    done = _run(tmp_path, "raise")
    assert done.returncode == 1
    assert "RuntimeError: the training loop failed" in done.stderr
    assert [step for step, _ in read_jsonl(tmp_path / "m.jsonl")][:50] == list(range(50))


FORK_SCRIPT = """
import os, sys
from metricbus import MetricBus
bus = MetricBus(dist=None, adapters=["jsonl:{path}"], journal="{journal}", strict=True)
for step in range(3):
    bus.log("loss", float(step))
    bus.commit(step=step)
bus.log("loss", 3.0)  # pending when the process forks
pid = os.fork()
if pid == 0:
    sys.exit(0)  # runs atexit in the child: it must not commit or close the parent's bus
os.waitpid(pid, 0)
bus.commit(step=3)
"""


def test_forked_child_does_not_close_the_parents_bus(tmp_path: Path) -> None:
    """A child of os.fork() exiting normally leaves the parent's bus alone: each step once, in jsonl and journal."""
    from metricbus.journal import read_journal
    from metricbus.replay import emitted

    code = FORK_SCRIPT.format(path=tmp_path / "m.jsonl", journal=tmp_path / "journal")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert [step for step, _ in read_jsonl(tmp_path / "m.jsonl")] == [0, 1, 2, 3]
    assert [step for step, _ in emitted(read_journal(tmp_path / "journal"))] == [0, 1, 2, 3]
    kinds = _frame_kinds(tmp_path / "journal" / "rank-00000.mbj")
    assert sum(kind in {b"S", b"R", b"P"} for kind in kinds) == 4  # no step committed twice


def _frame_kinds(path: Path) -> list[bytes]:
    """The frame types of a journal file, read by its documented layout (magic, then <I len><I crc> payload)."""
    data = path.read_bytes()[8:]
    kinds, pos = [], 0
    while pos < len(data):
        length, _ = struct.unpack_from("<II", data, pos)
        kinds.append(data[pos + 8 : pos + 9])
        pos += 8 + length
    return kinds


HUNG_AT_EXIT = """
import threading
from metricbus import MetricBus
from metricbus.testing import MemoryAdapter

class Hung(MemoryAdapter):
    name = "hung"
    def write(self, *, step, metrics):
        threading.Event().wait()  # never returns

bus = MetricBus(dist=None, adapters=[Hung()], journal="{journal}", write_timeout_s=3600, exit_timeout_s=0.5)
for step in range(20):
    bus.log("loss", float(step))
    bus.commit(step=step)
print("loop done", flush=True)
"""


def test_exit_with_a_hung_adapter_is_bounded_and_journal_first(tmp_path: Path) -> None:
    """An adapter stuck in write() at exit: the process still exits 0 (exit_timeout_s), every step journaled."""
    from metricbus.journal import read_journal
    from metricbus.replay import emitted

    code = HUNG_AT_EXIT.format(journal=tmp_path / "journal")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "loop done" in done.stdout
    assert "'hung' did not drain within 0.5 s" in done.stderr
    assert [step for step, _ in emitted(read_journal(tmp_path / "journal"))] == list(range(20))
