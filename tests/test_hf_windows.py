"""metricbus.integrations.hf's windows against transformers' own Trainer (tiny GPT-2 from a config, CPU): the
Trainer's logging_steps are the windows, with or without evaluations between them, live and replayed."""

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
from metricbus.integrations.hf import HFIntegrationError, MetricBusCallback  # noqa: E402
from metricbus.journal import read_journal  # noqa: E402
from metricbus.replay import emitted  # noqa: E402
from metricbus.testing import MemoryAdapter  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import hf_workers  # noqa: E402


def _trainer(tmp_path: Path, bus: MetricBus, **overrides: Any) -> Any:
    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"), "use_cpu": True, "max_steps": 7, "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 2, "logging_steps": 2, "report_to": "none", "save_strategy": "no",
        "seed": hf_workers.SEED, "disable_tqdm": True, "dataloader_num_workers": 0, "per_device_eval_batch_size": 2,
    }  # fmt: skip
    return hf_workers.TruthTrainer(
        model=hf_workers.tiny_model(), args=transformers.TrainingArguments(**{**options, **overrides}),
        train_dataset=hf_workers.dataset(), eval_dataset=hf_workers.dataset(8), data_collator=hf_workers.collate,
        callbacks=[MetricBusCallback(bus)],
    )  # fmt: skip


def _points(rows: list[tuple[int, dict[str, float]]], name: str) -> dict[int, float]:
    points = [(step, metrics[name]) for step, metrics in rows if name in metrics]
    assert len({step for step, _ in points}) == len(points), name  # one value per step
    return dict(points)


@pytest.mark.parametrize("eval_steps", [3, 5])
def test_eval_between_logging_steps_keeps_the_windows(tmp_path: Path, eval_steps: int) -> None:
    """logging_steps=2 over 7 steps, evaluated every 3 (or 5) steps and at the last: train/loss and train/tokens
    are at 2, 4, 6 and 7 (the tail), each the exact token mean of its window's micro-batches (an evaluation commits
    its own values alone); eval_loss is at each eval step with the Trainer's value; the journal replays to the same
    rows."""
    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None, journal=str(tmp_path / "j"))
    trainer = _trainer(tmp_path, bus, eval_strategy="steps", eval_steps=eval_steps)
    trainer.train()
    bus.close()
    losses, tokens = _points(memory.rows, "train/loss"), _points(memory.rows, "train/tokens")
    assert sorted(losses) == sorted(tokens) == [2, 4, 6, 7]
    windows = hf_workers.windows(trainer.truth, per_step=2, logging_steps=2)
    for step, micro in zip((2, 4, 6, 7), windows, strict=True):
        exact = hf_workers.exact_mean(micro)
        assert abs(losses[step] - exact) <= 1e-12 * exact, step
        assert tokens[step] == sum(len(m) for m in micro), step
    evals = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    assert sorted(evals) == [*range(eval_steps, 7, eval_steps), 7]  # and at the last step
    assert _points(memory.rows, "eval_loss") == evals
    assert list(emitted(read_journal(tmp_path / "j"))) == memory.rows


def test_evaluate_outside_train_refuses_a_bus_with_log_every_above_one(tmp_path: Path) -> None:
    """A bus with log_every=2 is refused by evaluate() as by train() (HFIntegrationError naming logging_steps),
    before anything is logged: windowed, the evaluation would not be delivered when evaluate() returns and a later
    one would be reduced into it."""
    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None, log_every=2)
    trainer = _trainer(tmp_path, bus)
    with pytest.raises(HFIntegrationError, match=r"log_every=2.*logging_steps"):
        trainer.evaluate()
    bus.close()
    assert memory.rows == []
