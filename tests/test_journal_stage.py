"""The journal's stage (metricbus/journal/stage.py): staged commits are read as written, live and after SIGKILL;
batches move them to the file; a failed batch loses none; the next writer takes a dead writer's stage."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from metricbus import MetricBus
from metricbus.errors import JournalError
from metricbus.journal import rank_file, read_journal, stage, writer
from metricbus.replay import emitted
from metricbus.testing import MemoryAdapter
from tests.journal_workers import RULES, log_step

pytestmark = pytest.mark.skipif(not stage.STAGED, reason="the stage needs Linux's posix_fallocate")
ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 60


def _steps(directory: Path) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no damage reported: staged bytes read as frames
        return [step for step, _ in read_journal(directory).commits]


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != "cursors")


def test_staged_commits_are_read_live_and_the_stage_goes_at_close(tmp_path: Path) -> None:
    """Commits fewer than a batch stay staged (the file holds the headers only) and read as written; close writes
    them to the file and removes the stage; replay gives what live emitted."""
    directory = tmp_path / "j"
    mem = MemoryAdapter()
    bus = MetricBus(dist=None, rules=RULES, journal=str(directory), adapters=[mem])
    for step in range(20):
        log_step(bus, step, 0)
        bus.commit(step)
    path = rank_file(directory, 0)
    assert _files(directory) == ["rank-00000.mbj", "rank-00000.mbj.lock", "rank-00000.mbj.stage"]
    assert path.stat().st_size < 2_000  # the headers: the commits are staged
    assert _steps(directory) == list(range(20))
    bus.close()
    assert _files(directory) == ["rank-00000.mbj"]
    assert _steps(directory) == list(range(20))
    assert list(emitted(read_journal(directory))) == mem.rows


def test_batches_move_the_staged_commits_to_the_file(tmp_path: Path) -> None:
    """Past half the stage a batch is written: the file grows in batches, and every commit reads at every moment."""
    directory = tmp_path / "j"
    path = rank_file(directory, 0)
    sizes = []
    with MetricBus(dist=None, journal=str(directory)) as bus:
        for step in range(3000):
            bus.log({f"m{i}": float(step + i) for i in range(40)})
            bus.commit(step)
            if step % 500 == 499:
                sizes.append(path.stat().st_size)
                assert _steps(directory) == list(range(step + 1))
    assert sizes == sorted(sizes)
    assert sizes[-1] > stage.STAGE_BYTES // 2  # batches written
    assert _steps(directory) == list(range(3000))


def _killed(directory: Path, *, steps: int) -> None:
    """A process that commits ``steps`` steps (40 metrics each), then SIGKILLs itself."""
    code = (
        "import os, signal, sys\n"
        "from metricbus import MetricBus\n"
        f"bus = MetricBus(dist=None, journal={str(directory)!r})\n"
        f"for step in range({steps}):\n"
        "    bus.log({f'm{i}': step * 0.5 + i for i in range(40)})\n"
        "    bus.commit(step)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=WAIT_S, check=False, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr


@pytest.mark.parametrize("steps", [7, 1500])
def test_sigkill_keeps_every_commit_that_returned_and_the_next_writer_takes_them(tmp_path: Path, steps: int) -> None:
    """A writer killed with commits staged (and, at 1,500 steps, batches written before): readers read every commit
    that returned, without a warning; a resumed bus writes the stage into the file first, then goes on."""
    directory = tmp_path / "j"
    _killed(directory, steps=steps)
    assert "rank-00000.mbj.stage" in _files(directory)
    assert _steps(directory) == list(range(steps))
    bus = MetricBus(dist=None, journal=str(directory), resume=True)
    assert _files(directory) == ["rank-00000.mbj", "rank-00000.mbj.lock", "rank-00000.mbj.stage"]  # its own, new
    bus.log("after", 1.0)
    bus.commit()
    bus.close()
    assert _files(directory) == ["rank-00000.mbj"]
    assert _steps(directory) == [*range(steps), steps]


def test_a_batch_cut_short_by_a_crash_is_read_and_written_again_whole(tmp_path: Path) -> None:
    """A writer killed in the middle of a batch's write: the stage says where the batch began, so readers read the
    staged bytes from there (not after the torn part), and the next writer cuts the torn part and writes the batch
    whole."""
    directory = tmp_path / "j"
    code = (
        "import os, signal\n"
        "from metricbus import MetricBus\n"
        "from metricbus.journal import rank_file, writer\n"
        f"bus = MetricBus(dist=None, journal={str(directory)!r})\n"
        "for step in range(10):\n"
        "    bus.log({'a': float(step), 'b': 2.0 * step})\n"
        "    bus.commit(step)\n"
        "held = next(iter(writer._STAGED))._stage\n"
        f"fd = os.open(rank_file({str(directory)!r}, 0), os.O_WRONLY | os.O_APPEND)\n"
        "view = held.take()\n"  # the batch begins, and half of it reaches the file
        "os.write(fd, bytes(view[: len(view) // 2]))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=WAIT_S, check=False, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert _steps(directory) == list(range(10))
    with MetricBus(dist=None, journal=str(directory), resume=True) as bus:
        bus.log("a", 1.0)
        bus.commit()
    assert _steps(directory) == list(range(11))
    assert _files(directory) == ["rank-00000.mbj"]


def test_a_failed_batch_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose write fails (a full disk) keeps its commits staged: commits go on (read as written) until the
    stage is full; then a commit that cannot be kept raises JournalError (a gap); once the disk has room, every
    other commit is in the file."""
    directory = tmp_path / "j"
    real = os.write
    full = {"on": False}

    def write(fd: int, data: Any) -> int:
        if full["on"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(writer.os, "write", write)
    failed = []
    bus = MetricBus(dist=None, journal=str(directory))
    full["on"] = True
    step = 0
    while not failed:
        bus.log({f"m{i}": float(step + i) for i in range(40)})
        try:
            bus.commit(step)
        except JournalError as exc:
            failed.append((step, str(exc)))
        step += 1
        assert step < 10_000
    ((lost, message),) = failed
    assert "No space left on device (ENOSPC)" in message
    assert lost > 100  # the stage held the commits before it
    assert _steps(directory) == list(range(lost))
    full["on"] = False
    for _ in range(5):
        bus.log({f"m{i}": float(step + i) for i in range(40)})
        bus.commit(step)
        step += 1
    bus.close()
    journal = read_journal(directory)
    assert [s for s, _ in journal.commits] == list(range(step))  # the failed one read as an empty commit
    assert [s for s, entries in journal.commits if not entries] == [lost]
    assert [(g.first_step, g.last_step) for g in journal.gaps] == [(lost, lost)]


def test_a_copy_of_a_killed_writers_journal_reads_its_staged_commits(tmp_path: Path) -> None:
    """The stage belongs to the file's contents, not to its inode: a copy of the directory (a backup, a move to
    another disk) reads every commit that returned, and a writer resuming the copy takes them."""
    _killed(tmp_path / "j", steps=9)
    shutil.copytree(tmp_path / "j", tmp_path / "copy")
    assert _steps(tmp_path / "copy") == list(range(9))
    with MetricBus(dist=None, journal=str(tmp_path / "copy"), resume=True) as bus:
        bus.log("x", 1.0)
        bus.commit()
    assert _steps(tmp_path / "copy") == list(range(10))
    assert _files(tmp_path / "copy") == ["rank-00000.mbj"]


def test_a_stale_stage_of_another_file_is_ignored_and_removed(tmp_path: Path) -> None:
    """A stage left beside a rank file that was replaced since (another inode) is not read, and the next writer
    removes it."""
    directory = tmp_path / "j"
    _killed(directory, steps=5)
    path = rank_file(directory, 0)
    path.unlink()
    with MetricBus(dist=None, journal=str(directory)) as bus:
        bus.log("x", 1.0)
        bus.commit(0)
        assert _steps(directory) == [0]
    assert _steps(directory) == [0]
    assert _files(directory) == ["rank-00000.mbj"]


_READER = """
import sys, warnings
from pathlib import Path
from metricbus.journal import read_journal
directory, stop, count = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
warnings.simplefilter("error")
reads = 0
while not stop.exists():
    steps = [step for step, _ in read_journal(directory).commits]
    if steps != list(range(len(steps))):
        sys.exit(f"read {len(steps)} commits, not a prefix: {steps[:5]} ... {steps[-5:]}")
    reads += 1
    count.write_text(str(reads))
"""


def test_a_live_reader_reads_a_prefix_of_the_commits_every_time(tmp_path: Path) -> None:
    """Another process reading while the writer stages and writes batches: each read is every commit up to some
    step, in order, without a warning (a batch under way, or a commit being copied, is never read half)."""
    directory = tmp_path / "j"
    stop, count = tmp_path / "stop", tmp_path / "count"
    bus = MetricBus(dist=None, journal=str(directory))
    bus.log("x", 0.0)
    bus.commit(0)
    reader = subprocess.Popen(
        [sys.executable, "-c", _READER, str(directory), str(stop), str(count)], cwd=ROOT, stderr=subprocess.PIPE,
        text=True,
    )
    step = seen = since = 0  # commits; reads counted so far, and commits since that count last moved
    try:
        deadline = time.monotonic() + 3 * WAIT_S  # (a guard against a hang: a loaded machine reads slowly)
        while step < 3000 or seen < 20:  # many reads, several batches
            assert time.monotonic() < deadline, f"the reader read {seen} times"
            if reader.poll() is not None:
                break
            reads = int(count.read_text() or 0) if count.exists() else 0  # ("": the reader is writing it)
            if reads > seen:
                seen, since = reads, 0
            if step >= 3000 and since >= 100:  # from here the journal grows with the reads, not with time (each
                time.sleep(0.001)  # read reads the whole journal): ~100 commits of ~300 bytes a read, a batch
                continue  # (half the stage) every ~17 reads
            step += 1
            since += 1
            bus.log({f"m{i}": float(step + i) for i in range(30)})
            bus.commit(step)
            time.sleep(0.0005)  # (a pace the reader keeps up with)
    finally:
        stop.touch()
        _, err = reader.communicate(timeout=WAIT_S)
        bus.close()
    assert reader.returncode == 0, err
    assert int(count.read_text()) >= 20
    assert _steps(directory) == list(range(step + 1))


def _until_interrupted(bus: MetricBus) -> int:
    """Commit steps 0, 1, ... until one raises KeyboardInterrupt; that step."""
    step = 0
    while True:
        bus.log({f"m{i}": float(step + i) for i in range(40)})
        try:
            bus.commit(step)
        except KeyboardInterrupt:
            return step
        step += 1
        assert step < 100_000


def test_a_batch_interrupted_after_its_write_is_not_written_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception right after a batch's os.write returned (a signal handler's, before the stage is emptied): the
    next batch finds the file already holding it and writes it once (no commit read twice, no rewind)."""
    directory = tmp_path / "j"
    real = os.write
    armed = [True]

    def write(fd: int, data: Any) -> int:
        done = real(fd, data)
        if armed[0] and len(data) >= stage.STAGE_BYTES // 4:  # the batch's write
            armed[0] = False
            raise KeyboardInterrupt
        return done

    monkeypatch.setattr(writer.os, "write", write)
    bus = MetricBus(dist=None, journal=str(directory))
    step = _until_interrupted(bus)
    for more in range(step + 1, step + 4):
        bus.log({f"m{i}": float(more + i) for i in range(40)})
        bus.commit(more)
    bus.close()
    assert _steps(directory) == list(range(step + 4))


def test_a_reader_meeting_a_batch_between_its_reads_misses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch written between the reader's look at the file and at its stage: the reader reads the file again, so
    every commit that returned before it began is read."""
    from metricbus.journal import scan

    directory = tmp_path / "j"
    with MetricBus(dist=None, journal=str(directory)) as bus:
        for step in range(20):
            bus.log("a", float(step))
            bus.commit(step)
        held = next(w for w in writer._STAGED if w.directory == directory)
        real = stage.staged

        def late(path: Path, fd: int) -> tuple[int, bytes] | None:
            assert held._stage is not None
            held._flush(held._stage)  # the writer's batch, between the two
            return real(path, fd)

        monkeypatch.setattr(scan.stage, "staged", late)
        assert _steps(directory) == list(range(20))
