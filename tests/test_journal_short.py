"""A rank file cut short: a torch.distributed rank stopped between a commit's collectives and its journal write leaves
its file without steps the other ranks' files hold; replay says so instead of silently replaying them without it."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.adapter import RunInfo
from metricbus.cli_views import inspect
from metricbus.errors import JournalWarning
from metricbus.journal import open_journal, read_journal, stream_journal
from metricbus.journal.scan import Gap
from metricbus.replay import emitted

RUN = RunInfo(id="short-run")


def _tokens(value: float) -> object:
    bus = MetricBus(dist=None, rules={"tokens": "sum"})
    bus.log("tokens", value)
    partial = bus.export()
    bus.close()
    return partial


def _write(path: Path, *, rank: int, steps: range) -> None:
    """One writer (a segment) of ``rank``'s file: a commit of 10 tokens at each of ``steps``."""
    writer = open_journal(path=path, fsync="never", rank=rank, run=RUN, rules=[], log_every=1)
    for step in steps:
        writer.append(step=step, entries=[(rank, _tokens(10.0))])  # type: ignore[list-item]
    writer.close()


def _quiet(path: Path) -> list[Gap]:
    """The journal's cut-short ranks, read where no warning is expected."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", JournalWarning)
        return read_journal(path).short


def test_a_rank_file_ending_before_the_others_is_named_and_listed(tmp_path: Path) -> None:
    _write(tmp_path, rank=0, steps=range(4))
    _write(tmp_path, rank=1, steps=range(3))  # killed after step 3's collectives, before its write
    expected = r"rank 1's file stops at step 2 where the other ranks' files go on to step 3 "
    with pytest.warns(JournalWarning, match=expected):
        journal = read_journal(tmp_path)
    assert journal.short == [Gap(1, 3, 3)]
    assert list(emitted(journal))[-1] == (3, {"tokens": 10.0})  # what is left, as before: the warning says so
    out = io.StringIO()
    inspect(journal, out)
    assert "cut short   rank 1: its file stops at step 2, the other ranks' go on to step 3" in out.getvalue()
    with pytest.warns(JournalWarning, match="rank 1's file"):
        assert stream_journal(tmp_path).short == [Gap(1, 3, 3)]


def test_the_writer_rank_cut_short_is_named_too(tmp_path: Path) -> None:
    _write(tmp_path, rank=0, steps=range(2))
    _write(tmp_path, rank=1, steps=range(5))
    expected = r"rank 0's file stops at step 1 where the other ranks' files go on to step 4 "
    with pytest.warns(JournalWarning, match=expected):
        assert read_journal(tmp_path).short == [Gap(0, 2, 4)]


def test_ranks_ending_together_are_not_cut_short(tmp_path: Path) -> None:
    for rank in range(3):
        _write(tmp_path, rank=rank, steps=range(4))
    assert _quiet(tmp_path) == []
    assert _quiet(tmp_path / "rank-00000.mbj") == []  # one file alone: nothing to compare


def test_a_run_resumed_with_fewer_ranks_is_not_cut_short(tmp_path: Path) -> None:
    _write(tmp_path, rank=0, steps=range(3))
    _write(tmp_path, rank=1, steps=range(3))
    _write(tmp_path, rank=0, steps=range(3, 6))  # resumed at step 3 on one rank
    assert _quiet(tmp_path) == []


def test_a_resume_at_the_missing_step_replaces_it(tmp_path: Path) -> None:
    _write(tmp_path, rank=0, steps=range(4))
    _write(tmp_path, rank=1, steps=range(3))
    for rank in range(2):  # both resumed from a checkpoint at step 3: the new segment replaces step 3
        _write(tmp_path, rank=rank, steps=range(3, 5))
    assert _quiet(tmp_path) == []


def test_a_resume_after_the_missing_step_keeps_it_listed(tmp_path: Path) -> None:
    _write(tmp_path, rank=0, steps=range(4))
    _write(tmp_path, rank=1, steps=range(3))
    for rank in range(2):  # both resumed after step 3: rank 1 never journaled it
        _write(tmp_path, rank=rank, steps=range(4, 6))
    with pytest.warns(JournalWarning, match="rank 1's file stops at step 2 where"):
        journal = read_journal(tmp_path)
    assert journal.short == [Gap(1, 3, 3)]
    assert [step for step, _ in emitted(journal)] == [0, 1, 2, 3, 4, 5]


def test_a_second_resume_at_the_same_step_with_fewer_ranks_is_not_cut_short(tmp_path: Path) -> None:
    """Resumed twice from one checkpoint, the second time on fewer ranks: the absent rank was not cut short."""
    for rank in range(2):
        _write(tmp_path, rank=rank, steps=range(6))
    for rank in range(2):  # resumed from the checkpoint at step 3, crashed at step 6
        _write(tmp_path, rank=rank, steps=range(3, 7))
    _write(tmp_path, rank=0, steps=range(3, 10))  # resumed from it again, on one rank
    assert _quiet(tmp_path) == []


def test_a_resume_with_more_ranks_then_again_with_fewer_is_not_cut_short(tmp_path: Path) -> None:
    """Ranks added by a resume and gone from a later one at the same step are not cut short."""
    _write(tmp_path, rank=0, steps=range(6))
    for rank in range(3):  # resumed at step 3 on three ranks
        _write(tmp_path, rank=rank, steps=range(3, 7))
    _write(tmp_path, rank=0, steps=range(3, 10))  # resumed at step 3 again, on one
    assert _quiet(tmp_path) == []


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


def _replayed(path: Path) -> list[tuple[int, float]]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", JournalWarning)
        return [(step, out["tokens"]) for step, out in emitted(read_journal(path))]


def test_a_resume_on_fewer_ranks_replaces_the_absent_ranks_steps(tmp_path: Path) -> None:
    """Ranks 0 and 1 write steps 0..5; rank 0 alone resumes from a checkpoint at step 3: from step 3 on the timeline
    is the resumed run's (live: 10.0), not merged with rank 1's old records (20.0)."""
    for rank in range(2):
        _write(tmp_path, rank=rank, steps=range(6))
    _write(tmp_path, rank=0, steps=range(3, 8))
    assert _replayed(tmp_path) == [(0, 20.0), (1, 20.0), (2, 20.0), *((s, 10.0) for s in range(3, 8))]
    assert read_journal(tmp_path).last_step == 7


def test_the_absent_ranks_later_steps_are_not_the_journals_last(tmp_path: Path) -> None:
    """The absent rank's file reaches step 9; the resumed run stopped at step 5: the journal's last step is 5."""
    for rank in range(2):
        _write(tmp_path, rank=rank, steps=range(10))
    _write(tmp_path, rank=0, steps=range(3, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", JournalWarning)
        assert stream_journal(tmp_path).last_step == 5
    assert _replayed(tmp_path) == [(0, 20.0), (1, 20.0), (2, 20.0), (3, 10.0), (4, 10.0), (5, 10.0)]


def test_a_rank_rejoining_a_later_resume_is_replayed_from_there(tmp_path: Path) -> None:
    """Ranks 0 and 1 to step 9; rank 0 alone from step 3; both again from step 5."""
    for rank in range(2):
        _write(tmp_path, rank=rank, steps=range(10))
    _write(tmp_path, rank=0, steps=range(3, 7))
    for rank in range(2):
        _write(tmp_path, rank=rank, steps=range(5, 9))
    expected = [*((s, 20.0) for s in range(3)), (3, 10.0), (4, 10.0), *((s, 20.0) for s in range(5, 9))]
    assert _replayed(tmp_path) == expected
    assert read_journal(tmp_path).last_step == 8


def _flip_commit(path: Path, *, step: int) -> None:
    """Flip a byte in the middle of the commit frame of ``step`` in the rank file ``path``."""
    import struct

    data = bytearray(path.read_bytes())
    pos = 8  # after the magic
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        if data[pos + 8 : pos + 9] in (b"P", b"S", b"R") and struct.unpack_from("<q", data, pos + 9)[0] == step:
            data[pos + 8 + length // 2] ^= 0xFF
            path.write_bytes(bytes(data))
            return
        pos += 8 + length
    raise AssertionError(f"no commit frame of step {step} in {path}")


def test_a_commit_lost_to_damage_in_one_rank_file_is_named_by_its_step(tmp_path: Path) -> None:
    """Found by the journal-damage review: a flipped byte in rank 1's commit at step 5 replayed step 5 with 20.0 where
    live had 30.0, and the only warning gave a byte offset; now the step is named, listed and shown by inspect."""
    for rank in range(3):
        _write(tmp_path, rank=rank, steps=range(10))
    (rank_file,) = [p for p in tmp_path.glob("*.mbj") if p.name.endswith("1.mbj")]
    _flip_commit(rank_file, step=5)
    with pytest.warns(JournalWarning) as caught:
        journal = read_journal(tmp_path)
    messages = [str(w.message) for w in caught]
    assert any("damaged record at byte" in m for m in messages)
    assert any("rank 1's file lost its commits at step 5 to damaged bytes" in m for m in messages)
    assert journal.short == [Gap(1, 5, 5)]
    assert journal.holes == [Gap(1, 5, 5)]
    assert dict(emitted(journal))[5] == {"tokens": 20.0}  # what is left, as before: the warning says so
    out = io.StringIO()
    inspect(journal, out)
    assert "damaged     rank 1: its file lost its commits at step 5 to damaged bytes" in out.getvalue()
