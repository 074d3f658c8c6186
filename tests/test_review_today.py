"""Review of today's change: regressions found between the commits made in parallel."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from metricbus.adapter import RunInfo
from metricbus.errors import ConfigError, JournalWarning
from metricbus.journal import open_journal, read_journal
from metricbus.journal.scan import Gap
from metricbus.partial import Partial

RUN = RunInfo(id="review-run")


def _tokens(value: float) -> Partial:
    from metricbus import MetricBus

    bus = MetricBus(dist=None, rules={"tokens": "sum"})
    bus.log("tokens", value)
    partial = bus.export()
    bus.close()
    return partial


def _write(path: Path, *, rank: int, steps: range) -> None:
    """One writer (a segment) of ``rank``'s file: a commit of 10 tokens at each of ``steps``."""
    writer = open_journal(path=path, fsync="never", rank=rank, run=RUN, rules=[], log_every=1)
    for step in steps:
        writer.append(step=step, entries=[(rank, _tokens(10.0))])
    writer.close()


def _short(path: Path) -> list[Gap]:
    """The journal's cut-short ranks, read where no warning is expected."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", JournalWarning)
        return read_journal(path).short


def test_a_second_resume_at_the_same_step_with_fewer_ranks_is_not_cut_short(tmp_path: Path) -> None:
    """Resumed twice from one checkpoint, the second time on fewer ranks: the absent rank was not cut short."""
    for rank in range(2):
        _write(tmp_path, rank=rank, steps=range(6))
    for rank in range(2):  # resumed from the checkpoint at step 3, crashed at step 6
        _write(tmp_path, rank=rank, steps=range(3, 7))
    _write(tmp_path, rank=0, steps=range(3, 10))  # resumed from it again, on one rank
    assert _short(tmp_path) == []


def test_a_resume_with_more_ranks_then_again_with_fewer_is_not_cut_short(tmp_path: Path) -> None:
    """Ranks added by a resume and gone from a later one at the same step are not cut short."""
    _write(tmp_path, rank=0, steps=range(6))
    for rank in range(3):  # resumed at step 3 on three ranks
        _write(tmp_path, rank=rank, steps=range(3, 7))
    _write(tmp_path, rank=0, steps=range(3, 10))  # resumed at step 3 again, on one
    assert _short(tmp_path) == []


def test_a_rank_cut_short_after_a_second_resume_at_one_step_is_still_named(tmp_path: Path) -> None:
    """Both ranks resumed twice at one step, one of them cut short in the last run: still named."""
    for rank in range(2):
        _write(tmp_path, rank=rank, steps=range(6))
        _write(tmp_path, rank=rank, steps=range(3, 7))
    _write(tmp_path, rank=0, steps=range(3, 10))
    _write(tmp_path, rank=1, steps=range(3, 9))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert read_journal(tmp_path).short == [Gap(1, 9, 9)]


def test_lightning_logger_resume_without_a_journal_fails_at_construction() -> None:
    """MetricBusLogger(resume=True) without a journal is refused when built, not at its first log mid-fit."""
    pytest.importorskip("pytorch_lightning")
    from metricbus.integrations.lightning import MetricBusLogger

    with pytest.raises(ConfigError, match="resume: needs a journal"):
        MetricBusLogger(adapters=[], resume=True)
