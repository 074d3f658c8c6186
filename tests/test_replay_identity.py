"""A replay never writes into the live run, whatever the environment names; inspect counts failed commits apart.

``metricbus replay`` opens a run of its own (``<live id>-replay-<new id>``); ``MLFLOW_RUN_ID``, ``WANDB_RUN_ID``
and ``WANDB_RESUME`` left in the shell (as a trainer's job sets them) are ignored, and an adapter option that names
the live run's file, folder or run is refused before anything is opened. Read back through each backend's reader.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import wandb
from backend_env import isolate_env, read_wandb_history
from metricbus.adapters.jsonl import JsonlAdapter, read_jsonl
from metricbus.adapters.mlflow import MlflowAdapter
from metricbus.adapters.tensorboard import TensorBoardAdapter
from metricbus.adapters.wandb import WandbAdapter
from tb_reader import read_tensors

from metricbus import MetricBus, RunInfo
from metricbus.cli import main
from metricbus.errors import ConfigError, JournalError
from metricbus.journal import read_journal, writer
from metricbus.replay import replay

STEPS = 5
LIVE = RunInfo(project="ident", name="live-a", id="20261203-150237-df2645", config={"lr": 0.5})


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """An isolated HOME/WANDB_DIR in tmp_path, offline, as the working folder; wandb set up afresh (it reads its
    environment once per process), so the WANDB_* variables a test sets take effect."""
    wandb.teardown()
    isolate_env(monkeypatch, tmp_path)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    wandb.teardown()


def _live(env: Path, adapters: list[object]) -> Path:
    """A live run of STEPS steps (loss = step + 0.5) journaled under env/journal, delivered to ``adapters``."""
    with MetricBus(dist=None, adapters=adapters, strict=True, run=LIVE, journal=str(env / "journal")) as bus:
        for step in range(STEPS):
            bus.log("loss", step + 0.5)
            bus.commit(step)
    return env / "journal"


def _wandb_folders(env: Path, run_id: str) -> list[Path]:
    return sorted((env / "wandb").glob(f"offline-run-*-{run_id}"))


def test_mlflow_run_id_in_the_environment_leaves_the_live_run_alone(
    env: Path, sqlite_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With MLFLOW_RUN_ID naming the live MLflow run, replay logs into a new run tagged replay; the live run keeps
    its points once each, its status, name and metricbus.run_id tag."""
    from mlflow.tracking import MlflowClient

    journal = _live(env, [MlflowAdapter(tracking_uri=sqlite_uri)])
    client = MlflowClient(tracking_uri=sqlite_uri)
    experiment = client.get_experiment_by_name("ident")
    assert experiment is not None
    (live,) = client.search_runs([experiment.experiment_id])
    monkeypatch.setenv("MLFLOW_RUN_ID", live.info.run_id)
    assert main(["replay", str(journal), "--to", f"mlflow:{sqlite_uri}"]) == 0
    runs = {r.info.run_id: r for r in client.search_runs([experiment.experiment_id])}
    assert len(runs) == 2
    kept = runs.pop(live.info.run_id)
    assert (kept.info.status, kept.info.run_name, kept.data.tags["metricbus.run_id"]) == ("FINISHED", "live-a", LIVE.id)
    assert "replay" not in kept.data.tags
    assert [(m.step, m.value) for m in client.get_metric_history(live.info.run_id, "loss")] == [
        (s, s + 0.5) for s in range(STEPS)
    ]
    (other,) = runs.values()
    assert other.data.tags["metricbus.run_id"].startswith(f"{LIVE.id}-replay-")
    assert (other.info.status, other.info.run_name, other.data.tags["replay"]) == ("FINISHED", "live-a (replay)",
                                                                                    "true")
    history = sorted((m.step, m.value) for m in client.get_metric_history(other.info.run_id, "loss"))
    assert history == [(s, s + 0.5) for s in range(STEPS)]


def test_mlflow_attach_is_refused_by_a_replay(env: Path, sqlite_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """mlflow attach=True would log into the run MLFLOW_RUN_ID names (the live one): a replay refuses it, naming the
    option and the fix, and the live run is left as it was."""
    from mlflow.tracking import MlflowClient

    journal = _live(env, [MlflowAdapter(tracking_uri=sqlite_uri)])
    client = MlflowClient(tracking_uri=sqlite_uri)
    (live,) = client.search_runs([client.get_experiment_by_name("ident").experiment_id])
    monkeypatch.setenv("MLFLOW_RUN_ID", live.info.run_id)
    with pytest.raises(ConfigError, match=r"attach=True .*a replay opens a run of its own.*leave attach out"):
        replay(journal, [MlflowAdapter(tracking_uri=sqlite_uri, attach=True)])
    again = client.get_run(live.info.run_id)
    assert again.info.status == "FINISHED"
    assert again.data.tags["metricbus.run_id"] == LIVE.id
    assert len(client.get_metric_history(live.info.run_id, "loss")) == STEPS


def test_wandb_run_id_in_the_environment_leaves_the_live_run_alone(
    env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With WANDB_RUN_ID naming the live run (and WANDB_RESUME=must), replay writes a wandb run of its own id; no
    folder of the live run id is added, and the live folder's rows are unchanged."""
    journal = _live(env, [WandbAdapter(mode="offline")])
    (live_folder,) = _wandb_folders(env, LIVE.id)
    live_rows = read_wandb_history(live_folder)
    wandb.teardown()  # a new process's wandb, which reads the variables below
    monkeypatch.setenv("WANDB_RUN_ID", LIVE.id)
    monkeypatch.setenv("WANDB_RESUME", "must")
    assert main(["replay", str(journal), "--to", "wandb"]) == 0
    assert _wandb_folders(env, LIVE.id) == [live_folder]
    assert read_wandb_history(live_folder) == live_rows
    (replayed,) = (env / "wandb").glob(f"offline-run-*-{LIVE.id}-replay-*")
    assert [(row["_step"], row["loss"]) for row in read_wandb_history(replayed)] == [
        (s, s + 0.5) for s in range(STEPS)
    ]


def test_a_config_whose_jsonl_path_is_the_live_file_is_refused(
    env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """replay --config with the trainer's config (jsonl: the live run's file): exit 2 naming the file and what to
    give instead; the live file is byte for byte as the live bus left it and nothing else is created."""
    live_file = env / "live" / "metrics.jsonl"
    journal = _live(env, [JsonlAdapter(path=live_file)])
    before = live_file.read_bytes()
    (env / "c.json").write_text(json.dumps({"adapters": [f"jsonl:{live_file}", "jsonl:fresh.jsonl"]}))
    assert main(["replay", str(journal), "--config", str(env / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"metricbus: error: jsonl: {str(live_file)!r} is the live run's file")
    assert "a replay opens a run of its own" in err
    assert "metricbus sync" in err
    assert err.count("\n") == 1
    assert live_file.read_bytes() == before
    assert len(read_jsonl(live_file)) == STEPS
    assert not (env / "fresh.jsonl").exists()


def test_the_live_per_run_jsonl_file_named_as_a_path_is_refused(env: Path) -> None:
    """The live bus wrote its default per-run file; --to jsonl:<that file> (a relative path) is refused too."""
    journal = _live(env, [JsonlAdapter()])
    relative = Path("runs", LIVE.project, LIVE.id, "metrics.jsonl")
    before = (env / relative).read_bytes()
    with pytest.raises(ConfigError, match="is the live run's file"):
        replay(journal, [JsonlAdapter(path=relative)])
    assert (env / relative).read_bytes() == before


def test_the_live_tensorboard_folder_is_refused(env: Path) -> None:
    """tensorboard:<the live run's folder> is refused before any event file is added to it."""
    folder = env / "tb"
    journal = _live(env, [TensorBoardAdapter(log_dir=folder)])
    files = sorted(folder.iterdir())
    with pytest.raises(ConfigError, match=r"tensorboard: .* is the live run's folder"):
        replay(journal, [TensorBoardAdapter(log_dir=folder)])
    assert sorted(folder.iterdir()) == files
    assert [(s, v) for s, v in read_tensors(folder, "loss")] == [(s, s + 0.5) for s in range(STEPS)]


def test_wandb_attach_is_refused_by_a_replay(env: Path) -> None:
    """wandb attach=True would log into the trainer's active run: a replay refuses it before opening anything."""
    journal = _live(env, [])
    with pytest.raises(ConfigError, match=r"wandb option attach=True .*leave attach out for the replay"):
        replay(journal, [WandbAdapter(attach=True), JsonlAdapter(path=env / "out.jsonl")])
    assert not (env / "out.jsonl").exists()


class _FullDisk:
    """``os`` as :mod:`metricbus.journal.writer` sees it, its ``write`` failing with ENOSPC while ``full``."""

    def __init__(self) -> None:
        self.full = False

    def write(self, fd: int, data: bytes) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, data)

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)


@pytest.mark.parametrize(
    ("failing", "line"),
    [
        ({4, 5, 6}, "commits     7 (steps 0..9), 3 failed (steps 4..6: the journal write failed, their records are "
                    "not in the journal)"),
        ({2, 8, 9}, "commits     7 (steps 0..7), 3 failed (steps 2, 8..9: the journal write failed, their records are "
                    "not in the journal)"),
        ({0}, "commits     9 (steps 1..9), 1 failed (step 0: the journal write failed, their records are not in the "
              "journal)"),
        (set(), "commits     10 (steps 0..9)"),
    ],
)
@pytest.mark.usefixtures("unstaged")  # each commit's own os.write fails or not
def test_inspect_counts_failed_commits_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], failing: set[int],
    line: str,
) -> None:
    """Commits whose journal write failed (ENOSPC; the "L" frame counts them as empty commits, for the windows) are
    not counted as commits: inspect says how many are in the journal, with their steps, and how many failed, where;
    an empty commit that was written (step 3 logs nothing) is a commit."""
    disk = _FullDisk()
    monkeypatch.setattr(writer, "os", disk)
    bus = MetricBus(dist=None, journal=str(tmp_path / "j"), fsync="never", log_every=2)
    for step in range(10):
        if step != 3:
            bus.log("loss", float(step))
        disk.full = step in failing
        if step in failing:
            with pytest.raises(JournalError, match=f"step {step} is not journaled"):
                bus.commit(step)
        else:
            bus.commit(step)
    disk.full = False
    bus.close()
    assert main(["inspect", str(tmp_path / "j")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert line in lines
    assert f"summaries   {9 - len(failing - {3})} ({9 - len(failing - {3})} records)" in lines
    journal = read_journal(tmp_path / "j")
    assert [journal.commits[i][0] for i in sorted(journal.failed)] == sorted(failing)
    assert len(journal.commits) == 10  # the failed ones stay in the timeline, so replay's windows are the live ones
