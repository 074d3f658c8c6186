"""metricbus.integrations.accelerate with Accelerate's own Accelerator (CPU, one process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

from accelerate import Accelerator
from accelerate.tracking import LOGGER_TYPE_TO_CLASS
from metricbus.adapters.jsonl import read_jsonl

from metricbus import MetricBus
from metricbus.integrations.accelerate import REGISTERED, MetricBusTracker, register
from metricbus.testing import MemoryAdapter

needs_registration = pytest.mark.skipif(
    not REGISTERED, reason="this Accelerate has no register_tracker_class: use log_with=[MetricBusTracker(...)]"
)


@pytest.fixture
def jsonl_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$METRICBUS_ADAPTERS pointing at a jsonl file; returns the file."""
    out = tmp_path / "metrics.jsonl"
    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    monkeypatch.setenv("METRICBUS_ADAPTERS", f"jsonl:{out}")
    return out


@needs_registration
def test_log_with_name_delivers_to_jsonl(jsonl_env: Path) -> None:
    """Accelerator(log_with="metricbus") delivers every log at its step and stores the run config."""
    accelerator = Accelerator(cpu=True, log_with="metricbus")
    accelerator.init_trackers("proj", config={"lr": 1e-3, "layers": 2})
    for i in range(3):
        accelerator.log({"loss": 1.0 / (i + 1), "acc": 0.5 + i / 10}, step=i)
    tracker = accelerator.get_tracker("metricbus")
    bus = tracker.tracker
    assert isinstance(bus, MetricBus)
    accelerator.end_training()
    assert bus.closed
    assert read_jsonl(jsonl_env) == [(i, {"acc": 0.5 + i / 10, "loss": 1.0 / (i + 1)}) for i in range(3)]
    assert bus.run.project == "proj"
    assert dict(bus.run.config) == {"lr": 1e-3, "layers": 2}


@needs_registration
def test_init_kwargs_config_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """init_kwargs={"metricbus": {"config_source": ...}} configures the bus built by name."""
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    out = tmp_path / "m.jsonl"
    accelerator = Accelerator(cpu=True, log_with="metricbus")
    accelerator.init_trackers(
        "proj", config={"seed": 1}, init_kwargs={"metricbus": {"config_source": {"adapters": [f"jsonl:{out}"]}}}
    )
    accelerator.log({"loss": 0.25}, step=7)
    accelerator.end_training()
    assert read_jsonl(out) == [(7, {"loss": 0.25})]


def test_instance_form_works_in_every_version() -> None:
    """log_with=[MetricBusTracker(bus=...)] delivers to the given bus's adapters."""
    memory = MemoryAdapter()
    tracker = MetricBusTracker("proj", bus=MetricBus(adapters=[memory], strict=True, dist=None))
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("proj", config={"lr": 0.1})
    accelerator.log({"loss": 2.0}, step=0)
    accelerator.log({"loss": 1.0, "note": "text is left out"}, step=1)
    accelerator.end_training()
    assert memory.rows == [(0, {"loss": 2.0}), (1, {"loss": 1.0})]
    assert memory.status == "finished"


def test_bad_step_is_reported_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    """A step below the last one is reported once on the metricbus.accelerate logger, training goes on."""
    memory = MemoryAdapter()
    tracker = MetricBusTracker("proj", bus=MetricBus(adapters=[memory], dist=None))
    tracker.log({"loss": 1.0}, step=5)
    with caplog.at_level("WARNING", logger="metricbus.accelerate"):
        tracker.log({"loss": 2.0}, step=3)
    tracker.finish()
    assert "below the last step 5" in caplog.text
    assert [step for step, _ in memory.rows] == [5]


def test_register_is_idempotent() -> None:
    """register() leaves one entry named metricbus pointing at MetricBusTracker."""
    assert register() is REGISTERED
    if REGISTERED:
        assert LOGGER_TYPE_TO_CLASS["metricbus"] is MetricBusTracker


def test_tracker_never_uses_collectives() -> None:
    """The bus the tracker builds has dist=None even where a process group could exist."""
    code = (
        "import json, metricbus.integrations.accelerate as a; t = a.MetricBusTracker('p');"
        "t.store_init_configuration({}); print(json.dumps(t.tracker._ranks.collective)); t.finish()"
    )
    env = {**os.environ, "METRICBUS_ADAPTERS": "none"}  # a config of some kind: none at all is a ConfigError
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert json.loads(out) is False
