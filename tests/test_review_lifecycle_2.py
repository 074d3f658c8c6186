"""Review (second round) of closing: a bad timeout given to an integration is refused where it is given, not at the
end of training; a Ctrl-C (and a SIGTERM) while close() drains the adapters waits for close() to end, and neither is
lost. Real child processes and signals."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.terminal import SIGINT_DEFAULT

pytest.importorskip("pytorch_lightning")

from metricbus.errors import ConfigError
from metricbus.integrations.lightning import MetricBusLogger

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("option", ["save_timeout_s", "close_timeout_s"])
@pytest.mark.parametrize("value", [-1, math.nan, "5", None, True])
def test_a_bad_logger_timeout_is_refused_at_construction(option: str, value: Any) -> None:
    """MetricBusLogger(close_timeout_s=-1) or (save_timeout_s='5') raises ConfigError naming it, before any fit."""
    with pytest.raises(ConfigError, match=rf"MetricBusLogger\({option}=.*{option} must be a number of seconds >= 0"):
        MetricBusLogger(adapters=[], **{option: value})


@pytest.mark.parametrize("value", [0, 2.5, math.inf])
def test_a_valid_logger_timeout_is_taken(value: float) -> None:
    """0, a float and math.inf (no bound) are valid timeouts of the logger."""
    MetricBusLogger(adapters=[], save_timeout_s=value, close_timeout_s=value)


SIGNALS_IN_CLOSE = """
import os, signal, sys, threading
from metricbus import MetricBus, shutdown
from metricbus.testing import MemoryAdapter

sent = sys.argv[1].split(",")
handled = threading.Event()  # the main thread saw KeyboardInterrupt
calls = []
signal.signal(signal.SIGTERM, lambda signum, frame: calls.append("program's SIGTERM handler"))

def waits(count):  # the main thread, inside close(), deferred that many signals (or already raised)
    for _ in range(1200):
        if len(shutdown._deferred or ()) >= count or handled.wait(0.05):
            return

class Closing(MemoryAdapter):
    def close(self, *, status):  # runs while close() waits for the adapters, on the bus's delivery thread
        for count, name in enumerate(sent, 1):
            os.kill(os.getpid(), getattr(signal, name))
            waits(count)
        super().close(status=status)

adapter = Closing()
bus = MetricBus(adapters=[adapter], dist=None)
for step in range(3):
    bus.log("x", float(step))
    bus.commit(step)
try:
    bus.close(timeout_s=120)
    calls.append("close() returned")
except KeyboardInterrupt:
    handled.set()
    calls.append(f"KeyboardInterrupt, the adapter closed {adapter.status}, {len(adapter.rows)} steps")
print(calls)
"""


@pytest.mark.parametrize(
    ("sent", "seen"),
    [
        ("SIGINT", ["KeyboardInterrupt, the adapter closed finished, 3 steps"]),
        ("SIGTERM,SIGINT", ["program's SIGTERM handler", "KeyboardInterrupt, the adapter closed finished, 3 steps"]),
        ("SIGINT,SIGTERM", ["program's SIGTERM handler", "KeyboardInterrupt, the adapter closed finished, 3 steps"]),
    ],
)
def test_a_ctrl_c_while_close_drains_the_adapters_waits_for_close(sent: str, seen: list[str]) -> None:
    """A SIGINT (and a SIGTERM the program handles) while close() drains: close ends first, neither is lost."""
    args = [sys.executable, "-c", SIGINT_DEFAULT + SIGNALS_IN_CLOSE, sent]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [repr(seen)]
