"""metricbus.integrations.lightning on a real Lightning Trainer (CPU): exact token means, DDP, the Logger."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning")

import pytorch_lightning as pl

from metricbus.errors import ConfigError, MetricBusWarning
from metricbus.integrations.lightning import MetricBusCallback, MetricBusLogger
from metricbus.testing import MemoryAdapter
from tests import lightning_workers as lw
from tests.backend_env import free_port, isolate_env
from tests.tb_reader import read_tensors

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings(f) for f in lw.QUIET]


def token_means(records: list[list[float]] | list[tuple[int, float, float]]) -> dict[int, float]:
    """Reference: per optimizer step, the sum of token losses over its micro-batches (all ranks) / their tokens."""
    totals: dict[int, list[float]] = defaultdict(list)
    tokens: dict[int, float] = defaultdict(float)
    for step, total, n_tokens in records:
        totals[int(step)].append(total)
        tokens[int(step)] += n_tokens
    return {step: math.fsum(totals[step]) / tokens[step] for step in totals}


def bus_values(rows: Any, name: str) -> dict[int, float]:
    """``{step: value}`` of ``name`` in a MemoryAdapter's rows (or their JSON form)."""
    return {int(step): metrics[name] for step, metrics in rows if name in metrics}


def test_callback_logs_the_exact_token_mean_of_each_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Single process, 2 micro-batches per step: metricbus's loss is the step's token mean; Lightning's is not."""
    isolate_env(monkeypatch, tmp_path)
    memory, lightning = MemoryAdapter(), lw.MemoryLogger()
    module = lw.TinyLM()
    trainer = pl.Trainer(
        **lw.TRAINER_ARGS, devices=1, logger=lightning, default_root_dir=tmp_path,
        callbacks=[MetricBusCallback(adapters=[memory])],
    )  # fmt: skip
    trainer.fit(module, lw.loader())

    truth = token_means(module.records)
    ours = bus_values(memory.rows, "train/loss")
    theirs = lw.last_values(lightning.calls, "train_loss")
    assert sorted(ours) == sorted(truth) == sorted(theirs) == list(range(6))
    assert memory.status == "finished"
    for step, value in truth.items():
        assert abs(ours[step] - value) <= 1e-12
        assert abs(theirs[step] - value) > 1e-4  # the last micro-batch's mean, not the step's


def test_callback_under_ddp_reduces_over_both_ranks(tmp_path: Path) -> None:
    """2 gloo ranks: the loss is the token mean over both ranks' micro-batches of each step."""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "NODE_RANK": "0",
           "GLOO_SOCKET_IFNAME": "lo", "HOME": str(tmp_path), "PYTHONWARNINGS": "ignore"}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "lightning_workers.py"), str(tmp_path)],
            env={**env, "LOCAL_RANK": str(rank)},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    truth = token_means(ranks[0]["records"] + ranks[1]["records"])
    ours = bus_values(ranks[0]["rows"], "train/loss")
    theirs = {int(k): v for k, v in lw.last_values([(s, m) for s, m in ranks[0]["lightning"]], "train_loss").items()}
    assert ranks[1]["rows"] == []  # adapters run on rank 0 only
    assert sorted(ours) == sorted(truth) == list(range(6))
    assert len(ranks[0]["records"]) == len(ranks[1]["records"]) == 12
    for step, value in truth.items():
        assert abs(ours[step] - value) <= 1e-12
        assert abs(theirs[step] - value) > 1e-4  # rank 0's last micro-batch only


def test_logger_delivers_lightning_metrics_to_tensorboard_and_mlflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MetricBusLogger: what Lightning passed (last value per step) reaches TensorBoard and MLflow; hparams too."""
    from mlflow.tracking import MlflowClient

    isolate_env(monkeypatch, tmp_path)
    tb_dir, uri = tmp_path / "tb", f"sqlite:///{tmp_path / 'mlflow.db'}"
    ours = MetricBusLogger(adapters=[f"tensorboard:{tb_dir}", {"type": "mlflow", "tracking_uri": uri}], strict=True)
    lightning = lw.MemoryLogger()
    trainer = pl.Trainer(
        **lw.TRAINER_ARGS, devices=1, logger=[ours, lightning], default_root_dir=tmp_path, val_check_interval=6,
        limit_val_batches=2,
    )  # fmt: skip
    trainer.fit(lw.TinyLM(lr=0.05), lw.loader(), lw.loader())

    names = {name for _, metrics in lightning.calls for name in metrics}
    assert names == {"train_loss", "val_loss", "epoch"}
    steps = [step for step, _ in lightning.calls]
    assert len(steps) > len(set(steps))  # validation is logged at the step of the training log before it
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], f"tags.`metricbus.run_id` = '{ours.version}'"
    )
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.05", "dim": "16"}
    for name in names:
        expected = lw.last_values(lightning.calls, name)
        assert dict(read_tensors(tb_dir, name)) == expected
        assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)} == expected


def test_logger_merges_calls_at_one_step_last_value_wins() -> None:
    """Several log_metrics calls at one step are one commit; a repeated name keeps its last value."""
    memory = MemoryAdapter()
    logger = MetricBusLogger(adapters=[memory], strict=True)
    logger.log_hyperparams({"lr": 0.1, "optim": {"name": "sgd"}, "act": dict, "seed": Path("s")})
    logger.log_metrics({"loss": 1.0, "epoch": 0}, step=0)
    logger.log_metrics({"loss": 2.0, "val": 5.0}, step=0)
    logger.log_metrics({"loss": 3.0}, step=1)
    with pytest.warns(MetricBusWarning, match="after step 1"):
        logger.log_metrics({"val": 4.0}, step=0)
    logger.finalize("success")
    assert memory.rows == [(0, {"loss": 2.0, "epoch": 0.0, "val": 5.0}), (1, {"loss": 3.0, "val": 4.0})]
    assert memory.run is not None
    assert dict(memory.run.config) == {"lr": 0.1, "optim": {"name": "sgd"}, "act": "dict", "seed": "s"}
    assert (memory.run.id, memory.status) == (logger.version, "finished")


def test_an_exception_in_training_closes_both_as_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A training_step that raises: the callback's bus and the logger's bus are closed as failed."""
    isolate_env(monkeypatch, tmp_path)
    for_callback, for_logger = MemoryAdapter(), MemoryAdapter()

    class Failing(lw.TinyLM):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if self.trainer.global_step == 3:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    trainer = pl.Trainer(
        **lw.TRAINER_ARGS, devices=1, logger=MetricBusLogger(adapters=[for_logger]), default_root_dir=tmp_path,
        callbacks=[MetricBusCallback(adapters=[for_callback])],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Failing(), lw.loader())
    assert [step for step, _ in for_callback.rows] == [0, 1, 2]
    assert [step for step, _ in for_logger.rows] == [0, 1, 2]
    assert (for_callback.status, for_logger.status) == ("failed", "failed")


def test_callback_rejects_unknown_and_window_options() -> None:
    """Bus options are checked at construction; log_every is Lightning's log_every_n_steps."""
    with pytest.raises(ConfigError, match="did you mean 'adapters'"):
        MetricBusCallback(adaptors=["console"])
    with pytest.raises(ConfigError, match="log_every_n_steps"):
        MetricBusCallback(log_every=5)


def test_callback_window_is_log_every_n_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """log_every_n_steps=2, 5 steps: commits at steps 1, 3 (two steps each) and 4 (the last, at train end)."""
    isolate_env(monkeypatch, tmp_path)
    memory = MemoryAdapter()
    module = lw.TinyLM()
    args = {**lw.TRAINER_ARGS, "max_steps": 5, "log_every_n_steps": 2}
    trainer = pl.Trainer(
        **args, devices=1, logger=False, default_root_dir=tmp_path, callbacks=[MetricBusCallback(adapters=[memory])]
    )
    trainer.fit(module, lw.loader())
    windows = {1: (0, 1), 3: (2, 3), 4: (4,)}
    truth = {end: token_means([(end, t, n) for s, t, n in module.records if s in steps])[end]
             for end, steps in windows.items()}  # fmt: skip
    ours = bus_values(memory.rows, "train/loss")
    assert sorted(ours) == [1, 3, 4]
    assert all(abs(ours[s] - truth[s]) <= 1e-12 for s in truth)
