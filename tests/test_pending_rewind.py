"""A run resumed from a checkpoint without some backend's adapter (or whose catch-up of it failed) leaves that
backend holding the abandoned timeline after the checkpoint: the next sender, ``metricbus sync`` or a later resumed
bus with that adapter, rewinds it there before it writes (wandb's history only grows: without the rewind the server
keeps none of the resumed steps below the old last one; MLflow's run would not be tagged rewound)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest
from backend_env import isolate_env, read_wandb_history, read_wandb_records

from metricbus import MetricBus
from metricbus.adapter import Status
from metricbus.journal import CursorStore
from metricbus.journal.cursors import adapter_key
from metricbus.replay import sync
from metricbus.testing import MemoryAdapter


class Rewinding(MemoryAdapter):
    """A MemoryAdapter that records its verbs (rewind included) in order."""

    name = "rewinding"
    cursor_key = "rewinding"

    def __init__(self, *, fail_rewind: bool = False) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self.fail_rewind = fail_rewind

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        self.calls.append(("write", step))
        super().write(step=step, metrics=metrics)

    def rewind(self, *, step: int) -> None:
        if self.fail_rewind:
            raise ConnectionError("backend down")
        self.calls.append(("rewind", step))

    def close(self, *, status: Status) -> None:
        self.status = status
        super().close(status=status)


def _run(journal: Path, steps: range, adapters: list[object], *, resume: bool, offset: float = 0.0) -> None:
    bus = MetricBus(dist=None, journal=str(journal), resume=resume, adapters=adapters)
    for step in steps:
        bus.log("loss", offset + step)
        bus.commit(step=step)
    bus.close()


def _resumed_without_it(journal: Path, first: Rewinding) -> None:
    """Steps 0..9 with ``first``, then a resume from step 5 (5..7) without it."""
    _run(journal, range(10), [first], resume=False)
    _run(journal, range(5, 8), [], resume=True, offset=100.0)


def test_sync_rewinds_a_backend_a_resume_left_behind(tmp_path: Path) -> None:
    journal = tmp_path / "j"
    _resumed_without_it(journal, Rewinding())
    assert CursorStore(journal).pending_rewind(Rewinding()) == 5
    synced = Rewinding()
    assert sync(str(journal), [synced]) == {"rewinding": 3}
    assert synced.calls == [("rewind", 5), ("write", 5), ("write", 6), ("write", 7)]
    assert CursorStore(journal).pending_rewind(Rewinding()) is None  # step 7 acknowledged: done
    again = Rewinding()
    assert sync(str(journal), [again]) == {"rewinding": 0}
    assert again.calls == []


def test_a_resumed_bus_with_the_adapter_rewinds_it_first(tmp_path: Path) -> None:
    journal = tmp_path / "j"
    _resumed_without_it(journal, Rewinding())
    live = Rewinding()
    _run(journal, range(8, 9), [live], resume=True, offset=100.0)
    assert live.calls == [("rewind", 5), ("write", 5), ("write", 6), ("write", 7), ("write", 8)]
    assert CursorStore(journal).pending_rewind(Rewinding()) is None


def test_a_rewind_that_fails_at_sync_stays_pending(tmp_path: Path) -> None:
    journal = tmp_path / "j"
    _resumed_without_it(journal, Rewinding())
    failing = Rewinding(fail_rewind=True)
    with pytest.raises(ConnectionError):
        sync(str(journal), [failing])
    assert failing.calls == []
    assert failing.status == "failed"
    assert CursorStore(journal).pending_rewind(Rewinding()) == 5
    synced = Rewinding()
    sync(str(journal), [synced])
    assert synced.calls[0] == ("rewind", 5)


def test_a_catch_up_whose_rewind_failed_leaves_it_to_sync(tmp_path: Path) -> None:
    """The resumed bus has the adapter, but its rewind fails: the adapter is stopped for the run, and sync rewinds."""
    journal = tmp_path / "j"
    _run(journal, range(10), [Rewinding()], resume=False)
    _run(journal, range(5, 8), [Rewinding(fail_rewind=True)], resume=True, offset=100.0)  # reported, stopped
    assert CursorStore(journal).pending_rewind(Rewinding()) == 5
    synced = Rewinding()
    sync(str(journal), [synced])
    assert synced.calls == [("rewind", 5), ("write", 5), ("write", 6), ("write", 7)]


def test_an_older_cursor_record_without_the_field_reads_as_none(tmp_path: Path) -> None:
    store = CursorStore(tmp_path)
    store.directory.mkdir(parents=True)
    key = adapter_key(Rewinding())
    record = {"adapter": "rewinding", "key": key, "step": 3, "identity": None}
    (store.directory / f"{key}.json").write_text(json.dumps(record), encoding="utf-8")
    assert store.pending_rewind(Rewinding()) is None
    assert store.get(Rewinding()) == 3


def test_wandb_gets_its_branch_point_at_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real wandb (offline): the folder sync writes branches the run at step 4 (resume_from), as a live
    rewind's does, so the server takes the resumed steps 5..7 below the old last step 9."""
    from metricbus.adapters.wandb import WandbAdapter

    isolate_env(monkeypatch, tmp_path)
    journal = tmp_path / "j"
    _run(journal, range(10), [WandbAdapter(mode="offline", dir=str(tmp_path))], resume=False)
    _run(journal, range(5, 8), [], resume=True, offset=100.0)
    synced = WandbAdapter(mode="offline", dir=str(tmp_path))
    assert sync(str(journal), [synced]) == {"wandb": 3}
    assert synced.identity is not None
    folder = Path(synced.identity["dir"])
    (run,) = [r.run for r in read_wandb_records(folder) if r.WhichOneof("record_type") == "run"][-1:]
    assert (run.branch_point.metric, run.branch_point.value) == ("_step", 4.0)
    assert [(row["_step"], row["loss"]) for row in read_wandb_history(folder)] == [(5, 105.0), (6, 106.0), (7, 107.0)]


def test_mlflow_is_tagged_rewound_at_sync(tmp_path: Path, sqlite_uri: str) -> None:
    """The real MLflow (sqlite store): sync tags the run rewound at 5, as a live rewind does."""
    from metricbus.adapters.mlflow import MlflowAdapter
    from mlflow.tracking import MlflowClient

    journal = tmp_path / "j"
    live = MlflowAdapter(tracking_uri=sqlite_uri)
    _run(journal, range(10), [live], resume=False)
    _run(journal, range(5, 8), [], resume=True, offset=100.0)
    synced = MlflowAdapter(tracking_uri=sqlite_uri)
    assert sync(str(journal), [synced]) == {"mlflow": 3}
    assert synced.run_id == live.run_id
    run = MlflowClient(tracking_uri=sqlite_uri).get_run(live.run_id)
    assert run.data.tags["metricbus.rewind"] == "5"
    assert run.info.status == "FINISHED"
