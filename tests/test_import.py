"""Importing metricbus has no side effects: no threads, no open files, no torch."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, os, sys, threading
def fds():
    return sorted(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else []
threads, files = threading.active_count(), fds()
import metricbus, metricbus.testing, metricbus.adapters.console
print(json.dumps({
    "threads": [threads, threading.active_count()],
    "fds": [files, fds()],
    "torch": "torch" in sys.modules,
}))
"""


def probe() -> dict[str, list[object] | bool]:
    """Run the import in a fresh interpreter and report what changed."""
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_import_starts_no_threads() -> None:
    """The thread count is the same before and after import."""
    before, after = probe()["threads"]  # type: ignore[misc]
    assert before == after


def test_import_opens_no_files() -> None:
    """No file descriptor is left open by the import."""
    before, after = probe()["fds"]  # type: ignore[misc]
    assert before == after


def test_import_does_not_import_torch() -> None:
    """torch stays unimported."""
    assert probe()["torch"] is False
