"""One run is one run in every backend: a SIGKILLed trainer completed by ``metricbus sync``, and a trainer resumed
from a checkpoint, read back through TensorBoard's, MLflow's and wandb's own readers, and jsonl's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backend_env import isolate_env, read_wandb_records_now, wandb_history_of
from metricbus.adapters.jsonl import read_jsonl
from tb_reader import read_tensors

from metricbus import MetricBus
from metricbus.journal import read_journal
from metricbus.replay import emitted
from metricbus.testing import MemoryAdapter
from tests.identity_trainer import records

ROOT = Path(__file__).resolve().parents[1]
TRAINER = Path(__file__).with_name("identity_trainer.py")
NAMES = ("train/acc", "train/loss")
pytestmark = pytest.mark.slow


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An isolated folder the children run in (their per-run folders land under its runs/)."""
    isolate_env(monkeypatch, tmp_path)
    config = {
        "adapters": ["tensorboard", "jsonl", {"type": "mlflow", "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"},
                     {"type": "wandb", "mode": "offline", "dir": str(tmp_path)}],
        "journal": str(tmp_path / "journal"),
        "run": {"project": "ident", "config": {"lr": 0.5}},
    }
    (tmp_path / "c.json").write_text(json.dumps(config))
    return tmp_path


def _child(env: Path, first: int, stop: int, scale: float, *, resume: bool = False) -> subprocess.Popen[str]:
    args = [sys.executable, str(TRAINER), str(env / "c.json"), str(first), str(stop), str(scale)]
    return subprocess.Popen([*args, *(["resume"] if resume else [])], cwd=env, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def _expected(segments: list[tuple[range, float]]) -> dict[int, dict[str, float]]:
    """Step -> metrics, from fresh in-process buses, one per segment: later segments replace earlier steps."""
    out: dict[int, dict[str, float]] = {}
    for steps, scale in segments:
        out = {s: m for s, m in out.items() if s < steps.start}
        mem = MemoryAdapter()
        with MetricBus(dist=None, adapters=[mem]) as bus:
            for step in steps:
                for name, values in records(step, scale).items():
                    for value in values:
                        bus.log(name, value)
                bus.commit(step)
        out.update(dict(mem.rows))
    return out


def _series(expected: dict[int, dict[str, float]], name: str) -> list[tuple[int, bytes]]:
    return [(s, np.float64(m[name]).tobytes()) for s, m in sorted(expected.items())]


def _bits(points: list[tuple[int, float]]) -> list[tuple[int, bytes]]:
    return [(s, np.float64(v).tobytes()) for s, v in points]


def _check_backends(
    env: Path, expected: dict[int, dict[str, float]], *, run_id: str, rewound: int | None = None
) -> None:
    """Every backend holds ``expected``, each step once, in one run. ``rewound``: a resume went back to that step;
    MLflow then keeps the old points beside the new ones (the newest wins) and wandb's rewound folder replaces
    the earlier folders' rows from that step on (as wandb's server does with ``resume_from``)."""
    from mlflow.tracking import MlflowClient

    (tb,) = (env / "runs" / "ident").glob("*/tensorboard")
    assert tb.parent.name == run_id
    for name in NAMES:
        assert _bits(read_tensors(tb, name)) == _series(expected, name), name
    (jsonl,) = (env / "runs" / "ident").glob("*/metrics.jsonl")
    assert dict(read_jsonl(jsonl)) == expected
    assert len(read_jsonl(jsonl)) == len(expected)
    client = MlflowClient(tracking_uri=f"sqlite:///{env}/mlflow.db")
    experiment = client.get_experiment_by_name("ident")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["metricbus.run_id"] == run_id
    for name in NAMES:
        history = sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run.info.run_id, name))
        if rewound is None:
            assert _bits([(s, v) for s, _, v in history]) == _series(expected, name), name
        else:
            newest = {s: v for s, _, v in history}  # sorted by (step, timestamp): the last one of a step wins
            assert _bits([(s, newest[s]) for s in sorted(expected)]) == _series(expected, name), name
            assert [s for s, _, _ in history if s < rewound] == [s for s in sorted(expected) if s < rewound]
    if rewound is not None:
        assert run.data.tags["metricbus.rewind"] == str(rewound)
    wandb_rows: dict[int, dict[str, Any]] = {}
    # offline-run-<time>-<run id>, and "-<n>" after it where another folder of the run started in the same second
    # (wandb.init's x_sync_dir_suffix): in start order
    named = re.compile(rf"offline-run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    started = {folder: named.fullmatch(folder.name) for folder in (env / "wandb").glob("offline-run-*")}
    assert started
    assert all(started.values()), sorted(started)
    folders = sorted(started, key=lambda f: (started[f][1], int(started[f][2] or 0)))  # type: ignore[index]
    for folder in folders:
        rows = wandb_history_of(read_wandb_records_now(folder))
        if rows and wandb_rows and int(rows[0]["_step"]) <= max(wandb_rows):
            assert rewound is not None, folder
            assert int(rows[0]["_step"]) == rewound, folder
            wandb_rows = {s: m for s, m in wandb_rows.items() if s < rewound}
        for row in rows:
            step = int(row["_step"])
            values = {k: v for k, v in row.items() if not k.startswith("_")}
            assert not set(values) & set(wandb_rows.get(step, {})), f"wandb step {step} twice"
            wandb_rows.setdefault(step, {}).update(values)
    assert {s: m for s, m in wandb_rows.items() if m} == expected


def _settled(folder: Path, *, quiet_s: float = 1.0, timeout_s: float = 60.0) -> None:
    """Wait until no file under ``folder`` has changed size for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    last: list[tuple[str, int]] = []
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        sizes = sorted((str(p), p.stat().st_size) for p in folder.rglob("*.wandb"))
        if sizes != last:
            last, quiet_since = sizes, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        time.sleep(0.1)
    raise AssertionError(f"files under {folder} kept changing for {timeout_s} s")


def _sync(env: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "metricbus", "sync", str(env / "journal"), "--config",
                           str(env / "c.json")], cwd=env, capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_sigkilled_run_completed_by_sync_is_one_run_everywhere(env: Path) -> None:
    """SIGKILL mid-run, then `metricbus sync`: one MLflow run (FINISHED), one wandb run id, one TensorBoard and
    jsonl folder, every journaled step once, bit for bit; a second sync sends nothing."""
    child = _child(env, 0, 100_000, 1.0)
    assert child.stdout is not None
    for line in child.stdout:
        if int(line) >= 60:
            break
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)
    _settled(env / "wandb")  # the dead trainer's wandb-core writes out what it had received, then stops
    journal = read_journal(env / "journal")
    last = journal.commits[-1][0]
    assert last >= 60
    _sync(env)
    expected = _expected([(range(last + 1), 1.0)])
    assert dict(emitted(journal)) == expected
    _check_backends(env, expected, run_id=journal.run.id)
    assert "sent 0 steps" in _sync(env)


def test_a_resume_from_a_checkpoint_is_one_timeline_everywhere(env: Path) -> None:
    """Run 1 commits 0..39 and closes; run 2 resumes at step 20 with other values and commits 20..29: replay and
    every backend hold steps 0..19 of run 1 and 20..29 of run 2, once each, in one run."""
    for first, stop, scale, resume in ((0, 40, 1.0, False), (20, 30, 10.0, True)):
        child = _child(env, first, stop, scale, resume=resume)
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        assert out.split() == [str(s) for s in range(first, stop)]
    journal = read_journal(env / "journal")
    expected = _expected([(range(40), 1.0), (range(20, 30), 10.0)])
    assert dict(emitted(journal)) == expected
    _check_backends(env, expected, run_id=journal.run.id, rewound=20)
