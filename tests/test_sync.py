"""Delivery cursors and ``metricbus sync``: after an outage nothing is lost and nothing is sent twice."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from metricbus.adapters.jsonl import JsonlAdapter, read_jsonl

from metricbus import MetricBus
from metricbus.adapter import RunInfo, Status
from metricbus.cli import main
from metricbus.journal import CursorStore, JournalWriter, adapter_key
from metricbus.replay import SyncInterrupted, sync
from metricbus.testing import MemoryAdapter
from tests.journal_workers import RULES, log_step

STEPS = 30
OUTAGE_FROM = 10


class DownAdapter(JsonlAdapter):
    """A jsonl backend that is down from step OUTAGE_FROM on (until the end of the live run).

    An acknowledged write is flushed (durable), and ``closed`` is set when the abandoned thread finally closes it.
    """

    def __init__(self, *, path: str | Path) -> None:
        super().__init__(path=path)
        self.closed = threading.Event()

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Raise for steps in the outage."""
        if step >= OUTAGE_FROM:
            raise ConnectionError(f"backend down at step {step}")
        super().write(step=step, metrics=metrics)
        self.flush()

    def close(self, *, status: Status) -> None:
        """Close and tell the test."""
        super().close(status=status)
        self.closed.set()


def steps_and_values(path: Path) -> list[tuple[int, dict[str, float]]]:
    """The jsonl content without the write times."""
    return read_jsonl(path)


@pytest.fixture
def outage_run(tmp_path: Path) -> Path:
    """A journaled run with a good jsonl adapter and one that is down from step OUTAGE_FROM to the end."""
    journal = tmp_path / "journal"
    down = DownAdapter(path=tmp_path / "down.jsonl")
    bus = MetricBus(dist=None, rules=RULES, journal=str(journal),
                    adapters=[JsonlAdapter(path=tmp_path / "good.jsonl"), down])
    for step in range(STEPS):
        log_step(bus, step, 0)
        bus.commit(step)
    bus.close(timeout_s=1.0)  # the down adapter is still retrying: abandoned
    assert down.closed.wait(10)  # its thread wakes from the retry wait, then closes it
    config = tmp_path / "metricbus.json"
    uris = [f"jsonl:{tmp_path / 'good.jsonl'}", f"jsonl:{tmp_path / 'down.jsonl'}"]
    config.write_text(json.dumps({"adapters": uris}))
    return tmp_path


def test_cursors_follow_acknowledged_steps(outage_run: Path) -> None:
    """The live cursors are the last step each backend acknowledged."""
    store = CursorStore(outage_run / "journal")
    assert store.get(JsonlAdapter(path=outage_run / "good.jsonl")) == STEPS - 1
    assert store.get(JsonlAdapter(path=outage_run / "down.jsonl")) == OUTAGE_FROM - 1


def test_two_adapters_of_one_type_have_distinct_cursor_keys(tmp_path: Path) -> None:
    """Keys include the adapter's options, so two jsonl files do not share a cursor."""
    a, b = JsonlAdapter(path=tmp_path / "a.jsonl"), JsonlAdapter(path=tmp_path / "b.jsonl")
    assert adapter_key(a) != adapter_key(b)
    assert adapter_key(a) == adapter_key(JsonlAdapter(path=str(tmp_path / "a.jsonl")))


def test_sync_after_an_outage_completes_the_backend_and_a_second_sync_sends_nothing(
    outage_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """sync sends the down backend exactly its missing steps; then both files are equal; a second sync sends 0."""
    good, down = outage_run / "good.jsonl", outage_run / "down.jsonl"
    assert len(steps_and_values(down)) == OUTAGE_FROM
    argv = ["sync", str(outage_run / "journal"), "--config", str(outage_run / "metricbus.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"sent {STEPS - OUTAGE_FROM} steps" in out
    assert steps_and_values(down) == steps_and_values(good)
    assert len(steps_and_values(good)) == STEPS
    assert main(argv) == 0
    assert "sent 0 steps" in capsys.readouterr().out
    assert steps_and_values(down) == steps_and_values(good)


def test_a_failure_during_sync_keeps_the_cursor_for_the_next_sync(outage_run: Path) -> None:
    """A backend still down during sync keeps its cursor; a later sync resumes from it without duplicates."""
    down = outage_run / "down.jsonl"
    with pytest.raises(ConnectionError):
        sync(outage_run / "journal", [DownAdapter(path=down)])
    assert CursorStore(outage_run / "journal").get(JsonlAdapter(path=down)) == OUTAGE_FROM - 1
    assert sync(outage_run / "journal", [JsonlAdapter(path=down)]) == {"jsonl": STEPS - OUTAGE_FROM}
    assert [s for s, _ in steps_and_values(down)] == list(range(STEPS))


class LedgerAdapter(JsonlAdapter):
    """A jsonl backend that checks, at every call, that its cursor is never ahead of what it flushed.

    Its constructor takes only ``path``, so it shares the plain jsonl adapter's cursor.
    """

    def __init__(self, *, path: str | Path) -> None:
        super().__init__(path=path)
        self.journal = Path(path).parent / "journal"  # the outage_run layout
        self.interrupt_at: int | None = None
        self.calls: list[str] = []
        self.flushed: int | None = None
        self.written: int | None = None

    def _check(self) -> None:
        cursor = CursorStore(self.journal).get(self)
        assert cursor is None or (self.flushed is not None and cursor <= self.flushed)

    def resume(self, *, after_step: int | None) -> None:
        """Record the call; what the cursor says is durable already."""
        self.calls.append(f"resume {after_step}")
        super().resume(after_step=after_step)
        self.flushed = self.written = after_step  # durable from an earlier run

    def open(self, *, run: RunInfo) -> None:
        """Record the call."""
        self.calls.append("open")
        super().open(run=run)

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Write, unless this is the step to interrupt at."""
        self._check()
        if step == self.interrupt_at:
            raise KeyboardInterrupt
        super().write(step=step, metrics=metrics)
        self.written = step

    def flush(self) -> None:
        """Flush and remember the last durable step."""
        self._check()
        super().flush()
        self.flushed = self.written


def test_sync_acknowledges_a_step_only_after_flush(outage_run: Path) -> None:
    """sync resumes then opens the adapter, and its cursor never passes the last flushed step (flush every 4)."""
    down = outage_run / "down.jsonl"
    ledger = LedgerAdapter(path=down)
    assert sync(outage_run / "journal", [ledger], flush_every=4) == {"jsonl": STEPS - OUTAGE_FROM}
    assert ledger.calls == [f"resume {OUTAGE_FROM - 1}", "open"]
    assert ledger.flushed == STEPS - 1
    assert CursorStore(outage_run / "journal").get(ledger) == STEPS - 1
    assert [s for s, _ in steps_and_values(down)] == list(range(STEPS))


def test_sync_cuts_unacknowledged_lines_before_sending(outage_run: Path) -> None:
    """Lines written after the cursor (a crash before they were acknowledged) are replaced, not duplicated."""
    down = outage_run / "down.jsonl"
    good = steps_and_values(outage_run / "good.jsonl")
    extra = JsonlAdapter(path=down)
    extra.open(run=RunInfo())
    for step, metrics in good[OUTAGE_FROM : OUTAGE_FROM + 5]:
        extra.write(step=step, metrics=metrics)
    extra.close(status="failed")
    assert sync(outage_run / "journal", [JsonlAdapter(path=down)]) == {"jsonl": STEPS - OUTAGE_FROM}
    assert steps_and_values(down) == good


def test_a_failed_flush_acknowledges_nothing(outage_run: Path) -> None:
    """When flush() raises, the cursor stays where it was and the error reaches the caller."""
    down = outage_run / "down.jsonl"

    class NoFlush(JsonlAdapter):
        def flush(self) -> None:
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        sync(outage_run / "journal", [NoFlush(path=down)])
    assert CursorStore(outage_run / "journal").get(JsonlAdapter(path=down)) == OUTAGE_FROM - 1
    assert sync(outage_run / "journal", [JsonlAdapter(path=down)]) == {"jsonl": STEPS - OUTAGE_FROM}
    assert [s for s, _ in steps_and_values(down)] == list(range(STEPS))


def test_an_interrupted_sync_acknowledges_what_it_wrote(outage_run: Path) -> None:
    """KeyboardInterrupt in the middle: written steps are flushed and acknowledged; SyncInterrupted says how many."""
    down = outage_run / "down.jsonl"
    ledger = LedgerAdapter(path=down)
    ledger.interrupt_at = OUTAGE_FROM + 7
    with pytest.raises(SyncInterrupted) as stopped:
        sync(outage_run / "journal", [ledger])
    assert stopped.value.sent == {"jsonl": 7}
    assert isinstance(stopped.value, KeyboardInterrupt)
    assert CursorStore(outage_run / "journal").get(ledger) == OUTAGE_FROM + 6
    assert [s for s, _ in steps_and_values(down)] == list(range(OUTAGE_FROM + 7))


def test_a_set_stop_event_ends_sync_after_the_current_step(outage_run: Path) -> None:
    """sync(stop=event) with the event set sends nothing more and raises SyncInterrupted."""
    stop = threading.Event()
    stop.set()
    with pytest.raises(SyncInterrupted) as stopped:
        sync(outage_run / "journal", [JsonlAdapter(path=outage_run / "down.jsonl")], stop=stop)
    assert stopped.value.sent == {"jsonl": 0}
    assert len(steps_and_values(outage_run / "down.jsonl")) == OUTAGE_FROM


def test_a_sync_stopped_between_two_commits_of_a_step_sends_the_whole_step_again(tmp_path: Path) -> None:
    """A cursor covers whole steps: stopped after the first of a step's two commits (training, then evaluation),
    the step is not acknowledged, and the next sync sends both commits, each once (review finding: the cursor
    reached that step and the evaluation commit was never delivered)."""
    journal, out = tmp_path / "journal", tmp_path / "out.jsonl"
    bus = MetricBus(dist=None, journal=str(journal))
    for step in range(4):
        bus.log("loss", float(step))
        bus.commit(step)
        if step == 2:
            bus.log("eval/acc", 0.5)
            bus.commit(step)
    bus.close()
    stop = threading.Event()

    def progress(done: int, total: int, sent: int) -> None:
        if sent == 3:  # steps 0, 1 and step 2's first commit written
            stop.set()

    with pytest.raises(SyncInterrupted):
        sync(journal, [JsonlAdapter(path=out)], progress=progress, flush_every=1, stop=stop)
    assert CursorStore(journal).get(JsonlAdapter(path=out)) == 1
    assert sync(journal, [JsonlAdapter(path=out)]) == {"jsonl": 3}
    assert sync(journal, [JsonlAdapter(path=out)]) == {"jsonl": 0}
    assert read_jsonl(out) == [
        (0, {"loss": 0.0}), (1, {"loss": 1.0}), (2, {"loss": 2.0}), (2, {"eval/acc": 0.5}), (3, {"loss": 3.0})
    ]


class _Keyed(MemoryAdapter):
    cursor_key = "memory-keyed"


def test_a_second_commit_at_an_acknowledged_step_moves_the_cursor_back_before_it_is_journaled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live bus rewinds each adapter's cursor below a step inside commit(), before journaling a second commit
    at it, and holds it there until that commit's emission was written: a crash right after commit() (the copy of
    the journal taken then) leaves a cursor the next sync sends the whole step from (second review: the cursor
    still covered the step until the delivery thread picked the commit up, and sync never sent it)."""
    journal = tmp_path / "journal"
    live = _Keyed()
    bus = MetricBus(dist=None, journal=str(journal), adapters=[live], fsync="commit")
    for step in range(3):
        bus.log("loss", float(step))
        bus.commit(step)
    assert bus.flush()
    assert CursorStore(journal).get(live) == 2
    crashed = tmp_path / "crashed"
    append = JournalWriter.append

    def append_then_crash(self: JournalWriter, *, step: int, entries: Any) -> None:
        append(self, step=step, entries=entries)
        shutil.copytree(journal, crashed)  # the files as a SIGKILL right after the journal write leaves them

    monkeypatch.setattr(JournalWriter, "append", append_then_crash)
    bus.log("eval/acc", 0.5)
    bus.commit(2)
    monkeypatch.undo()
    assert CursorStore(crashed).get(live) == 1
    bus.close()
    assert CursorStore(journal).get(live) == 2  # delivered whole: acknowledged again
    again = _Keyed()
    assert sync(crashed, [again]) == {"memory": 2}
    assert again.rows == [(2, {"loss": 2.0}), (2, {"eval/acc": 0.5})]
