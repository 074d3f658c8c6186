"""``log_every`` windows in replay are the live ones after commits whose journal write failed: the "L" frame
written with the next write counts each as an empty commit where it was (review finding: every later window of the
replay was shifted by one commit, at other steps and with other values than live)."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.errors import JournalError
from metricbus.journal import Gap, JournalWarning, read_journal
from metricbus.replay import emitted
from metricbus.testing import MemoryAdapter


@pytest.mark.parametrize(("failing", "log_every"), [({1}, 2), ({4, 5, 6}, 3), ({0}, 2), ({9}, 4), ({2, 3}, 1)])
def test_failed_commits_keep_the_live_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: set[int], log_every: int
) -> None:
    directory = tmp_path / "j"
    memory = MemoryAdapter()
    bus = MetricBus(dist=None, journal=str(directory), adapters=[memory], log_every=log_every, fsync="never")
    real = os.write

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for step in range(10):
        bus.log("loss", float(step))
        bus.log("tokens", 1.0, agg="sum")
        monkeypatch.setattr(os, "write", full if step in failing else real)
        if step in failing:
            with pytest.raises(JournalError, match=f"step {step} is not journaled"):
                bus.commit(step)
        else:
            bus.commit(step)
    monkeypatch.setattr(os, "write", real)
    bus.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JournalWarning)
        journal = read_journal(directory)
    assert [(g.first_step, g.last_step) for g in journal.gaps] == [(min(failing), max(failing))]
    assert all(isinstance(g, Gap) for g in journal.gaps)
    replayed = dict(emitted(journal))
    # every window emits at its live step (one whose commits all failed emits nothing), and a window without a
    # failed commit emits the live values, bit for bit
    windows = {step: set(range(step - log_every + 1, step + 1)) for step, _ in memory.rows}
    assert set(replayed) == {step for step, window in windows.items() if not window <= failing}
    for step, live in memory.rows:
        if not failing & windows[step]:
            assert replayed[step] == live
