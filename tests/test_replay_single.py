"""A one-rank journal read as runs of commits of one shape: the same timeline, values, warnings and cuts."""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metricbus import MetricBus
from metricbus.journal import rank_file, read_journal, stream_journal
from metricbus.journal.reader import CommitRun
from metricbus.replay import emissions, emitted, replay
from metricbus.testing import MemoryAdapter
from tests.test_replay import bits

NAMES = [f"group{i % 3}/metric{i}" for i in range(12)]


def write(directory: Path, steps: range, *, resume: bool = False, seed: int = 0) -> None:
    """A live bus's journal: every name each commit (runs of one shape), an extra name every 7th commit."""
    rng = random.Random(seed)
    with MetricBus(dist=None, journal=str(directory), resume=resume) as bus:
        for step in steps:
            for name in NAMES:
                for _ in range(3):
                    bus.log(name, rng.random())
            if step % 7 == 0:
                bus.log("eval/x", rng.random())
            bus.commit(step)


def quietly(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``, its warnings recorded: ``(result, messages)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = function(*args, **kwargs)
    return out, [str(w.message) for w in caught]


def expanded(directory: Path) -> list[tuple[int, bool, bytes]]:
    """The stream's runs, each commit of a run on its own: step, segment start, rows."""
    out = []
    for item in stream_journal(directory).runs():
        for commit in item.commits() if isinstance(item, CommitRun) else [item]:
            out.append((commit.step, commit.starts_segment, b"".join(p.rows.tobytes() for p in commit.parts)))
    return out


def timeline(directory: Path) -> list[tuple[int, bool, bytes]]:
    """The stream's commits one at a time: step, segment start, rows."""
    return [(c.step, c.starts_segment, b"".join(p.rows.tobytes() for p in c.parts))
            for c in stream_journal(directory).commits()]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files read 16 KiB at a time: runs end at chunk ends and frames straddle them."""
    monkeypatch.setattr("metricbus.journal.frames.CHUNK", 1 << 14)


def test_runs_hold_the_commits_one_at_a_time_hold(tmp_path: Path) -> None:
    """runs() is commits() with the commits of a run together, and the runs do come together."""
    write(tmp_path, range(300))
    runs = list(stream_journal(tmp_path).runs())
    assert any(isinstance(item, CommitRun) and len(item.steps) > 1 for item in runs)
    assert expanded(tmp_path) == timeline(tmp_path)
    assert [step for step, _, _ in timeline(tmp_path)] == list(range(300))


def test_a_rewind_into_a_run_drops_the_replaced_commits_of_the_run(tmp_path: Path) -> None:
    """A resumed run that rewinds to a step inside an earlier run of commits: that run's commits from the step on
    are replaced (dropped), the ones before it kept, as read one at a time; a second rewind likewise."""
    write(tmp_path, range(300))
    write(tmp_path, range(150, 260), resume=True, seed=1)
    write(tmp_path, range(40, 90), resume=True, seed=2)
    runs = list(stream_journal(tmp_path).runs())
    assert any(isinstance(item, CommitRun) and len(item.steps) > 1 for item in runs)
    assert expanded(tmp_path) == timeline(tmp_path)
    assert [step for step, _, _ in timeline(tmp_path)] == list(range(90))
    assert bits(emitted(stream_journal(tmp_path))) == bits(emitted(read_journal(tmp_path)))


@pytest.mark.usefixtures("small_chunks")
def test_small_chunks_replay_the_same_bits(tmp_path: Path) -> None:
    """Runs cut by chunk ends and frames across them replay the bits of the journal read whole."""
    write(tmp_path, range(200))
    assert expanded(tmp_path) == timeline(tmp_path)
    assert bits(emitted(stream_journal(tmp_path))) == bits(emitted(read_journal(tmp_path)))


def test_replay_of_runs_equals_the_journal_read_whole(tmp_path: Path) -> None:
    """The streamed replay (runs, columnar) emits what the decoded journal (one commit at a time) emits."""
    write(tmp_path, range(400), seed=3)
    streamed, whole = MemoryAdapter(), MemoryAdapter()
    assert replay(tmp_path, [streamed]) == replay(read_journal(tmp_path), [whole]) == 400
    assert bits(streamed.rows) == bits(whole.rows)


@pytest.mark.parametrize("where", [0.3, 0.5, 0.97])
def test_a_damaged_commit_inside_a_run_costs_that_commit_only(tmp_path: Path, where: float) -> None:
    """A flipped byte in the middle of a run: one warning when opened, and one naming its step, that commit skipped,
    the others replayed."""
    write(tmp_path, range(300))
    path = rank_file(tmp_path, 0)
    data = bytearray(path.read_bytes())
    at = int(len(data) * where)
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))
    stream, messages = quietly(stream_journal, tmp_path)
    assert len(messages) == 2
    assert "damaged record at byte" in messages[0]
    commits = quietly(timeline, tmp_path)[0]
    assert len(commits) == 299
    (lost,) = set(range(300)) - {step for step, _, _ in commits}
    assert f"the file lost its commits at step {lost} to damaged bytes" in messages[1]
    assert quietly(expanded, tmp_path)[0] == commits
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second pass warns of nothing
        streamed = bits(emitted(stream))
    assert streamed == bits(quietly(lambda: list(emitted(read_journal(tmp_path))))[0])


def test_a_resume_inside_a_run_drops_the_later_steps(tmp_path: Path) -> None:
    """A writer resumed at step 150 of 250: the first segment's steps from 150 on are dropped from its run."""
    write(tmp_path, range(250))
    write(tmp_path, range(150, 260), resume=True, seed=1)
    commits = timeline(tmp_path)
    assert [step for step, _, _ in commits] == list(range(260))
    assert [i for i, (_, starts, _) in enumerate(commits) if starts] == [150]
    assert expanded(tmp_path) == commits
    assert bits(emitted(stream_journal(tmp_path))) == bits(emitted(read_journal(tmp_path)))


def test_until_cuts_a_run(tmp_path: Path) -> None:
    """emissions(until=...) stops inside a run at the first commit at that step."""
    write(tmp_path, range(300))
    cut = list(emissions(stream_journal(tmp_path), until=123))
    assert [step for step, _, _ in cut] == list(range(123))
    whole = [(step, out) for step, out, _ in emissions(read_journal(tmp_path), until=123)]
    assert bits([(step, out) for step, out, _ in cut]) == bits(whole)


def test_progress_counts_every_commit_of_a_run(tmp_path: Path) -> None:
    """The progress callback is called once per commit, the last call (done, total) at the journal's length."""
    write(tmp_path, range(120))
    calls: list[tuple[int, int]] = []
    replay(tmp_path, [MemoryAdapter()], progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 120) for i in range(1, 121)]


def test_commits_appended_after_opening_are_not_read(tmp_path: Path) -> None:
    """A journal still being written: the stream reads what the first pass saw, with no warning."""
    write(tmp_path, range(100))
    stream = stream_journal(tmp_path)
    write(tmp_path, range(100, 180), resume=True, seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [step for step, _ in emitted(stream)] == list(range(100))
    assert [step for step, _ in emitted(stream_journal(tmp_path))] == list(range(180))


def test_commits_of_one_length_but_other_names_are_read_one_by_one(tmp_path: Path) -> None:
    """Commits as long as each other but naming other metrics are no run of one shape: values as read whole."""
    with MetricBus(dist=None, journal=str(tmp_path)) as bus:
        for step in range(60):
            for name in NAMES[:6] if step % 2 else NAMES[6:]:
                bus.log(name, float(step))
            bus.commit(step)
    runs = list(stream_journal(tmp_path).runs())
    assert not any(isinstance(item, CommitRun) for item in runs)
    assert bits(emitted(stream_journal(tmp_path))) == bits(emitted(read_journal(tmp_path)))


def test_a_run_part_is_one_array_of_its_commits(tmp_path: Path) -> None:
    """A CommitRun's rows are (commits, entries): each row of it is that commit's rows."""
    write(tmp_path, range(50))
    run = next(item for item in stream_journal(tmp_path).runs() if isinstance(item, CommitRun))
    rows = run.part.rows
    assert rows.shape == (len(run.steps), len(NAMES))
    first = next(run.commits())
    assert np.array_equal(first.parts[0].rows, rows[0])
    assert run.head(2).steps == run.steps[:2]
