"""Review of recent Lightning commits (diff review 3h): MetricBusLogger with real Trainers/Fabric, jsonl read back."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")

import pytorch_lightning as pl
import torch
from metricbus.adapters.jsonl import read_jsonl
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from metricbus.errors import MetricBusWarning
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


QUIET = [  # Lightning's advice for real runs, not about what these tests check
    "ignore:.*does not have many workers.*",
    "ignore:.*GPU available but not used.*",
    "ignore:.*litlogger.*",
    "ignore:.*dataloader is not resumable.*",
    "ignore:.*callbacks used to create the checkpoint.*",
    "ignore:.*exists and is not empty.*",
]
pytestmark = [pytest.mark.filterwarnings(f) for f in QUIET]


def _fit_then_resume(tmp_path: Path, journal: str | None) -> list[tuple[int, dict[str, float]]]:
    """Fit 6 steps (checkpoints at 3 and 6), then fit(ckpt_path=step 3) to 8 steps with the same logger."""
    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 1)

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            self.log("seen", float(self.global_step))
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=4)
    out = tmp_path / "m.jsonl"
    logger = MetricBusLogger(adapters=[f"jsonl:{out}"], journal=journal, strict=True)
    args: dict[str, object] = {
        "accelerator": "cpu", "log_every_n_steps": 1, "enable_progress_bar": False, "enable_model_summary": False,
        "logger": logger, "default_root_dir": str(tmp_path),
    }  # fmt: skip
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    pl.Trainer(max_steps=6, callbacks=[checkpoints], **args).fit(Model(), data)  # type: ignore[arg-type]
    (step3,) = (tmp_path / "ckpt").glob("*step=3.ckpt")
    pl.Trainer(max_steps=8, **args).fit(Model(), data, ckpt_path=str(step3))  # type: ignore[arg-type]
    return [(step, {"seen": row["seen"]}) for step, row in read_jsonl(out)]


def test_fit_from_an_earlier_checkpoint_with_a_journal_rewinds_not_shifts(tmp_path: Path) -> None:
    """fit(ckpt_path=step 3) after a 6-step fit, same logger with a journal: steps 3.. are rewound and replaced
    (each step once, at Lightning's own step), not shifted after step 5 with a warning."""
    rows = _fit_then_resume(tmp_path, journal=str(tmp_path / "journal"))
    assert rows == [(step, {"seen": float(step)}) for step in range(8)]


def test_fit_from_an_earlier_checkpoint_without_a_journal_says_how_to_rewind(tmp_path: Path) -> None:
    """Without a journal the restarted session is shifted (steps keep increasing), and the warning says that
    journal= would rewind it."""
    with pytest.warns(MetricBusWarning, match=r"rewound to it only with journal=DIR"):
        rows = _fit_then_resume(tmp_path, journal=None)
    assert rows == [(step, {"seen": float(step)}) for step in range(6)] + [
        (step + 3, {"seen": float(step)}) for step in range(3, 8)
    ]


def test_finalize_mid_fit_moves_only_the_rest_of_that_step(tmp_path: Path) -> None:
    """finalize() mid-fit (Lightning's SLURM handler) then more calls at that step: they move to the next step,
    and the later steps keep Lightning's numbers (were each one step late for the rest of the run)."""
    out = tmp_path / "m.jsonl"
    logger = MetricBusLogger(adapters=[f"jsonl:{out}"], strict=True)
    for step in range(3):
        logger.log_metrics({"loss": float(step)}, step=step)
    logger.finalize("finished")
    with pytest.warns(MetricBusWarning, match=r"logged at step 3, later steps as given"):
        logger.log_metrics({"lr": 0.5}, step=2)
    for step in range(3, 6):
        logger.log_metrics({"loss": float(step)}, step=step)
    logger.finalize("finished")
    assert read_jsonl(out) == [(0, {"loss": 0.0}), (1, {"loss": 1.0}), (2, {"loss": 2.0}),
                               (3, {"loss": 3.0, "lr": 0.5}), (4, {"loss": 4.0}), (5, {"loss": 5.0})]


def test_second_fit_after_a_one_step_run_is_shifted_whole(tmp_path: Path) -> None:
    """A run whose only step was 0, then a new session from step 0 (a new Trainer): every step moves by one, none
    merged into another."""
    out = tmp_path / "m.jsonl"
    logger = MetricBusLogger(adapters=[f"jsonl:{out}"], strict=True)
    logger.log_metrics({"loss": 9.0}, step=0)
    logger.finalize("finished")
    with pytest.warns(MetricBusWarning, match=r"each later step of this session 1 later"):
        logger.log_metrics({"loss": 0.0}, step=0)
    for step in range(1, 3):
        logger.log_metrics({"loss": float(step)}, step=step)
    logger.finalize("finished")
    assert read_jsonl(out) == [(0, {"loss": 9.0}), (1, {"loss": 0.0}), (2, {"loss": 1.0}), (3, {"loss": 2.0})]
