"""Review (second round) of replay's refusal of a target that already holds rows: a target that is not a regular file
(a pipe, such as the standard output of ``metricbus replay ... | cat``) is not read for lines. Real child processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from metricbus import MetricBus

ROOT = Path(__file__).resolve().parents[1]


def test_replay_into_a_pipe_ends_rather_than_waiting_to_read_it(tmp_path: Path) -> None:
    """'replay --to jsonl:/dev/stdout' into a pipe ends with the adapter's error, where it waited forever to count
    the pipe's lines."""
    with MetricBus(journal=str(tmp_path / "j"), dist=None) as bus:
        for step in range(3):
            bus.log("x", float(step))
            bus.commit(step)
    done = subprocess.run(
        [sys.executable, "-m", "metricbus", "replay", str(tmp_path / "j"), "--to", "jsonl:/dev/stdout"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "a backend failed" in done.stderr


def test_replay_into_a_regular_file_holding_lines_is_still_refused(tmp_path: Path) -> None:
    """A regular file that holds a line is still refused (exit 2), and left as it was."""
    with MetricBus(journal=str(tmp_path / "j"), dist=None) as bus:
        bus.log("x", 1.0)
        bus.commit(0)
    target = tmp_path / "rows.jsonl"
    target.write_text('{"step": 0}\n')
    done = subprocess.run(
        [sys.executable, "-m", "metricbus", "replay", str(tmp_path / "j"), "--to", f"jsonl:{target}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "already holds 1 line(s)" in done.stderr
    assert target.read_text() == '{"step": 0}\n'
