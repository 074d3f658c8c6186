"""The public API under hostile and concurrent use, as a demanding trainer author would hit it (second review):
records logged on another thread while ``close()`` runs are either in its last commit or refused; a Partial object
ingested twice before a commit is refused; a Ctrl-C inside a commit is raised once the commit is whole."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from metricbus import MetricBus
from metricbus.errors import ClosedError, ConfigError, MetricValueError, StepError
from metricbus.partial import Partial
from metricbus.testing import MemoryAdapter
from tests.terminal import SIGINT_DEFAULT

ROOT = Path(__file__).resolve().parent.parent


def _log_while_closing(call: Any, *, boundaries: bool = False) -> tuple[int, float]:
    """Two threads log ``call(bus)`` in a loop (``boundaries``: a third ends updates) while the main thread closes
    the bus: how many records the calls that returned logged, and how many the bus delivered (every metric is a
    count)."""
    mem = MemoryAdapter()
    bus = MetricBus(dist=None, adapters=[mem], rules={"*": "count"})
    returned = [0, 0]
    running = [threading.Event(), threading.Event()]

    def logger(i: int) -> None:
        calls = 0
        while True:
            try:
                returned[i] += call(bus)
            except ClosedError:
                return
            calls += 1
            if calls == 100:  # both threads are logging when close() begins, and go on until it refuses them
                running[i].set()

    def ender() -> None:
        while True:
            try:
                bus.end_update()
            except ClosedError:
                return

    threads = [threading.Thread(target=logger, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=ender)] if boundaries else []
    for thread in threads:
        thread.start()
    for event in running:
        event.wait()
    bus.close()
    for thread in threads:
        thread.join()
    return sum(returned), sum(value for _, row in mem.rows for value in row.values())


def _float(bus: MetricBus) -> int:
    bus.log("x", 1.0)
    return 1


def _dict(bus: MetricBus) -> int:
    bus.log({"x": 1.0, "y": 2.0})
    return 2


def _list(bus: MetricBus) -> int:
    bus.log("x", [1.0, 2.0])
    return 2


def _array(bus: MetricBus) -> int:
    bus.log("x", np.ones(3))
    return 3


@pytest.mark.parametrize("call", [_float, _dict, _list, _array], ids=["float", "dict", "list", "array"])
def test_a_record_logged_on_another_thread_while_close_runs_is_committed_or_refused(call: Any) -> None:
    """A log() racing close() on another thread is in close()'s last commit or raises ClosedError, never lost."""
    for _ in range(20):
        returned, delivered = _log_while_closing(call)
        assert delivered == returned


def test_update_boundaries_on_a_third_thread_while_close_runs_lose_no_record() -> None:
    """end_update() on another thread while close() runs takes no record a racing log() still looks for."""
    for _ in range(20):
        returned, delivered = _log_while_closing(_float, boundaries=True)
        assert delivered == returned


def _worker_partial(values: list[float]) -> Partial:
    worker = MetricBus(dist=None, rules={"x": "sum"})
    for value in values:
        worker.log("x", value)
    part = worker.export()
    worker.close()
    return part


def test_the_same_partial_twice_in_one_ingest_is_refused_and_nothing_is_ingested() -> None:
    """ingest([p, p]) would count that worker's records twice: a MetricValueError, and nothing of the call is taken."""
    driver = MetricBus(dist=None)
    first, second = _worker_partial([1.0, 2.0]), _worker_partial([5.0])
    with pytest.raises(MetricValueError, match=r"partial 2 of this call \(holding 'x'\) is the same Partial"):
        driver.ingest([first, second, first])
    driver.ingest([first, second])
    assert driver.commit() == {"x": 8.0}
    driver.close()


def test_a_partial_a_refused_commit_kept_is_refused_when_ingested_again() -> None:
    """A refused commit keeps its ingested partials for the next one: ingesting them again is refused, not doubled."""
    driver = MetricBus(dist=None)
    driver.log("y", 1.0)
    driver.commit(step=5)
    part = _worker_partial([1.0, 2.0])
    driver.ingest([part])
    with pytest.raises(StepError):
        driver.commit(step=4)
    with pytest.raises(MetricValueError, match="ingested since the last commit"):
        driver.ingest([part])
    assert driver.commit(step=6) == {"x": 3.0}
    driver.ingest([part])  # reduced at step 6: a later commit may take it again, as a new worker's
    assert driver.commit(step=7) == {"x": 3.0}
    driver.close()


def test_one_empty_partial_may_stand_for_several_workers() -> None:
    """An empty Partial holds no records: the same object ingested for several absent workers counts nothing."""
    driver = MetricBus(dist=None)
    empty = Partial()
    driver.ingest([empty, _worker_partial([4.0]), empty])
    driver.ingest([empty])
    assert driver.commit() == {"x": 4.0}
    driver.close()


CTRL_C_IN_COMMIT = """
import os, signal, sys, threading
from metricbus import MetricBus
from metricbus.adapters.jsonl import read_jsonl
from metricbus.replay import replay
from metricbus.testing import MemoryAdapter

from metricbus.journal import stage
stage.STAGED = False  # each commit written with its own os.write: where the Ctrl-C below lands
journal, path = sys.argv[1], sys.argv[2]
bus = MetricBus(dist=None, journal=journal, adapters=["jsonl:" + path], rules={{"c": "sum"}})
bus.log("c", 1.0)
bus.commit()
real, armed = os.write, [{presses}]

def write(fd, data):  # a Ctrl-C arriving while the main thread writes the journal (where one mostly lands)
    written = real(fd, data)
    if threading.current_thread() is threading.main_thread() and os.readlink(f"/proc/self/fd/{{fd}}").endswith(".mbj"):
        while armed[0]:
            armed[0] -= 1
            signal.raise_signal(signal.SIGINT)
    return written

os.write = write
bus.log("c", 10.0)
try:
    bus.commit()
except KeyboardInterrupt:
    print("interrupted, last step", bus.last_step)
os.write = real
bus.log("c", 100.0)
bus.commit()
bus.close()
mem = MemoryAdapter()
replay(journal, adapters=[mem])
print("live", read_jsonl(path))
print("replay", mem.rows)
"""


def _ctrl_c_in_commit(tmp_path: Path, presses: int) -> list[str]:
    code = CTRL_C_IN_COMMIT.format(presses=presses)
    args = [sys.executable, "-c", SIGINT_DEFAULT + code, str(tmp_path / "j"), str(tmp_path / "m.jsonl")]
    done = subprocess.run(args, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_ctrl_c_during_a_commit_is_raised_once_the_commit_is_whole(tmp_path: Path) -> None:
    """A SIGINT right after the journal write: the step is committed, delivered and counted, then KeyboardInterrupt."""
    steps = [(0, {"c": 1.0}), (1, {"c": 10.0}), (2, {"c": 100.0})]
    assert _ctrl_c_in_commit(tmp_path, presses=1) == ["interrupted, last step 1", f"live {steps}", f"replay {steps}"]


def test_a_second_ctrl_c_while_one_waits_is_raised_at_once(tmp_path: Path) -> None:
    """Two SIGINTs inside one commit: the second raises where it lands (a hung call can still be left)."""
    assert _ctrl_c_in_commit(tmp_path, presses=2)[0] == "interrupted, last step 0"


def _runs_clean(code: str) -> None:
    """Run ``code`` in a fresh interpreter (signal handlers are per process); its asserts must hold."""
    done = subprocess.run([sys.executable, "-c", SIGINT_DEFAULT + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_a_programs_own_sigint_handler_is_left_alone() -> None:
    """A bus with a journal installs its SIGINT handler only over Python's default one."""
    code = (
        "import signal, tempfile\nfrom metricbus import MetricBus\n"
        "def mine(signum, frame): pass\nsignal.signal(signal.SIGINT, mine)\n"
        "bus = MetricBus(dist=None, journal=tempfile.mkdtemp())\nassert signal.getsignal(signal.SIGINT) is mine\n"
        "bus.close()\nbus = MetricBus(dist=None, journal=tempfile.mkdtemp())\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "other = MetricBus(dist=None, journal=tempfile.mkdtemp())\n"
        "assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler\nbus.close()\nother.close()\n"
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
    )
    _runs_clean(code)


def test_the_default_sigint_handler_is_back_once_the_last_bus_closed() -> None:
    """Ours only while a bus is open: asyncio.run, which handles Ctrl-C only over the default handler, finds it."""
    code = (
        "import asyncio, signal, tempfile\nfrom metricbus import MetricBus\n"
        "first = MetricBus(dist=None, journal=tempfile.mkdtemp())\n"
        "second = MetricBus(dist=None, journal=tempfile.mkdtemp())\n"
        "ours = signal.getsignal(signal.SIGINT)\nassert ours is not signal.default_int_handler\n"
        "first.close()\nassert signal.getsignal(signal.SIGINT) is ours\n"
        "second.close()\nassert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
        "async def main():\n    return signal.getsignal(signal.SIGINT)\n"
        "assert asyncio.run(main()) is not signal.default_int_handler  # asyncio's own\n"
        "third = MetricBus(dist=None, journal=tempfile.mkdtemp())\n"
        "assert signal.getsignal(signal.SIGINT) is ours\nthird.close()\n"
        "assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
    )
    _runs_clean(code)


@pytest.mark.parametrize(
    "value",
    [np.longdouble("1e400"), np.array([1.0, np.longdouble("-1e400")], dtype=np.longdouble),
     [np.longdouble("1e400")], np.array([np.longdouble("1e400")])[::1]],
    ids=["scalar", "array", "list", "view"],
)  # fmt: skip
def test_a_longdouble_beyond_the_double_range_is_refused_naming_the_metric(value: object) -> None:
    """A finite longdouble beyond 1.8e308 is a MetricValueError naming the metric (as an int is), not a silent inf."""
    bus = MetricBus(dist=None, rules={"x": "sum"})
    bus.log("x", 2.0)
    bus.log("x", np.ones(2, dtype=np.longdouble))
    with pytest.raises(MetricValueError, match=r"for 'x' is beyond the double range"):
        bus.log("x", value)
    bus.log("x", np.array([np.longdouble("inf")]))  # an infinity it holds is one
    bus.log("x", np.longdouble(0.5))
    assert bus.commit() == {"x": math.inf}
    bus.log("x", np.array([1.5, 2.0], dtype=np.longdouble))
    assert bus.commit() == {"x": 3.5}
    bus.close()


@pytest.mark.parametrize("timeout_s", [math.nan, -1.0, "5", None, True], ids=["nan", "negative", "str", "none", "bool"])
def test_a_bad_close_or_flush_timeout_is_a_config_error_and_leaves_the_bus_open(
    tmp_path: Path, timeout_s: object
) -> None:
    """Before, NaN or -1 gave the adapters no time (cursor never acknowledged), a string a TypeError mid-close."""
    from metricbus.adapters.jsonl import read_jsonl

    bus = MetricBus(dist=None, adapters=[f"jsonl:{tmp_path / 'm.jsonl'}"], journal=str(tmp_path / "j"))
    bus.log("x", 1.0)
    bus.commit()
    bus.log("x", 2.0)
    for call in (bus.flush, bus.close):
        with pytest.raises(ConfigError, match=r"timeout_s must be a number of seconds >= 0"):
            call(timeout_s=timeout_s)  # type: ignore[operator]
    assert not bus.closed
    bus.close(timeout_s=math.inf)
    assert read_jsonl(tmp_path / "m.jsonl") == [(0, {"x": 1.0}), (1, {"x": 2.0})]
    cursor = next((tmp_path / "j" / "cursors").glob("jsonl-*.json")).read_text()
    assert '"step": 1' in cursor


def test_an_unknown_close_status_is_a_config_error_and_leaves_the_bus_open() -> None:
    """Before, close(status='failure') was taken: MLflow's adapter could not end its run with it (a KeyError)."""
    mem = MemoryAdapter()
    bus = MetricBus(dist=None, adapters=[mem])
    bus.log("x", 1.0)
    with pytest.raises(ConfigError, match=r"status must be 'finished' or 'failed'"):
        bus.close(status="failure")  # type: ignore[arg-type]
    assert not bus.closed
    bus.close(status="failed")
    assert mem.rows == [(0, {"x": 1.0})]
