"""The MLflow adapter, read back with MlflowClient from sqlite and from a real ``mlflow server``."""

from __future__ import annotations

import logging
import math
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from backend_env import free_port, isolate_env, start_server, stop_server, wait_http
from metricbus.adapters._names import mlflow_key, mlflow_mapper
from metricbus.adapters.mlflow import DEFAULT_TRACKING_URI, MAX_PARAM_VALUE_CHARS, MlflowAdapter

from metricbus.adapter import RunInfo
from metricbus.errors import AdapterNotFoundError, ConfigError, MetricBusWarning, MetricValueError
from metricbus.histogram import Histogram
from metricbus.registry import make_adapter

MLFLOW_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path, MLflow telemetry off, no MLflow settings from the caller's environment."""
    for name in MLFLOW_ENV:
        monkeypatch.delenv(name, raising=False)
    return isolate_env(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real ``mlflow server`` (sqlite backend, one worker) for the module; yields its URI."""
    root = tmp_path_factory.mktemp("mlflow-server")
    exe = shutil.which("mlflow", path=str(Path(sys.executable).parent))
    assert exe is not None
    port = free_port()
    args = [exe, "server", "--backend-store-uri", f"sqlite:///{root / 'server.db'}", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--workers", "1", "--default-artifact-root", str(root / "artifacts")]
    with pytest.MonkeyPatch.context() as patch:
        isolate_env(patch, root)
        proc = start_server(args, log=root / "mlflow-server.log")
    try:
        uri = f"http://127.0.0.1:{port}"
        wait_http(f"{uri}/health", proc=proc, timeout_s=90)
        yield uri
    finally:
        stop_server(proc)


def _series(*, steps: int) -> list[dict[str, float]]:
    return [{"train/loss": 1.0 / (i + 1), "train/acc": i / 7.0, "lr": 0.1 * 0.99**i} for i in range(steps)]


def _run(adapter: MlflowAdapter, rows: list[dict[str, float]], *, status: Any = "finished", config: Any = None) -> str:
    adapter.open(run=RunInfo(project="proj", name="run-a", tags=("baseline",), config=config or {"lr": 0.1}))
    for step, metrics in enumerate(rows):
        adapter.write(step=step * 10, metrics=metrics)
    adapter.flush()
    adapter.close(status=status)
    assert adapter.run_id is not None
    return adapter.run_id


def _assert_history(client: Any, run_id: str, rows: list[dict[str, float]]) -> None:
    for key in rows[0]:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(i * 10, row[key]) for i, row in enumerate(rows)]


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every point of ``key``, in the order MLflow ranks them: by step, then timestamp."""
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
    return [(m.step, m.value) for m in points]


def _write_steps(adapter: MlflowAdapter, steps: range, *, offset: float = 0.0) -> None:
    for step in steps:
        adapter.write(step=step, metrics={"loss": step + offset})


def _kill_then_complete(uri: str, info: RunInfo, *, identity: bool, option: bool = True) -> MlflowAdapter:
    """Adapter A writes steps 0-9 and is abandoned unclosed (a SIGKILL); B resumes after step 9, writes 10-19.

    ``option`` False: both adapters find ``uri`` in MLFLOW_TRACKING_URI.
    """
    from mlflow.tracking import MlflowClient

    killed = MlflowAdapter(tracking_uri=uri if option else None)
    killed.open(run=info)
    _write_steps(killed, range(10))
    assert killed.run_id is not None
    assert MlflowClient(tracking_uri=uri).get_run(killed.run_id).info.status == "RUNNING"
    synced = MlflowAdapter(tracking_uri=uri if option else None)
    synced.resume(after_step=9, identity=killed.identity if identity else None)
    synced.open(run=info)
    _write_steps(synced, range(10, 20))
    synced.close(status="finished")
    assert synced.run_id == killed.run_id
    return synced


# -- what is logged ------------------------------------------------------------------------------------------------


def test_sqlite_history_matches_every_point(sqlite_uri: str) -> None:
    """Every (step, value) written comes back from get_metric_history, exactly."""
    from mlflow.tracking import MlflowClient

    rows = _series(steps=50)
    run_id = _run(MlflowAdapter(tracking_uri=sqlite_uri), rows)
    client = MlflowClient(tracking_uri=sqlite_uri)
    _assert_history(client, run_id, rows)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run-a"
    assert run.data.tags["baseline"] == "true"
    assert run.data.params == {"lr": "0.1"}
    assert client.get_experiment(run.info.experiment_id).name == "proj"


def test_failed_close_marks_run_failed(sqlite_uri: str) -> None:
    """close(status="failed") ends the MLflow run as FAILED."""
    from mlflow.tracking import MlflowClient

    adapter = MlflowAdapter(tracking_uri=sqlite_uri, experiment="exp", run_name="x")
    run_id = _run(adapter, _series(steps=2), status="failed")
    run = MlflowClient(tracking_uri=sqlite_uri).get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.info.run_name == "x"


def test_config_flattened_truncated_and_batched(sqlite_uri: str) -> None:
    """250 nested params (more than one 100-param batch) are logged; long values are cut to 6000 chars."""
    from mlflow.tracking import MlflowClient

    config = {"group": {f"k{i}": i for i in range(249)}, "long": "x" * 10_000}
    run_id = _run(MlflowAdapter(tracking_uri=sqlite_uri), _series(steps=1), config=config)
    params = MlflowClient(tracking_uri=sqlite_uri).get_run(run_id).data.params
    assert len(params) == 250
    assert params["group.k17"] == "17"
    assert params["long"] == "x" * MAX_PARAM_VALUE_CHARS


def test_non_finite_values_are_stored(sqlite_uri: str) -> None:
    """NaN stays NaN; sqlite stores infinities as the largest finite double (MLflow's documented behaviour)."""
    from mlflow.tracking import MlflowClient

    run_id = _run(MlflowAdapter(tracking_uri=sqlite_uri), [{"a": math.nan, "b": math.inf}])
    client = MlflowClient(tracking_uri=sqlite_uri)
    assert math.isnan(client.get_metric_history(run_id, "a")[0].value)
    assert client.get_metric_history(run_id, "b")[0].value >= sys.float_info.max


def test_two_writes_at_one_step_keep_both_parts(sqlite_uri: str) -> None:
    """Train metrics then eval metrics at the same step: each key has that step once."""
    from mlflow.tracking import MlflowClient

    adapter = MlflowAdapter(tracking_uri=sqlite_uri)
    adapter.open(run=RunInfo(project="two-parts"))
    adapter.write(step=5, metrics={"train/loss": 1.5})
    adapter.write(step=5, metrics={"eval/loss": 2.5, "eval/acc": 0.5})
    adapter.close(status="finished")
    client = MlflowClient(tracking_uri=sqlite_uri)
    assert adapter.run_id is not None
    assert client.get_run(adapter.run_id).data.metrics == {"train/loss": 1.5, "eval/loss": 2.5, "eval/acc": 0.5}
    assert [_history(client, adapter.run_id, key) for key in ("train/loss", "eval/loss")] == [[(5, 1.5)], [(5, 2.5)]]


def _hist(p50: float, p90: float, p99: float) -> Histogram:
    return Histogram(
        10.0, edges=(0.0, p50, p99 + 1), counts=(5, 5), quantiles=(("p50", p50), ("p90", p90), ("p99", p99))
    )


def test_histogram_is_logged_as_its_quantiles(sqlite_uri: str) -> None:
    """A Histogram becomes metrics <key>/p50, /p90, /p99 (not its count), with one warning for the key."""
    from mlflow.tracking import MlflowClient

    hists = [_hist(1.25, 3.5, 7.0), _hist(0.1, math.nan, 1e300)]
    adapter = MlflowAdapter(tracking_uri=sqlite_uri)
    adapter.open(run=RunInfo(project="hist"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, h in enumerate(hists):
            adapter.write(step=step, metrics={"loss": 0.5 + step, "len/hist": h})
    adapter.close(status="finished")
    assert [str(w.message) for w in caught if issubclass(w.category, MetricBusWarning)] == [
        "MLflow has no histograms, so 'len/hist' is logged as its quantiles 'len/hist/p50', 'len/hist/p90', "
        "'len/hist/p99'"
    ]
    client = MlflowClient(tracking_uri=sqlite_uri)
    assert adapter.run_id is not None
    assert set(client.get_run(adapter.run_id).data.metrics) == {"loss", "len/hist/p50", "len/hist/p90", "len/hist/p99"}
    assert _history(client, adapter.run_id, "loss") == [(0, 0.5), (1, 1.5)]
    for suffix, _ in hists[0].quantiles:
        points = _history(client, adapter.run_id, f"len/hist/{suffix}")
        want = [(step, dict(h.quantiles)[suffix]) for step, h in enumerate(hists)]
        assert [step for step, _ in points] == [step for step, _ in want]
        assert all(
            got == value or (math.isnan(got) and math.isnan(value))
            for (_, got), (_, value) in zip(points, want, strict=True)
        )


def test_histogram_quantiles_are_mapped_and_warned_per_key(sqlite_uri: str) -> None:
    """Quantile names go through MLflow's key mapping, and the warning names the mapped keys, once per key."""
    from mlflow.tracking import MlflowClient

    adapter = MlflowAdapter(tracking_uri=sqlite_uri)
    adapter.open(run=RunInfo(project="hist-names"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            adapter.write(step=step, metrics={"len?": _hist(1.0, 2.0, 3.0), "other": _hist(4.0, 5.0, 6.0)})
    adapter.close(status="finished")
    assert [str(w.message) for w in caught if issubclass(w.category, MetricBusWarning)] == [
        "MLflow has no histograms, so 'len?' is logged as its quantiles 'len_/p50', 'len_/p90', 'len_/p99'",
        "MLflow has no histograms, so 'other' is logged as its quantiles 'other/p50', 'other/p90', 'other/p99'",
    ]
    assert adapter.run_id is not None
    assert MlflowClient(tracking_uri=sqlite_uri).get_run(adapter.run_id).data.metrics == {
        "len_/p50": 1.0,
        "len_/p90": 2.0,
        "len_/p99": 3.0,
        "other/p50": 4.0,
        "other/p90": 5.0,
        "other/p99": 6.0,
    }


def test_step_outside_int64_is_refused(sqlite_uri: str) -> None:
    """A step MLflow cannot store raises MetricValueError (a permanent rejection), and later steps still land."""
    from mlflow.tracking import MlflowClient

    from metricbus.errors_classify import classify

    adapter = MlflowAdapter(tracking_uri=sqlite_uri)
    adapter.open(run=RunInfo(project="int64"))
    for step in (2**63, -(2**63) - 1):
        with pytest.raises(MetricValueError, match=rf"step {step} is outside MLflow's int64 step range") as caught:
            adapter.write(step=step, metrics={"loss": 1.0})
        assert classify(caught.value) == "permanent"
    adapter.write(step=2**63 - 1, metrics={"loss": 2.0})
    adapter.close(status="finished")
    assert adapter.run_id is not None
    assert _history(MlflowClient(tracking_uri=sqlite_uri), adapter.run_id, "loss") == [(2**63 - 1, 2.0)]


# -- names ---------------------------------------------------------------------------------------------------------


def test_names_are_mapped_to_valid_keys(sqlite_uri: str) -> None:
    """Names MLflow rejects (bad characters, bad paths, dots-only segments, too long) are logged under a mapped key."""
    from mlflow.tracking import MlflowClient

    rows = [{"loss@val": 1.0, "a//b/": 2.0, "../up": 3.0, "z" * 300: 4.0, "...": 5.0, "..x": 6.0, "a/./b": 7.0}]
    run_id = _run(MlflowAdapter(tracking_uri=sqlite_uri), rows)
    metrics = MlflowClient(tracking_uri=sqlite_uri).get_run(run_id).data.metrics
    assert metrics == {
        "loss_val": 1.0, "a/b": 2.0, "__/up": 3.0, "z" * 250: 4.0, "___": 5.0, "__x": 6.0, "a/_/b": 7.0,
    }  # fmt: skip


def test_mlflow_key_rules() -> None:
    """The mapping keeps valid keys, repairs the invalid ones, and every key it returns passes MLflow's checks."""
    from mlflow.utils.validation import _validate_metric_name, _validate_param_name

    assert mlflow_key("train/loss: ep 1.5-x_y") == "train/loss: ep 1.5-x_y"
    assert mlflow_key("/a//b/") == "a/b"
    assert mlflow_key("a/../b") == "a/__/b"
    assert mlflow_key("...") == "___"
    assert mlflow_key("..x/y") == "__x/y"
    assert mlflow_key(".x/...y/a...") == ".x/...y/a..."
    assert mlflow_key("") == "_"
    assert mlflow_key("é") == "_"
    assert len(mlflow_key("a" * 1000)) == 250
    assert mlflow_key("a" * 248 + "/...") == "a" * 248 + "/_"  # the cut leaves "." as the last segment
    tricky = ["", ".", "..", "...", "/", "./", "/..", "..a", "a/.", "a/..b", " ", ". /.", "a" * 249 + "/..", ":/:"]
    for name in tricky:
        key = mlflow_key(name)
        _validate_metric_name(key)
        _validate_param_name(key)
        assert mlflow_key(key) == key


def test_colliding_names_raise_naming_both(sqlite_uri: str) -> None:
    """Two names that map to one MLflow key raise MetricValueError the first time they meet."""
    mapper = mlflow_mapper()
    assert mapper("a/b") == "a/b"
    with pytest.raises(MetricValueError, match=r"'a/b' and 'a//b'"):
        mapper("a//b")
    assert mapper("...") == "___"
    with pytest.raises(MetricValueError, match=r"'\.\.\.' and '___'"):
        mapper("___")
    adapter = MlflowAdapter(tracking_uri=sqlite_uri)
    adapter.open(run=RunInfo())
    adapter.write(step=0, metrics={"x y": 1.0})
    with pytest.raises(MetricValueError, match=r"'x@y'.*'x_y'|'x_y'.*'x@y'"):
        adapter.write(step=1, metrics={"x_y": 1.0, "x@y": 2.0})
    adapter.close(status="failed")


# -- one run is one run --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("identity", [True, False], ids=["by-identity", "by-tag"])
def test_killed_run_completed_later_is_one_finished_run(sqlite_uri: str, identity: bool) -> None:
    """A run abandoned unclosed after step 9 and resumed (with or without its identity) is one FINISHED run."""
    from mlflow.tracking import MlflowClient

    info = RunInfo(project="killed", name="r", config={"lr": 0.1})
    synced = _kill_then_complete(sqlite_uri, info, identity=identity)
    client = MlflowClient(tracking_uri=sqlite_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("killed").experiment_id])
    assert run.info.run_id == synced.run_id
    assert run.info.status == "FINISHED"
    assert run.data.tags["metricbus.run_id"] == info.id
    assert run.data.params == {"lr": "0.1"}
    assert _history(client, run.info.run_id, "loss") == [(s, float(s)) for s in range(20)]
    assert dict(synced.identity) == {
        "run_id": run.info.run_id, "tracking_uri": sqlite_uri, "experiment_id": run.info.experiment_id,
    }  # fmt: skip


def test_identity_of_a_missing_run_falls_back_to_the_tag(sqlite_uri: str) -> None:
    """An identity naming a run this store lacks is ignored; the run tagged with the run id is reopened, RUNNING."""
    from mlflow.tracking import MlflowClient

    info = RunInfo(project="stale")
    first = MlflowAdapter(tracking_uri=sqlite_uri)
    first.open(run=info)
    first.close(status="failed")
    again = MlflowAdapter(tracking_uri=sqlite_uri)
    again.resume(after_step=None, identity={"run_id": "f" * 32, "tracking_uri": "sqlite:///elsewhere.db"})
    again.open(run=info)
    assert again.run_id == first.run_id
    assert MlflowClient(tracking_uri=sqlite_uri).get_run(first.run_id).info.status == "RUNNING"  # FAILED before
    again.close(status="finished")


def test_resent_steps_after_a_lagging_cursor_are_logged_once(sqlite_uri: str) -> None:
    """MLflow got steps 0-12 but the cursor says 9: the steps 10-12 sent again are not logged twice."""
    from mlflow.tracking import MlflowClient

    info = RunInfo(project="lagging")
    killed = MlflowAdapter(tracking_uri=sqlite_uri)
    killed.open(run=info)
    _write_steps(killed, range(13))
    synced = MlflowAdapter(tracking_uri=sqlite_uri)
    synced.resume(after_step=9, identity=killed.identity)
    synced.open(run=info)
    _write_steps(synced, range(10, 20))
    synced.close(status="finished")
    assert synced.run_id is not None
    assert _history(MlflowClient(tracking_uri=sqlite_uri), synced.run_id, "loss") == [(s, float(s)) for s in range(20)]


def test_reopened_run_keeps_its_params(sqlite_uri: str, caplog: pytest.LogCaptureFixture) -> None:
    """A reopened run logs only new params; a changed value keeps the old one (MLflow refuses) with a warning."""
    from mlflow.tracking import MlflowClient

    first = MlflowAdapter(tracking_uri=sqlite_uri)
    first.open(run=RunInfo(project="params", id="run-1", config={"lr": 0.1, "bs": 32}))
    first.close(status="failed")
    again = MlflowAdapter(tracking_uri=sqlite_uri)
    with caplog.at_level(logging.WARNING, logger="metricbus.adapters.mlflow"):
        again.open(run=RunInfo(project="params", id="run-1", config={"lr": 0.2, "bs": 32, "seed": 7}))
    again.close(status="finished")
    assert again.run_id == first.run_id
    params = MlflowClient(tracking_uri=sqlite_uri).get_run(first.run_id).data.params
    assert params == {"lr": "0.1", "bs": "32", "seed": "7"}
    assert [r.getMessage() for r in caplog.records] == [
        f"mlflow run {first.run_id} keeps its params lr='0.1' (new '0.2'): MLflow refuses to change a param's value"
    ]


def test_rewind_logs_new_values_beside_old_ones(sqlite_uri: str) -> None:
    """After rewind(step=5): replayed points are logged once, new values beside old ones, the rewind is a tag."""
    from mlflow.tracking import MlflowClient

    info = RunInfo(project="rewind")
    killed = MlflowAdapter(tracking_uri=sqlite_uri)
    killed.open(run=info)
    _write_steps(killed, range(12))
    resumed = MlflowAdapter(tracking_uri=sqlite_uri)
    resumed.resume(after_step=11, identity=killed.identity)
    resumed.open(run=info)
    resumed.rewind(step=3)
    _write_steps(resumed, range(3, 5))  # the old timeline up to the checkpoint, sent again with the same values
    _write_steps(resumed, range(5, 10), offset=100.0)  # the resumed run, from its checkpoint at step 5
    resumed.close(status="finished")
    client = MlflowClient(tracking_uri=sqlite_uri)
    assert resumed.run_id is not None
    old, new = [(s, float(s)) for s in range(12)], [(s, s + 100.0) for s in range(5, 10)]
    assert _history(client, resumed.run_id, "loss") == sorted(old + new, key=lambda p: (p[0], p[1] > 100))
    run = client.get_run(resumed.run_id)
    assert run.data.tags["metricbus.rewind"] == "3"
    # The latest value is the one with the largest (step, timestamp): the old step 11 outranks the new steps.
    assert run.data.metrics == {"loss": 11.0}
    more = MlflowAdapter(tracking_uri=sqlite_uri)
    more.resume(after_step=9, identity=resumed.identity)
    more.open(run=info)
    _write_steps(more, range(10, 13), offset=100.0)
    more.close(status="finished")
    assert client.get_run(resumed.run_id).data.metrics == {"loss": 112.0}


# -- where: options and MLflow's own environment variables ---------------------------------------------------------


def test_default_store_is_sqlite_under_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without option or MLFLOW_TRACKING_URI the run goes to runs/metricbus/mlflow.db, its folders created."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    adapter = MlflowAdapter()
    assert adapter.tracking_uri == DEFAULT_TRACKING_URI
    run_id = _run(adapter, _series(steps=1))
    assert (tmp_path / "runs" / "metricbus" / "mlflow.db").is_file()
    assert MlflowClient(tracking_uri=DEFAULT_TRACKING_URI).get_run(run_id).info.status == "FINISHED"


def test_explicit_options_win_over_environment(
    sqlite_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tracking_uri and experiment options beat MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'env' / 'env.db'}")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    adapter = MlflowAdapter(tracking_uri=sqlite_uri, experiment="from-option")
    run_id = _run(adapter, _series(steps=1))
    run = MlflowClient(tracking_uri=sqlite_uri).get_run(run_id)
    assert MlflowClient(tracking_uri=sqlite_uri).get_experiment(run.info.experiment_id).name == "from-option"
    assert not (tmp_path / "env").exists()


def test_experiment_from_environment(sqlite_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME place the run; the project name is the last fallback."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "env-exp")
    adapter = MlflowAdapter()
    assert adapter.tracking_uri == sqlite_uri
    run_id = _run(adapter, _series(steps=1))
    client = MlflowClient(tracking_uri=sqlite_uri)
    assert client.get_experiment(client.get_run(run_id).info.experiment_id).name == "env-exp"


def test_experiment_id_from_environment(sqlite_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLFLOW_EXPERIMENT_ID picks an existing experiment; disagreeing with MLFLOW_EXPERIMENT_NAME is a ConfigError."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sqlite_uri)
    chosen, other = client.create_experiment("chosen"), client.create_experiment("other")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_ID", chosen)
    run_id = _run(MlflowAdapter(tracking_uri=sqlite_uri), _series(steps=1))
    assert client.get_run(run_id).info.experiment_id == chosen
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "other")
    with pytest.raises(
        ConfigError,
        match=rf"MLFLOW_EXPERIMENT_NAME='other' is experiment {other}.*"
        rf"MLFLOW_EXPERIMENT_ID='{chosen}'",
    ):
        MlflowAdapter(tracking_uri=sqlite_uri).open(run=RunInfo())


def test_mlflow_run_id_from_environment(sqlite_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLFLOW_RUN_ID names the run to log into; it is ended with the bus's status; a missing one is a ConfigError."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=sqlite_uri)
    given = client.create_run(client.create_experiment("launcher")).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", given)
    adapter = MlflowAdapter(tracking_uri=sqlite_uri)
    assert _run(adapter, _series(steps=3), status="failed") == given
    run = client.get_run(given)
    assert run.info.status == "FAILED"
    assert run.data.tags["metricbus.project"] == "proj"
    _assert_history(client, given, _series(steps=3))
    monkeypatch.setenv("MLFLOW_RUN_ID", "0" * 32)
    with pytest.raises(ConfigError, match=r"MLFLOW_RUN_ID names run '0{32}', which sqlite:///.* does not hold"):
        MlflowAdapter(tracking_uri=sqlite_uri).open(run=RunInfo())


# -- attach to the trainer's own MLflow run ------------------------------------------------------------------------


def test_attach_logs_into_the_active_run_and_leaves_it_running(
    sqlite_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attach=True logs into the run of mlflow.start_run() (opened from another thread, as the bus does)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)
    adapter = MlflowAdapter(attach=True)  # built before the run starts: found in the trainer's thread at open
    active = mlflow.start_run(run_name="trainer-run")
    try:
        opener = threading.Thread(target=adapter.open, kwargs={"run": RunInfo(project="p", config={"lr": 0.1})})
        opener.start()
        opener.join()
        assert adapter.run_id == active.info.run_id
        _write_steps(adapter, range(3))
        adapter.close(status="finished")
        client = MlflowClient(tracking_uri=sqlite_uri)
        run = client.get_run(active.info.run_id)
        assert run.info.status == "RUNNING"
        assert run.info.run_name == "trainer-run"
        assert run.data.params == {"lr": "0.1"}
        assert _history(client, run.info.run_id, "loss") == [(0, 0.0), (1, 1.0), (2, 2.0)]
    finally:
        mlflow.end_run()
    assert MlflowClient(tracking_uri=sqlite_uri).get_run(active.info.run_id).info.status == "FINISHED"


def test_attach_without_a_run_raises_at_open(sqlite_uri: str) -> None:
    """attach=True with no active run and no MLFLOW_RUN_ID raises a ConfigError saying what to do."""
    adapter = MlflowAdapter(tracking_uri=sqlite_uri, attach=True)
    with pytest.raises(ConfigError, match=r"attach=True.*mlflow\.start_run\(\).*MLFLOW_RUN_ID"):
        adapter.open(run=RunInfo())


# -- validation ----------------------------------------------------------------------------------------------------


def test_uri_spec_sets_tracking_uri(sqlite_uri: str) -> None:
    """``mlflow:<tracking uri>`` keeps the whole URI, colons included."""
    adapter = make_adapter(f"mlflow:{sqlite_uri}")
    assert isinstance(adapter, MlflowAdapter)
    assert adapter.tracking_uri == sqlite_uri


@pytest.mark.parametrize("spec", ["mlflow:bogus://x", "mlflow:", "mlflow: ", "mlflow:sqlite+a+b:///x.db"])
def test_bad_tracking_uri_raises_at_construction(spec: str) -> None:
    """A URI MLflow cannot track to raises ConfigError naming the option and the valid schemes."""
    with pytest.raises(ConfigError, match=r"tracking_uri.*file, sqlite, postgresql, mysql, mssql, http, https"):
        make_adapter(spec)


@pytest.mark.parametrize(
    "uri", ["postgresql+psycopg2://u@db/x", "mysql://h/x", "mssql+pyodbc://h/x", "https://mlflow.example",
            "databricks", "databricks://profile", "file:///tmp/mlruns", "relative/mlruns"],
)  # fmt: skip
def test_good_tracking_uris_are_accepted(uri: str) -> None:
    """Every scheme MLflow 3.17 tracks to (database drivers and plain paths too) passes; nothing is contacted."""
    assert MlflowAdapter(tracking_uri=uri).tracking_uri == uri


def test_bad_environment_uri_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad MLFLOW_TRACKING_URI raises naming the variable; an explicit option is used instead of it."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://x")
    with pytest.raises(ConfigError, match=r"MLFLOW_TRACKING_URI 'bogus://x' has the scheme 'bogus'"):
        MlflowAdapter()
    assert MlflowAdapter(tracking_uri="sqlite:///x.db").tracking_uri == "sqlite:///x.db"


def test_bad_options_raise_config_error() -> None:
    """attach, experiment and run_name are checked when the adapter is built."""
    with pytest.raises(ConfigError, match="attach must be true or false"):
        make_adapter({"type": "mlflow", "attach": "yes"})
    with pytest.raises(ConfigError, match="experiment must be a non-empty string"):
        make_adapter({"type": "mlflow", "experiment": ""})


def test_missing_mlflow_raises_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the mlflow package the adapter cannot be built, and the error says how to install it."""
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(AdapterNotFoundError, match=r"pip install 'metricbus\[mlflow\]'"):
        MlflowAdapter()


def test_uncreatable_sqlite_folder_fails_at_open(tmp_path: Path) -> None:
    """A sqlite path under a file raises ConfigError at open naming the URI and the folder."""
    (tmp_path / "blocker").write_text("not a folder")
    uri = f"sqlite:///{tmp_path / 'blocker' / 'sub' / 'mlflow.db'}"
    adapter = MlflowAdapter(tracking_uri=uri)
    with pytest.raises(ConfigError, match=r"cannot create the database folder '.*blocker/sub'"):
        adapter.open(run=RunInfo())


# -- a real mlflow server ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_mlflow_server_round_trip(mlflow_server: str) -> None:
    """A real ``mlflow server`` receives every point; the same client reads them back over HTTP."""
    from mlflow.tracking import MlflowClient

    rows = _series(steps=30)
    run_id = _run(MlflowAdapter(tracking_uri=mlflow_server), rows, status="failed")
    client = MlflowClient(tracking_uri=mlflow_server)
    _assert_history(client, run_id, rows)
    assert client.get_run(run_id).info.status == "FAILED"


@pytest.mark.slow
def test_server_from_environment_and_killed_run(mlflow_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME pick the server and experiment; a killed run stays one run."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "env-killed")
    synced = _kill_then_complete(mlflow_server, RunInfo(project="ignored"), identity=False, option=False)
    client = MlflowClient(tracking_uri=mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("env-killed").experiment_id])
    assert (run.info.run_id, run.info.status) == (synced.run_id, "FINISHED")
    assert _history(client, run.info.run_id, "loss") == [(s, float(s)) for s in range(20)]
    assert client.get_experiment_by_name("ignored") is None


def test_a_colliding_name_leaves_the_steps_other_metrics_written(sqlite_uri: str) -> None:
    """A name that collides with another's MLflow key is refused alone: the step's other metrics are logged."""
    from mlflow.tracking import MlflowClient

    from metricbus.errors import RejectedMetricsError

    adapter = MlflowAdapter(tracking_uri=sqlite_uri)
    adapter.open(run=RunInfo(project="collide"))
    adapter.write(step=0, metrics={"x@y": 1.0, "loss": 1.0})
    with pytest.raises(RejectedMetricsError, match=r"'x_y' at step 1 \(its other 1 metric was written\)") as info:
        adapter.write(step=1, metrics={"x_y": 2.0, "loss": 2.0})
    assert list(info.value.rejected) == ["x_y"]
    adapter.close(status="finished")
    client = MlflowClient(tracking_uri=sqlite_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("collide").experiment_id])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(0, 1.0), (1, 2.0)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "x_y")] == [(0, 1.0)]
