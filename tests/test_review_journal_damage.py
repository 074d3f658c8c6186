"""Review of the journal's durability: damaged, foreign and misplaced files and cursor records, read by the reader
and by the ``metricbus`` command (its exit code, and no traceback for a damaged input)."""

from __future__ import annotations

import io
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from metricbus.adapters.jsonl import JsonlAdapter, read_jsonl

from metricbus.adapter import RunInfo
from metricbus.cli import main
from metricbus.errors import JournalWarning
from metricbus.journal import CursorStore, open_journal, rank_file, stream_journal
from metricbus.replay import emitted
from tests.test_journal_short import _tokens


def _write(path: Path, *, rank: int, steps: range, run: str, tokens: float = 10.0) -> None:
    """One writer of ``rank``'s file in ``path`` for run ``run``: ``tokens`` (a sum) at each of ``steps``."""
    writer = open_journal(path=path, fsync="never", rank=rank, run=RunInfo(id=run), rules=[], log_every=1)
    for step in steps:
        writer.append(step=step, entries=[(rank, _tokens(tokens))])  # type: ignore[list-item]
    writer.close()


def _cli(*argv: str) -> tuple[int, str, str]:
    """``metricbus ARGV``: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_a_rank_file_of_another_run_is_skipped_not_merged(tmp_path: Path) -> None:
    """A rank file another run wrote, left in the folder, is skipped with a warning naming both runs; before, its
    entries (rank 0's, as its header says) replaced run A's rank 0 at steps 0..3 and its steps 4..7 were added,
    and every rank of run A was said to be cut short."""
    journal = tmp_path / "j"
    for rank in range(2):
        _write(journal, rank=rank, steps=range(4), run="run-a")
    with warnings.catch_warnings():
        warnings.simplefilter("error", JournalWarning)
        live = list(emitted(stream_journal(journal)))
    assert live == [(step, {"tokens": 20.0}) for step in range(4)]
    _write(tmp_path / "other", rank=0, steps=range(8), run="run-b", tokens=1000.0)
    foreign = rank_file(journal, 2)
    foreign.write_bytes(rank_file(tmp_path / "other", 0).read_bytes())
    why = f"{foreign} was written by run 'run-b', the journal's other files by run 'run-a'"
    with pytest.warns(JournalWarning) as caught:
        stream = stream_journal(journal)
    assert [str(w.message) for w in caught] == [
        f"journal {foreign}: skipped, the other ranks are read ({why} (a file of another run in this folder: "
        "move it out))"
    ]
    assert stream.run.id == "run-a"
    assert stream.short == []
    assert [path for path, _ in stream.skipped] == [foreign]
    assert list(emitted(stream)) == live
    code, out, err = _cli("inspect", str(journal))
    assert code == 0
    assert "Traceback" not in err
    assert f"skipped     {foreign.name}: {why}" in out


def test_on_a_tie_the_lowest_rank_file_names_the_run(tmp_path: Path) -> None:
    """One file of each run: the lowest rank's run is the journal's, the other file is skipped."""
    _write(tmp_path, rank=0, steps=range(3), run="run-a")
    _write(tmp_path / "other", rank=0, steps=range(5), run="run-b", tokens=7.0)
    rank_file(tmp_path, 1).write_bytes(rank_file(tmp_path / "other", 0).read_bytes())
    with pytest.warns(JournalWarning, match="written by run 'run-b'"):
        stream = stream_journal(tmp_path)
    assert list(emitted(stream)) == [(step, {"tokens": 10.0}) for step in range(3)]


def test_a_damaged_gaps_record_is_skipped_with_a_warning_not_a_backend_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gaps line whose step is 1e400 made sync exit 1 with 'a backend failed: OverflowError' (and one of 2.7 was
    read as step 2, sent again though delivered); now each is a warning and the sound record (step 1) is retried."""
    _write(tmp_path, rank=0, steps=range(4), run="run-a")
    out = tmp_path / "out.jsonl"
    monkeypatch.setenv("METRICBUS_ADAPTERS", f"jsonl:{out}")
    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    assert _cli("sync", str(tmp_path))[:2] == (0, "jsonl: sent 4 steps\n")
    store = CursorStore(tmp_path)
    store.add_gap(JsonlAdapter(path=out), 1, "rejected")
    gaps = next((tmp_path / "cursors").glob("*.gaps.jsonl"))
    with gaps.open("a", encoding="utf-8") as file:
        file.write('{"step": 1e400, "reason": "x"}\n{"step": 2.7, "reason": "x"}\n')
    code, stdout, err = _cli("sync", str(tmp_path))
    assert (code, stdout) == (0, "jsonl: sent 1 steps\n"), err
    assert err.splitlines() == [
        f"metricbus: warning: delivery gaps file {gaps} is damaged: line {n}'s step {v} is not an int64; skipped, "
        "so sync does not retry what it held there"
        for n, v in ((2, "inf"), (3, "2.7"))
    ]
    assert [step for step, _ in read_jsonl(out)] == [0, 1, 2, 3, 1]


def test_a_cursor_folder_that_cannot_be_written_is_no_backend_failure(tmp_path: Path) -> None:
    """Found by the journal-damage review: 'cursors' a regular file made sync end 'a backend failed:
    FileExistsError' (exit 1), blaming the backend; now one line naming the cursor and the folder (exit 2)."""
    import json

    from metricbus import MetricBus

    journal, out = tmp_path / "j", tmp_path / "out.jsonl"
    bus = MetricBus(dist=None, journal=str(journal), adapters=[f"jsonl:{out}"])
    for step in range(3):
        bus.log("x", float(step))
        bus.commit(step)
    bus.close()
    for cursor in (journal / "cursors").iterdir():
        cursor.unlink()
    (journal / "cursors").rmdir()
    (journal / "cursors").write_text("not a folder", encoding="utf-8")
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"adapters": [f"jsonl:{out}"]}), encoding="utf-8")
    code, _, err = _cli("sync", str(journal), "--config", str(config))
    assert code == 2
    assert "cannot write the delivery cursor" in err
    assert f"make {journal / 'cursors'} a writable folder" in err
    assert "a backend failed" not in err
    assert "Traceback" not in err
