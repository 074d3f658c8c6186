"""Review of the framework integrations: HF evaluations and windows, Ray partials one by one, Lightning resume."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from metricbus import Agg, MetricBus
from metricbus.errors import MetricTypeError
from metricbus.testing import MemoryAdapter

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
import hf_workers  # noqa: E402


def _hf(tmp_path: Path, bus: MetricBus, *, steps: int, logging_steps: int, eval_steps: int | None = None) -> Any:
    from transformers import TrainingArguments

    from metricbus.integrations.hf import MetricBusCallback

    evaluation: dict[str, Any] = {"eval_strategy": "steps", "eval_steps": eval_steps} if eval_steps else {}
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=steps, gradient_accumulation_steps=2,
        per_device_train_batch_size=2, logging_steps=logging_steps, report_to="none", save_strategy="no",
        seed=hf_workers.SEED, disable_tqdm=True, dataloader_num_workers=0, **evaluation,
    )  # fmt: skip
    return hf_workers.TruthTrainer(
        model=hf_workers.tiny_model(), args=args, train_dataset=hf_workers.dataset(),
        eval_dataset=hf_workers.dataset(8), data_collator=hf_workers.collate, callbacks=[MetricBusCallback(bus)],
    )  # fmt: skip


def _merged(memory: MemoryAdapter) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    for step, metrics in memory.rows:
        rows.setdefault(step, {}).update(metrics)
    return rows


def test_hf_eval_between_logging_steps_keeps_the_training_window(tmp_path: Path) -> None:
    """An evaluation at step 3 of logging windows 1-2, 3-4: train/loss at 4 is the exact mean of steps 3 and 4."""
    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None)
    trainer = _hf(tmp_path, bus, steps=6, logging_steps=2, eval_steps=3)
    trainer.train()
    bus.close()
    rows = _merged(memory)
    assert "eval_loss" in rows[3]
    assert "train/loss" not in rows[3]
    for step, micro in zip((2, 4, 6), hf_workers.windows(trainer.truth, per_step=2, logging_steps=2), strict=True):
        exact = hf_workers.exact_mean(micro)
        assert abs(rows[step]["train/loss"] - exact) <= 1e-12 * exact, step
        assert rows[step]["train/tokens"] == sum(len(m) for m in micro)


def test_hf_eval_and_summary_after_the_last_logging_step_keep_the_tail(tmp_path: Path) -> None:
    """Steps 4-5 after the last logging step (3), evaluated at 5: the tail is committed at 5, one train/loss."""
    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None)
    trainer = _hf(tmp_path, bus, steps=5, logging_steps=3, eval_steps=5)
    trainer.train()
    rows_at_train_end = list(memory.rows)
    bus.close()
    assert memory.rows == rows_at_train_end  # everything was delivered when train() returned
    rows = _merged(memory)
    exact = hf_workers.exact_mean(trainer.truth[6:])
    assert abs(rows[5]["train/loss"] - exact) <= 1e-12 * exact
    assert sum(1 for step, metrics in memory.rows if "train/loss" in metrics) == 2
    assert {"eval_loss", "train/train_runtime", "train/total_flos"} <= set(rows[5])
    assert [step for step, metrics in memory.rows if "train/train_runtime" in metrics] == [5]


def test_hf_a_bus_with_log_every_above_one_is_refused_before_training(tmp_path: Path) -> None:
    """log_every=2 on the bus: train() raises at its start naming logging_steps; nothing was logged or lost."""
    from metricbus.integrations.hf import HFIntegrationError

    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None, log_every=2)
    trainer = _hf(tmp_path, bus, steps=2, logging_steps=1)
    with pytest.raises(HFIntegrationError, match=r"log_every=2.*logging_steps"):
        trainer.train()
    assert trainer.truth == []
    bus.close()
    assert memory.rows == []


def test_hf_a_config_with_log_every_above_one_is_refused(tmp_path: Path) -> None:
    """A callback-built bus whose config says log_every: 3 is refused (and closed) at train()'s start."""
    from metricbus.integrations.hf import HFIntegrationError, MetricBusCallback

    trainer = _hf(tmp_path, MetricBus(dist=None), steps=2, logging_steps=1)
    trainer.remove_callback(MetricBusCallback)
    trainer.add_callback(MetricBusCallback(config={"adapters": ["console"], "log_every": 3}))
    with pytest.raises(HFIntegrationError, match="log_every=3"):
        trainer.train()
    assert trainer.truth == []


def test_commit_only_keeps_the_other_records_in_their_update() -> None:
    """commit(only=...) commits those names; the others stay buffered, in their updates, for the next commit."""
    memory = MemoryAdapter()
    with MetricBus(adapters=[memory], dist=None) as bus:
        bus.define("loss", "mean")
        bus.define("n", Agg(micro="sum", update="mean"))
        bus.log("loss", 1.0)
        bus.log("n", 1.0)
        bus.end_update()
        bus.log("loss", 3.0)
        bus.log("n", 1.0)
        bus.log("eval", 7.0)
        assert bus.commit(step=1, only=["eval"]) == {"eval": 7.0}
        bus.log("n", 1.0)  # joins the open update: 2 in it, 1 in the first, mean 1.5
        assert bus.commit(step=2) == {"loss": 2.0, "n": 1.5}
        with pytest.raises(MetricTypeError, match="only='loss'"):
            bus.commit(step=3, only="loss")


def test_lightning_a_crash_mid_window_commits_it_at_lightnings_step_and_resume_continues(tmp_path: Path) -> None:
    """log_every_n_steps=4, a checkpoint every 2 steps, a crash before step 7: the window 4..6 is committed at 6
    (not at 4); the fit resumed from the step-6 checkpoint commits 6..7 at 7 and 8..9 at 9, nothing lost."""
    pl = pytest.importorskip("pytorch_lightning")
    import lightning_workers as lw
    from pytorch_lightning.callbacks import ModelCheckpoint

    from metricbus.integrations.lightning import MetricBusCallback

    class Crash(pl.Callback):  # type: ignore[misc]
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 7:
                raise RuntimeError("the node went away")

    def means(records: list[tuple[int, float, float]], steps: range) -> float:
        kept = [(t, n) for s, t, n in records if s in steps]
        return math.fsum(t for t, _ in kept) / sum(n for _, n in kept)

    args = {**lw.TRAINER_ARGS, "enable_checkpointing": True, "max_steps": 10, "log_every_n_steps": 4}
    first, memory = lw.TinyLM(), MemoryAdapter()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(
        **args, devices=1, logger=False, default_root_dir=tmp_path,
        callbacks=[MetricBusCallback(adapters=[memory]), checkpoints, Crash()],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="the node went away"):
        trainer.fit(first, lw.loader())
    ours = {step: metrics["train/loss"] for step, metrics in memory.rows}
    assert sorted(ours) == [3, 6]
    assert abs(ours[6] - means(first.records, range(4, 7))) <= 1e-12
    second, resumed = lw.TinyLM(), MemoryAdapter()
    trainer = pl.Trainer(
        **args, devices=1, logger=False, default_root_dir=tmp_path, callbacks=[MetricBusCallback(adapters=[resumed])]
    )
    from metricbus.errors import MetricBusWarning

    with pytest.warns(MetricBusWarning, match=r"mid-window, 2 optimizer step\(s\) after the commit at step 3"):
        trainer.fit(second, lw.loader(), ckpt_path=str(tmp_path / "ck" / "epoch=0-step=6.ckpt"))
    ours = {step: metrics["train/loss"] for step, metrics in resumed.rows}
    assert sorted(ours) == [7, 9]
    assert abs(ours[7] - means(second.records, range(6, 8))) <= 1e-12
    assert abs(ours[9] - means(second.records, range(8, 10))) <= 1e-12
