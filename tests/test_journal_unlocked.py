"""A journal on a file system without ``flock``: written unguarded, and it leaves no blocks reserved past its end."""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from metricbus import MetricBus
from metricbus.errors import JournalWarning
from metricbus.journal import rank_file, read_journal, reserve, writer
from tests.journal_workers import RULES, log_step


def _no_flock(fd: int, operation: int) -> Any:
    raise OSError(errno.ENOLCK, "No locks available")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fallocate is Linux's")
def test_an_unlocked_journal_leaves_no_blocks_reserved_past_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found reviewing the reservation: unlocked, close() does not trim (another writer may be appending), so the
    4 MiB reserved past the end stayed allocated for good; an unlocked writer now reserves nothing."""
    if reserve.reserver() is None:
        pytest.skip("this libc has no fallocate")
    monkeypatch.setattr(writer.fcntl, "flock", _no_flock)
    directory = tmp_path / "journal"
    with pytest.warns(JournalWarning, match="cannot lock it"):
        bus = MetricBus(dist=None, rules=RULES, journal=str(directory))
    for step in range(3):
        log_step(bus, step, 0)
        bus.commit(step)
    bus.close()
    monkeypatch.setattr(writer.fcntl, "flock", fcntl.flock)
    path = rank_file(directory, 0)
    assert os.stat(path).st_blocks * 512 < os.stat(path).st_size + 64 * 1024
    assert [s for s, _ in read_journal(directory).commits] == [0, 1, 2]
