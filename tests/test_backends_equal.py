"""One trainer script, three configs (TensorBoard, MLflow, wandb): each backend holds exactly MemoryAdapter's values.

The script runs as a subprocess with only ``--config`` changing; each backend is read back through its own reader
and compared point by point with the same loop run in-process against a MemoryAdapter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import trainer_script
from backend_env import isolate_env, read_wandb_history

from metricbus import MetricBus
from metricbus.testing import MemoryAdapter

SCRIPT = Path(trainer_script.__file__)
RUN = {"project": "equal", "name": "equal-run", "tags": ["test"], "config": {"lr": 1e-6, "steps": 25}}
Series = dict[str, list[tuple[int, float]]]


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME, WANDB_DIR, XDG_CONFIG_HOME in tmp_path; wandb offline and silent; MLflow telemetry off."""
    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    return isolate_env(monkeypatch, tmp_path)


def _yaml_metrics() -> str:
    lines = ["metrics:"]
    for pattern, spec in trainer_script.METRICS.items():
        lines.append(f"  {json.dumps(pattern)}: {json.dumps(spec)}")
    return "\n".join(lines) + "\n"


def _toml_metrics() -> str:
    def value(spec: object) -> str:
        if isinstance(spec, dict):
            return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in spec.items()) + "}"
        return json.dumps(spec)

    return "[metrics]\n" + "".join(f"{json.dumps(p)} = {value(s)}\n" for p, s in trainer_script.METRICS.items())


def _configs(root: Path) -> dict[str, Path]:
    """The three configs, one per backend and per file format."""
    tb = root / "tb.yaml"
    tb.write_text(
        f"adapters:\n  - {{type: tensorboard, log_dir: {root / 'tb'}}}\ndist: null\nstrict: true\n"
        f"run: {json.dumps(RUN)}\n" + _yaml_metrics(),
        encoding="utf-8",
    )
    ml = root / "mlflow.toml"
    ml.write_text(
        f'adapters = ["mlflow:sqlite:///{root / "mlflow.db"}"]\ndist = "none"\nstrict = true\n'
        + _toml_metrics()
        + '[run]\nproject = "equal"\nname = "equal-run"\ntags = ["test"]\nconfig = {lr = 1e-6, steps = 25}\n',
        encoding="utf-8",
    )
    wb = root / "wandb.json"
    wb.write_text(
        json.dumps({
            "adapters": [{"type": "wandb", "mode": "offline", "dir": str(root / "wb")}],
            "dist": None, "strict": True, "run": RUN, "metrics": trainer_script.METRICS,
        }),
        encoding="utf-8",
    )  # fmt: skip
    return {"tensorboard": tb, "mlflow": ml, "wandb": wb}


def _run_script(config: Path, cwd: Path) -> None:
    args = [sys.executable, str(SCRIPT), "--config", str(config)]
    done = subprocess.run(args, check=False, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


def _expected(config: Path) -> Series:
    """The same loop in-process, adapters replaced by a MemoryAdapter."""
    mem = MemoryAdapter()
    with MetricBus.from_config(config, adapters=[mem]) as bus:
        trainer_script.train(bus)
    names = sorted({name for _, metrics in mem.rows for name in metrics})
    return {name: mem.series(name) for name in names}


def _tensorboard(log_dir: Path) -> Series:

    from tb_reader import legacy_accumulator, tensor_points

    acc = legacy_accumulator(log_dir)
    tags = [t for t in sorted(acc.Tags()["tensors"]) if acc.SummaryMetadata(t).plugin_data.plugin_name == "scalars"]
    return {tag: tensor_points(acc, tag) for tag in tags}


def _mlflow(db: Path, names: list[str]) -> tuple[Series, str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("equal")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert sorted(run.data.metrics) == names
    series = {
        name: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)) for name in names
    }
    return series, run.info.status


def _wandb(wandb_dir: Path) -> Series:
    (run_dir,) = (wandb_dir / "wandb").glob("offline-run-*")
    series: Series = {}
    for row in read_wandb_history(run_dir):
        for key, value in row.items():
            if not key.startswith("_"):
                series.setdefault(key, []).append((row["_step"], float(value)))
    return dict(sorted(series.items()))


def _bits(series: Series) -> dict[str, list[tuple[int, bytes]]]:
    return {name: [(s, np.float64(v).tobytes()) for s, v in points] for name, points in series.items()}


def test_three_backends_hold_memory_adapters_values(env: Path) -> None:
    """TensorBoard (float64), MLflow sqlite and wandb offline each hold exactly the in-process values."""
    configs = _configs(env)
    expected = _expected(configs["tensorboard"])
    assert len(expected) == 8
    assert all(len(points) == trainer_script.STEPS for points in expected.values())
    for config in configs.values():
        _run_script(config, cwd=env)

    assert _bits(_tensorboard(env / "tb")) == _bits(expected)  # float64, bit for bit

    mlflow_series, status = _mlflow(env / "mlflow.db", sorted(expected))
    assert mlflow_series == expected
    assert status == "FINISHED"

    assert _wandb(env / "wb") == expected
