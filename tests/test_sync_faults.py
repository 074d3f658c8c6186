"""Crashes around ``metricbus sync``, with real processes: every journaled step reaches jsonl exactly once.

Each test states what was committed, what the live bus delivered before the crash, and what ``sync`` recovers:
no loss, no duplicates, steps in order, values bit for bit. The cursor may lag the file but never leads it.

Run as a script, this file is the child: ``trainer JOURNAL JSONL STEPS`` commits STEPS steps (0: forever), printing
each after ``commit()`` returned, then ``os._exit(0)`` (no close, no atexit); ``sync JOURNAL CONFIG`` runs
``metricbus sync`` with a slowed-down jsonl backend (so a test can stop it midway).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import IO

import pytest

CHILD = Path(__file__).resolve()
ROOT = CHILD.parent.parent
BIG_STEPS = 20_000
Rows = list[tuple[int, dict[str, float]]]


# -- the child ---------------------------------------------------------------------------------------------------


def _trainer(journal: str, jsonl: str, steps: int) -> None:
    from metricbus.adapters.jsonl import JsonlAdapter

    from metricbus import MetricBus
    from tests.journal_workers import RULES, log_step

    bus = MetricBus(dist=None, rules=RULES, journal=journal, adapters=[JsonlAdapter(path=jsonl)])
    step = 0
    while not steps or step < steps:
        log_step(bus, step, 0)
        bus.commit(step)
        sys.stdout.write(f"{step}\n")
        sys.stdout.flush()
        step += 1
    os._exit(0)


def _slow_sync(journal: str, config: str) -> int:
    from metricbus.adapters.jsonl import JsonlAdapter

    from metricbus.cli import main

    write = JsonlAdapter.write

    def slow_write(self: JsonlAdapter, *, step: int, metrics: dict[str, float]) -> None:
        time.sleep(0.0002)  # a remote backend's latency; the write itself is the real one
        write(self, step=step, metrics=metrics)

    JsonlAdapter.write = slow_write  # type: ignore[method-assign]
    return main(["sync", journal, "--config", config])


# -- helpers -----------------------------------------------------------------------------------------------------


def _python(*args: str, stdout: int | IO[str] | None = subprocess.PIPE) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, str(CHILD), *args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                            env=env)


def _journal_rows(journal: Path) -> Rows:
    from metricbus.journal import JournalWarning, read_journal
    from metricbus.replay import emitted

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JournalWarning)  # a kill inside a journal write may tear its last record
        return list(emitted(read_journal(journal)))


def _jsonl(path: Path) -> Rows:
    from metricbus.adapters.jsonl import read_jsonl

    return read_jsonl(path) if path.exists() else []


def _bits(rows: Rows) -> list[tuple[int, dict[str, str]]]:
    return [(step, {k: float(v).hex() for k, v in m.items()}) for step, m in rows]


def _cursor(journal: Path, jsonl: Path) -> int | None:
    from metricbus.adapters.jsonl import JsonlAdapter

    from metricbus.journal import CursorStore

    return CursorStore(journal).get(JsonlAdapter(path=jsonl))


def _config(tmp_path: Path, jsonl: Path) -> Path:
    config = tmp_path / "metricbus.json"
    config.write_text(json.dumps({"adapters": [f"jsonl:{jsonl}"]}))
    return config


def _sync(journal: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> int:
    """Run ``metricbus sync`` in this process; returns the steps it reports sent to jsonl."""
    from metricbus.cli import main

    capsys.readouterr()
    assert main(["sync", str(journal), "--config", str(config)]) == 0
    out = capsys.readouterr().out.strip()
    label, sent, count, unit = out.split()
    assert (label, sent, unit) == ("jsonl:", "sent", "steps"), out
    return int(count)


def _assert_before_sync(journal: Path, jsonl: Path, want: Rows) -> int:
    """The live file is an in-order prefix of ``want`` and the cursor is within it; returns what sync must send."""
    live = _jsonl(jsonl)
    assert _bits(live) == _bits(want[: len(live)])  # delivered live: a prefix, in order, once each
    cursor = _cursor(journal, jsonl)
    assert cursor is None or (bool(live) and cursor <= live[-1][0])  # never ahead of the data
    return len(want) if cursor is None else len(want) - (cursor + 1)


def _assert_synced_twice(journal: Path, config: Path, jsonl: Path, want: Rows, capsys: pytest.CaptureFixture[str],
                         *, to_send: int) -> None:
    """sync sends exactly the unacknowledged steps, then the file is ``want``; a second sync sends nothing."""
    assert _sync(journal, config, capsys) == to_send
    assert _bits(_jsonl(jsonl)) == _bits(want)
    assert _cursor(journal, jsonl) == want[-1][0]
    assert _sync(journal, config, capsys) == 0
    assert _bits(_jsonl(jsonl)) == _bits(want)


def _reference(steps: int) -> Rows:
    from metricbus import MetricBus
    from metricbus.testing import MemoryAdapter
    from tests.journal_workers import RULES, log_step

    mem = MemoryAdapter()
    with MetricBus(dist=None, rules=RULES, adapters=[mem], strict=True) as bus:
        for step in range(steps):
            log_step(bus, step, 0)
            bus.commit(step)
    return mem.rows


# -- a trainer that dies -----------------------------------------------------------------------------------------


def test_os_exit_after_50_commits_then_sync_delivers_each_step_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """50 commits, os._exit(0) (no close): sync completes the jsonl to steps 0..49, once each."""
    journal, jsonl = tmp_path / "journal", tmp_path / "live.jsonl"
    child = _python("trainer", str(journal), str(jsonl), "50")
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert [int(s) for s in out.split()] == list(range(50))  # committed
    want = _reference(50)
    assert _bits(_journal_rows(journal)) == _bits(want)  # journaled: all of it
    to_send = _assert_before_sync(journal, jsonl, want)
    _assert_synced_twice(journal, _config(tmp_path, jsonl), jsonl, want, capsys, to_send=to_send)


def test_sigkill_after_50_reported_commits_then_sync_delivers_each_step_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL once the trainer reported 50 commits: sync delivers every journaled step once, in order."""
    journal, jsonl = tmp_path / "journal", tmp_path / "live.jsonl"
    child = _python("trainer", str(journal), str(jsonl), "0")
    assert child.stdout is not None
    first = [child.stdout.readline() for _ in range(50)]
    os.kill(child.pid, signal.SIGKILL)
    printed = [int(s) for s in "".join(first).split() + child.stdout.read().split()]
    child.wait(timeout=60)
    assert printed == list(range(len(printed)))  # committed (commit() returned), in order
    assert len(printed) >= 50
    rows = _journal_rows(journal)
    assert len(printed) <= len(rows) <= len(printed) + 1  # journaled: each returned commit, plus the one in flight
    want = _reference(len(rows))
    assert _bits(rows) == _bits(want)
    to_send = _assert_before_sync(journal, jsonl, want)
    _assert_synced_twice(journal, _config(tmp_path, jsonl), jsonl, want, capsys, to_send=to_send)


# -- a sync that dies --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_journal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Rows, int]:
    """A 20,000-step journal, its replayed rows, and the size of a complete jsonl of it."""
    from metricbus.adapters.jsonl import JsonlAdapter

    from metricbus import MetricBus
    from metricbus.replay import replay
    from tests.journal_workers import RULES, log_step

    root = tmp_path_factory.mktemp("big")
    with MetricBus(dist=None, rules=RULES, journal=str(root / "journal"), fsync="never") as bus:
        for step in range(BIG_STEPS):
            log_step(bus, step, 0)
            bus.commit(step)
    replay(root / "journal", [JsonlAdapter(path=root / "full.jsonl")])
    return root / "journal", _journal_rows(root / "journal"), (root / "full.jsonl").stat().st_size


def _sync_child_until(tmp_path: Path, big_journal: tuple[Path, Rows, int], fraction: float
                      ) -> tuple[subprocess.Popen[str], Path, Path, Path]:
    """Copy the big journal, start a slow ``metricbus sync`` of it, return once ``fraction`` of it was written."""
    import shutil

    source, _, full_size = big_journal
    journal, jsonl = tmp_path / "journal", tmp_path / "out.jsonl"
    shutil.copytree(source, journal)
    config = _config(tmp_path, jsonl)
    child = _python("sync", str(journal), str(config), stdout=subprocess.DEVNULL)
    while (jsonl.stat().st_size if jsonl.exists() else 0) < fraction * full_size:
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        time.sleep(0.001)
    return child, journal, jsonl, config


@pytest.mark.parametrize("fraction", [0.02, 0.3, 0.7])
def test_sigkill_during_sync_then_sync_again_delivers_each_step_once(
    tmp_path: Path, big_journal: tuple[Path, Rows, int], capsys: pytest.CaptureFixture[str], fraction: float
) -> None:
    """SIGKILL a sync of 20,000 steps midway (before, across flushes): the next sync completes it without duplicates."""
    child, journal, jsonl, config = _sync_child_until(tmp_path, big_journal, fraction)
    os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    want = big_journal[1]
    assert 0 < len(_jsonl(jsonl)) < BIG_STEPS  # killed midway
    to_send = _assert_before_sync(journal, jsonl, want)
    if fraction < 0.04:  # before the first flush (every 1,000 steps): nothing was acknowledged
        assert to_send == BIG_STEPS
    _assert_synced_twice(journal, config, jsonl, want, capsys, to_send=to_send)


def test_ctrl_c_during_sync_acknowledges_what_was_written_and_exits_130(
    tmp_path: Path, big_journal: tuple[Path, Rows, int], capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGINT midway: one summary line, exit 130, no traceback; every written step acknowledged; resync completes."""
    child, journal, jsonl, config = _sync_child_until(tmp_path, big_journal, 0.3)
    os.kill(child.pid, signal.SIGINT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 130, err
    assert "Traceback" not in err
    (line,) = err.splitlines()
    live = _jsonl(jsonl)
    assert line == f"interrupted: sent {len(live)} steps to jsonl; run sync again to resume"
    assert 0 < len(live) < BIG_STEPS
    want = big_journal[1]
    assert _bits(live) == _bits(want[: len(live)])
    assert _cursor(journal, jsonl) == live[-1][0]  # flushed and acknowledged, all of it
    _assert_synced_twice(journal, config, jsonl, want, capsys, to_send=BIG_STEPS - len(live))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1] == "trainer":
        _trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(_slow_sync(sys.argv[2], sys.argv[3]))
