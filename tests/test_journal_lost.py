"""A commit lost to damage in a journal of one file, next to a commit at its own step: the warning names the step and
its metrics, not only a byte offset."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.errors import JournalWarning
from metricbus.journal import rank_file, read_journal
from metricbus.replay import emitted


def _train_and_eval(directory: Path) -> Path:
    """Steps 0..9, each a training commit (loss) and an evaluation commit (eval/acc); the rank file."""
    with MetricBus(dist=None, journal=str(directory)) as bus:
        for step in range(10):
            bus.log("loss", float(step))
            bus.commit(step)
            bus.log("eval/acc", step / 10)
            bus.commit(step)
    return rank_file(directory, 0)


def _flip(path: Path, *, step: int, nth: int) -> None:
    """Flip a byte in the middle of the ``nth`` commit frame at ``step``."""
    from test_review_diff import flip_frame

    flip_frame(path, (b"P", b"S", b"R"), step=step, nth=nth)


def _messages(directory: Path) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read_journal(directory)
    return [str(w.message) for w in caught if issubclass(w.category, JournalWarning)]


@pytest.mark.parametrize(("nth", "metric", "around"), [(1, "eval/acc", (5, 6)), (0, "loss", (4, 5))])
def test_a_lost_commit_at_a_step_is_named_with_its_metrics(tmp_path: Path, nth: int, metric: str,
                                                            around: tuple[int, int]) -> None:
    """Found reviewing one-file damage: step 5's evaluation (or training) commit lost to a flipped byte was warned
    about by byte offset only; the commits read around it are at steps 5 and 6 (4 and 5), so no step was named."""
    _flip(_train_and_eval(tmp_path), step=5, nth=nth)
    messages = _messages(tmp_path)
    assert any("damaged record at byte" in m for m in messages)
    assert [m for m in messages if "damaged bytes" in m] == [
        f"journal {tmp_path}: a commit at step 5 (of {metric}) was in damaged bytes (between the commits read at "
        f"steps {around[0]} and {around[1]}; the step holds fewer commits than most steps): it is not replayed, so "
        "that step is missing its values"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JournalWarning)
        assert [step for step, out in emitted(read_journal(tmp_path)) if metric in out] == [
            s for s in range(10) if s != 5
        ]


def test_damage_that_held_no_commit_names_no_step(tmp_path: Path) -> None:
    """A flipped byte in the header a resume wrote between two steps' commits costs no commit: no step is named."""
    with MetricBus(dist=None, journal=str(tmp_path)) as bus:
        for step in range(5):
            bus.log("loss", float(step))
            bus.commit(step)
    size = rank_file(tmp_path, 0).stat().st_size
    with MetricBus(dist=None, journal=str(tmp_path), resume=True) as bus:
        for step in range(5, 10):
            bus.log("loss", float(step))
            bus.commit(step)
    path = rank_file(tmp_path, 0)
    data = bytearray(path.read_bytes())
    data[size + 20] ^= 0xFF  # the resumed writer's first header copy (the second one is read)
    path.write_bytes(bytes(data))
    messages = _messages(tmp_path)
    assert any("damaged record at byte" in m for m in messages)
    assert not [m for m in messages if "damaged bytes" in m]


@pytest.mark.parametrize(("resumed_at", "named"), [(10, True), (9, False)])
def test_a_torn_tail_then_a_resume_names_the_lost_commit(tmp_path: Path, resumed_at: int, named: bool) -> None:
    """Step 9's evaluation commit torn at the file's end, then a resume at step 10: the warning names step 9 and
    eval/acc; a resume at step 9 replaces that step, and nothing is named."""
    path = _train_and_eval(tmp_path)
    data = path.read_bytes()
    pos, last = 8, 0
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        if data[pos + 8 : pos + 9] in (b"P", b"S", b"R"):
            last = pos
        pos += 8 + length
    path.write_bytes(data[: last + 20])  # the last commit (step 9's evaluation), torn
    with pytest.warns(JournalWarning, match="torn or damaged record"):
        bus = MetricBus(dist=None, journal=str(tmp_path), resume=True)
    with bus:
        for step in range(resumed_at, 12):
            bus.log("loss", float(step))
            bus.commit(step)
            bus.log("eval/acc", step / 10)
            bus.commit(step)
    lost = [m for m in _messages(tmp_path) if "damaged bytes" in m]
    assert lost == ([
        f"journal {tmp_path}: a commit at step 9 (of eval/acc) was in damaged bytes (between the commits read at "
        "steps 9 and 10; the step holds fewer commits than most steps): it is not replayed, so that step is missing "
        "its values"
    ] if named else [])
