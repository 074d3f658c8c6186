"""Process lifecycle of a bus: a rank that ends with its bus open while another closes, fork, Ctrl-C, close().

The torch.distributed cases run each rank as its own ``python`` process (tests/exit_workers.py), so what is checked
is the real interpreter exit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from metricbus.adapters.jsonl import read_jsonl

from tests.exit_workers import STEPS
from tests.test_exit import check_clean, committed, run_order


def test_close_while_another_rank_ends_with_its_bus_open(tmp_path: Path) -> None:
    """rank 0 close(), rank 1 exits with its bus open: one DistributedError naming why, exit 0, every step kept."""
    ranks = run_order("close-one", tmp_path)
    check_clean(ranks, codes=(0, 0))
    assert "RuntimeError" not in ranks[0].stderr + ranks[1].stderr
    said = ranks[0].stdout
    assert "close: close() on rank 0: a torch.distributed collective failed" in said, said
    assert "ended without calling bus.close()" in said, said
    assert "this rank closes alone" in said, said
    assert "records of 'len', 'loss', 'tokens'" in ranks[1].stderr
    assert "interpreter exit" in ranks[1].stderr
    assert committed(tmp_path) == list(range(STEPS))
    assert [step for step, _ in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(STEPS))


def test_commit_while_another_rank_ends_with_its_bus_open(tmp_path: Path) -> None:
    """rank 0 commits after rank 1 exited: DistributedError keeping the records, then close() warns naming them."""
    ranks = run_order("commit-one", tmp_path)
    check_clean(ranks, codes=(0, 0))
    assert "RuntimeError" not in ranks[0].stderr + ranks[1].stderr
    said = ranks[0].stdout
    assert f"commit: commit(step={STEPS}) on rank 0: a torch.distributed collective failed" in said, said
    assert "The records stay buffered" in said, said
    assert "close:" not in said, said  # closed alone: the group is known broken
    assert "warning: rank 0: records of 'len', 'loss', 'tokens'" in said, said
    assert "were not committed" in said, said
    assert committed(tmp_path) == list(range(STEPS))
    assert [step for step, _ in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(STEPS))

