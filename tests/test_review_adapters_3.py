"""Review of the adapters and re-delivery into them (third pass): sync next to a live bus, the console adapter
without a reader, ..."""

from __future__ import annotations

import errno
import io
import logging
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from backend_env import read_wandb_history
from metricbus.adapters.console import ConsoleAdapter
from metricbus.adapters.jsonl import JsonlAdapter, read_jsonl

from metricbus import MetricBus
from metricbus.adapter import RunInfo
from metricbus.errors import AdapterError, JournalError, MetricValueError
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


PIPED_TRAINER = """
import sys
from metricbus import MetricBus
with MetricBus(adapters=["console"], strict=True) as bus:
    bus.log("loss", 0.5)
    bus.commit(step=0)
    assert bus.flush(timeout_s=30)
    sys.stdin.readline()  # the test closes the pipe's reading end meanwhile (`| head -2`)
    for step in range(1, 20):
        bus.log("loss", step / 7)
        bus.commit(step=step)
    assert bus.flush(timeout_s=30)
print("closed", file=sys.stderr)
"""


def test_console_piped_into_a_reader_that_left_neither_stalls_nor_fails() -> None:
    """`python train.py | head -2`: the console stops printing after one warning; close neither waits nor fails."""
    from test_console_pipe import run_piped

    code, err = run_piped(PIPED_TRAINER)
    assert code == 0, err
    assert err.count("no one reads <stdout> any more (BrokenPipeError") == 1, err
    assert "retrying" not in err
    assert "did not drain" not in err
    assert err.endswith("closed\n")


def test_console_with_a_closed_stream_warns_once_and_prints_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """A closed stream: one warning naming it, no error per step, the bus closes cleanly (strict)."""
    stream = io.StringIO()
    stream.close()
    with caplog.at_level(logging.WARNING), MetricBus(adapters=[ConsoleAdapter(stream=stream)], strict=True) as bus:
        for step in range(5):
            bus.log("loss", float(step))
            bus.commit(step=step)
    warned = [r.getMessage() for r in caplog.records if r.name == "metricbus.adapters.console"]
    assert len(warned) == 1
    assert "I/O operation on closed file" in warned[0]
    assert not [r for r in caplog.records if r.name == "metricbus.delivery"]


def test_console_prints_to_a_new_stdout_after_the_old_one_closed(capsys: pytest.CaptureFixture[str]) -> None:
    """Only the stream whose reader left is given up: a stdout put in its place later gets the lines."""
    adapter = ConsoleAdapter()
    gone = io.StringIO()
    gone.close()
    old = sys.stdout
    sys.stdout = gone
    try:
        adapter.write(step=1, metrics={"x": 1.0})
    finally:
        sys.stdout = old
    adapter.write(step=2, metrics={"x": 2.0})
    assert capsys.readouterr().out.startswith("step      2 | x 2")


def test_console_still_raises_other_stream_errors() -> None:
    """An error that does not say the reader left (a full disk) still reaches delivery, which retries it."""

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        ConsoleAdapter(stream=Full()).write(step=0, metrics={"x": 1.0})


TB_FULL_DISK_CHILD = """
import os, resource, signal, sys, time
from pathlib import Path
from metricbus.adapter import RunInfo
from metricbus.adapters.tensorboard import TensorBoardAdapter
from metricbus.delivery import Delivery
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past RLIMIT_FSIZE fails with EFBIG, as on a full disk
folder = sys.argv[1]
delivery = Delivery([TensorBoardAdapter(log_dir=folder)], strict=False, retry_base_s=0.01, retry_cap_s=0.02)
delivery.open(run=RunInfo())
delivery.submit(step=0, metrics={"x": 1.0})
assert delivery.flush(timeout_s=30)
(events,) = Path(folder).glob("*tfevents*")
resource.setrlimit(resource.RLIMIT_FSIZE, (events.stat().st_size + 30, resource.RLIM_INFINITY))
wide = {"x": 2.0, **{f"m{i}": i / 3 for i in range(400)}}  # past the 8 KiB a buffered file keeps
delivery.submit(step=1, metrics=wide)  # its event does not fit: retried while the disk is full
deadline = time.monotonic() + 30
while delivery.failures.get("tensorboard", 0) < 3 and time.monotonic() < deadline:
    time.sleep(0.01)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
delivery.submit(step=2, metrics={"x": 4.0})
assert delivery.flush(timeout_s=30)
delivery.close(status="finished", timeout_s=30)
print(delivery.failures.get("tensorboard", 0))
"""


def test_tensorboard_keeps_every_later_step_readable_after_the_disk_was_full(tmp_path: Path) -> None:
    """A write torn by a full disk and retried leaves whole records: readers see every step once, not none after it."""
    from tb_reader import legacy_accumulator, multiplexer_accumulator, tensor_points

    folder = tmp_path / "tb"
    done = _python(TB_FULL_DISK_CHILD, str(folder), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    assert int(out.split()[-1]) >= 3  # the event of step 1 failed at least three times
    for acc in (legacy_accumulator(folder), multiplexer_accumulator(folder)):
        assert tensor_points(acc, "x") == [(0, 1.0), (1, 2.0), (2, 4.0)]
        assert tensor_points(acc, "m399") == [(1, 399 / 3)]


@pytest.fixture
def wandb_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """wandb offline and silent, everything under tmp_path; wandb's settings reloaded around the test."""
    import wandb
    from backend_env import isolate_env

    wandb.teardown()
    root = isolate_env(monkeypatch, tmp_path)
    yield root
    wandb.teardown()


def test_wandb_resume_reads_a_long_runs_earlier_folder_in_bounded_memory(wandb_env: Path) -> None:
    """Resuming near the end of a long run decodes only the rows after the cursor, streaming the earlier .wandb file:
    the open's peak allocation stays far below the file's size (it read the whole file and decoded every row)."""
    from metricbus.adapters.wandb import WandbAdapter

    run = RunInfo(id="long-run")
    first = WandbAdapter(mode="offline")
    first.open(run=run)
    for step in range(2000):
        first.write(step=step, metrics={f"a_rather_long_metric_name_to_make_rows_wide/{i}": step + i / 7
                                        for i in range(100)})
    first.close(status="finished")
    assert first.identity is not None
    size = sum(path.stat().st_size for path in wandb_env.rglob("*.wandb"))
    fresh = WandbAdapter(mode="offline")
    tracemalloc.start()
    fresh.open(run=RunInfo(id="another-run"))
    base = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    fresh.close(status="finished")
    resumed = WandbAdapter(mode="offline")
    resumed.resume(after_step=1997, identity=first.identity)
    tracemalloc.start()
    resumed.open(run=run)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    try:
        assert peak - base < size / 2, (peak, base, size)
        resumed.write(step=1998, metrics={"a_rather_long_metric_name_to_make_rows_wide/3": 1998 + 3 / 7})  # held
        resumed.write(step=1999, metrics={"a_rather_long_metric_name_to_make_rows_wide/3": -1.0})  # differs
    finally:
        resumed.close(status="finished")
    rows = read_wandb_history(Path(resumed.identity["dir"]))  # type: ignore[index]
    assert [(row["_step"], row["a_rather_long_metric_name_to_make_rows_wide/3"]) for row in rows] == [(1999, -1.0)]


@pytest.mark.parametrize("adapter", ["jsonl", "tensorboard"])
@pytest.mark.parametrize("field", ["id", "project"])
def test_a_run_id_or_project_that_leaves_runs_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, adapter: str, field: str
) -> None:
    """An absolute or '..' run id / project is an error naming it, never a per-run folder outside runs/."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for value in (str(tmp_path / "outside"), "../../escaped"):
        with pytest.raises(AdapterError, match=rf"run {field} .* cannot name the per-run folder"):
            MetricBus(adapters=[adapter], run=RunInfo(**{field: value}))  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    assert not (work / "runs").exists() or not any((work / "runs").rglob("*.*"))


def test_wandb_refuses_a_metric_named_like_its_own_summary_key(wandb_env: Path) -> None:
    """A metric named _wandb would replace wandb's own summary entry (its runtime): refused, naming it; the step's
    other metrics are logged."""
    from metricbus.adapters.wandb import WandbAdapter

    adapter = WandbAdapter(mode="offline")
    adapter.open(run=RunInfo(id="summary-key"))
    try:
        with pytest.raises(MetricValueError, match=r"metric name '_wandb' maps to wandb name '_wandb', which wandb "
                                                   r"keeps for its own run data in the summary"):
            adapter.write(step=0, metrics={"_wandb": 7.0, "loss": 1.0})
        adapter.write(step=1, metrics={"loss": 2.0})
    finally:
        adapter.close(status="finished")
    rows = read_wandb_history(Path(adapter.identity["dir"]))  # type: ignore[index]
    assert [(row["_step"], row["loss"]) for row in rows] == [(0, 1), (1, 2)]
