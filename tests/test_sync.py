"""Delivery cursors and ``metricbus sync``: after an outage nothing is lost and nothing is sent twice."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path

import pytest
from metricbus.adapters.jsonl import JsonlAdapter, read_jsonl

from metricbus import MetricBus
from metricbus.adapter import Status
from metricbus.cli import main
from metricbus.journal import CursorStore, adapter_key
from metricbus.replay import sync
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
