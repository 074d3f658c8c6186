"""Review of the console, TensorBoard, wandb and jsonl adapters (second pass): rejected names, config keys, -0."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from backend_env import isolate_env
from metricbus.adapters.console import ConsoleAdapter
from metricbus.adapters.tensorboard import TensorBoardAdapter
from metricbus.adapters.wandb import WandbAdapter
from tb_reader import legacy_accumulator

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


def test_tensorboard_hparams_keep_both_values_of_a_dotted_key_and_its_nested_twin(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """config "a.b" and {"a": {"b"}} with different values: both hparams read back, and a warning names both keys."""
    from tensorboard.plugins.hparams import metadata

    config = {"a.b": 1, "a": {"b": 2, "c": 3}, "x": {"y": 5}, "x.y": 5}
    adapter = TensorBoardAdapter(log_dir=tmp_path / "tb")
    with caplog.at_level(logging.WARNING, logger="metricbus.adapters.tensorboard"):
        adapter.open(run=RunInfo(config=config))
    adapter.close(status="finished")
    content = legacy_accumulator(tmp_path / "tb").PluginTagToContent(metadata.PLUGIN_NAME)
    info = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    values = {name: getattr(value, value.WhichOneof("kind")) for name, value in info.hparams.items()}
    assert values == {"a.b": 1.0, '["a", "b"]': 2.0, "a.c": 3.0, "x.y": 5.0}  # the same value twice is one
    (record,) = [r for r in caplog.records if "flatten to one hparams name" in r.getMessage()]
    assert "config['a.b'] and config['a']['b']" in record.getMessage()
