"""MetricBusCallback across checkpoints and fit() calls, on a real Lightning Trainer (CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning")

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

from metricbus.errors import ConfigError
from metricbus.integrations.lightning import MetricBusCallback
from metricbus.testing import MemoryAdapter
from tests import lightning_workers as lw
from tests.backend_env import isolate_env

pytestmark = [pytest.mark.filterwarnings(f) for f in lw.QUIET]

# 4 optimizer steps per epoch (8 batches, 2 per step), a window of 3 steps: commits at steps 2, 5 and 7 (the end);
# a checkpoint every 4 steps falls mid-window (after step 3 of the window 3..5), at an epoch's end (a plain
# DataLoader resumes there with the same data as the uninterrupted run)
WINDOWED: dict[str, Any] = {
    **lw.TRAINER_ARGS, "max_steps": 8, "log_every_n_steps": 3, "limit_train_batches": 8, "enable_checkpointing": True
}  # fmt: skip


def fit_once(
    root: Path, *, checkpoints: Path | None = None, ckpt_path: str | None = None, **options: Any
) -> list[tuple[int, dict[str, float]]]:
    """One fit() of TinyLM with a MetricBusCallback; the rows its bus emitted."""
    memory = MemoryAdapter()
    callbacks: list[pl.Callback] = [MetricBusCallback(adapters=[memory], strict=True, **options)]
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=4, save_top_k=-1))
    trainer = pl.Trainer(**WINDOWED, devices=1, logger=False, default_root_dir=root, callbacks=callbacks)
    trainer.fit(lw.TinyLM(), lw.loader(), ckpt_path=ckpt_path)
    return memory.rows


@pytest.mark.parametrize("journal", [False, True])
def test_a_run_resumed_from_a_mid_window_checkpoint_emits_the_uninterrupted_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, journal: bool
) -> None:
    """A checkpoint taken mid-window holds the window's records so far: the resumed run's first window (and every
    later one) equals the uninterrupted run's exactly, with or without a journal; taking it changes nothing."""
    isolate_env(monkeypatch, tmp_path)
    uninterrupted = fit_once(tmp_path / "a")
    assert [step for step, _ in uninterrupted] == [2, 5, 7]
    options: dict[str, Any] = {"journal": str(tmp_path / "journal")} if journal else {}
    with_checkpoints = fit_once(tmp_path / "b", checkpoints=tmp_path / "ckpt", **options)
    assert with_checkpoints == uninterrupted
    (ckpt,) = (tmp_path / "ckpt").glob("*step=4.ckpt")
    resuming: dict[str, Any] = {**options, "resume": True} if journal else {}
    resumed = fit_once(tmp_path / "c", ckpt_path=str(ckpt), **resuming)
    assert resumed == uninterrupted[1:]  # bit for bit: steps 5 (steps 3, 4, 5 of the window) and 7


def test_a_mid_window_checkpoint_loads_with_weights_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback's state is plain lists and floats: fit(ckpt_path=..., weights_only=True) resumes it."""
    isolate_env(monkeypatch, tmp_path)
    uninterrupted = fit_once(tmp_path / "a", checkpoints=tmp_path / "ckpt")
    (ckpt,) = (tmp_path / "ckpt").glob("*step=4.ckpt")
    memory = MemoryAdapter()
    trainer = pl.Trainer(
        **WINDOWED, devices=1, logger=False, default_root_dir=tmp_path / "b",
        callbacks=[MetricBusCallback(adapters=[memory], strict=True)],
    )  # fmt: skip
    trainer.fit(lw.TinyLM(), lw.loader(), ckpt_path=str(ckpt), weights_only=True)
    assert memory.rows == uninterrupted[1:]


def test_a_second_fit_with_a_journal_continues_its_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fit(), validate(), then fit() again on the same Trainer to train more: the second fit continues the
    journal's run (same run id, steps 3..5 after 0..2), where it raised JournalError."""
    isolate_env(monkeypatch, tmp_path)
    memory = MemoryAdapter()
    callback = MetricBusCallback(adapters=[memory], journal=str(tmp_path / "journal"), strict=True)
    module = lw.TinyLM()
    trainer = pl.Trainer(
        **{**lw.TRAINER_ARGS, "max_steps": 3}, devices=1, logger=False, default_root_dir=tmp_path, callbacks=[callback]
    )
    trainer.fit(module, lw.loader())
    assert memory.run is not None
    first = memory.run.id
    trainer.validate(module, lw.loader(), verbose=False)
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(module, lw.loader())
    assert [step for step, _ in memory.rows] == [0, 1, 2, 3, 4, 5]
    assert (memory.run.id, memory.status) == (first, "finished")


def test_a_new_trainer_from_step_0_on_the_same_journal_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second fit() from step 0 (a new Trainer, no checkpoint) would rewind the journal's run and erase the first
    fit's steps: a ConfigError at its start saying what to do; the run keeps its steps."""
    isolate_env(monkeypatch, tmp_path)
    memory = MemoryAdapter()
    callback = MetricBusCallback(adapters=[memory], journal=str(tmp_path / "journal"), strict=True)
    args = {**lw.TRAINER_ARGS, "max_steps": 3}
    pl.Trainer(**args, devices=1, logger=False, default_root_dir=tmp_path, callbacks=[callback]).fit(
        lw.TinyLM(), lw.loader()
    )
    trainer = pl.Trainer(**args, devices=1, logger=False, default_root_dir=tmp_path, callbacks=[callback])
    with pytest.raises(ConfigError, match=r"starts at Lightning step 0, at or before step 2 .* another journal"):
        trainer.fit(lw.TinyLM(), lw.loader())
    assert [step for step, _ in memory.rows] == [0, 1, 2]
    assert memory.status == "finished"


def test_two_callbacks_keep_their_own_records_in_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two MetricBusCallbacks (metricbus_log logs into the first): each restores its own state, so the first's
    resumed windows are the uninterrupted ones and the second, which held no records, emits none."""
    isolate_env(monkeypatch, tmp_path)

    def fit_two(root: Path, ckpt_path: str | None = None) -> tuple[list[Any], list[Any]]:
        first, second = MemoryAdapter(), MemoryAdapter()
        callbacks: list[pl.Callback] = [MetricBusCallback(adapters=[first]), MetricBusCallback(adapters=[second])]
        if ckpt_path is None:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1))
        trainer = pl.Trainer(**WINDOWED, devices=1, logger=False, default_root_dir=root, callbacks=callbacks)
        trainer.fit(lw.TinyLM(), lw.loader(), ckpt_path=ckpt_path)
        return first.rows, second.rows

    uninterrupted, none = fit_two(tmp_path / "a")
    assert none == []
    assert [step for step, _ in uninterrupted] == [2, 5, 7]
    (ckpt,) = (tmp_path / "ckpt").glob("*step=4.ckpt")
    assert fit_two(tmp_path / "b", str(ckpt)) == (uninterrupted[1:], [])


DDP_OF_ONE = """
import sys, warnings
from pathlib import Path
sys.path.insert(0, {root!r})
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from metricbus.errors import MetricBusWarning
from metricbus.integrations.lightning import MetricBusCallback
from metricbus.testing import MemoryAdapter
from tests import lightning_workers as lw
from tests.test_lightning_resume import WINDOWED
for quiet in lw.QUIET:
    warnings.filterwarnings("ignore", quiet.partition(":")[2])
tmp = Path({tmp!r})
memory = MemoryAdapter()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", MetricBusWarning)
    trainer = pl.Trainer(**WINDOWED, devices=1, strategy="ddp", logger=False, default_root_dir=tmp,
                         callbacks=[MetricBusCallback(adapters=[memory], strict=True),
                                    ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=4, save_top_k=-1)])
    trainer.fit(lw.TinyLM(), lw.loader())
print("STEPS", [step for step, _ in memory.rows])
print("WARNED", sum("under DDP" in str(w.message) for w in caught if issubclass(w.category, MetricBusWarning)))
"""


def test_a_mid_window_checkpoint_under_ddp_of_one_rank_warns_and_commits(tmp_path: Path) -> None:
    """strategy="ddp" on one device: the bus is a torch.distributed one (its commit a collective of a group of one,
    ingest() refused), so the window's records stay in the bus, with the DDP warning, instead of a DistributedError
    at the next commit. In a process of its own (Lightning leaves the process group initialized)."""
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[1])
    code = DDP_OF_ONE.format(root=root, tmp=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300, cwd=root
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "STEPS [2, 5, 7]" in done.stdout
    assert "WARNED 2" in done.stdout  # the checkpoints at steps 4 and 8, both mid-window
