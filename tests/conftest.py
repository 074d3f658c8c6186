"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings

# The property tests draw a fixed sequence of examples (derandomize), so that the suite's result depends on the
# code alone: a counter-example found at random would make CI red by chance. To hunt for new ones, draw fresh
# examples each run: METRICBUS_HYPOTHESIS=explore (a failure found so becomes an explicit test).
settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("explore", database=None)
settings.load_profile(os.environ.get("METRICBUS_HYPOTHESIS", "fixed"))

if TYPE_CHECKING:
    from backend_env import MlflowServer

RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # no usage reporting
    "RAY_AUTH_MODE": "disabled",  # a local test cluster: no token written to ~/.ray
    "RAY_DEDUP_LOGS": "0",
}
SYNCS = ("item", "cpu", "tolist", "__float__", "__bool__", "__int__", "numpy")  # what copies a tensor to the host


@pytest.fixture
def no_host_sync(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make every host-sync call on a tensor raise (skipped without torch)."""
    torch = pytest.importorskip("torch")

    def fail(*_a: object, **_k: object) -> None:
        raise AssertionError("host sync in log()")

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, fail)
    yield
    monkeypatch.undo()


@pytest.fixture(scope="module")
def empty_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty sqlite MLflow tracking database, created once per module (MLflow's schema migrations take about a
    second)."""
    from backend_env import isolate_env
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("template")
    with pytest.MonkeyPatch.context() as patch:
        isolate_env(patch, root)
        MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}").search_experiments()
    return root / "mlflow.db"


@pytest.fixture
def sqlite_uri(tmp_path: Path, empty_db: Path) -> str:
    """A fresh sqlite MLflow tracking database (a copy of the empty one)."""
    (tmp_path / "db").mkdir()
    shutil.copyfile(empty_db, tmp_path / "db" / "mlflow.db")
    return f"sqlite:///{tmp_path / 'db' / 'mlflow.db'}"


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray with 2 CPUs for the module using it; shut down (and its temp dir removed) after its last test."""
    ray = pytest.importorskip("ray")
    temp = tempfile.mkdtemp(prefix="mbray-")  # short: Ray's socket paths live under it
    with pytest.MonkeyPatch.context() as monkeypatch:
        for key, value in RAY_ENV.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp)
        try:
            yield ray
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[MlflowServer]:
    """A real ``mlflow server`` of this test's own, started (the test may stop and restart it)."""
    from backend_env import MlflowServer

    server = MlflowServer(tmp_path / "server")
    server.root.mkdir()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def unstaged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Journals opened in the test write each commit with its own ``os.write`` (no stage: metricbus/journal/stage.py),
    for the tests that make those writes fail one by one."""
    from metricbus.journal import stage

    monkeypatch.setattr(stage, "STAGED", False)
