"""Review of the console, TensorBoard, wandb and jsonl adapters (second pass): rejected names, config keys, -0."""

from __future__ import annotations

import io

from metricbus.adapters.console import ConsoleAdapter

from metricbus import MetricBus, RunInfo


def test_console_prints_negative_zero_with_its_sign() -> None:
    """-0.0 prints as -0 (0.0 as 0), as every other adapter keeps the sign."""
    stream = io.StringIO()
    with MetricBus(adapters=[ConsoleAdapter(stream=stream)], dist=None, strict=True, run=RunInfo(name="z")) as bus:
        bus.log({"a": -0.0, "b": 0.0})
        bus.commit()
    (line,) = [line for line in stream.getvalue().splitlines() if line.startswith("step")]
    cells = [cell.split() for cell in line.split("|")[1:]]
    assert cells == [["a", "-0"], ["b", "0"]]
