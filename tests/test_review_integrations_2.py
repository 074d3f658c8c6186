"""Review (framework integrations, round 2): real Trainers (tiny models from config, CPU), exact references."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from metricbus import MetricBus
from metricbus.testing import MemoryAdapter

TESTS = Path(__file__).resolve().parent


def _hf_trainer(tmp_path: Path, bus: MetricBus, **overrides: Any) -> Any:
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from metricbus.integrations.hf import MetricBusCallback

    sys.path.insert(0, str(TESTS))
    import hf_workers

    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"), "use_cpu": True, "max_steps": 3, "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 2, "logging_steps": 2, "report_to": "none", "save_strategy": "no",
        "seed": hf_workers.SEED, "disable_tqdm": True, "dataloader_num_workers": 0,
    }  # fmt: skip
    args = TrainingArguments(**{**options, **overrides})
    return hf_workers.TruthTrainer(
        model=hf_workers.tiny_model(), args=args, train_dataset=hf_workers.dataset(),
        eval_dataset=hf_workers.dataset(8), data_collator=hf_workers.collate, callbacks=[MetricBusCallback(bus)],
    )  # fmt: skip


def test_hf_num_input_tokens_seen_is_one_series(tmp_path: Path) -> None:
    """include_num_input_tokens_seen: the training log's, the summary's and evaluate()'s counts are one series."""
    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None)
    trainer = _hf_trainer(tmp_path, bus, include_num_input_tokens_seen=True)
    trainer.train()
    trainer.evaluate()
    bus.close()
    assert not [step for step, metrics in memory.rows if "num_input_tokens_seen" in metrics]
    ours = {step: m["train/num_input_tokens_seen"] for step, m in memory.rows if "train/num_input_tokens_seen" in m}
    theirs = {e["step"]: e["num_input_tokens_seen"] for e in trainer.state.log_history}
    assert ours == theirs == {2: theirs[2], 3: trainer.state.num_input_tokens_seen}


def test_hf_callback_without_the_mixin_forwards_the_trainers_loss_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A plain Trainer with the callback (no mixin): its loss is logged as train/loss and said to be inexact."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from metricbus.integrations.hf import MetricBusCallback

    sys.path.insert(0, str(TESTS))
    import hf_workers

    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=2, gradient_accumulation_steps=2,
        per_device_train_batch_size=2, logging_steps=1, report_to="none", save_strategy="no", seed=hf_workers.SEED,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = Trainer(
        model=hf_workers.tiny_model(), args=args, train_dataset=hf_workers.dataset(), data_collator=hf_workers.collate,
        callbacks=[MetricBusCallback(bus)],
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="metricbus.hf"):
        trainer.train()
    bus.close()
    theirs = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    ours = {step: m["train/loss"] for step, m in memory.rows if "train/loss" in m}
    assert ours == theirs
    assert sorted(ours) == [1, 2]
    summary = trainer.state.log_history[-1]["train_loss"]
    assert [m["train/train_loss"] for _, m in memory.rows if "train/train_loss" in m] == [summary]
    assert "not the exact token mean" in caplog.text
    assert "MetricBusTrainerMixin" in caplog.text


def test_hf_the_mixin_keeps_the_trainers_loss_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With the mixin, train/loss is the exact token mean of each window and the Trainer's losses stay out."""
    sys.path.insert(0, str(TESTS))
    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None)
    trainer = _hf_trainer(tmp_path, bus, logging_steps=2)
    with caplog.at_level("WARNING", logger="metricbus.hf"):
        trainer.train()
    bus.close()
    import hf_workers

    exact = [hf_workers.exact_mean(w) for w in hf_workers.windows(trainer.truth, per_step=2, logging_steps=2)]
    ours = [m["train/loss"] for _, m in memory.rows if "train/loss" in m]
    assert len(ours) == len(exact) == 2
    assert all(abs(a - b) <= 1e-12 * b for a, b in zip(ours, exact, strict=True))
    assert not [m for _, m in memory.rows if "train/train_loss" in m]
    assert "not the exact token mean" not in caplog.text


def test_hf_evaluate_before_train_is_logged_and_train_keeps_its_bus(tmp_path: Path) -> None:
    """A baseline evaluate() before train() (bus built from the config) is delivered at step 0, in train()'s run."""
    pytest.importorskip("transformers")
    from metricbus.adapters.jsonl import read_jsonl
    from transformers import TrainingArguments

    from metricbus.integrations.hf import MetricBusCallback

    sys.path.insert(0, str(TESTS))
    import hf_workers

    out = tmp_path / "m.jsonl"
    callback = MetricBusCallback(config={"adapters": [f"jsonl:{out}"], "dist": None})
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=2, gradient_accumulation_steps=2,
        per_device_train_batch_size=2, logging_steps=1, report_to="none", save_strategy="no", seed=hf_workers.SEED,
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = hf_workers.TruthTrainer(
        model=hf_workers.tiny_model(), args=args, train_dataset=hf_workers.dataset(),
        eval_dataset=hf_workers.dataset(8), data_collator=hf_workers.collate, callbacks=[callback],
    )  # fmt: skip
    baseline = trainer.evaluate()
    assert [m["eval_loss"] for _, m in read_jsonl(out) if "eval_loss" in m] == [baseline["eval_loss"]]
    bus = callback.bus
    trainer.train()
    assert callback.bus is bus
    callback.close()
    rows = list(read_jsonl(out))
    assert [step for step, m in rows if "eval_loss" in m] == [0]
    assert [step for step, m in rows if "train/loss" in m] == [1, 2]
