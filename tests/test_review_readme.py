"""README.md read as a new user does: what it shows runs and prints what it says."""

from __future__ import annotations

import io
import re
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from metricbus.adapters.console import ConsoleAdapter

from metricbus import AdapterError, ConfigError, MetricBus

TESTS = Path(__file__).resolve().parent
README = TESTS.parent / "README.md"


def test_readme_says_where_read_jsonl_comes_from(tmp_path: Path) -> None:
    """The README's import for read_jsonl works and reads back what the jsonl adapter wrote."""
    found = re.search(r"`(from metricbus[\w.]* import read_jsonl)`", README.read_text(encoding="utf-8"))
    assert found, "README.md names read_jsonl without saying where to import it from"
    scope: dict[str, object] = {}
    exec(found.group(1), scope)  # the README's own import line
    path = tmp_path / "m.jsonl"
    with MetricBus(adapters=[f"jsonl:{path}"], dist=None, strict=True) as bus:
        bus.log("x", 0.1)
        bus.commit(step=3)
    assert scope["read_jsonl"](path) == [(3, {"x": 0.1})]  # type: ignore[operator]


def test_readme_shows_the_console_form_of_a_histogram() -> None:
    """The console prints a hist value as hist(n=..., p50=...), and the README says so (not just its count)."""
    stream = io.StringIO()
    with MetricBus(adapters=[ConsoleAdapter(stream=stream)], dist=None, strict=True) as bus:
        bus.log("h", [1.0, 2.0, 3.0], agg="hist")
        bus.commit(step=0)
    line = next(line for line in stream.getvalue().splitlines() if line.startswith("step"))
    assert "h hist(n=3, p50=" in line
    assert "the console prints `hist(n=…, p50=…, p90=…, p99=…)`" in README.read_text(encoding="utf-8")


class _SlowAdapter:
    """Takes ``write_s`` per write, so a flush after a commit has to wait for it."""

    name = "slow"

    def __init__(self, write_s: float) -> None:
        self.write_s = write_s

    def open(self, *, run: object) -> None:
        pass

    def write(self, *, step: int, metrics: object) -> None:
        time.sleep(self.write_s)

    def flush(self) -> None:
        pass

    def close(self, *, status: object) -> None:
        pass


def test_flush_returns_false_at_its_timeout_not_a_polling_slice_later() -> None:
    """bus.flush(timeout_s=0.05) with a write still running returns False at about 0.05 s (it took 0.25 s)."""
    with MetricBus(adapters=[_SlowAdapter(write_s=2.0)], dist=None) as bus:
        bus.log("x", 1.0)
        bus.commit(step=0)
        start = time.monotonic()
        flushed = bus.flush(timeout_s=0.05)
        elapsed_s = time.monotonic() - start
        assert flushed is False
        assert elapsed_s < 0.2, elapsed_s
        bus.close(timeout_s=0.1)


def test_hf_epoch_is_one_series_when_evaluation_logs_at_a_training_log_step(tmp_path: Path) -> None:
    """eval_steps == logging_steps: the training log and the evaluation both carry 'epoch'; it was kept twice
    (train/epoch 0.125 and epoch 0.125 at step 2, the same at 4), now once, as train/epoch."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(TESTS))
    import hf_workers
    from transformers import TrainingArguments

    from metricbus.integrations.hf import MetricBusCallback
    from metricbus.testing import MemoryAdapter

    memory = MemoryAdapter()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=4, gradient_accumulation_steps=2,
        per_device_train_batch_size=2, logging_steps=2, report_to="none", save_strategy="no", seed=hf_workers.SEED,
        disable_tqdm=True, dataloader_num_workers=0, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=2,
    )  # fmt: skip
    bus = MetricBus(adapters=[memory], strict=True, dist=None)
    trainer = hf_workers.TruthTrainer(
        model=hf_workers.tiny_model(), args=args, train_dataset=hf_workers.dataset(),
        eval_dataset=hf_workers.dataset(8), data_collator=hf_workers.collate, callbacks=[MetricBusCallback(bus)],
    )  # fmt: skip
    trainer.train()
    bus.close()
    epochs = [(step, name, value) for step, row in memory.rows for name, value in row.items() if "epoch" in name]
    assert epochs == [(2, "train/epoch", 0.125), (4, "train/epoch", 0.25)]
    assert any("eval_loss" in metrics for step, metrics in memory.rows if step == 2)


def test_the_demo_says_how_to_open_what_it_wrote(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's closing hints: TensorBoard with --load_fast=false (the fast loader shows none of the float64
    scalars), and the adapters' default places for bare names (it printed 'jsonl: ' and an empty MLflow URI)."""
    sys.path.insert(0, str(TESTS.parent / "examples"))
    from ppo_grad_accum import how_to_look

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("METRICBUS_ADAPTERS", "jsonl,tensorboard,mlflow")
    lines = how_to_look(Path("out"), {"run": {"project": "demo"}, "journal": "out/journal"})
    assert "  jsonl: runs/demo/<run id>/metrics.jsonl" in lines
    assert "  tensorboard --logdir runs/demo --load_fast=false" in lines
    assert "  mlflow ui --backend-store-uri sqlite:///runs/metricbus/mlflow.db" in lines
    monkeypatch.delenv("METRICBUS_ADAPTERS")
    config = {"adapters": ["tensorboard:out/tb", {"type": "jsonl", "path": "out/m.jsonl"}], "run": {}}
    hints = ["  tensorboard --logdir out/tb --load_fast=false", "  jsonl: out/m.jsonl"]
    assert how_to_look(Path("out"), config)[1:] == hints


def test_readme_tensorboard_snippets_read_what_the_adapter_wrote(tmp_path: Path) -> None:
    """The README's two TensorBoard readers, run as shown: the scalar block and the histogram one-liner (which
    raised KeyError: it never loaded the folder)."""
    pytest.importorskip("tensorboard")
    text = README.read_text(encoding="utf-8")
    block = re.search(r"\*\*Exact values in scripts:\*\*.*?```python\n(.*?)```", text, re.S)
    line = re.search(r"In scripts: `(acc = EventAccumulator\(folder, size_guidance=\{\"histograms\": 0\}\).*?)`", text)
    assert block, "README.md lost its TensorBoard scalar snippet"
    assert line, "README.md lost its TensorBoard histogram snippet"
    folder = str(tmp_path / "tb")
    with MetricBus(adapters=[f"tensorboard:{folder}"], dist=None, strict=True) as bus:
        bus.log("train/loss", 0.1)
        bus.log("h", [1.0, 2.0, 3.0], agg="hist")
        bus.commit(step=2)
    scalars: dict[str, object] = {"folder": folder}
    exec(textwrap.dedent(block.group(1)), scalars)  # the README's own lines (indented in its list)
    assert scalars["points"] == [(2, 0.1)]
    histograms: dict[str, object] = {"folder": folder, "tag": "h"}
    exec(f"from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n{line.group(1)}",
         histograms)  # fmt: skip
    events: Any = histograms["events"]
    assert [(e.step, e.histogram_value.num) for e in events] == [(2, 3.0)]


class _NoOpen(_SlowAdapter):
    """Fails to open."""

    name = "noopen"

    def open(self, *, run: object) -> None:
        raise OSError("backend unreachable")


def test_adapter_reports_say_the_journal_keeps_the_steps_only_where_there_is_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An adapter that cannot open, or a step dropped at a full queue, on a bus without journal=: the message said
    'the journal keeps its steps for `metricbus sync`'; those steps are lost, and it now says so."""
    with pytest.raises(AdapterError) as no_journal:
        MetricBus(adapters=[_NoOpen(write_s=0.0)], dist=None)
    assert "journal keeps" not in str(no_journal.value)
    assert "lost: this bus has no journal=" in str(no_journal.value)
    with pytest.raises(AdapterError) as journaled:
        MetricBus(adapters=[_NoOpen(write_s=0.0)], dist=None, journal=str(tmp_path / "journal"))
    assert "the journal keeps the steps it misses for `metricbus sync`" in str(journaled.value)
    with caplog.at_level("WARNING", logger="metricbus.delivery"):
        bus = MetricBus(adapters=[_SlowAdapter(write_s=0.2)], dist=None, queue_size=1, queue_policy="drop")
        for step in range(4):
            bus.log("x", 1.0)
            bus.commit(step=step)
        bus.close(timeout_s=5)
    drops = [r.getMessage() for r in caplog.records if "queue full" in r.getMessage()]
    assert drops
    assert all("lost: this bus has no journal=" in m and "from the journal" not in m for m in drops)


def test_accelerate_by_name_without_any_config_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Accelerator(log_with="metricbus") with neither $METRICBUS_CONFIG, $METRICBUS_ADAPTERS nor config_source built
    a bus without adapters and dropped every log silently; init_trackers now raises ConfigError saying what to set."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from metricbus.integrations.accelerate import REGISTERED

    if not REGISTERED:
        pytest.skip("this Accelerate has no register_tracker_class")
    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    accelerator = Accelerator(cpu=True, log_with="metricbus")
    with pytest.raises(ConfigError, match=r"no metricbus config.*METRICBUS_CONFIG.*METRICBUS_ADAPTERS.*config_source"):
        accelerator.init_trackers("proj", config={"lr": 1e-3})


def test_hf_callback_without_any_config_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MetricBusCallback() with neither $METRICBUS_CONFIG nor $METRICBUS_ADAPTERS trained with a bus that had no
    adapters (nothing delivered, no warning); train() now raises ConfigError at its start, saying what to set."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(TESTS))
    import hf_workers

    from metricbus.integrations.hf import MetricBusCallback

    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    trainer = hf_workers.build_trainer(tmp_path, MetricBusCallback(), logging_steps=2)
    with pytest.raises(ConfigError, match=r"no metricbus config.*METRICBUS_CONFIG.*METRICBUS_ADAPTERS.*config="):
        trainer.train()
    assert trainer.state.global_step == 0
