"""Review of metricbus.integrations on the real frameworks: a value logged twice at one step must not leak into a
later step (Accelerate, HF Trainer), and the Trainer's logs keep their steps."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from metricbus import MetricBus  # noqa: E402
from metricbus.testing import MemoryAdapter  # noqa: E402

TESTS = Path(__file__).resolve().parent


def test_accelerate_a_name_twice_at_one_step_does_not_change_the_next_step(caplog: pytest.LogCaptureFixture) -> None:
    """Accelerator.log of 'loss' twice at step 1: the second is left out (reported), step 2 keeps its own value."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from metricbus.integrations.accelerate import MetricBusTracker

    memory = MemoryAdapter()
    tracker = MetricBusTracker("proj", bus=MetricBus(adapters=[memory], strict=True, dist=None))
    accelerator = Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("proj")
    accelerator.log({"loss": 1.0}, step=1)
    with caplog.at_level("WARNING", logger="metricbus.accelerate"):
        accelerator.log({"loss": 2.0, "acc": 0.5}, step=1)  # 'acc' is new at this step: kept
    accelerator.log({"loss": 3.0}, step=2)
    accelerator.end_training()
    assert memory.rows == [(1, {"loss": 1.0}), (1, {"acc": 0.5}), (2, {"loss": 3.0})]
    assert "'loss' was already logged at step 1" in caplog.text
