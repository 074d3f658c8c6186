"""MetricBusCallback across checkpoints and fit() calls, on a real Lightning Trainer (CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning")

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

from metricbus.errors import ConfigError, MetricBusWarning
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
    root: Path, *, checkpoints: Path | None = None, ckpt_path: str | None = None, weights_only: bool | None = None,
    **options: Any,
) -> list[tuple[int, dict[str, float]]]:
    """One fit() of TinyLM with a MetricBusCallback; the rows its bus emitted."""
    memory = MemoryAdapter()
    callbacks: list[pl.Callback] = [MetricBusCallback(adapters=[memory], strict=True, **options)]
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=4, save_top_k=-1))
    trainer = pl.Trainer(**WINDOWED, devices=1, logger=False, default_root_dir=root, callbacks=callbacks)
    trainer.fit(lw.TinyLM(), lw.loader(), ckpt_path=ckpt_path, weights_only=weights_only)
    return memory.rows


@pytest.mark.parametrize("journal", [False, True])
def test_a_run_resumed_from_a_mid_window_checkpoint_says_its_first_window_lacks_the_steps_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, journal: bool
) -> None:
    """The bus's records are not in checkpoints (the run that saved one commits them itself, at its next logging
    step, its end or its crash: carried into the resumed window they could count twice). Resumed from a checkpoint
    taken one step into the window 3..5: a warning naming that step, the window 4..5 at 5, then the uninterrupted
    run's window 6..7 bit for bit; saving the checkpoints changes nothing; it loads with weights_only=True."""
    isolate_env(monkeypatch, tmp_path)
    uninterrupted = fit_once(tmp_path / "a")
    assert [step for step, _ in uninterrupted] == [2, 5, 7]
    options: dict[str, Any] = {"journal": str(tmp_path / "journal")} if journal else {}
    with_checkpoints = fit_once(tmp_path / "b", checkpoints=tmp_path / "ckpt", **options)
    assert with_checkpoints == uninterrupted
    (ckpt,) = (tmp_path / "ckpt").glob("*step=4.ckpt")
    resuming: dict[str, Any] = {**options, "resume": True} if journal else {}
    with pytest.warns(MetricBusWarning, match=r"mid-window, 1 optimizer step\(s\) after the commit at step 2"):
        resumed = fit_once(tmp_path / "c", ckpt_path=str(ckpt), weights_only=True, **resuming)
    assert [step for step, _ in resumed] == [5, 7]
    assert resumed[1] == uninterrupted[2]


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


def test_two_callbacks_in_one_trainer_checkpoint_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two MetricBusCallbacks (metricbus_log logs into the first) in one Trainer with checkpoints: each notes its
    own window count under its own key, and the resume reads each one's back (each warns): no state_dict key clash,
    and the first's window after the resume is the uninterrupted one."""
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
    with pytest.warns(MetricBusWarning, match="mid-window") as caught:
        first, second = fit_two(tmp_path / "b", str(ckpt))
    assert sum("mid-window" in str(w.message) for w in caught) == 2
    assert ([step for step, _ in first], first[1], second) == ([5, 7], uninterrupted[2], [])
