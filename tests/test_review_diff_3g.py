"""Review of 946bc2a/00ecf5e/a994043 (close through a commit's collectives, options agreed across ranks, sync's
writer lock), with real gloo processes and real journal writers."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.gloo_ranks import run_ranks

torch = pytest.importorskip("torch")


def sigterm_while_waiting(rank: int, size: int, where: str, call: str) -> dict[str, Any]:
    """Rank 0, whose program has a SIGTERM handler of its own, gets SIGTERM while its ``call`` waits in a collective
    for rank 1, which enters it only once the signal was sent."""
    from metricbus import MetricBus

    sent = Path(where) / "sent"
    got: list[int] = []
    if rank == 0:
        signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    bus = MetricBus(dist="torch", journal=str(Path(where) / "journal"))
    bus.log("x", 1.0 + rank)
    bus.commit(step=0)
    bus.log("x", 10.0 + rank)
    if rank == 0:

        def send() -> None:
            time.sleep(0.5)  # (ordering only: rank 0 is then inside the call, which waits for rank 1)
            os.kill(os.getpid(), signal.SIGTERM)
            sent.touch()

        threading.Thread(target=send).start()
    else:
        while not sent.exists():
            time.sleep(0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if call == "commit":
            bus.commit(step=1)
        bus.close()
    return {"warned": [str(w.message) for w in caught], "handled": got, "last": bus.last_step}


@pytest.mark.parametrize("call", ["close", "commit"])
def test_sigterm_while_a_collective_waits_leaves_no_tensor_held(tmp_path: Path, call: str) -> None:
    """SIGTERM deferred inside close()'s (or commit()'s) collective: no 'backend still holds' warning."""
    results = run_ranks(sigterm_while_waiting, 2, str(tmp_path), call)
    assert results[0]["handled"] == [signal.SIGTERM]  # the program's handler ran once the call returned
    for rank in range(2):
        assert results[rank]["warned"] == [], results[rank]
        assert results[rank]["last"] == 1


def build_with_writer(rank: int, size: int, writers: list[int]) -> str:
    """MetricBus(writer_rank=writers[rank]): what the construction raised on this rank."""
    from metricbus import MetricBus

    try:
        MetricBus(dist="torch", writer_rank=writers[rank]).close()
    except Exception as exc:  # (the test compares what each rank saw)
        return f"{type(exc).__name__}: {exc}"
    return "built"


@pytest.mark.parametrize("writers", [[0, 5], [2, 2]])
def test_a_writer_rank_beyond_the_group_raises_on_every_rank(writers: list[int]) -> None:
    """writer_rank beyond the group on some rank: every rank raises DistributedError (none waits for the others)."""
    results = run_ranks(build_with_writer, 2, writers)
    for rank in range(2):
        said = results[rank]
        assert said.startswith("DistributedError: "), said
        if writers[0] != writers[1]:
            assert "MetricBus(writer_rank=...) differs" in said
            assert "5 on rank 1" in said
        else:
            assert "writer_rank=2 is not a rank of the group (size 2)" in said


_TRAINER = """
import sys, time
from metricbus import MetricBus
bus = MetricBus(journal=sys.argv[1])
for step in range(5):
    bus.log("x", float(step))
    bus.commit()
print("ready", flush=True)
time.sleep(300)
"""


def _live_trainer(journal: Path) -> Any:
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER, str(journal)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_sync_is_refused_while_the_trainer_lives_and_read_only_commands_still_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A live trainer: sync is a JournalError naming its PID; show and inspect read the journal all the same."""
    from metricbus.adapters.jsonl import JsonlAdapter

    from metricbus.cli import main
    from metricbus.errors import JournalError
    from metricbus.replay import sync

    proc = _live_trainer(tmp_path / "j")
    try:
        with pytest.raises(JournalError, match=f"PID {proc.pid} "):
            sync(tmp_path / "j", [JsonlAdapter(path=tmp_path / "out.jsonl")])
        for command in ("show", "inspect"):
            assert main([command, str(tmp_path / "j")]) == 0
        assert "steps 0..4" in capsys.readouterr().out
    finally:
        proc.kill()
        proc.wait()


def test_sync_after_the_trainer_was_killed_delivers_and_the_run_resumes_after_it(tmp_path: Path) -> None:
    """SIGKILL releases the trainer's flock: sync sends every step, then releases its own so the run resumes."""
    from metricbus.adapters.jsonl import JsonlAdapter

    from metricbus import MetricBus
    from metricbus.replay import sync

    proc = _live_trainer(tmp_path / "j")
    proc.kill()
    proc.wait()
    assert sync(tmp_path / "j", [JsonlAdapter(path=tmp_path / "out.jsonl")]) == {"jsonl": 5}
    files = sorted(p.name for p in (tmp_path / "j").iterdir())
    assert files in (["cursors", "rank-00000.mbj"], ["cursors", "rank-00000.mbj", "rank-00000.mbj.stage"])  # no lock
    bus = MetricBus(journal=str(tmp_path / "j"), resume=True)
    bus.log("x", 9.0)
    bus.commit()
    bus.close()
    assert bus.last_step == 5
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == ["cursors", "rank-00000.mbj"]  # the stage taken
