"""metricbus.integrations.hf against transformers' own Trainer (tiny GPT-2 from a config, CPU, no downloads).

"Exact" here: the model's float32 per-token cross-entropies (the same kernel on the same logits), summed exactly
(``math.fsum`` of their float64 values) and divided by the label-token count of the logging window.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from metricbus import MetricBus  # noqa: E402
from metricbus.integrations.hf import (  # noqa: E402
    HFIntegrationError,
    MetricBusCallback,
    token_losses,
)
from metricbus.testing import MemoryAdapter  # noqa: E402

WORKERS = Path(__file__).with_name("hf_workers.py")
sys.path.insert(0, str(WORKERS.parent))
import hf_workers  # noqa: E402


@pytest.fixture
def memory() -> MemoryAdapter:
    """An in-memory adapter for the bus."""
    return MemoryAdapter()


def _rows(memory: MemoryAdapter) -> dict[int, dict[str, float]]:
    merged: dict[int, dict[str, float]] = {}
    for step, metrics in memory.rows:  # the Trainer's final summary is a second commit at the last step
        merged.setdefault(step, {}).update(metrics)
    return merged


def _train(tmp_path: Path, memory: MemoryAdapter, *, logging_steps: int = 1) -> tuple[Any, list[list[Any]]]:
    bus = MetricBus(adapters=[memory], strict=True, dist=None)
    trainer = hf_workers.build_trainer(tmp_path, MetricBusCallback(bus), logging_steps=logging_steps)
    trainer.train()
    return trainer, trainer.truth


def test_loss_is_exact_token_mean_per_logging_step(tmp_path: Path, memory: MemoryAdapter) -> None:
    """train/loss at each logging step is the exact token mean of its micro-batches (1e-12)."""
    trainer, truth = _train(tmp_path, memory)
    rows = _rows(memory)
    assert sorted(rows) == [1, 2, 3, 4]
    hf = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    for step, micro in enumerate(hf_workers.windows(truth, per_step=2, logging_steps=1), start=1):
        exact = hf_workers.exact_mean(micro)
        assert len(micro) == 2
        assert abs(rows[step]["train/loss"] - exact) <= 1e-12 * abs(exact)
        assert rows[step]["train/tokens"] == sum(len(m) for m in micro)
        # HF 5.23 divides by the label count before the shift for GPT2LMHeadModel (its loss_type is None, so
        # Trainer._loss_shifts_labels is False): one token per sequence too many. Its loss is that, in float32.
        counts = trainer.label_counts[2 * (step - 1) : 2 * step]
        assert abs(hf[step] - hf_workers.hf_expected(micro, counts)) <= 1e-6 * exact
        assert hf[step] < exact * (1 - 1e-3)
        print(
            f"logging_steps=1 step {step}: HF loss {hf[step]:.9f}, exact {exact:.9f}, HF/exact {hf[step] / exact:.6f}"
        )


def test_hf_means_of_means_over_a_window(tmp_path: Path, memory: MemoryAdapter) -> None:
    """With logging_steps=2 train/loss stays the window's token mean; HF's loss is the mean of update values."""
    trainer, truth = _train(tmp_path, memory, logging_steps=2)
    rows = _rows(memory)
    assert sorted(rows) == [2, 4]
    hf = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    for step, micro in zip((2, 4), hf_workers.windows(truth, per_step=2, logging_steps=2), strict=True):
        exact = hf_workers.exact_mean(micro)
        assert abs(rows[step]["train/loss"] - exact) <= 1e-12 * abs(exact)
        first = 4 * (step // 2 - 1)
        counts = trainer.label_counts[first : first + 4]
        updates = [hf_workers.hf_expected(micro[:2], counts[:2]), hf_workers.hf_expected(micro[2:], counts[2:])]
        assert abs(hf[step] - sum(updates) / 2) <= 1e-6 * exact
        print(f"logging_steps=2 step {step}: HF loss {hf[step]:.9f}, exact {exact:.9f}")


def test_forwards_trainer_logs_and_flushes_at_train_end(tmp_path: Path, memory: MemoryAdapter) -> None:
    """grad_norm and learning_rate are forwarded under the prefix; every step is delivered and flushed when train()
    returns; the bus passed in stays open (for an evaluate() after train()) until its owner closes it."""
    trainer, _ = _train(tmp_path, memory)
    rows = _rows(memory)
    assert sorted(rows) == [1, 2, 3, 4]
    assert memory.flushes >= 1
    assert {"train/grad_norm", "train/learning_rate"} <= set(rows[1])
    callback = trainer.metricbus_callback()
    assert callback.bus is not None
    assert not callback.bus.closed
    callback.bus.close()
    assert memory.status == "finished"


def test_tail_after_last_logging_step_is_committed(tmp_path: Path, memory: MemoryAdapter) -> None:
    """Steps after the last logging step are committed at the final step at train end."""
    _, truth = _train(tmp_path, memory, logging_steps=3)
    rows = _rows(memory)
    assert sorted(rows) == [3, 4]
    exact = hf_workers.exact_mean(truth[6:])
    assert abs(rows[4]["train/loss"] - exact) <= 1e-12 * abs(exact)


def test_bus_built_from_env_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a bus the callback builds one from $METRICBUS_ADAPTERS with the Trainer's args as run config."""
    out = tmp_path / "m.jsonl"
    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    monkeypatch.setenv("METRICBUS_ADAPTERS", f"jsonl:{out}")
    trainer = hf_workers.build_trainer(tmp_path, MetricBusCallback(), logging_steps=2)
    trainer.train()
    from metricbus.adapters.jsonl import read_jsonl

    rows = read_jsonl(out)
    assert [step for step, metrics in rows if "train/loss" in metrics] == [2, 4]
    bus = trainer.metricbus_callback().bus
    assert bus is not None
    assert bus.run.config["gradient_accumulation_steps"] == 2


def test_mixin_without_callback_says_how_to_fix(tmp_path: Path) -> None:
    """The mixin without a MetricBusCallback raises HFIntegrationError naming the fix."""
    trainer = hf_workers.build_trainer(tmp_path, None, logging_steps=1)
    with pytest.raises(HFIntegrationError, match="callbacks=\\[MetricBusCallback"):
        trainer.train()


def test_token_losses_match_model_loss() -> None:
    """token_losses summed / counted equals the model's own loss for a causal LM."""
    model = hf_workers.tiny_model()
    batch = hf_workers.collate([[1, 2, 3, 4, 5], [6, 7, 8]])
    out = model(**batch)
    losses, mask = token_losses(out.logits, batch["labels"], shift=True)
    assert int(mask.sum()) == 4 + 2
    assert abs(float(losses.sum() / mask.sum()) - float(out.loss.detach())) < 1e-6


def test_import_metricbus_does_not_import_transformers() -> None:
    """`import metricbus` leaves transformers and accelerate unimported."""
    code = "import sys, metricbus; print('transformers' in sys.modules, 'accelerate' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.slow
def test_ddp_two_ranks_exact(tmp_path: Path) -> None:
    """2 gloo ranks (torch.distributed.run): train/loss is the exact token mean over both ranks' micro-batches."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HF_WORKERS_OUT": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKERS)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows, truth, hf, counts = hf_workers.read_ddp(tmp_path)
    rows = {step: metrics for step, metrics in rows.items() if "train/loss" in metrics}
    assert sorted(rows) == [1, 2, 3, 4]
    for step in rows:
        micro = truth[0][step] + truth[1][step]  # both ranks' micro-batches of that update
        exact = hf_workers.exact_mean(micro)
        assert abs(rows[step]["train/loss"] - exact) <= 1e-12 * abs(exact)
        assert rows[step]["train/tokens"] == sum(len(m) for m in micro)
        both = counts[0][2 * (step - 1) : 2 * step] + counts[1][2 * (step - 1) : 2 * step]
        assert abs(hf[step] - hf_workers.hf_expected(micro, both)) <= 1e-6 * exact  # HF: global count, pre-shift
        print(f"ddp step {step}: HF loss {hf[step]:.9f}, exact {exact:.9f}, HF/exact {hf[step] / exact:.6f}")


def test_exact_mean_is_fsum() -> None:
    """The reference: fsum of float64 per-token losses over the token count."""
    assert hf_workers.exact_mean([[0.1, 0.2], [0.3]]) == math.fsum([0.1, 0.2, 0.3]) / 3
