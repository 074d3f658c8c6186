"""The wandb adapter, run offline and read back from the run's own ``.wandb`` files."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import wandb
from backend_env import (
    isolate_env,
    read_wandb_history,
    read_wandb_records,
    read_wandb_records_now,
    wandb_history_of,
)
from metricbus.adapters.wandb import MODES, WandbAdapter

from metricbus.adapter import RunInfo
from metricbus.errors import AdapterNotFoundError, ConfigError
from metricbus.histogram import Histogram
from metricbus.registry import make_adapter

RUN_ID = "20261203-150237-df2645"


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """HOME, WANDB_DIR (tmp_path), XDG_CONFIG_HOME inside tmp_path; offline and silent.

    wandb reads its environment once per process (``wandb.setup``), so it is torn down around each test: the
    WANDB_* variables a test sets take effect, and none leak into the next test.
    """
    wandb.teardown()
    root = isolate_env(monkeypatch, tmp_path)
    yield root
    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()


def _run_dir(adapter: WandbAdapter) -> Path:
    identity = adapter.identity
    assert identity is not None
    return Path(identity["dir"])


def _record(run_dir: Path, kind: str) -> Any:
    found = [r for r in read_wandb_records(run_dir) if r.WhichOneof("record_type") == kind]
    assert found, f"no {kind} record"
    return getattr(found[-1], kind)


def _steps(run_dir: Path) -> list[int]:
    return [row["_step"] for row in read_wandb_history(run_dir)]


def _user(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if not k.startswith("_")}


def _offline_run(tmp_path: Path, rows: list[dict[str, float]], *, status: Any) -> Path:
    """Write ``rows`` at steps 0, 2, 4, ... and return the run folder."""
    adapter = WandbAdapter(mode="offline", dir=tmp_path / "wb", project="proj")
    adapter.open(run=RunInfo(project="ignored", name="run-w", tags=("t1", "t2"), config={"lr": 0.25, "opt": {"b": 2}}))
    for i, metrics in enumerate(rows):
        adapter.write(step=2 * i, metrics=metrics)
    adapter.flush()
    adapter.close(status=status)
    return _run_dir(adapter)


def _open(run: RunInfo | None = None, **options: Any) -> WandbAdapter:
    adapter = WandbAdapter(**options)
    adapter.open(run=run or RunInfo(id=RUN_ID))
    return adapter


def _write_close(adapter: WandbAdapter, steps: range, *, offset: float = 0.0) -> Path:
    for step in steps:
        adapter.write(step=step, metrics={"x": offset + step})
    adapter.close(status="finished")
    return _run_dir(adapter)


def test_history_matches_every_point(tmp_path: Path) -> None:
    """Each written step is one history row with the same step and exactly the same values."""
    rows = [{"train/loss": 1.0 / (i + 3), "acc": i / 9.0, "tiny": 1e-300 * i} for i in range(40)]
    rows[5]["nan"] = math.nan
    history = read_wandb_history(_offline_run(tmp_path, rows, status="finished"))
    assert [h["_step"] for h in history] == [2 * i for i in range(len(rows))]
    for got, want in zip(history, rows, strict=True):
        user = _user(got)
        assert user.keys() == want.keys()
        for key, value in want.items():
            assert user[key] == value or (math.isnan(value) and math.isnan(user[key]))


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


def test_run_id_is_the_runs_id(tmp_path: Path) -> None:
    """The wandb run id is RunInfo.id; identity names it, the project and the run folder (under WANDB_DIR)."""
    adapter = _open(RunInfo(project="p1", id=RUN_ID))
    run_dir = _write_close(adapter, range(2))
    assert adapter.identity == {"run_id": RUN_ID, "project": "p1", "dir": str(run_dir)}
    assert run_dir.parent == tmp_path / "wandb"
    assert run_dir.name.startswith("offline-run-")
    assert run_dir.name.endswith(RUN_ID)
    assert _record(run_dir, "run").run_id == RUN_ID


def test_two_opens_write_one_wandb_run() -> None:
    """A resumed adapter (same RunInfo.id) writes a second offline folder of the same wandb run id, resume allowed."""
    first = _open()
    first_dir = _write_close(first, range(3))
    second = WandbAdapter()
    second.resume(after_step=2, identity=first.identity)
    second.open(run=RunInfo(id=RUN_ID))
    second_dir = _write_close(second, range(3, 5))
    assert second_dir != first_dir
    for run_dir in (first_dir, second_dir):
        run = _record(run_dir, "run")
        assert (run.run_id, run.resume) == (RUN_ID, True)
    assert _steps(first_dir) == [0, 1, 2]
    assert _steps(second_dir) == [3, 4]


def test_resume_keeps_the_identitys_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """resume() with an identity reopens that wandb run and project, even if RunInfo and WANDB_PROJECT differ."""
    first = _open(RunInfo(project="kept", id=RUN_ID))
    _write_close(first, range(1))
    wandb.teardown()  # a new process, with another environment
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    second = WandbAdapter()
    second.resume(after_step=0, identity=first.identity)
    second.open(run=RunInfo(project="other", id="20261203-160000-aaaaaa"))
    run_dir = _write_close(second, range(1, 2))
    run = _record(run_dir, "run")
    assert (run.run_id, run.project) == (RUN_ID, "kept")


def test_env_project_and_group_used_when_options_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """WANDB_PROJECT, WANDB_RUN_GROUP, WANDB_JOB_TYPE and WANDB_NOTES win over metricbus's run."""
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("WANDB_RUN_GROUP", "env-group")
    monkeypatch.setenv("WANDB_JOB_TYPE", "env-job")
    monkeypatch.setenv("WANDB_NOTES", "env notes")
    run = _record(_write_close(_open(RunInfo(project="mb-project", id=RUN_ID)), range(1)), "run")
    assert (run.project, run.run_group, run.job_type, run.notes) == ("env-project", "env-group", "env-job", "env notes")


def test_explicit_options_win_over_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """project, group, job_type, notes and dir given to the adapter win over WANDB_* variables."""
    monkeypatch.setenv("WANDB_PROJECT", "env-project")
    monkeypatch.setenv("WANDB_RUN_GROUP", "env-group")
    monkeypatch.setenv("WANDB_JOB_TYPE", "env-job")
    adapter = _open(project="opt-project", group="opt-group", job_type="eval", notes="opt notes", dir=tmp_path / "d")
    run_dir = _write_close(adapter, range(1))
    assert run_dir.parent == tmp_path / "d" / "wandb"
    run = _record(run_dir, "run")
    assert (run.project, run.run_group, run.job_type, run.notes) == ("opt-project", "opt-group", "eval", "opt notes")


def test_env_run_id_replaces_runs_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """With WANDB_RUN_ID set, that id names the wandb run instead of RunInfo.id."""
    monkeypatch.setenv("WANDB_RUN_ID", "env-run-id")
    adapter = _open()
    run_dir = _write_close(adapter, range(1))
    assert _record(run_dir, "run").run_id == "env-run-id"
    assert adapter.identity is not None
    assert adapter.identity["run_id"] == "env-run-id"


def test_env_mode_and_dir_respected(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """WANDB_MODE and WANDB_DIR apply when mode and dir are unset; mode="disabled" overrides WANDB_MODE=offline."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "env-dir"))
    run_dir = _write_close(_open(), range(1))
    assert run_dir.parent == tmp_path / "env-dir" / "wandb"
    assert run_dir.name.startswith("offline-run-")
    disabled = _open(mode="disabled")
    disabled.write(step=0, metrics={"x": 1.0})
    disabled.flush()
    disabled.close(status="finished")
    assert disabled.identity is not None
    assert "dir" not in disabled.identity
    assert len(list((tmp_path / "env-dir" / "wandb").glob("*run-*"))) == 1


def test_two_writes_at_one_step_share_a_row() -> None:
    """A second write at a step (after a flush) joins that step's row; the next step opens a new row."""
    adapter = _open()
    adapter.write(step=1, metrics={"train/loss": 0.5})
    adapter.flush()
    adapter.write(step=1, metrics={"eval/acc": 0.75})
    adapter.write(step=2, metrics={"train/loss": 0.25})
    adapter.close(status="finished")
    history = read_wandb_history(_run_dir(adapter))
    assert [(row["_step"], _user(row)) for row in history] == [
        (1, {"train/loss": 0.5, "eval/acc": 0.75}),
        (2, {"train/loss": 0.25}),
    ]


def test_flush_puts_closed_rows_in_the_file() -> None:
    """Once flush() returned, every row but the last step's (still open) is in the .wandb file."""
    adapter = _open()
    for step in range(5):
        adapter.write(step=step, metrics={"x": float(step)})
    adapter.flush()
    run_dir = _run_dir(adapter)
    assert [row["_step"] for row in wandb_history_of(read_wandb_records_now(run_dir))] == [0, 1, 2, 3]
    adapter.close(status="finished")
    assert _steps(run_dir) == [0, 1, 2, 3, 4]


def test_close_returns_after_the_exit_record_is_written() -> None:
    """close() returns only once the exit record is in the .wandb file."""
    adapter = _open()
    run_dir = _write_close(adapter, range(3))
    kinds = [r.WhichOneof("record_type") for r in read_wandb_records_now(run_dir)]
    assert "exit" in kinds


def test_rewind_reopens_the_run_from_that_step() -> None:
    """rewind(step=3) ends the folder and opens one more whose branch point is step 2 and whose history restarts."""
    adapter = _open()
    for step in range(6):
        adapter.write(step=step, metrics={"x": float(step)})
    first_dir = _run_dir(adapter)
    adapter.rewind(step=3)
    second_dir = _write_close(adapter, range(3, 5), offset=100.0)
    assert second_dir != first_dir
    assert _steps(first_dir) == [0, 1, 2, 3, 4, 5]
    assert _record(first_dir, "exit").exit_code == 0
    run = _record(second_dir, "run")
    assert run.run_id == RUN_ID
    assert (run.branch_point.run, run.branch_point.metric, run.branch_point.value) == (RUN_ID, "_step", 2.0)
    assert [(row["_step"], row["x"]) for row in read_wandb_history(second_dir)] == [(3, 103.0), (4, 104.0)]


def test_attach_logs_into_the_trainers_run_and_leaves_it_running() -> None:
    """attach=True logs into wandb.run; close() leaves that run active for the trainer to finish."""
    trainer = wandb.init(project="trainer", id="trainer-run", settings=wandb.Settings(x_disable_stats=True))
    adapter = _open(attach=True)
    assert adapter.run is trainer
    assert adapter.identity is not None
    assert adapter.identity["run_id"] == "trainer-run"
    adapter.write(step=0, metrics={"mb/loss": 1.0})
    adapter.write(step=1, metrics={"mb/loss": 0.5})
    adapter.rewind(step=1)  # the trainer's run is not rewound
    adapter.flush()
    adapter.close(status="finished")
    assert wandb.run is trainer
    trainer.log({"own": 2.0}, step=2)
    trainer.finish()
    history = read_wandb_history(Path(trainer.settings.sync_dir))
    assert [(row["_step"], _user(row)) for row in history] == [
        (0, {"mb/loss": 1.0}),
        (1, {"mb/loss": 0.5}),
        (2, {"own": 2.0}),
    ]


def test_attach_without_an_active_run_fails_at_open() -> None:
    """attach=True with no wandb.run raises ConfigError at open, saying to call wandb.init() first."""
    with pytest.raises(ConfigError, match=r"attach=True.*wandb\.init\(\)"):
        _open(attach=True)


def test_own_run_leaves_an_active_trainer_run_alone() -> None:
    """Without attach, the adapter opens its own run beside an active one; wandb.run stays the trainer's."""
    trainer = wandb.init(project="trainer", id="trainer-run", settings=wandb.Settings(x_disable_stats=True))
    adapter = _open()
    assert adapter.run is not trainer
    assert adapter.run.id == RUN_ID
    assert wandb.run is trainer
    _write_close(adapter, range(2))
    assert wandb.run is trainer
    trainer.finish()


def test_misspelled_mode_raises_at_construction() -> None:
    """mode="ofline" raises ConfigError naming the close match and every mode wandb accepts."""
    with pytest.raises(ConfigError, match=r"'ofline'.*did you mean 'offline'.*" + ", ".join(MODES)):
        WandbAdapter(mode="ofline")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"project": 3}, "'project'"),
        ({"group": ["g"]}, "'group'"),
        ({"dir": 5}, "'dir'"),
        ({"attach": "yes"}, "'attach'"),
        ({"project": "a/b"}, "'a/b'"),
        ({"attach": True, "project": "p"}, "attach=True.*project"),
    ],
)
def test_invalid_options_raise_at_construction(options: dict[str, Any], named: str) -> None:
    """A wrongly typed or invalid option raises ConfigError naming it."""
    with pytest.raises(ConfigError, match=named):
        WandbAdapter(**options)


def test_missing_wandb_raises_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without wandb installed, constructing the adapter says how to install it."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(AdapterNotFoundError, match=r"pip install 'metricbus\[wandb\]'"):
        WandbAdapter()


def _metrics(step: int, *, x: float | None = None) -> dict[str, float]:
    return {"x": step + 0.1 if x is None else x, "nan": math.nan, "neg": -0.0}


def _killed(adapter: WandbAdapter, steps: range, metrics: Callable[[int], dict[str, float]] = _metrics) -> Path:
    """Write ``steps`` and flush, then leave the run folder as a SIGKILL right then would: the closed rows only, no
    exit record, a torn last record. (The run is finished to release wandb's state, then its file is put back.)"""
    for step in steps:
        adapter.write(step=step, metrics=metrics(step))
    adapter.flush()
    run_dir = _run_dir(adapter)
    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    adapter.close(status="finished")
    path.write_bytes(data + b"\x00\x00\x00\x00\x20\x00\x01partial")  # a record cut short by the kill
    return run_dir


def _rows_of_run(root: Path) -> list[dict[str, Any]]:
    """The history rows of every folder of run RUN_ID under ``root`` (complete records only)."""
    folders = sorted(root.glob(f"*run-*-{RUN_ID}*"))
    return [row for folder in folders for row in wandb_history_of(read_wandb_records_now(folder))]


def _same_row(got: dict[str, Any], want: dict[str, float]) -> bool:
    user = _user(got)
    return user.keys() == want.keys() and all(
        (math.isnan(v) and math.isnan(user[k])) or user[k] == v for k, v in want.items()
    )


def test_resume_after_a_kill_writes_each_step_once(tmp_path: Path) -> None:
    """A killed process's file holds rows past the cursor; the resumed adapter writes only the steps it lacks."""
    first = _open()
    first_dir = _killed(first, range(10))
    assert [row["_step"] for row in wandb_history_of(read_wandb_records_now(first_dir))] == list(range(9))
    second = WandbAdapter()
    second.resume(after_step=3, identity=first.identity)
    second.open(run=RunInfo(id=RUN_ID))
    for step in range(4, 15):
        second.write(step=step, metrics=_metrics(step))
        second.flush()
    second.close(status="finished")
    assert _steps(_run_dir(second)) == list(range(9, 15))
    rows = _rows_of_run(tmp_path / "wandb")
    assert sorted(row["_step"] for row in rows) == list(range(15))
    for row in rows:
        assert _same_row(row, _metrics(row["_step"])), row


def test_resent_step_with_another_value_is_written(tmp_path: Path) -> None:
    """After a resume, a step sent again with a changed value or a key not held is written (only that); after
    rewind(step=S) the steps >= S are written again whatever the earlier folders hold."""
    _killed(first := _open(), range(8))  # its file holds rows 0..6
    second = WandbAdapter()
    second.resume(after_step=1, identity=first.identity)
    second.open(run=RunInfo(id=RUN_ID))
    for step in range(2, 5):
        second.write(step=step, metrics=_metrics(step, x=-1.0 if step == 3 else None))
    second.write(step=4, metrics={"eval": 0.5})
    second_dir = _run_dir(second)
    second.rewind(step=5)
    rewound_dir = _run_dir(second)
    for step in (5, 6):
        second.write(step=step, metrics=_metrics(step))
    second.close(status="finished")
    assert [(row["_step"], _user(row)) for row in read_wandb_history(second_dir)] == [
        (3, {"x": -1}),
        (4, {"eval": 0.5}),
    ]
    assert [row["_step"] for row in read_wandb_history(rewound_dir)] == [5, 6]


def _hist(counts: list[int], edges: list[float]) -> Histogram:
    quantiles = (("p50", edges[0]), ("p90", edges[-1]), ("p99", edges[-1])) if edges else ()
    return Histogram(float(sum(counts)), edges=tuple(edges), counts=tuple(counts), quantiles=quantiles)


def _histogram_of(row: dict[str, Any], key: str) -> tuple[Any, list[float], list[float]]:
    """wandb-core writes a logged histogram as three items, nested keys ``[key, "_type" | "values" | "bins"]``."""
    return row[f"{key}/_type"], row[f"{key}/values"], row[f"{key}/bins"]


def test_histogram_is_logged_in_the_steps_row(tmp_path: Path) -> None:
    """A Histogram is a wandb histogram (counts and edges exactly) in the same history row as the step's scalars."""
    hists = [_hist([3, 0, 5], [-0.25, 0.1, 0.7, 1e9]), _hist([1, 1000], [1e-3, 0.123456789, 17.5])]
    rows = [{"loss": 0.5 + i, "len/hist": h} for i, h in enumerate(hists)]
    history = read_wandb_history(_offline_run(tmp_path, rows, status="finished"))
    assert [row["_step"] for row in history] == [0, 2]
    for row, h in zip(history, hists, strict=True):
        assert _user(row).keys() == {"loss", "len/hist/_type", "len/hist/values", "len/hist/bins"}
        assert _histogram_of(row, "len/hist") == ("histogram", list(h.counts), list(h.edges))
    assert [row["loss"] for row in history] == [0.5, 1.5]


def test_histogram_over_wandbs_bin_limit_is_merged(tmp_path: Path) -> None:
    """More than wandb's 512 bins: neighbouring bins are merged (counts summed, the outer edges kept)."""
    edges = [i / 8 for i in range(1026)]  # 1025 bins: merged 3 by 3 into 342
    counts = [i % 7 for i in range(1025)]
    history = read_wandb_history(_offline_run(tmp_path, [{"h": _hist(counts, edges)}], status="finished"))
    _, values, bins = _histogram_of(history[0], "h")
    assert values == [sum(counts[i : i + 3]) for i in range(0, 1025, 3)]
    assert bins == [*edges[:-1:3], edges[-1]]
    assert len(values) == 342
    assert sum(values) == sum(counts)


def test_histogram_without_bins_is_not_logged(tmp_path: Path) -> None:
    """A Histogram without bins (wandb refuses one) is left out; the rest of the row is logged."""
    empty = Histogram(0.0, edges=(), counts=(), quantiles=())
    history = read_wandb_history(_offline_run(tmp_path, [{"x": 1.0, "h": empty}, {"h": empty}], status="finished"))
    assert [(row["_step"], _user(row)) for row in history] == [(0, {"x": 1})]


def test_resent_histogram_is_written_once(tmp_path: Path) -> None:
    """After a resume, a histogram an earlier folder holds at that step is not logged again; a changed one is."""

    def metrics(step: int, *, shift: float = 0.0) -> dict[str, float]:
        return {"x": step + 0.5, "h": _hist([step, 2], [0.1 + shift, 0.2, 0.3])}

    _killed(first := _open(), range(6), metrics)  # its file holds rows 0..4
    second = WandbAdapter()
    second.resume(after_step=1, identity=first.identity)
    second.open(run=RunInfo(id=RUN_ID))
    for step in range(2, 7):
        second.write(step=step, metrics=metrics(step, shift=0.05 if step == 3 else 0.0))
    second.close(status="finished")
    history = read_wandb_history(_run_dir(second))
    assert [(row["_step"], sorted(_user(row))) for row in history] == [
        (3, ["h/_type", "h/bins", "h/values"]),
        (5, ["h/_type", "h/bins", "h/values", "x"]),
        (6, ["h/_type", "h/bins", "h/values", "x"]),
    ]
    assert _histogram_of(history[0], "h") == ("histogram", [3, 2], [0.1 + 0.05, 0.2, 0.3])
