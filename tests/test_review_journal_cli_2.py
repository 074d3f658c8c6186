"""Review of the journal and the command line (second round): commits lost at a step that also holds commits read
(a step's training or evaluation commit) on real gloo ranks, and replays into a file or folder that already holds
rows."""

from __future__ import annotations

import io
import shutil
import struct
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from metricbus.adapters.jsonl import read_jsonl

from metricbus.cli import main
from metricbus.errors import JournalWarning
from metricbus.journal import read_journal, stream_journal
from metricbus.journal.scan import Gap
from metricbus.replay import emitted

STEPS = 6
DAMAGED_STEP = 3


def gloo_train_eval_rank(rank: int, world: int, init_file: str, journal: str, live_path: str) -> None:
    """One torch.distributed rank: at each step a training commit then an evaluation commit (other names); rank 0
    writes what was emitted live to ``live_path``."""
    import torch.distributed as dist
    from metricbus.adapters.jsonl import JsonlAdapter

    from metricbus import MetricBus

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        bus = MetricBus(dist="torch", rules={"loss": "mean", "tokens": "sum", "eval/loss": "mean"}, journal=journal,
                        adapters=[JsonlAdapter(path=live_path)], strict=True)
        for step in range(STEPS):
            bus.log("loss", (step + 1) / 3 + rank / 7)
            bus.log("tokens", float(10 * rank + step + 1))
            bus.commit(step)
            bus.log("eval/loss", (step + 2) / 9 - rank / 11)
            bus.commit(step)
        bus.close()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_journal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[int, dict[str, float]]]]:
    """A journal two gloo ranks wrote (two commits a step) and the rows rank 0 emitted live."""
    pytest.importorskip("metricbus.dist", reason="metricbus.dist (torch.distributed transport) is not available")
    mp = pytest.importorskip("torch.multiprocessing")
    root = tmp_path_factory.mktemp("gloo")
    journal, live = root / "j", root / "live.jsonl"
    mp.spawn(gloo_train_eval_rank, args=(2, str(root / "init"), str(journal), str(live)), nprocs=2, join=True)
    rows = [(step, dict(metrics)) for step, metrics in read_jsonl(live)]
    assert len(rows) == 2 * STEPS
    return journal, rows


def _copy(source: Path, tmp_path: Path) -> Path:
    journal = tmp_path / "j"
    shutil.copytree(source, journal)
    return journal


def _commit_frames(path: Path) -> list[tuple[int, int, int]]:
    """``(step, offset, length)`` of each commit frame of the rank file ``path``, in file order."""
    data, pos, out = path.read_bytes(), 8, []
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        if data[pos + 8 : pos + 9] in (b"P", b"S", b"R"):
            out.append((struct.unpack_from("<q", data, pos + 9)[0], pos, length))
        pos += 8 + length
    return out


def _flip(path: Path, *, step: int, nth: int) -> None:
    """Flip a byte in the middle of the ``nth`` commit frame of ``step`` in the rank file ``path``."""
    _, pos, length = [frame for frame in _commit_frames(path) if frame[0] == step][nth]
    data = bytearray(path.read_bytes())
    data[pos + 8 + length // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_a_lost_evaluation_commit_in_one_rank_file_is_named_by_its_step(
    gloo_journal: tuple[Path, list[tuple[int, dict[str, float]]]], tmp_path: Path
) -> None:
    """Found by the journal/CLI review: rank 1's evaluation commit at step 3 lost to a flipped byte replayed step 3's
    eval/loss from rank 0 alone with only a byte offset in the warning; now the step is named, listed and shown."""
    journal = _copy(gloo_journal[0], tmp_path)
    _flip(journal / "rank-00001.mbj", step=DAMAGED_STEP, nth=1)
    with pytest.warns(JournalWarning) as caught:
        stream = stream_journal(journal)
    assert any(f"rank 1's file lost its commits at step {DAMAGED_STEP} to damaged bytes" in str(w.message)
               for w in caught)
    assert stream.holes == [Gap(1, DAMAGED_STEP, DAMAGED_STEP)]
    rows = list(emitted(stream))
    live = gloo_journal[1]
    lost = 2 * DAMAGED_STEP + 1  # the eval row of step 3
    assert rows[:lost] + rows[lost + 1 :] == live[:lost] + live[lost + 1 :]
    assert rows[lost][0] == DAMAGED_STEP
    assert rows[lost][1].keys() == {"eval/loss"}
    code, out, err = _cli("inspect", str(journal))
    assert code == 0
    assert f"damaged     rank 1: its file lost its commits at step {DAMAGED_STEP} to damaged bytes" in out
    assert f"metricbus: warning: journal {journal}: rank 1's file lost its commits at step {DAMAGED_STEP}" in err


def test_a_lost_training_commit_leaves_the_evaluation_commit_in_its_place(
    gloo_journal: tuple[Path, list[tuple[int, dict[str, float]]]], tmp_path: Path
) -> None:
    """Found by the journal/CLI review: rank 1's training commit at step 3 lost to a flipped byte merged its evaluation
    commit with rank 0's training commit, so step 3 emitted eval/loss twice (each row one rank's), silently; now the
    evaluation row is live's and the step is named."""
    journal = _copy(gloo_journal[0], tmp_path)
    _flip(journal / "rank-00001.mbj", step=DAMAGED_STEP, nth=0)
    with pytest.warns(JournalWarning) as caught:
        journal_read = read_journal(journal)
    assert any(f"rank 1's file lost its commits at step {DAMAGED_STEP} to damaged bytes" in str(w.message)
               for w in caught)
    assert journal_read.holes == [Gap(1, DAMAGED_STEP, DAMAGED_STEP)]
    rows, live = list(emitted(journal_read)), gloo_journal[1]
    lost = 2 * DAMAGED_STEP  # the training row of step 3
    assert rows[:lost] + rows[lost + 1 :] == live[:lost] + live[lost + 1 :]
    assert rows[lost][0] == DAMAGED_STEP
    assert rows[lost][1].keys() == {"loss", "tokens"}


def test_a_rank_file_ending_between_the_last_steps_two_commits_is_cut_short(
    gloo_journal: tuple[Path, list[tuple[int, dict[str, float]]]], tmp_path: Path
) -> None:
    """Found by the journal/CLI review: rank 1's file cut right before its last commit (the evaluation at the last
    step) replayed that eval/loss from rank 0 alone without a word; now it is cut short inside that step."""
    journal = _copy(gloo_journal[0], tmp_path)
    path = journal / "rank-00001.mbj"
    last = STEPS - 1
    step, pos, _ = _commit_frames(path)[-1]
    assert step == last
    path.write_bytes(path.read_bytes()[:pos])
    with pytest.warns(JournalWarning, match=f"rank 1's file stops inside step {last}, with fewer commits") as caught:
        stream = stream_journal(journal)
    assert len(caught) == 1
    assert stream.short == [Gap(1, last, last)]
    assert stream.holes == []
    rows, live = list(emitted(stream)), gloo_journal[1]
    assert rows[:-1] == live[:-1]
    code, out, err = _cli("inspect", str(journal))
    assert code == 0
    assert f"cut short   rank 1: its file stops inside step {last} (fewer commits there than the other ranks')" in out
    assert f"metricbus: warning: journal {journal}: rank 1's file stops inside step {last}" in err


def test_a_rank_file_stopping_inside_an_earlier_step_is_cut_short_from_that_step(
    gloo_journal: tuple[Path, list[tuple[int, dict[str, float]]]], tmp_path: Path
) -> None:
    """Rank 1's file cut right before its evaluation commit at step 3: cut short from step 3 (it lacks that step's
    evaluation), not from step 4."""
    journal = _copy(gloo_journal[0], tmp_path)
    path = journal / "rank-00001.mbj"
    _, pos, _ = [frame for frame in _commit_frames(path) if frame[0] == DAMAGED_STEP][1]
    path.write_bytes(path.read_bytes()[:pos])
    with pytest.warns(JournalWarning) as caught:
        stream = stream_journal(journal)
    assert [str(w.message).split(": ", 1)[1][:59] for w in caught] == [
        f"rank 1's file stops inside step {DAMAGED_STEP}, with fewer commits there"
    ]
    assert stream.short == [Gap(1, DAMAGED_STEP, STEPS - 1)]


def test_an_undamaged_gloo_journal_replays_live_without_a_warning(
    gloo_journal: tuple[Path, list[tuple[int, dict[str, float]]]],
) -> None:
    """The journal the other tests damage replays every live row, with no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", JournalWarning)
        stream = stream_journal(gloo_journal[0])
        assert stream.short == []
        assert stream.holes == []
        assert list(emitted(stream)) == gloo_journal[1]


def test_replay_into_a_jsonl_file_that_holds_rows_is_refused(
    gloo_journal: tuple[Path, list[tuple[int, dict[str, float]]]], tmp_path: Path
) -> None:
    """Found by the journal/CLI review: ``replay --to jsonl:X`` run twice appended every step again to X (each row
    twice); the second replay is now refused (exit 2) saying what to do, and X is left as it was."""
    target = tmp_path / "X.jsonl"
    code, _, err = _cli("replay", str(gloo_journal[0]), "--to", f"jsonl:{target}")
    assert code == 0, err
    before = target.read_bytes()
    assert [(step, dict(metrics)) for step, metrics in read_jsonl(target)] == gloo_journal[1]
    code, _, err = _cli("replay", str(gloo_journal[0]), "--to", f"jsonl:{target}")
    assert code == 2
    assert f"jsonl: {str(target)!r} already holds {2 * STEPS} line(s)" in err
    assert "give a new path (jsonl:OTHER.jsonl)" in err
    assert "Traceback" not in err
    assert target.read_bytes() == before


def test_replay_into_a_tensorboard_folder_that_holds_events_is_refused(
    gloo_journal: tuple[Path, list[tuple[int, dict[str, float]]]], tmp_path: Path
) -> None:
    """``replay --to tensorboard:DIR`` run twice added a second event file of the same steps; now refused (exit 2)."""
    pytest.importorskip("tensorboard")
    target = tmp_path / "tb"
    code, _, err = _cli("replay", str(gloo_journal[0]), "--to", f"tensorboard:{target}")
    assert code == 0, err
    files = sorted(p.name for p in target.iterdir())
    code, _, err = _cli("replay", str(gloo_journal[0]), "--to", f"tensorboard:{target}")
    assert code == 2
    assert f"tensorboard: {str(target)!r} already holds event files" in err
    assert sorted(p.name for p in target.iterdir()) == files


def test_replay_into_an_empty_jsonl_file_is_allowed(
    gloo_journal: tuple[Path, list[tuple[int, dict[str, float]]]], tmp_path: Path
) -> None:
    """A file without a complete line (empty) is no earlier run's: the replay writes into it."""
    target = tmp_path / "X.jsonl"
    target.write_bytes(b"")
    code, _, err = _cli("replay", str(gloo_journal[0]), "--to", f"jsonl:{target}")
    assert code == 0, err
    assert len(read_jsonl(target)) == 2 * STEPS


def test_a_missing_rank_file_of_a_gloo_journal_is_named(
    gloo_journal: tuple[Path, list[tuple[int, dict[str, float]]]], tmp_path: Path
) -> None:
    """Found by the journal/CLI review: with rank 1's file gone (moved, not copied), replay and inspect read rank 0's
    alone (tokens 6 at step 5 where live had 22) without a word; the header now keeps the group's size, so the
    missing file is named, skipped and shown by inspect."""
    journal = _copy(gloo_journal[0], tmp_path)
    missing = journal / "rank-00001.mbj"
    missing.unlink()
    with pytest.warns(JournalWarning) as caught:
        stream = stream_journal(journal)
    assert [str(w.message).split(" (", 1)[0] for w in caught] == [
        f"journal {missing}: skipped, the other ranks are read"
    ]
    why = "rank-00001.mbj is missing, where the run's headers say 2 ranks journaled a file each"
    assert why in str(caught[0].message)
    assert [path for path, _ in stream.skipped] == [missing]
    assert [row for row in emitted(stream) if "tokens" in row[1]][-1] == (STEPS - 1, {"loss": 2.0, "tokens": 6.0})
    code, out, err = _cli("inspect", str(journal))
    assert code == 0
    assert "skipped     rank-00001.mbj: rank-00001.mbj is missing" in out
    assert f"metricbus: warning: journal {missing}: skipped" in err


def test_a_single_process_journal_names_no_missing_rank(tmp_path: Path) -> None:
    """A bus without torch.distributed writes no group size: its one rank file is the whole journal, no warning."""
    from metricbus import MetricBus

    with MetricBus(dist=None, journal=str(tmp_path / "j"), rules={"x": "sum"}) as bus:
        bus.log("x", 1.0)
        bus.commit(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", JournalWarning)
        stream = stream_journal(tmp_path / "j")
    assert "world" not in stream.header
    assert stream.skipped == []


def _single_process_journal(path: Path, *, log_every: int) -> list[tuple[int, dict[str, float]]]:
    """A one-process run of 9 steps (x: sum of 1.0 a step) journaled in ``path``; the rows it emitted live."""
    from metricbus import MetricBus
    from metricbus.testing import MemoryAdapter

    live = MemoryAdapter()
    with MetricBus(dist=None, journal=str(path), rules={"x": "sum"}, adapters=[live], log_every=log_every) as bus:
        for step in range(9):
            bus.log("x", 1.0)
            bus.commit(step)
    return [(step, dict(metrics)) for step, metrics in live.rows]


@pytest.mark.parametrize("log_every", [1, 3])
def test_a_commit_lost_in_a_single_process_journal_is_named_by_its_step(tmp_path: Path, log_every: int) -> None:
    """Found by the journal/CLI review: a flipped byte in step 4's commit of a one-process journal was warned only
    by a byte offset (holes were compared with other rank files, and there were none); now the step is named by
    the warning, ``holes`` and inspect."""
    journal = tmp_path / "j"
    live = _single_process_journal(journal, log_every=log_every)
    _flip(journal / "rank-00000.mbj", step=4, nth=0)
    with pytest.warns(JournalWarning) as caught:
        stream = stream_journal(journal)
    assert [str(w.message) for w in caught][1:] == [
        f"journal {journal}: the file lost its commits at step 4 to damaged bytes (the steps between the commits "
        "read around them; where steps jump, some may never have been committed): their records are not replayed, "
        "so those steps are missing or hold other values than live emitted"
    ]
    assert stream.holes == [Gap(0, 4, 4)]
    rows = list(emitted(stream))
    window = 4 // log_every * log_every + log_every - 1  # the step its window emits at
    assert [row for row in rows if row[0] != window] == [row for row in live if row[0] != window]
    assert dict(rows).get(window) == ({"x": float(log_every - 1)} if log_every > 1 else None)
    code, out, err = _cli("inspect", str(journal))
    assert code == 0
    assert "damaged     rank 0: its file lost its commits at step 4 to damaged bytes (not replayed" in out
    assert f"metricbus: warning: journal {journal}: the file lost its commits at step 4" in err
