"""When the trainer integrations open, flush and close their bus, on the real trainers (HF Trainer, Lightning):
``trainer.evaluate()`` after ``train()`` is delivered at the Trainer's step; a bus the callback built is closed at
the next ``train()`` or at interpreter exit; a bus that cannot take a run fails where the run starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from metricbus import MetricBus
from metricbus.errors import ClosedError
from metricbus.testing import MemoryAdapter

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
LIGHTNING_ADVICE = [  # Lightning's advice for real runs, not about what these tests check (test_review_integrations)
    "ignore:.*does not have many workers.*",
    "ignore:.*smaller than the logging interval.*",
    "ignore:.*GPU available but not used.*",
    "ignore:.*litlogger.*",
    "ignore:.*no `val_dataloader`.*",
]


def _hf_trainer(tmp_path: Path, callback: Any) -> Any:
    """The tiny GPT-2 Trainer of tests/hf_workers.py, 4 steps, logging every 2, with an eval set and no eval."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(TESTS))
    import hf_workers
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=4, gradient_accumulation_steps=2,
        per_device_train_batch_size=2, logging_steps=2, report_to="none", save_strategy="no", seed=hf_workers.SEED,
        disable_tqdm=True, dataloader_num_workers=0, per_device_eval_batch_size=2,
    )  # fmt: skip
    return hf_workers.TruthTrainer(
        model=hf_workers.tiny_model(), args=args, train_dataset=hf_workers.dataset(),
        eval_dataset=hf_workers.dataset(8), data_collator=hf_workers.collate, callbacks=[callback],
    )  # fmt: skip


def _eval_rows(memory: MemoryAdapter) -> dict[int, float]:
    return {step: metrics["eval_loss"] for step, metrics in memory.rows if "eval_loss" in metrics}


def test_hf_evaluate_after_train_is_delivered_at_the_trainers_step(tmp_path: Path) -> None:
    """trainer.evaluate() after train() (a bus passed in): its metrics are delivered at state.global_step by the
    time evaluate() returns, with the Trainer's values; the bus stays the caller's to close."""
    from metricbus.integrations.hf import MetricBusCallback

    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], strict=True, dist=None)
    trainer = _hf_trainer(tmp_path, MetricBusCallback(bus))
    trainer.train()
    assert [step for step, metrics in memory.rows if "train/loss" in metrics] == [2, 4]  # delivered at return
    metrics = trainer.evaluate()
    assert _eval_rows(memory) == {4: pytest.approx(metrics["eval_loss"], rel=1e-12)}
    assert not bus.closed
    bus.close()
    assert memory.status == "finished"


def test_hf_a_bus_the_callback_built_stays_open_for_evaluate_and_closes_at_the_next_train(tmp_path: Path) -> None:
    """A bus built from the config: flushed at train end (every step delivered), open for evaluate(), closed as
    finished when the next train() builds its own; callback.close() closes the last one."""
    from metricbus.integrations.hf import MetricBusCallback

    first, second = MemoryAdapter(), MemoryAdapter()
    callback = MetricBusCallback(config={"adapters": [first], "dist": None, "strict": True})
    trainer = _hf_trainer(tmp_path, callback)
    trainer.train()
    assert [step for step, metrics in first.rows if "train/loss" in metrics] == [2, 4]
    assert first.flushes >= 1
    assert first.status is None
    metrics = trainer.evaluate()
    assert _eval_rows(first) == {4: pytest.approx(metrics["eval_loss"], rel=1e-12)}
    callback.config = {"adapters": [second], "dist": None, "strict": True}
    trainer.train()
    assert first.status == "finished"
    assert [step for step, metrics in second.rows if "train/loss" in metrics] == [2, 4]
    callback.close()
    assert second.status == "finished"


CLOSED_AT_EXIT = """
import json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
import hf_workers
from transformers import TrainingArguments
from metricbus.integrations.hf import MetricBusCallback
from metricbus.testing import MemoryAdapter

class Recorder(MemoryAdapter):
    def close(self, *, status):
        Path({out!r}).write_text(json.dumps({{"status": status, "rows": self.rows}}))

args = TrainingArguments(
    output_dir={tmp!r}, use_cpu=True, max_steps=4, gradient_accumulation_steps=2, per_device_train_batch_size=2,
    logging_steps=2, report_to="none", save_strategy="no", seed=hf_workers.SEED, disable_tqdm=True,
    dataloader_num_workers=0, per_device_eval_batch_size=2,
)
callback = MetricBusCallback(config={{"adapters": [Recorder()], "dist": None, "strict": True}})
trainer = hf_workers.TruthTrainer(
    model=hf_workers.tiny_model(), args=args, train_dataset=hf_workers.dataset(),
    eval_dataset=hf_workers.dataset(8), data_collator=hf_workers.collate, callbacks=[callback],
)
trainer.train()
print(json.dumps(trainer.evaluate()["eval_loss"]))
"""


def test_hf_a_bus_the_callback_built_is_closed_at_interpreter_exit(tmp_path: Path) -> None:
    """A script that ends after train(); evaluate() without closing anything: its bus is closed as finished at
    exit, with every training step and the evaluation delivered."""
    pytest.importorskip("transformers")
    out = tmp_path / "closed.json"
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(CLOSED_AT_EXIT).format(tests=str(TESTS), out=str(out), tmp=str(tmp_path)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    closed = json.loads(out.read_text())
    assert closed["status"] == "finished"
    rows = closed["rows"]
    assert [step for step, metrics in rows if "train/loss" in metrics] == [2, 4]
    eval_loss = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(step, metrics["eval_loss"]) for step, metrics in rows if "eval_loss" in metrics] == [(4, eval_loss)]


def test_hf_a_bus_closed_by_its_owner_fails_at_train_begin(tmp_path: Path) -> None:
    """A bus passed in and closed by the caller: train() fails at on_train_begin saying what to pass instead."""
    from metricbus.integrations.hf import HFIntegrationError, MetricBusCallback

    bus = MetricBus(adapters=[MemoryAdapter()], dist=None)
    bus.close()
    trainer = _hf_trainer(tmp_path, MetricBusCallback(bus))
    with pytest.raises(HFIntegrationError, match=r"is closed.*pass a new MetricBus"):
        trainer.train()
    assert trainer.truth == []  # not a single micro-batch ran


def test_hf_a_bus_past_the_trainers_step_fails_at_train_begin(tmp_path: Path) -> None:
    """The same open bus for a second train() from step 0: the bus holds step 4, so train() fails at
    on_train_begin (its steps would go back) instead of leaving every log out."""
    from metricbus.integrations.hf import HFIntegrationError, MetricBusCallback

    memory = MemoryAdapter()
    bus = MetricBus(adapters=[memory], dist=None)
    trainer = _hf_trainer(tmp_path, MetricBusCallback(bus))
    trainer.train()
    rows = list(memory.rows)
    with pytest.raises(HFIntegrationError, match=r"step 4.*pass a new MetricBus"):
        trainer.train()
    bus.close()
    assert memory.rows == rows


@pytest.mark.filterwarnings(*LIGHTNING_ADVICE)
def test_lightning_a_closed_bus_given_to_the_callback_fails_at_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MetricBusCallback(bus) for a second fit(): teardown of the first closed the bus, so the second fit() fails
    at setup saying what to pass instead, before training_step runs."""
    pytest.importorskip("pytorch_lightning")
    import pytorch_lightning as pl

    from metricbus.integrations.lightning import MetricBusCallback
    from tests import lightning_workers as lw
    from tests.backend_env import isolate_env

    isolate_env(monkeypatch, tmp_path)
    memory = MemoryAdapter()
    callback = MetricBusCallback(MetricBus(adapters=[memory], dist=None))
    module = lw.TinyLM()

    def fit() -> None:
        trainer = pl.Trainer(
            **lw.TRAINER_ARGS, devices=1, logger=False, default_root_dir=tmp_path, callbacks=[callback]
        )  # fmt: skip
        trainer.fit(module, lw.loader())

    fit()
    assert memory.status == "finished"
    done = len(module.records)
    with pytest.raises(ClosedError, match=r"setup.*pass a new MetricBus.*MetricBusCallback\(adapters="):
        fit()
    assert len(module.records) == done  # training_step never ran


def test_hf_a_bus_the_callback_built_for_a_train_that_raised_closes_as_failed(tmp_path: Path) -> None:
    """train() raised mid-run (its bus left open, not flushed by on_train_end): the next train() closes that bus as
    failed before building its own."""
    from transformers import TrainerCallback

    from metricbus.integrations.hf import MetricBusCallback

    class Boom(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 3:
                raise RuntimeError("boom")

    first, second = MemoryAdapter(), MemoryAdapter()
    callback = MetricBusCallback(config={"adapters": [first], "dist": None, "strict": True})
    trainer = _hf_trainer(tmp_path, callback)
    trainer.add_callback(Boom)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    trainer.remove_callback(Boom)
    callback.config = {"adapters": [second], "dist": None, "strict": True}
    trainer.train()
    assert first.status == "failed"
    assert [step for step, metrics in first.rows if "train/loss" in metrics][:1] == [2]
    callback.close()
    assert [step for step, metrics in second.rows if "train/loss" in metrics] == [2, 4]
    assert second.status == "finished"
