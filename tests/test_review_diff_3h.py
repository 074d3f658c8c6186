"""Review of recent Lightning commits (diff review 3h): MetricBusLogger with real Trainers/Fabric, jsonl read back."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")

from metricbus.adapters.jsonl import read_jsonl

from metricbus.integrations.lightning import MetricBusLogger

ROOT = Path(__file__).resolve().parents[1]


def test_user_closing_the_logger_bus_commits_the_held_step_and_exits_clean(tmp_path: Path) -> None:
    """logger.bus.close() in a Fabric script: the step the logger held is delivered, no ClosedError at exit."""
    out = tmp_path / "m.jsonl"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from lightning_fabric import Fabric
        from metricbus.integrations.lightning import MetricBusLogger
        logger = MetricBusLogger(adapters=["jsonl:{out}"], strict=True)
        fabric = Fabric(accelerator="cpu", devices=1, loggers=[logger])
        for step in range(3):
            fabric.log_dict({{"loss": step + 0.25}}, step=step)
        logger.bus.close()
    """)
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert read_jsonl(out) == [(step, {"loss": step + 0.25}) for step in range(3)]


def test_finalize_after_the_user_closed_the_bus_opens_no_new_run(tmp_path: Path) -> None:
    """finalize() after logger.bus.close() (hyperparameters logged) ends nothing again: no second, empty run."""
    out = tmp_path / "m.jsonl"
    logger = MetricBusLogger(adapters=[f"jsonl:{out}"], strict=True)
    logger.log_hyperparams({"lr": 0.5})
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.bus.close()
    logger.finalize("success")
    assert read_jsonl(out) == [(0, {"loss": 1.0})]
    logger.log_metrics({"loss": 2.0}, step=1)  # logging again continues the run, as after finalize()
    logger.finalize("success")
    assert read_jsonl(out) == [(0, {"loss": 1.0}), (1, {"loss": 2.0})]

