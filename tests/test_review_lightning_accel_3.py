"""Review of the Lightning and Accelerate integrations (third pass): real Trainers, Fabric and Accelerators on CPU."""

from __future__ import annotations

import pytest

pytest.importorskip("pytorch_lightning")


from metricbus.integrations.lightning import MetricBusLogger
from metricbus.testing import MemoryAdapter

QUIET = [  # Lightning's advice for real runs, not about what these tests check
    "ignore:.*does not have many workers.*",
    "ignore:.*smaller than the logging interval.*",
    "ignore:.*GPU available but not used.*",
    "ignore:.*litlogger.*",
    "ignore:.*no `val_dataloader`.*",
]
pytestmark = [pytest.mark.filterwarnings(f) for f in QUIET]


def test_fabric_log_without_a_step_is_a_step_of_its_own() -> None:
    """fabric.log(name, value) passes step=None: each call is the next step (Lightning's loggers auto-increment),
    not merged into step 0 with the last value winning."""
    from lightning_fabric import Fabric

    memory = MemoryAdapter()
    logger = MetricBusLogger(adapters=[memory], strict=True)
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[logger])
    for value in (0.5, 1.5, 2.5):
        fabric.log("loss", value)
    fabric.log_dict({"loss": 3.5, "acc": 0.25}, step=7)
    fabric.log("loss", 4.5)
    logger.finalize("success")
    assert memory.rows == [
        (0, {"loss": 0.5}), (1, {"loss": 1.5}), (2, {"loss": 2.5}), (7, {"loss": 3.5, "acc": 0.25}), (8, {"loss": 4.5})
    ]  # fmt: skip
