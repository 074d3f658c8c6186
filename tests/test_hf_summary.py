"""The Trainer's end-of-training summary through metricbus.integrations.hf: one series per quantity, named under
the prefix like the training logs, at the last step (transformers' own Trainer, tiny GPT-2 from a config, CPU)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from metricbus import MetricBus  # noqa: E402
from metricbus.integrations.hf import MetricBusCallback  # noqa: E402
from metricbus.testing import MemoryAdapter  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import hf_workers  # noqa: E402
import tb_reader  # noqa: E402

# Trainer._finalize_training's log (speed_metrics("train", ...), total_flos, train_loss)
SUMMARY = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos")


def _trainer(tmp_path: Path, bus: MetricBus, *, mixin: bool = True, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"), "use_cpu": True, "max_steps": 4, "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 2, "logging_steps": 2, "report_to": "none", "save_strategy": "no",
        "seed": hf_workers.SEED, "disable_tqdm": True, "dataloader_num_workers": 0,
    }  # fmt: skip
    args = transformers.TrainingArguments(**{**options, **overrides})
    kind = hf_workers.TruthTrainer if mixin else transformers.Trainer
    return kind(
        model=hf_workers.tiny_model(), args=args, train_dataset=hf_workers.dataset(),
        data_collator=hf_workers.collate, callbacks=[MetricBusCallback(bus)],
    )  # fmt: skip


def _series(memory: MemoryAdapter) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for step, metrics in memory.rows:
        for name, value in metrics.items():
            series.setdefault(name, []).append((step, value))
    return series


def test_summary_is_named_under_the_prefix_once_at_the_last_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """include_num_input_tokens_seen: train_runtime is in every training log and in the summary; it is one series,
    train/train_runtime, whose last point is the summary's; every summary quantity is train/<key> once, at the last
    step, with the Trainer's value (MemoryAdapter and TensorBoard's own reader); nothing is reported."""
    from metricbus.adapters.tensorboard import TensorBoardAdapter

    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory, TensorBoardAdapter(log_dir=tmp_path / "tb")], strict=True, dist=None)
    trainer = _trainer(tmp_path, bus, include_num_input_tokens_seen="all")
    with caplog.at_level("WARNING", logger="metricbus.hf"):
        trainer.train()
    bus.close()
    assert caplog.text == ""
    history = trainer.state.log_history
    summary, training = history[-1], [e for e in history if "loss" in e]
    assert set(SUMMARY) <= set(summary)
    assert [e["step"] for e in training] == [2, 4]
    assert all("train_runtime" in e for e in training)
    series = _series(memory)
    assert not {name for name in series if not name.startswith("train/")}  # one naming for the Trainer's logs
    for key in SUMMARY:
        expected = [(e["step"], e[key]) for e in training[:-1] if key in e] + [(4, summary[key])]
        assert series[f"train/{key}"] == expected, key
        assert tb_reader.read_tensors(tmp_path / "tb", f"train/{key}") == expected, key
    tokens_per_second = [(e["step"], e["train_tokens_per_second"]) for e in training]
    assert series["train/train_tokens_per_second"] == tokens_per_second
    seen = [(2, training[0]["num_input_tokens_seen"]), (4, summary["num_input_tokens_seen"])]
    assert series["train/num_input_tokens_seen"] == seen
    assert "train/train_loss" not in series  # the mixin's exact train/loss replaces the Trainer's run mean


def test_summary_train_loss_without_the_mixin_is_train_train_loss(tmp_path: Path) -> None:
    """A plain Trainer: the summary's train_loss (forwarded, not replaced) is train/train_loss at the last step,
    next to train/loss of the training logs; the summary's other quantities are train/<key> there too."""
    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None)
    trainer = _trainer(tmp_path, bus, mixin=False, logging_steps=3)
    trainer.train()
    bus.close()
    summary = trainer.state.log_history[-1]
    series = _series(memory)
    assert series["train/train_loss"] == [(4, summary["train_loss"])]
    assert [step for step, _ in series["train/loss"]] == [3]  # the Trainer logs no loss for the tail (step 4)
    for key in SUMMARY:
        assert series[f"train/{key}"] == [(4, summary[key])], key
    assert not {name for name in series if not name.startswith("train/")}


def test_summary_total_flos_with_the_callback_added_after_the_printer(tmp_path: Path) -> None:
    """trainer.add_callback(MetricBusCallback(bus)) puts it after HF's PrinterCallback (disable_tqdm=True), which
    pops total_flos from the logs dict the callbacks share: train/total_flos is still at the last step."""
    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None)
    trainer = _trainer(tmp_path, bus)
    trainer.remove_callback(MetricBusCallback)
    trainer.add_callback(MetricBusCallback(bus))
    kinds = [type(callback).__name__ for callback in trainer.callback_handler.callbacks]
    assert kinds.index("PrinterCallback") < kinds.index("MetricBusCallback")
    trainer.train()
    bus.close()
    summary = trainer.state.log_history[-1]
    series = _series(memory)
    for key in SUMMARY:
        assert series[f"train/{key}"] == [(4, summary[key])], key


def test_an_early_stop_decided_after_the_last_training_log_reports_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop decided in on_evaluate (as EarlyStoppingCallback does), after the step's training log went out with
    its train_runtime: the summary's train_runtime at that step is the same quantity again, left out without a
    report; the series keeps one point per logging step."""

    class StopAt4(transformers.TrainerCallback):  # type: ignore[misc]
        def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step >= 4:
                control.should_training_stop = True

    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=8, gradient_accumulation_steps=2,
        per_device_train_batch_size=2, logging_steps=2, report_to="none", save_strategy="no", seed=hf_workers.SEED,
        disable_tqdm=True, dataloader_num_workers=0, include_num_input_tokens_seen="all", eval_strategy="steps",
        eval_steps=2,
    )  # fmt: skip
    trainer = hf_workers.TruthTrainer(
        model=hf_workers.tiny_model(), args=args, train_dataset=hf_workers.dataset(),
        eval_dataset=hf_workers.dataset(), data_collator=hf_workers.collate,
        callbacks=[MetricBusCallback(bus), StopAt4()],
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="metricbus.hf"):
        trainer.train()
    bus.close()
    assert not [r for r in caplog.records if r.name == "metricbus.hf"], caplog.text
    assert [step for step, _ in _series(memory)["train/train_runtime"]] == [2, 4]
    assert [step for step, _ in _series(memory)["train/total_flos"]] == [4]
