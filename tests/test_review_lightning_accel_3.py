"""Review of the Lightning and Accelerate integrations (third pass): real Trainers, Fabric and Accelerators on CPU."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning")

import pytorch_lightning as pl
import torch

from metricbus.errors import ConfigError, MetricBusWarning
from metricbus.integrations.lightning import MetricBusCallback, MetricBusLogger
from metricbus.testing import MemoryAdapter
from tests import lightning_workers as lw
from tests.backend_env import isolate_env

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.filterwarnings(f) for f in lw.QUIET]


def test_fabric_log_without_a_step_is_a_step_of_its_own() -> None:
    """fabric.log(name, value) passes step=None: each call is the next step (Lightning's loggers auto-increment),
    not merged into step 0 with the last value winning."""
    from lightning_fabric import Fabric

    memory = MemoryAdapter()
    logger = MetricBusLogger(adapters=[memory], strict=True)
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[logger])
    for value in (0.5, 1.5, 2.5):
        fabric.log("loss", value)
    fabric.log_dict({"loss": 3.5, "acc": 0.25}, step=7)
    fabric.log("loss", 4.5)
    logger.finalize("success")
    assert memory.rows == [
        (0, {"loss": 0.5}), (1, {"loss": 1.5}), (2, {"loss": 2.5}), (7, {"loss": 3.5, "acc": 0.25}), (8, {"loss": 4.5})
    ]  # fmt: skip


@pytest.mark.parametrize("journal", [False, True])
def test_a_second_fit_with_the_same_logger_keeps_every_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, journal: bool
) -> None:
    """Two fit() calls on new Trainers from step 0 with one MetricBusLogger (one run): the second fit's steps
    follow the first's, each with its own value (not all merged into one step, nor steps going back in the run)."""
    from metricbus.adapters.jsonl import read_jsonl

    isolate_env(monkeypatch, tmp_path)
    out = tmp_path / "m.jsonl"
    ours = MetricBusLogger(
        adapters=[f"jsonl:{out}"], journal=str(tmp_path / "journal") if journal else None, strict=True
    )
    fits = []
    for _ in range(2):
        memory = lw.MemoryLogger()
        trainer = pl.Trainer(
            **{**lw.TRAINER_ARGS, "max_steps": 3}, devices=1, logger=[ours, memory], default_root_dir=tmp_path
        )
        if fits:
            with pytest.warns(MetricBusWarning, match="after the run was finalized at step 2: logged at step 3"):
                trainer.fit(lw.TinyLM(), lw.loader())
        else:
            trainer.fit(lw.TinyLM(), lw.loader())
        fits.append(lw.last_values(memory.calls, "train_loss"))
    assert sorted(fits[0]) == sorted(fits[1]) == [0, 1, 2]
    expected = {**fits[0], **{step + 3: value for step, value in fits[1].items()}}
    rows = read_jsonl(out)
    assert [step for step, _ in rows] == [0, 1, 2, 3, 4, 5]
    assert {step: metrics["train_loss"] for step, metrics in rows} == expected


@pytest.mark.parametrize("ending", ["exit", "raise"])
def test_a_script_that_never_calls_finalize_delivers_its_last_step(tmp_path: Path, ending: str) -> None:
    """A Fabric loop that ends without logger.finalize(): the step the logger still buffers is committed and
    delivered at interpreter exit, and the run is closed (FAILED when the script dies of an exception)."""
    from metricbus.adapters.jsonl import read_jsonl
    from mlflow.tracking import MlflowClient

    out, uri = tmp_path / "m.jsonl", f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from lightning_fabric import Fabric
        from metricbus.integrations.lightning import MetricBusLogger
        logger = MetricBusLogger(adapters=["jsonl:{out}", {{"type": "mlflow", "tracking_uri": "{uri}"}}],
                                 version="run-1", strict=True)
        fabric = Fabric(accelerator="cpu", devices=1, loggers=[logger])
        logger.log_hyperparams({{"lr": 0.5}})
        for step in range(3):
            fabric.log_dict({{"loss": step + 0.25}}, step=step)
        if {ending == "raise"}:
            raise RuntimeError("boom")
    """)
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore", "MLFLOW_TRACKING_URI": uri}
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == (1 if ending == "raise" else 0), done.stderr[-3000:]
    assert read_jsonl(out) == [(step, {"loss": step + 0.25}) for step in range(3)]
    client = MlflowClient(tracking_uri=uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = client.search_runs(experiments, "tags.`metricbus.run_id` = 'run-1'")
    assert run.info.status == ("FAILED" if ending == "raise" else "FINISHED")
    assert run.data.params == {"lr": "0.5"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [
        (step, step + 0.25) for step in range(3)
    ]


def test_callback_without_adapters_or_config_is_an_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """MetricBusCallback() built a bus with no adapters: every fit's metrics went nowhere, silently (and a second
    fit failed saying 'the bus it was given is closed'). Without adapters, a config or a journal it now refuses."""
    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    with pytest.raises(ConfigError, match=r"no metricbus config.*METRICBUS_ADAPTERS.*MetricBusCallback\(adapters="):
        MetricBusCallback()
    with pytest.raises(ConfigError, match=r"no metricbus config"):
        MetricBusCallback(rules={"train/*": "mean"})
    monkeypatch.setenv("METRICBUS_ADAPTERS", "tensorbord")
    with pytest.raises(ConfigError, match=r"METRICBUS_ADAPTERS.*no adapter named 'tensorbord'"):
        MetricBusCallback()


def test_callback_without_adapters_takes_them_from_the_environment_at_each_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MetricBusCallback() with $METRICBUS_ADAPTERS delivers each fit's exact token means (a new bus per fit)."""
    from metricbus.adapters.jsonl import read_jsonl

    isolate_env(monkeypatch, tmp_path)
    out = tmp_path / "m.jsonl"
    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    monkeypatch.setenv("METRICBUS_ADAPTERS", f"jsonl:{out}")
    callback = MetricBusCallback()
    expected: list[tuple[int, float]] = []
    for _ in range(2):
        module = lw.TinyLM()
        trainer = pl.Trainer(
            **{**lw.TRAINER_ARGS, "max_steps": 3}, devices=1, logger=False, callbacks=[callback],
            default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(module, lw.loader())
        expected += sorted(_token_means(module.records).items())
    rows = [(step, metrics["train/loss"]) for step, metrics in read_jsonl(out)]
    assert [step for step, _ in rows] == [step for step, _ in expected] == [0, 1, 2, 0, 1, 2]
    assert all(abs(ours - truth) <= 1e-12 for (_, ours), (_, truth) in zip(rows, expected, strict=True))


def _token_means(records: list[tuple[int, float, float]]) -> dict[int, float]:
    """Per optimizer step: the sum of its micro-batches' token losses / their tokens (fsum)."""
    totals: dict[int, list[float]] = {}
    tokens: dict[int, float] = {}
    for step, total, n_tokens in records:
        totals.setdefault(step, []).append(total)
        tokens[step] = tokens.get(step, 0.0) + n_tokens
    return {step: math.fsum(values) / tokens[step] for step, values in totals.items()}


@pytest.mark.parametrize("bad", [1.5, "3", True, torch.tensor([1, 2]), torch.tensor(2.0)])
def test_logger_refuses_a_step_that_is_not_an_integer_and_keeps_what_was_logged(bad: Any) -> None:
    """log_metrics(step=1.5) (a Fabric log_dict with a float step) is a StepError naming the metrics and what a
    step is, at that call; nothing of it is buffered, and the steps logged before and after are delivered."""
    from metricbus.errors import StepError

    memory = MemoryAdapter()
    logger = MetricBusLogger(adapters=[memory], strict=True)
    logger.log_metrics({"a": 1.0}, step=0)
    with pytest.raises(StepError, match=r"log_metrics\(\['b'\], step=.*must be an int.*nothing of this call"):
        logger.log_metrics({"b": 2.0}, step=bad)
    logger.log_metrics({"c": 3.0}, step=torch.tensor(4))  # type: ignore[arg-type]  # a 0-d integer tensor is a step
    logger.finalize("success")
    assert memory.rows == [(0, {"a": 1.0}), (4, {"c": 3.0})]


def test_accelerate_a_step_out_of_range_or_a_bool_tensor_is_left_out(caplog: pytest.LogCaptureFixture) -> None:
    """Accelerator.log at step 2**63 logged its values, then the commit refused the step: they were carried into
    the next step's row; step=torch.tensor(True) was taken as step 1. Both are now reported and left out."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from metricbus import MetricBus
    from metricbus.integrations.accelerate import MetricBusTracker

    memory = MemoryAdapter()
    accelerator = Accelerator(cpu=True, log_with=[MetricBusTracker("p", bus=MetricBus(adapters=[memory], dist=None))])
    accelerator.init_trackers("p")
    with caplog.at_level("WARNING", logger="metricbus.accelerate"):
        accelerator.log({"a": 1.0}, step=0)
        accelerator.log({"b": 2.0}, step=2**63)
        accelerator.log({"c": 3.0}, step=torch.tensor(True))  # type: ignore[arg-type]
        accelerator.log({"d": 4.0}, step=torch.tensor(3))  # type: ignore[arg-type]  # a 0-d integer tensor is a step
    accelerator.end_training()
    assert memory.rows == [(0, {"a": 1.0}), (3, {"d": 4.0})]
    assert "values at step 9223372036854775808 are left out: commit step 9223372036854775808 is out of range" in (
        caplog.text
    )


@pytest.mark.parametrize(("bad", "match"), [
    ({"note": "warmup"}, r"cannot log 'warmup' \(str\) as 'note'"),
    ({"lr": None}, r"cannot log None \(NoneType\) as 'lr'"),
    ({"losses": {"a": 1.0}}, r"\(dict\) as 'losses'"),
    ({"": 1.0}, r"metric names must be non-empty strings"),
])  # fmt: skip
def test_logger_refuses_a_value_the_bus_cannot_log_at_that_call(bad: dict[str, Any], match: str) -> None:
    """fabric.log_dict({"loss": x, "note": "warmup"}) was buffered, and the next, valid call's commit raised
    MetricTypeError: that call and the whole buffered step (its good values too) were lost. It is now refused at
    the call, naming the metric; nothing of it is buffered, and the steps before and after are delivered."""
    from lightning_fabric import Fabric

    from metricbus.errors import MetricTypeError

    memory = MemoryAdapter()
    logger = MetricBusLogger(adapters=[memory], strict=True)
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[logger])
    fabric.log_dict({"loss": 1.0}, step=0)
    with pytest.raises(MetricTypeError, match=rf"log_metrics\(step=1\): .*{match}.*nothing of this call was logged"):
        fabric.log_dict({"loss": 2.0, **bad}, step=1)
    fabric.log_dict({"loss": 3.0}, step=1)
    fabric.log_dict({"loss": 4.0}, step=2)
    logger.finalize("success")
    assert memory.rows == [(0, {"loss": 1.0}), (1, {"loss": 3.0}), (2, {"loss": 4.0})]
