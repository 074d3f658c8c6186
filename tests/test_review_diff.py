"""Review of the changes after af2e2f5: a refused commit re-opening its update, pending rewinds, the nan= checks of
ingest(), steps lost to damage in a rank file, drop_ingested(). One regression test per defect found."""

from __future__ import annotations

import math
import struct
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

from metricbus import Agg, MetricBus
from metricbus.adapter import RunInfo
from metricbus.errors import JournalWarning, MetricValueError, SpecError, StepError
from metricbus.journal import open_journal, read_journal
from metricbus.journal.scan import Gap
from metricbus.replay import emitted


def _declared_error(value: float) -> object:
    """A worker's export of 'a' declared Agg('mean', nan='error')."""
    worker = MetricBus(dist=None)
    worker.log("a", value, agg=Agg("mean", nan="error"))
    part = worker.export()
    worker.close()
    return part


def test_a_declared_policy_takes_the_drivers_finite_records_however_many_were_logged() -> None:
    """3 finite records buffered on the driver took a worker's nan='error'; 300 (folded into a summary at 256) were
    refused with SpecError 'already reduced here', as were 2 split by end_update() or kept by a refused commit:
    finite summaries fit any policy (a summary holding a NaN still cannot be checked or dropped)."""
    driver = MetricBus(dist=None)
    driver.log("a", [2.0] * 300)
    driver.ingest([_declared_error(1.0)])
    assert driver.commit(0) == {"a": (300 * 2.0 + 1.0) / 301}
    driver.log("a", 2.0)
    driver.close()

    driver = MetricBus(dist=None)
    driver.log("b", 0.0)
    driver.commit(0)
    driver.log({"a": 2.0, "b": 1.0})
    with pytest.raises(StepError):
        driver.commit(0)  # 'b' is at step 0 already: refused, its records put back (reduced)
    driver.log("a", 4.0)
    driver.end_update()
    driver.ingest([_declared_error(1.0)])
    assert driver.commit(1) == {"a": (2.0 + 4.0 + 1.0) / 3, "b": 1.0}
    with pytest.raises(MetricValueError, match="non-finite"):
        driver.log("a", math.nan)  # the adopted policy applies from now on
    driver.close()


def test_a_declared_policy_still_refuses_the_drivers_reduced_nan() -> None:
    """A NaN already in a summary: nan='error' is a MetricValueError, nan='ignore' a SpecError (it cannot drop it)."""
    for declared, error in (("error", MetricValueError), ("ignore", SpecError)):
        driver = MetricBus(dist=None)
        driver.log("a", [math.nan] + [2.0] * 299)
        worker = MetricBus(dist=None)
        worker.log("a", 1.0, agg=Agg("mean", nan=declared))  # type: ignore[arg-type]
        part = worker.export()
        worker.close()
        with pytest.raises(error):
            driver.ingest([part])
        assert math.isnan(driver.commit(0)["a"])
        driver.close()


def _rank_journal(path: Path, segments: Sequence[Iterable[int]], *, log_every: int) -> None:
    """Three rank files of commits of 10 tokens, one writer per item of ``segments`` (its steps; more than one: a
    resume from a checkpoint), as torch.distributed ranks write them."""
    run = RunInfo(id="review-ranks")
    for rank in range(3):
        for steps in segments:
            writer = open_journal(path=path, fsync="never", rank=rank, run=run, rules=[], log_every=log_every)
            for step in steps:
                bus = MetricBus(dist=None, rules={"tokens": "sum"})
                bus.log("tokens", 10.0)
                writer.append(step=step, entries=[(rank, bus.export())])
                bus.close()
            writer.close()


def _window_journal(path: Path, steps: list[int]) -> None:
    """Three rank files of log_every=3 commits of 10 tokens at ``steps``."""
    _rank_journal(path, [steps], log_every=3)


def flip_frame(path: Path, kind: bytes | tuple[bytes, ...], *, step: int | None = None, nth: int = 0) -> None:
    """Flip a byte in the middle of the ``nth`` frame of ``kind`` (one frame type, or several: ``(b"P", b"S",
    b"R")``, any commit; a commit: the one of ``step``) of ``path``. Also used by tests/test_journal_lost.py."""
    kinds = (kind,) if isinstance(kind, bytes) else kind
    data = bytearray(path.read_bytes())
    pos, seen = 8, 0  # after the magic
    while pos < len(data):
        (length,) = struct.unpack_from("<I", data, pos)
        if data[pos + 8 : pos + 9] in kinds and (step is None or struct.unpack_from("<q", data, pos + 9)[0] == step):
            if seen == nth:
                data[pos + 8 + length // 2] ^= 0xFF
                path.write_bytes(bytes(data))
                return
            seen += 1
        pos += 8 + length
    raise AssertionError(f"no frame {nth} of {kinds!r} (step {step}) in {path}")


def _read_damaged(path: Path) -> tuple[list[Gap], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", JournalWarning)
        journal = read_journal(path)
    return journal.holes, [str(w.message) for w in caught if "lost its commits" in str(w.message)]


def test_a_log_every_window_names_the_steps_damage_took_and_only_those(tmp_path: Path) -> None:
    """log_every=3, steps 0, 10, ..., 80 on three ranks: a flipped byte in rank 1's "W" frame (nothing lost, the
    replay the same) was reported as 'lost its commits at steps 21..29'; its commit at step 20 lost was reported as
    steps 11..19 (not 20), and its commit at step 4 of steps 0..8 not at all. The "W" frame lists the
    window's steps: those it lost are now named exactly, and a damaged "W" frame alone names none."""
    steps = list(range(0, 90, 10))
    _window_journal(tmp_path / "w", steps)
    flip_frame(sorted((tmp_path / "w").glob("*.mbj"))[1], b"W")
    assert _read_damaged(tmp_path / "w") == ([], [])
    _window_journal(tmp_path / "c", steps)
    flip_frame(sorted((tmp_path / "c").glob("*.mbj"))[1], b"P", step=20)
    holes, messages = _read_damaged(tmp_path / "c")
    assert holes == [Gap(1, 20, 20)]
    assert len(messages) == 1
    assert "lost its commits at step 20 to damaged bytes" in messages[0]
    _window_journal(tmp_path / "e", list(range(9)))
    flip_frame(sorted((tmp_path / "e").glob("*.mbj"))[1], b"P", step=4)
    assert _read_damaged(tmp_path / "e")[0] == [Gap(1, 4, 4)]


def _resumed_journal(path: Path, segments: list[range]) -> None:
    """Three rank files, each written by one writer per range of ``segments`` (a resume from a checkpoint)."""
    _rank_journal(path, segments, log_every=1)


def test_damage_in_steps_a_resume_replaced_is_not_a_loss(tmp_path: Path) -> None:
    """Steps 0..7, then a resume from step 4 (4..8), on three ranks: a flipped byte in rank 1's abandoned commit at
    step 5 was warned 'rank 1's file lost its commits at step 5' (Journal.holes [Gap(1, 5, 5)]), though the resumed
    timeline replaced it and the replay is the intact one. Steps a later commit of the file drops are not holes."""
    _resumed_journal(tmp_path / "intact", [range(8), range(4, 9)])
    intact = list(emitted(read_journal(tmp_path / "intact")))
    _resumed_journal(tmp_path / "j", [range(8), range(4, 9)])
    flip_frame(sorted((tmp_path / "j").glob("*.mbj"))[1], b"P", step=5)  # the first writer's
    assert _read_damaged(tmp_path / "j") == ([], [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JournalWarning)  # the damaged record's own warning
        assert list(emitted(read_journal(tmp_path / "j"))) == intact
    flip_frame(sorted((tmp_path / "j").glob("*.mbj"))[1], b"P", step=5, nth=1)  # the resumed writer's: lost
    assert _read_damaged(tmp_path / "j")[0] == [Gap(1, 5, 5)]


def test_a_files_first_commit_lost_to_damage_is_named(tmp_path: Path) -> None:
    """Steps 0..5 on three ranks: rank 1's commit at step 0 lost to a flipped byte replayed step 0 with 20 tokens
    where live had 30, with no step named (nothing was read before the damage); the file's "K" frame says where its
    first writer's commits start, so step 0 is named."""
    _resumed_journal(tmp_path, [range(6)])
    flip_frame(sorted(tmp_path.glob("*.mbj"))[1], b"P", step=0)
    holes, messages = _read_damaged(tmp_path)
    assert holes == [Gap(1, 0, 0)]
    assert len(messages) == 1
