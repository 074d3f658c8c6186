"""Resume on a journal: one run id, one timeline (segments), rewinds and catch-up; several commits at one step."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from metricbus import MetricBus
from metricbus.adapter import RunInfo, Status
from metricbus.errors import ConfigError, JournalError, StepError
from metricbus.journal import CursorStore, read_journal
from metricbus.replay import emitted, sync


class Backend:
    """What a backend keeps between processes: rows by step, rewinds seen, its runs."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.rewinds: list[int] = []
        self.runs: list[str] = []


class Rec:
    """An adapter over a Backend with the optional verbs: resume (drops unacknowledged rows), rewind, identity."""

    name = "rec"
    cursor_key = "rec"

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.identity: dict[str, str] | None = None
        self.given: dict[str, str] | None = None

    def resume(self, *, after_step: int | None, identity: Mapping[str, str] | None = None) -> None:
        self.given = None if identity is None else dict(identity)
        self.backend.rows = [r for r in self.backend.rows if after_step is not None and r[0] <= after_step]

    def rewind(self, *, step: int) -> None:
        self.backend.rewinds.append(step)
        self.backend.rows = [r for r in self.backend.rows if r[0] < step]

    def open(self, *, run: RunInfo) -> None:
        self.backend.runs.append(run.id)
        self.identity = {"run_id": run.id}

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        self.backend.rows.append((step, dict(metrics)))

    def flush(self) -> None:
        pass

    def close(self, *, status: Status) -> None:
        pass


def _run(journal: Path, backend: Backend, steps: range, *, scale: float, **options: Any) -> dict[int, dict[str, float]]:
    out = {}
    with MetricBus(dist=None, journal=str(journal), adapters=[Rec(backend)], **options) as bus:
        for step in steps:
            bus.log("loss", scale * step)
            bus.log("loss", scale * step + 1.0)
            out[step] = bus.commit(step)
    return out


def _reference(segments: list[tuple[range, float]], *, log_every: int) -> list[tuple[int, dict[str, float]]]:
    """The timeline computed by fresh buses without a journal, one per segment (each closed at its end)."""
    rows: list[tuple[int, dict[str, float]]] = []
    for steps, scale in segments:
        backend = Backend()
        with MetricBus(dist=None, adapters=[Rec(backend)], log_every=log_every) as bus:
            for step in steps:
                bus.log("loss", scale * step)
                bus.log("loss", scale * step + 1.0)
                bus.commit(step)
        rows += backend.rows
    return rows


@pytest.mark.parametrize("log_every", [1, 3])
def test_resume_below_the_last_step_is_one_timeline(tmp_path: Path, log_every: int) -> None:
    """Run 1 commits 0..99; run 2 resumes at 50 with other values: steps < 50 from run 1, >= 50 from run 2, in
    the backend (rewound once), in replay and in sync to a new backend; no window mixes the two runs."""
    journal, backend = tmp_path / "j", Backend()
    _run(journal, backend, range(100), scale=1.0, log_every=log_every)
    _run(journal, backend, range(50, 80), scale=10.0, log_every=log_every, resume=True)
    expected = _reference([(range(50), 1.0), (range(50, 80), 10.0)], log_every=log_every)
    assert backend.rows == expected
    assert len(backend.rewinds) == 1
    assert backend.rewinds[0] == (50 if log_every == 1 else 49)  # 48, 49 were an open window, emitted now at 49
    assert len(set(backend.runs)) == 1
    replayed = read_journal(journal)
    assert list(emitted(replayed)) == expected
    assert replayed.run.id == backend.runs[0]
    fresh = Backend()
    sync(replayed, [_Fresh(fresh)])
    assert fresh.rows == expected


class _Fresh(Rec):
    name = "fresh"
    cursor_key = "fresh"


def test_resume_continues_after_a_crash_with_the_missed_steps_first(tmp_path: Path) -> None:
    """A run whose backend acknowledged only part of its steps (its cursor lags): the resumed bus first sends the
    steps the backend missed, then its own; each step once, in order."""
    journal, backend = tmp_path / "j", Backend()
    _run(journal, backend, range(10), scale=1.0)
    CursorStore(journal).rewind(Rec(backend), 5)  # as if the process died before steps 6..9 were acknowledged
    backend.rows = backend.rows[:8]  # and the backend held 0..7
    _run(journal, backend, range(10, 15), scale=1.0, resume=True)
    assert [s for s, _ in backend.rows] == list(range(15))
    assert backend.rows == _reference([(range(15), 1.0)], log_every=1)
    assert backend.rewinds == []


def test_resume_keeps_the_run_and_hands_adapters_their_identity(tmp_path: Path) -> None:
    """The resumed bus has the journal's run id (a run= given keeps its name, not its id); adapters get the
    identity their cursor record kept; commit() without a step continues after the last one."""
    journal, backend = tmp_path / "j", Backend()
    with MetricBus(dist=None, journal=str(journal), adapters=[Rec(backend)], run={"name": "a"}) as bus:
        bus.log("x", 1.0)
        bus.commit(7)
        first = bus.run
    adapter = Rec(backend)
    with MetricBus(dist=None, journal=str(journal), adapters=[adapter], run={"name": "b"}, resume=True) as bus:
        assert (bus.run.id, bus.run.name, bus.run.start_time_unix_ns) == (first.id, "b", first.start_time_unix_ns)
        assert adapter.given == {"run_id": first.id}
        bus.log("x", 2.0)
        assert bus.commit() == {"x": 2.0}
        assert bus.last_step == 8


def test_resume_needs_a_journal_and_a_journal_needs_resume(tmp_path: Path) -> None:
    """resume=True without a journal is a ConfigError; a journal that holds commits without resume=True is a
    JournalError naming the run; resume=True on an empty or missing journal starts a fresh run."""
    with pytest.raises(ConfigError, match="resume: needs a journal"):
        MetricBus(dist=None, resume=True)
    with MetricBus(dist=None, journal=str(tmp_path / "j"), resume=True) as bus:
        bus.log("x", 1.0)
        bus.commit()
        run_id = bus.run.id
    with pytest.raises(JournalError, match=f"already holds run '{run_id}' .steps 0..0.; pass resume=True"):
        MetricBus(dist=None, journal=str(tmp_path / "j"))


# -- several commits at one step ---------------------------------------------------------------------------------


def test_train_then_eval_at_one_step(tmp_path: Path) -> None:
    """Two commits at one step with different names: both emitted, adapters see non-decreasing steps, the journal
    keeps both and replays both; the same name again at that step is a StepError that loses nothing."""
    backend = Backend()
    with MetricBus(dist=None, journal=str(tmp_path / "j"), adapters=[Rec(backend)]) as bus:
        bus.log("train/loss", 1.0)
        assert bus.commit(5) == {"train/loss": 1.0}
        bus.log("eval/loss", 2.0)
        assert bus.commit(5) == {"eval/loss": 2.0}
        bus.log("eval/loss", 3.0)
        bus.log("eval/acc", 0.5)
        with pytest.raises(StepError, match=r"step 5: 'eval/loss' already committed at this step"):
            bus.commit(5)
        assert bus.commit(6) == {"eval/loss": 3.0, "eval/acc": 0.5}  # kept for the next step
        with pytest.raises(StepError, match="less than the last step 6"):
            bus.commit(4)
    rows = [(5, {"train/loss": 1.0}), (5, {"eval/loss": 2.0}), (6, {"eval/loss": 3.0, "eval/acc": 0.5})]
    assert backend.rows == rows
    assert list(emitted(read_journal(tmp_path / "j"))) == rows


def test_a_second_part_at_an_acknowledged_step_moves_the_cursor_back(tmp_path: Path) -> None:
    """The cursor covers whole steps: once step 5's first part is acknowledged, a second part at step 5 moves it
    back to 4 until that part is acknowledged too."""
    backend = Backend()
    adapter = Rec(backend)
    store = CursorStore(tmp_path / "j")
    with MetricBus(dist=None, journal=str(tmp_path / "j"), adapters=[adapter]) as bus:
        bus.log("train/loss", 1.0)
        bus.commit(5)
        assert bus.flush()
        assert store.get(adapter) == 5
        cursors: list[int | None] = []
        original = adapter.write

        def write(*, step: int, metrics: Mapping[str, float]) -> None:
            cursors.append(store.get(adapter))
            original(step=step, metrics=metrics)

        adapter.write = write  # type: ignore[method-assign]
        bus.log("eval/loss", 2.0)
        bus.commit(5)
        assert bus.flush()
        assert cursors == [4]
        assert store.get(adapter) == 5
