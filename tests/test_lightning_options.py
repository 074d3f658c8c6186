"""MetricBusCallback's and MetricBusLogger's options, checked at construction (before any Trainer runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pytorch_lightning")
pytest.importorskip("mlflow")

from metricbus.errors import ConfigError
from metricbus.integrations.lightning import MetricBusCallback
from tests.backend_env import isolate_env

REFUSED = r"adapters\[0\] \(mlflow, at its default\): request_timeout_s=5 s must be below the bus's write_timeout_s=2 s"


@pytest.mark.parametrize(
    "adapter", ["mlflow", "mlflow:sqlite:///m.db", {"type": "mlflow", "tracking_uri": "sqlite:///m.db"}]
)
def test_an_adapter_left_at_its_default_request_timeout_is_checked_at_construction(adapter: object) -> None:
    """MLflow's default request_timeout_s (5 s) at or above write_timeout_s: refused by the constructor (it was
    refused only at setup('fit'), once the bus built the adapter), naming the adapter; below it, taken."""
    with pytest.raises(ConfigError, match=REFUSED):
        MetricBusCallback(adapters=[adapter], write_timeout_s=2.0)
    MetricBusCallback(adapters=[adapter], write_timeout_s=6.0)


def test_adapters_from_the_config_file_are_checked_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without adapters=, the $METRICBUS_CONFIG file's adapters and write_timeout_s are checked alike."""
    isolate_env(monkeypatch, tmp_path)
    config = tmp_path / "metricbus.yaml"
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    config.write_text(f"adapters: [{{type: mlflow, tracking_uri: '{uri}'}}]\nwrite_timeout_s: 2\n")
    monkeypatch.setenv("METRICBUS_CONFIG", str(config))
    with pytest.raises(ConfigError, match=r"request_timeout_s=5 s must be below the bus's write_timeout_s=2 s"):
        MetricBusCallback()
