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
