"""Review of the adapters and re-delivery into them (third pass): sync next to a live bus, the console adapter
without a reader, ..."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Mapping
from pathlib import Path

import pytest
from metricbus.adapters.jsonl import JsonlAdapter, read_jsonl

from metricbus import MetricBus
from metricbus.adapter import RunInfo
from metricbus.errors import JournalError
from metricbus.replay import sync

REPO = Path(__file__).resolve().parent.parent

LIVE_TRAINER = """
import sys
from metricbus import MetricBus, RunInfo
journal, path = sys.argv[1], sys.argv[2]
with MetricBus(adapters=[f"jsonl:{path}"], journal=journal, run=RunInfo(id="live-run")) as bus:
    for step in range(5):
        bus.log("loss", step / 7)
        bus.commit(step=step)
    assert bus.flush(timeout_s=30)
    print("ready", flush=True)
    sys.stdin.readline()  # the test syncs meanwhile
    for step in range(5, 10):
        bus.log("loss", step / 7)
        bus.commit(step=step)
"""


def _python(code: str, *args: str, **kwargs: object) -> subprocess.Popen[str]:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-c", textwrap.dedent(code), *args]
    return subprocess.Popen(command, env=env, text=True, **kwargs)  # type: ignore[call-overload]


def test_sync_refuses_a_journal_a_bus_still_writes(tmp_path: Path) -> None:
    """`metricbus sync` while the trainer runs is refused (naming it) and cuts nothing: every step lands once."""
    journal, path = tmp_path / "journal", tmp_path / "m.jsonl"
    trainer = _python(LIVE_TRAINER, str(journal), str(path), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert trainer.stdin is not None
    assert trainer.stdout is not None
    try:
        assert trainer.stdout.readline() == "ready\n"
        with pytest.raises(JournalError, match=rf"still being written by a bus \(PID {trainer.pid} "):
            sync(journal, [JsonlAdapter(path=path)])
        cli = subprocess.run([sys.executable, "-m", "metricbus", "sync", str(journal)], capture_output=True,
                             text=True, env={"PYTHONPATH": str(REPO), "METRICBUS_ADAPTERS": f"jsonl:{path}"},
                             check=False)
        assert cli.returncode == 2, cli.stderr
        assert "still being written" in cli.stderr
        trainer.stdin.write("go\n")
        trainer.stdin.close()
        assert trainer.wait(timeout=60) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert sync(journal, [JsonlAdapter(path=path)]) == {"jsonl": 0}
    assert [(step, metrics["loss"]) for step, metrics in read_jsonl(path)] == [(s, s / 7) for s in range(10)]


class _Gate(JsonlAdapter):
    """A jsonl adapter whose first write waits until the test opened the gate."""

    def __init__(self, *, path: Path) -> None:
        super().__init__(path=path)
        self.writing, self.gate = threading.Event(), threading.Event()

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        self.writing.set()
        assert self.gate.wait(30)
        super().write(step=step, metrics=metrics)


def test_a_bus_resuming_the_journal_during_a_sync_is_refused(tmp_path: Path) -> None:
    """While sync runs, a trainer resuming the journal is a JournalError naming the sync; sync then sends every step."""
    journal, path = tmp_path / "journal", tmp_path / "m.jsonl"
    with MetricBus(journal=str(journal), run=RunInfo(id="r")) as bus:
        for step in range(6):
            bus.log("loss", step / 3)
            bus.commit(step=step)
    gate = _Gate(path=path)
    result: list[object] = []
    syncing = threading.Thread(target=lambda: result.append(sync(journal, [gate])))
    syncing.start()
    try:
        assert gate.writing.wait(30)
        with pytest.raises(JournalError, match=r"metricbus sync"):
            MetricBus(journal=str(journal), resume=True)
    finally:
        gate.gate.set()
        syncing.join(60)
    assert result == [{"jsonl": 6}]
    assert [(step, metrics["loss"]) for step, metrics in read_jsonl(path)] == [(s, s / 3) for s in range(6)]
