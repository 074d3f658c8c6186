"""Review of the console, TensorBoard, wandb and jsonl adapters (second pass): rejected names, config keys, -0."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from backend_env import isolate_env
from metricbus.adapters.console import ConsoleAdapter
from metricbus.adapters.wandb import WandbAdapter

from metricbus import MetricBus, RunInfo
from metricbus.errors import ConfigError


def test_console_prints_negative_zero_with_its_sign() -> None:
    """-0.0 prints as -0 (0.0 as 0), as every other adapter keeps the sign."""
    stream = io.StringIO()
    with MetricBus(adapters=[ConsoleAdapter(stream=stream)], dist=None, strict=True, run=RunInfo(name="z")) as bus:
        bus.log({"a": -0.0, "b": 0.0})
        bus.commit()
    (line,) = [line for line in stream.getvalue().splitlines() if line.startswith("step")]
    cells = [cell.split() for cell in line.split("|")[1:]]
    assert cells == [["a", "-0"], ["b", "0"]]


def test_wandb_config_value_it_cannot_store_names_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config leaf wandb cannot turn into JSON is a ConfigError naming its dotted key and what is valid."""
    isolate_env(monkeypatch, tmp_path)
    adapter = WandbAdapter()
    config = {"lr": 0.1, "opt": {"sched": [1, object()]}}
    with pytest.raises(ConfigError, match=r"config key 'opt\.sched\[1\]' holds .*type object.*bool, int, float, str"):
        adapter.open(run=RunInfo(config=config))
    assert not list(tmp_path.glob("wandb/offline-run-*"))  # refused before wandb.init started a run
