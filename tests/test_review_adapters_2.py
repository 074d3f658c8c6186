"""Review of the console, TensorBoard, wandb and jsonl adapters (second pass): rejected names, config keys, -0."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import wandb
from backend_env import isolate_env, read_wandb_history, read_wandb_records
from metricbus.adapters.console import ConsoleAdapter
from metricbus.adapters.tensorboard import TensorBoardAdapter
from metricbus.adapters.wandb import WandbAdapter
from tb_reader import legacy_accumulator, read_tensors

from metricbus import MetricBus, RunInfo
from metricbus.errors import AdapterError, ConfigError
from metricbus.replay import replay, sync


@pytest.fixture(autouse=True)
def fresh_wandb() -> Iterator[None]:
    """wandb's process-wide setup (settings read from the environment) is torn down around each test."""
    wandb.teardown()
    yield
    if wandb.run is not None:
        wandb.run.finish()
    wandb.teardown()


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


def _log_reserved(bus: MetricBus) -> list[AdapterError]:
    """Steps 0..3 of ``loss``; steps 1 and 2 also hold wandb's ``_step`` and TensorBoard's ``metricbus/run``; then
    close. What a strict bus raised at a commit (each after that step was committed) or at close."""
    raised = []
    for step in range(4):
        bus.log("loss", float(step))
        if step in (1, 2):
            bus.log({"_step": 9.0, "metricbus/run": 7.0})
        try:
            bus.commit(step=step)
        except AdapterError as exc:
            raised.append(exc)
    try:
        bus.close()
    except AdapterError as exc:
        raised.append(exc)
    return raised


def _wandb_losses(folder: Path) -> list[tuple[int, float]]:
    (run_dir,) = folder.glob("wandb/offline-run-*")
    return [(row["_step"], row["loss"]) for row in read_wandb_history(run_dir) if "loss" in row]


def _refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if " refuses metric " in r.getMessage()]


def _backends(root: Path) -> list[Any]:
    return [WandbAdapter(dir=str(root)), TensorBoardAdapter(log_dir=root / "tb")]


def _assert_every_loss(root: Path) -> None:
    losses = [(step, float(step)) for step in range(4)]
    assert _wandb_losses(root) == losses
    assert read_tensors(root / "tb", "loss") == losses


def test_a_refused_name_leaves_the_rest_of_its_step_delivered_live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Live: wandb and TensorBoard get every loss, each refused name is reported once, the runs end failed."""
    isolate_env(monkeypatch, tmp_path)
    bus = MetricBus(dist=None, adapters=_backends(tmp_path), journal=str(tmp_path / "j"))
    assert _log_reserved(bus) == []
    _assert_every_loss(tmp_path)
    said = _refusals(caplog)
    assert len(said) == 2
    assert all("reported once" in text and "rename the metric" in text for text in said)
    assert any("'wandb' refuses metric '_step' (first at step 1)" in text for text in said)
    assert any("'tensorboard' refuses metric 'metricbus/run' (first at step 1)" in text for text in said)
    (run_dir,) = tmp_path.glob("wandb/offline-run-*")
    (exit_record,) = [r for r in read_wandb_records(run_dir) if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit.exit_code == 1
    assert sync(str(tmp_path / "j"), _backends(tmp_path)) == {"wandb": 0, "tensorboard": 0}  # acknowledged, no gap


def test_a_strict_bus_raises_naming_the_refused_name_after_delivering_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Strict: close() raises AdapterError naming the refused metric and the reserved names; every loss arrived."""
    isolate_env(monkeypatch, tmp_path)
    bus = MetricBus(dist=None, adapters=_backends(tmp_path), strict=True)
    raised = _log_reserved(bus)
    assert raised
    for exc in raised:
        assert re.search(r"refuses metric '(_step|metricbus/run)' \(first at step 1; the step's other metrics were "
                         r"delivered\): .*rename the metric \(reserved: ", str(exc))
    _assert_every_loss(tmp_path)


def test_sync_sends_the_rest_of_a_step_holding_a_refused_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """metricbus sync: every loss reaches wandb and TensorBoard, one AdapterError names both refusals, no gap."""
    isolate_env(monkeypatch, tmp_path)
    bus = MetricBus(dist=None, adapters=[], journal=str(tmp_path / "j"))
    assert _log_reserved(bus) == []
    with pytest.raises(AdapterError, match=r"'wandb' refuses metric '_step' .*'tensorboard' refuses metric "
                                           r"'metricbus/run' .*the other metrics of those steps were written"):
        sync(str(tmp_path / "j"), _backends(tmp_path))
    _assert_every_loss(tmp_path)
    assert sync(str(tmp_path / "j"), _backends(tmp_path)) == {"wandb": 0, "tensorboard": 0}  # acknowledged, no gap


def test_replay_sends_the_rest_of_a_step_holding_a_refused_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """replay: every step is sent without the refused names, then one AdapterError names them."""
    isolate_env(monkeypatch, tmp_path)
    bus = MetricBus(dist=None, adapters=[], journal=str(tmp_path / "j"))
    assert _log_reserved(bus) == []
    with pytest.raises(AdapterError, match=r"replay sent 4 steps, without metrics a backend refuses: .*'_step'"):
        replay(str(tmp_path / "j"), _backends(tmp_path))
    _assert_every_loss(tmp_path)
