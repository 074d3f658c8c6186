"""metricbus.integrations on the real frameworks (Accelerate, HF Trainer, Lightning, Ray, verl 0.9.1's Tracking):
a value an integration cannot commit at its step is reported and left out, never committed at a later step;
logs keep the step the framework gave them; nothing is dropped silently or counted twice."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from metricbus import MetricBus
from metricbus.testing import MemoryAdapter
from tests.test_review_lifecycle import LIGHTNING_ADVICE

TESTS = Path(__file__).resolve().parent


def test_accelerate_a_name_twice_at_one_step_does_not_change_the_next_step(caplog: pytest.LogCaptureFixture) -> None:
    """Accelerator.log of 'loss' twice at step 1: the second is left out (reported), step 2 keeps its own value."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from metricbus.integrations.accelerate import MetricBusTracker

    memory = MemoryAdapter()
    tracker = MetricBusTracker("proj", bus=MetricBus(adapters=[memory], strict=True, dist=None))
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("proj")
    accelerator.log({"loss": 1.0}, step=1)
    with caplog.at_level("WARNING", logger="metricbus.accelerate"):
        accelerator.log({"loss": 2.0, "acc": 0.5}, step=1)  # 'acc' is new at this step: kept
    accelerator.log({"loss": 3.0}, step=2)
    accelerator.end_training()
    assert memory.rows == [(1, {"loss": 1.0}), (1, {"acc": 0.5}), (2, {"loss": 3.0})]
    assert "'loss' was already logged at step 1" in caplog.text


def _hf_trainer(tmp_path: Path, memory: MemoryAdapter, **overrides: Any) -> Any:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(TESTS))
    import hf_workers
    from transformers import TrainingArguments

    from metricbus.integrations.hf import MetricBusCallback

    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"), "use_cpu": True, "max_steps": 4, "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 2, "logging_steps": 2, "report_to": "none", "save_strategy": "no",
        "seed": hf_workers.SEED, "disable_tqdm": True, "dataloader_num_workers": 0, "eval_strategy": "steps",
        "eval_steps": 2, "per_device_eval_batch_size": 2,
    }  # fmt: skip
    args = TrainingArguments(**{**options, **overrides})
    bus = MetricBus(adapters=[memory], strict=True, dist=None)
    return hf_workers.TruthTrainer(
        model=hf_workers.tiny_model(), args=args, train_dataset=hf_workers.dataset(),
        eval_dataset=hf_workers.dataset(8), data_collator=hf_workers.collate, callbacks=[MetricBusCallback(bus)],
    )  # fmt: skip


def test_hf_eval_and_final_summary_keep_the_trainers_steps(tmp_path: Path) -> None:
    """Evaluation at the last logging step, then the Trainer's end-of-training summary: every row is at a step
    the Trainer logged (no step after the last), with the values of log_history."""
    memory = MemoryAdapter()
    trainer = _hf_trainer(tmp_path, memory)
    trainer.train()
    history = trainer.state.log_history
    assert max(step for step, _ in memory.rows) == 4 == trainer.state.global_step
    for entry in history:
        if "loss" in entry:
            continue
        row = {key: value for step, metrics in memory.rows if step == entry["step"] for key, value in metrics.items()}
        for key in ("eval_loss", "train_runtime", "total_flos"):
            if key in entry:
                name = key if key.startswith("eval_") else f"train/{key}"  # the summary: under the prefix
                assert row[name] == pytest.approx(entry[key], rel=1e-12), (entry["step"], key)


def test_hf_two_eval_datasets_at_one_step_keep_that_step(tmp_path: Path) -> None:
    """eval_dataset={"a": ..., "b": ...}: the Trainer logs two evaluations at each eval step, both with 'epoch';
    eval_b's metrics are at their own step, not carried into the next commit."""
    sys.path.insert(0, str(TESTS))
    import hf_workers

    memory = MemoryAdapter()
    trainer = _hf_trainer(tmp_path, memory)
    trainer.eval_dataset = {"a": hf_workers.dataset(8), "b": hf_workers.dataset(6)}
    trainer.train()
    expected = {e["step"]: e["eval_b_loss"] for e in trainer.state.log_history if "eval_b_loss" in e}
    got = {step: metrics["eval_b_loss"] for step, metrics in memory.rows if "eval_b_loss" in metrics}
    assert sorted(expected) == [2, 4]
    assert got == pytest.approx(expected, rel=1e-12)


QUIET_LIGHTNING = [*LIGHTNING_ADVICE, "ignore:.*configured so 1 batch will be used.*"]


@pytest.mark.filterwarnings(*QUIET_LIGHTNING)
def test_lightning_logger_with_a_journal_keeps_validate_when_test_logs_at_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fit, then validate, then test: Lightning logs both at the last step; the logger's bus, reopened on its
    journal for test, must not rewind (erase) validate's row."""
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning as pl
    from metricbus.adapters.jsonl import read_jsonl

    from metricbus.errors import MetricBusWarning
    from metricbus.integrations.lightning import MetricBusLogger
    from tests import lightning_workers as lw
    from tests.backend_env import isolate_env

    isolate_env(monkeypatch, tmp_path)

    class WithTest(lw.TinyLM):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_metric", float(batch_idx + 1))

    out = tmp_path / "m.jsonl"
    ours = MetricBusLogger(adapters=[f"jsonl:{out}"], journal=str(tmp_path / "journal"), strict=True)
    memory = lw.MemoryLogger()
    trainer = pl.Trainer(
        **{**lw.TRAINER_ARGS, "max_steps": 3}, devices=1, logger=[ours, memory], default_root_dir=tmp_path,
        limit_val_batches=1, limit_test_batches=1,
    )  # fmt: skip
    module = WithTest()
    trainer.fit(module, lw.loader())
    trainer.validate(module, lw.loader())
    with pytest.warns(MetricBusWarning, match="after the run was finalized"):
        trainer.test(module, lw.loader())
    rows = read_jsonl(out)
    val_step = max(step for step, metrics in memory.calls if "val_loss" in metrics)
    assert val_step is not None
    assert [m["val_loss"] for s, m in rows if "val_loss" in m] == [lw.last_values(memory.calls, "val_loss")[val_step]]
    assert [s for s, m in rows if "test_metric" in m] == [val_step + 1]
    assert [s for s, _ in rows] == sorted(s for s, _ in rows)


@pytest.mark.filterwarnings(*QUIET_LIGHTNING)
@pytest.mark.parametrize("every", [1, 2, 3])
def test_lightning_callback_with_two_optimizers_commits_at_lightnings_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """Manual optimization stepping two optimizers per batch (a GAN's shape): global_step advances by 2 per batch,
    Lightning's loggers by 1. The callback's commits have Lightning's steps and log_every_n_steps windows."""
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning as pl
    import torch

    from metricbus.integrations.lightning import MetricBusCallback, metricbus_log
    from tests import lightning_workers as lw
    from tests.backend_env import isolate_env

    isolate_env(monkeypatch, tmp_path)

    class TwoOptimizers(lw.TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            first, second = self.optimizers()  # type: ignore[misc]
            loss = super().training_step(batch, batch_idx)
            metricbus_log(self, "batch", float(batch_idx), agg="sum")
            self.manual_backward(loss)
            for optimizer in (first, second):
                optimizer.step()
                optimizer.zero_grad()
            return loss

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(part.parameters(), lr=0.1) for part in self.net]

    memory, lightning = MemoryAdapter(), lw.MemoryLogger()
    args = {**lw.TRAINER_ARGS, "max_steps": 12, "accumulate_grad_batches": 1, "log_every_n_steps": every}
    trainer = pl.Trainer(
        **args, devices=1, logger=lightning, default_root_dir=tmp_path, callbacks=[MetricBusCallback(adapters=[memory])]
    )
    trainer.fit(TwoOptimizers(), lw.loader())
    assert trainer.global_step == 12  # 6 batches
    theirs = sorted(lw.last_values(lightning.calls, "train_loss"))
    ours = [step for step, _ in memory.rows]
    assert ours == theirs
    batches = {step: metrics["batch"] for step, metrics in memory.rows}
    # each commit holds the batches since the previous one: batch indices (step - every, step]
    assert batches == {step: float(sum(range(max(step - every + 1, 0), step + 1))) for step in ours}


def test_hf_train_twice_with_a_callback_built_bus(tmp_path: Path) -> None:
    """trainer.train() a second time (resuming, or more steps): the callback that built its bus from the config
    builds a new one for it instead of failing the first micro-batch with ClosedError."""
    sys.path.insert(0, str(TESTS))
    import hf_workers

    from metricbus.integrations.hf import MetricBusCallback

    first, second = MemoryAdapter(), MemoryAdapter()
    callback = MetricBusCallback(config={"adapters": [first], "dist": None, "strict": True})
    trainer = hf_workers.build_trainer(tmp_path, callback, logging_steps=2)
    trainer.train()
    callback.config = {"adapters": [second], "dist": None, "strict": True}
    trainer.train()  # closes the first train()'s bus
    callback.close()  # the last one stays open after train() (for evaluate()) until this, or interpreter exit
    for memory in (first, second):
        assert [step for step, metrics in memory.rows if "train/loss" in metrics] == [2, 4]
        assert memory.status == "finished"


def test_hf_a_closed_bus_given_to_the_callback_fails_at_train_begin(tmp_path: Path) -> None:
    """A bus passed in is the caller's: used again by a train() from an earlier step, train() says what to pass
    instead."""
    sys.path.insert(0, str(TESTS))
    import hf_workers

    from metricbus.integrations.hf import HFIntegrationError, MetricBusCallback

    bus = MetricBus(adapters=[MemoryAdapter()], dist=None)
    trainer = hf_workers.build_trainer(tmp_path, MetricBusCallback(bus), logging_steps=2)
    trainer.train()
    with pytest.raises(HFIntegrationError, match="pass a new MetricBus"):
        trainer.train()


def test_hf_evaluate_after_train_is_reported_not_dropped_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """trainer.evaluate() after its owner closed the bus: the callback says its metrics are not logged."""
    memory = MemoryAdapter()
    trainer = _hf_trainer(tmp_path, memory, eval_strategy="no")
    trainer.train()
    trainer.metricbus_callback().bus.close()  # train() leaves a bus passed in open (evaluate() after it is logged)
    rows = list(memory.rows)
    with caplog.at_level("WARNING", logger="metricbus.hf"):
        trainer.evaluate()
    assert memory.rows == rows
    assert "eval_loss" in caplog.text
    assert "not logged" in caplog.text


def _partial(value: float) -> Any:
    bus = MetricBus(dist=None)
    bus.log("batch/tokens", value, agg="sum")
    part = bus.export()
    bus.close()
    return part


def test_gather_partials_refuses_one_partial_for_two_workers() -> None:
    """The same Partial given for two workers would be ingested as two ranks (its sums doubled): refused, named."""
    from metricbus.integrations.ray import gather_partials

    part, other = _partial(1.0), _partial(2.0)
    with pytest.raises(ValueError, match=r"worker 'a' \(index 0\) and worker 'c' \(index 2\)"):
        gather_partials({"a": part, "b": other, "c": {"metrics": part}})
    assert gather_partials({"a": part, "b": other}) == [part, other]


def test_gather_partials_refuses_one_ray_result_for_two_workers(ray_cluster: Any) -> None:
    """One actor's ObjectRef listed under two worker names: refused before waiting, naming both; nothing ingested."""
    from metricbus.integrations.ray import gather_partials
    from tests.ray_workers import PolicyWorker, make_plan

    worker = ray_cluster.remote(num_cpus=0)(PolicyWorker).remote(0)
    try:
        shard = make_plan(ranks=1, updates=1, micro=2, steps=1)[0][0]
        ref = worker.update_actor.remote(0, shard)
        with pytest.raises(ValueError, match=r"worker 'actor_0' \(index 0\) and worker 'actor_1' \(index 1\)"):
            gather_partials({"actor_0": ref, "actor_1": ref}, timeout_s=60)
        (part,) = gather_partials({"actor_0": ref}, timeout_s=60)
        driver = MetricBus(dist=None)
        driver.ingest([part])
        tokens = sum(m.n for update in shard for m in update)
        assert driver.commit(step=0)["batch/tokens"] == tokens
        driver.close()
    finally:
        ray_cluster.kill(worker)


def test_accelerate_a_non_integer_step_leaves_its_values_out(caplog: pytest.LogCaptureFixture) -> None:
    """Accelerator.log(..., step=0.5): reported and left out, not committed with the next step's values."""
    pytest.importorskip("accelerate")
    import numpy as np
    from accelerate import Accelerator

    from metricbus.integrations.accelerate import MetricBusTracker

    memory = MemoryAdapter()
    tracker = MetricBusTracker("proj", bus=MetricBus(adapters=[memory], strict=True, dist=None))
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("proj")
    accelerator.log({"loss": 1.0}, step=0)
    with caplog.at_level("WARNING", logger="metricbus.accelerate"):
        accelerator.log({"loss": 5.0}, step=0.5)  # type: ignore[arg-type]
        accelerator.log({"loss": 7.0}, step=True)  # type: ignore[arg-type]
    accelerator.log({"loss": 3.0}, step=np.int64(2))  # type: ignore[arg-type]
    accelerator.end_training()
    assert memory.rows == [(0, {"loss": 1.0}), (2, {"loss": 3.0})]
    assert "step 0.5 are left out" in caplog.text


@pytest.fixture
def verl_tracking(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """verl 0.9.1's own Tracking with metricbus installed; the class is restored afterwards."""
    from tests import verl_source

    if not verl_source.available():  # a checkout without its own .venv: the sources next to the interpreter
        monkeypatch.setattr(verl_source, "SOURCE", Path(sys.prefix) / "verl-src")
    if not verl_source.available():
        pytest.skip("verl's sources are not installed")
    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    verl_source.verl_modules()
    from verl.utils import tracking

    from metricbus.integrations.verl import install_tracking_backend

    saved = dict(vars(tracking.Tracking))
    install_tracking_backend()
    yield tracking.Tracking
    for key in set(vars(tracking.Tracking)) - set(saved):
        delattr(tracking.Tracking, key)
    for key in ("__init__", "finish", "supported_backend"):
        setattr(tracking.Tracking, key, saved[key])


def test_verl_a_name_the_rules_refuse_is_reported_and_left_out(
    verl_tracking: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """verl logs 'x' and 'x/mean' under a rule emitting 'x' as x/mean, x/max: 'x/mean' is refused with a SpecError.
    It is reported and left out; Tracking.log does not raise and the step's other values stay at their step."""
    memory = MemoryAdapter()
    config = {"metricbus": {"adapters": [memory], "metrics": {"x": ["mean", "max"]}}}
    tracking = verl_tracking("p", "e", default_backend=["metricbus"], config=config)
    with caplog.at_level("WARNING", logger="metricbus.verl"):
        tracking.log({"x": 1.0, "x/mean": 2.0, "y": 1.0}, step=0)
    tracking.log({"y": 3.0}, step=1)
    tracking.finish()
    assert memory.rows == [(0, {"x/mean": 1.0, "x/max": 1.0, "y": 1.0}), (1, {"y": 3.0})]
    assert "'x/mean' at step 0 is left out" in caplog.text


def test_accelerate_a_name_the_rules_refuse_is_reported_and_left_out(caplog: pytest.LogCaptureFixture) -> None:
    """The same collision through Accelerator.log: reported, left out, the other values at their step."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from metricbus.integrations.accelerate import MetricBusTracker

    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None, rules={"x": ["mean", "max"]})
    accelerator = Accelerator(cpu=True, log_with=[MetricBusTracker("proj", bus=bus)])
    accelerator.init_trackers("proj")
    with caplog.at_level("WARNING", logger="metricbus.accelerate"):
        accelerator.log({"x": 1.0, "x/mean": 2.0, "y": 1.0}, step=0)
    accelerator.log({"y": 3.0}, step=1)
    accelerator.end_training()
    assert memory.rows == [(0, {"x/mean": 1.0, "x/max": 1.0, "y": 1.0}), (1, {"y": 3.0})]
    assert "'x/mean' is left out" in caplog.text


def test_hf_nan_error_policy_reports_forwarded_nans(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A bus with nan="error" and a model that went NaN: the Trainer's NaN grad_norm and the NaN token losses are
    reported and left out; training is not stopped by the logging callback and the other values keep their steps."""
    pytest.importorskip("transformers")
    import torch

    sys.path.insert(0, str(TESTS))
    import hf_workers

    from metricbus.integrations.hf import MetricBusCallback

    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], dist=None, nan="error")
    trainer = hf_workers.build_trainer(tmp_path, MetricBusCallback(bus), logging_steps=1)
    with torch.no_grad():
        trainer.model.transformer.wte.weight[1:].fill_(float("nan"))
    with caplog.at_level("WARNING", logger="metricbus.hf"):
        trainer.train()
    assert [step for step, metrics in memory.rows if "train/learning_rate" in metrics] == [1, 2, 3, 4]
    assert all("train/grad_norm" not in metrics for _, metrics in memory.rows)
    assert "'train/grad_norm' at step 1 is left out" in caplog.text


@pytest.mark.filterwarnings(*QUIET_LIGHTNING)
def test_lightning_logger_resumes_its_journal_after_a_restart_from_a_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer restarted from a checkpoint with MetricBusLogger(journal=..., resume=True) continues the run: one
    run id, the steps of both fits in order in the backend (without resume the journal refuses a second run)."""
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning as pl
    from metricbus.adapters.jsonl import read_jsonl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from metricbus.integrations.lightning import MetricBusLogger
    from tests import lightning_workers as lw
    from tests.backend_env import isolate_env

    isolate_env(monkeypatch, tmp_path)
    out, journal = tmp_path / "m.jsonl", str(tmp_path / "journal")

    def fit(max_steps: int, logger: MetricBusLogger, ckpt_path: str | None = None) -> None:
        args = {**lw.TRAINER_ARGS, "max_steps": max_steps, "enable_checkpointing": True}
        checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
        trainer = pl.Trainer(**args, devices=1, logger=logger, default_root_dir=tmp_path, callbacks=[checkpoints])
        trainer.fit(lw.TinyLM(), lw.loader(), ckpt_path=ckpt_path)

    first = MetricBusLogger(adapters=[f"jsonl:{out}"], journal=journal, strict=True)
    fit(3, first)
    (ckpt,) = (tmp_path / "ckpt").glob("*.ckpt")
    second = MetricBusLogger(adapters=[f"jsonl:{out}"], journal=journal, strict=True, resume=True)
    fit(6, second, str(ckpt))
    assert second.version == first.version
    assert [step for step, metrics in read_jsonl(out) if "train_loss" in metrics] == list(range(6))
