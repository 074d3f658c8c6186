"""The wandb adapter, run offline and read back from the run's own ``.wandb`` file."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from backend_env import isolate_env, read_wandb_history, read_wandb_records
from metricbus.adapters.wandb import WandbAdapter

from metricbus.adapter import RunInfo
from metricbus.registry import make_adapter


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME, WANDB_DIR, XDG_CONFIG_HOME inside tmp_path; offline and silent."""
    return isolate_env(monkeypatch, tmp_path)


def _offline_run(tmp_path: Path, rows: list[dict[str, float]], *, status: Any) -> Path:
    """Write ``rows`` at steps 0, 2, 4, ... and return the run folder."""
    adapter = WandbAdapter(mode="offline", dir=tmp_path / "wb", project="proj")
    adapter.open(run=RunInfo(project="ignored", name="run-w", tags=("t1", "t2"), config={"lr": 0.25, "opt": {"b": 2}}))
    run_dir = Path(adapter.run.dir).parent
    for i, metrics in enumerate(rows):
        adapter.write(step=2 * i, metrics=metrics)
    adapter.flush()
    adapter.close(status=status)
    return run_dir


def test_history_matches_every_point(tmp_path: Path) -> None:
    """Each written step is one history row with the same step and exactly the same values."""
    rows = [{"train/loss": 1.0 / (i + 3), "acc": i / 9.0, "tiny": 1e-300 * i} for i in range(40)]
    rows[5]["nan"] = math.nan
    history = read_wandb_history(_offline_run(tmp_path, rows, status="finished"))
    assert [h["_step"] for h in history] == [2 * i for i in range(len(rows))]
    for got, want in zip(history, rows, strict=True):
        user = {k: v for k, v in got.items() if not k.startswith("_")}
        assert user.keys() == want.keys()
        for key, value in want.items():
            assert user[key] == value or (math.isnan(value) and math.isnan(user[key]))


def _record(run_dir: Path, kind: str) -> Any:
    found = [r for r in read_wandb_records(run_dir) if r.WhichOneof("record_type") == kind]
    assert found, f"no {kind} record"
    return getattr(found[-1], kind)


def test_finished_run_exits_zero_with_metadata(tmp_path: Path) -> None:
    """close("finished") writes exit code 0; project, name, tags and config reach the run record."""
    run_dir = _offline_run(tmp_path, [{"a": 1.0}], status="finished")
    assert _record(run_dir, "exit").exit_code == 0
    run = _record(run_dir, "run")
    assert run.project == "proj"
    assert run.display_name == "run-w"
    assert list(run.tags) == ["t1", "t2"]
    config = {item.key: item.value_json for item in run.config.update}
    assert config["lr"] == "0.25"


def test_failed_run_exits_one(tmp_path: Path) -> None:
    """close("failed") finishes the wandb run with exit code 1."""
    run_dir = _offline_run(tmp_path, [{"a": 1.0}], status="failed")
    assert _record(run_dir, "exit").exit_code == 1


def test_uri_spec_sets_project() -> None:
    """``wandb:<project>`` builds an adapter for that project (opening nothing)."""
    adapter = make_adapter("wandb:my-project")
    assert isinstance(adapter, WandbAdapter)
    assert adapter.project == "my-project"
    assert adapter.run is None
