"""A 2-rank gloo run ends cleanly in every order a trainer may call close() and destroy_process_group().

Each rank is its own ``python`` process (tests/exit_workers.py), so what is checked is the real interpreter exit:
the exit code, no ``terminate called`` from a native thread, and every committed step in the journal and jsonl.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("torch")

from backend_env import free_port
from metricbus.adapters.jsonl import read_jsonl

from metricbus.journal import JournalWarning, read_journal
from metricbus.replay import emitted
from tests.exit_workers import RAISE_AT, STEPS

WORKER = Path(__file__).with_name("exit_workers.py")
ROOT = Path(__file__).resolve().parents[1]
SIZE = 2
TIMEOUT_S = 120


@dataclass(frozen=True)
class Rank:
    """How one rank's process ended."""

    code: int
    stdout: str
    stderr: str


def run_order(order: str, out: Path) -> list[Rank]:
    """Start every rank of ``order`` and wait for all of them."""
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), order, str(rank), str(SIZE), str(port), str(out)],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(SIZE)
    ]
    ranks = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            ranks.append(Rank(proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return ranks


def committed(out: Path) -> list[int]:
    """The steps replay of ``out/journal`` emits."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", JournalWarning)
        return [step for step, _ in emitted(read_journal(out / "journal"))]


def check_clean(ranks: list[Rank], *, codes: tuple[int, ...]) -> None:
    """The expected exit codes, and no native abort on any rank."""
    for rank, result in enumerate(ranks):
        detail = f"rank {rank} exit {result.code}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
        assert result.code == codes[rank], detail
        assert "terminate called" not in result.stderr, detail
        assert "Fatal Python error" not in result.stderr, detail


@pytest.mark.parametrize("order", ["close-destroy", "destroy", "neither"])
def test_every_step_reaches_the_journal_and_jsonl(order: str, tmp_path: Path) -> None:
    """close then destroy, destroy without close, neither: exit 0, every step in the journal and the jsonl."""
    ranks = run_order(order, tmp_path)
    check_clean(ranks, codes=(0, 0))
    assert committed(tmp_path) == list(range(STEPS))
    assert [step for step, _ in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(STEPS))


def test_close_after_destroy_warns_about_the_uncommitted_records(tmp_path: Path) -> None:
    """destroy then commit (refused) then close: exit 0, committed steps kept, a warning naming the pending records."""
    ranks = run_order("destroy-close", tmp_path)
    check_clean(ranks, codes=(0, 0))
    assert committed(tmp_path) == list(range(STEPS))
    assert [step for step, _ in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(STEPS))
    for result in ranks:
        assert "commit: commit(step=12)" in result.stdout
        assert "process group was destroyed" in result.stdout
        assert "were not committed" in result.stdout
        assert "destroy_process_group" in result.stdout


def test_exception_in_the_loop_on_every_rank(tmp_path: Path) -> None:
    """A ValueError inside ``with bus:`` on every rank: exit 1 with its traceback, steps before it kept."""
    ranks = run_order("raise", tmp_path)
    check_clean(ranks, codes=(1, 1))
    for result in ranks:
        assert "ValueError" in result.stderr
    assert committed(tmp_path) == list(range(RAISE_AT))
    assert [step for step, _ in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(RAISE_AT))


def test_exception_on_one_rank(tmp_path: Path) -> None:
    """rank 1 raises, rank 0 runs into the next commit: both exit 1 (no hang, no abort), steps before it kept."""
    ranks = run_order("raise-one", tmp_path)
    check_clean(ranks, codes=(1, 1))
    assert "ValueError" in ranks[1].stderr
    assert committed(tmp_path) == list(range(RAISE_AT))
    assert [step for step, _ in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(RAISE_AT))
