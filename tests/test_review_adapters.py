"""Review of the adapters against their real backends: names and steps a backend would lose or merge silently.

Each backend is the real one (wandb offline read back from its ``.wandb`` file, TensorBoard read back with
``EventAccumulator``, MLflow on sqlite read back with ``MlflowClient``), driven through a real ``Delivery``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import wandb
from backend_env import isolate_env, read_wandb_history
from metricbus.adapters.tensorboard import RUN_TEXT_TAG, TensorBoardAdapter
from metricbus.adapters.wandb import WandbAdapter
from tb_reader import legacy_accumulator, tensor_points

from metricbus.adapter import Adapter, RunInfo
from metricbus.delivery import Delivery
from metricbus.testing import MemoryAdapter

MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """HOME, WANDB_DIR, XDG_CONFIG_HOME inside tmp_path, offline, no MLflow settings; wandb torn down around it."""
    for name in MLFLOW_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    wandb.teardown()
    root = isolate_env(monkeypatch, tmp_path)
    yield root
    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()


def _deliver(adapter: Adapter, steps: list[tuple[int, Mapping[str, float]]]) -> tuple[Delivery, MemoryAdapter]:
    """Deliver ``steps`` to ``adapter`` and a MemoryAdapter next to it through a real Delivery, then close it."""
    mem = MemoryAdapter()
    delivery = Delivery([adapter, mem], strict=False)
    delivery.open(run=RunInfo(project="review", id="20261205-120000-abcdef"))
    for step, metrics in steps:
        delivery.submit(step=step, metrics=metrics)
    assert delivery.flush(timeout_s=120)
    delivery.close(status="finished", timeout_s=120)
    return delivery, mem


def _wandb_rows(adapter: WandbAdapter) -> list[dict[str, Any]]:
    identity = adapter.identity
    assert identity is not None
    return read_wandb_history(Path(identity["dir"]))


# -- wandb ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["_step", "_runtime", "_timestamp"])
def test_wandb_refuses_a_metric_named_like_its_own_history_keys(name: str) -> None:
    """A metric named _step/_runtime/_timestamp would be dropped or overwritten by wandb: a gap naming it instead."""
    adapter = WandbAdapter(mode="offline", project="review")
    delivery, _ = _deliver(adapter, [(0, {"loss": 1.0}), (1, {name: 123.0, "loss": 2.0}), (2, {"loss": 3.0})])
    (gap,) = delivery.gaps
    assert (gap.adapter, gap.step, gap.metric) == ("wandb", 1, name)
    assert f"metric name {name!r} maps to wandb name {name!r}, which wandb keeps for" in gap.reason
    assert "rename the metric" in gap.reason
    rows = _wandb_rows(adapter)
    assert [(row["_step"], row["loss"]) for row in rows] == [(0, 1), (2, 3)]


def test_wandb_refuses_a_negative_step() -> None:
    """wandb drops a row at a negative step without an error; the adapter reports it as a gap instead."""
    adapter = WandbAdapter(mode="offline", project="review")
    delivery, mem = _deliver(adapter, [(-2, {"loss": 1.0}), (-1, {"loss": 2.0}), (0, {"loss": 3.0})])
    assert [(gap.adapter, gap.step) for gap in delivery.gaps] == [("wandb", -2), ("wandb", -1)]
    assert "wandb keeps only steps >= 0" in delivery.gaps[0].reason
    assert [(row["_step"], row["loss"]) for row in _wandb_rows(adapter)] == [(0, 3)]
    assert [step for step, _ in mem.rows] == [-2, -1, 0]


# -- TensorBoard ---------------------------------------------------------------------------------------------------


def test_tensorboard_refuses_a_metric_under_the_run_text_tag(tmp_path: Path) -> None:
    """A metric named like the run's text tag would be read as text, not as scalars: a gap naming it instead."""
    adapter = TensorBoardAdapter(log_dir=tmp_path / "tb")
    delivery, _ = _deliver(adapter, [(0, {"loss": 1.0}), (1, {RUN_TEXT_TAG: 5.0, "loss": 2.0}), (2, {"loss": 3.0})])
    (gap,) = delivery.gaps
    assert (gap.adapter, gap.step, gap.metric) == ("tensorboard", 1, RUN_TEXT_TAG)
    assert "which TensorBoard keeps for the run's text summary" in gap.reason
    acc = legacy_accumulator(tmp_path / "tb")
    assert tensor_points(acc, "loss") == [(0, 1.0), (2, 3.0)]
    assert acc.SummaryMetadata(RUN_TEXT_TAG).plugin_data.plugin_name == "text"
    assert len(acc.Tensors(RUN_TEXT_TAG)) == 1  # the run text alone
