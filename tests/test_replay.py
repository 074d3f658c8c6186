"""Replay equals live bit for bit (single controller and gloo ranks); rule overrides re-aggregate exactly."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.journal import read_journal
from metricbus.replay import StepRange, emitted, parse_rule, replay
from metricbus.spec import parse_spec_text
from metricbus.testing import MemoryAdapter
from tests.journal_workers import RULES, log_step

WORKERS = 3


def bits(rows: list[tuple[int, dict[str, float]]]) -> list[tuple[int, dict[str, bytes]]]:
    """Rows with every float as its 8 bytes (so NaN == NaN and -0.0 != 0.0)."""
    return [(step, {k: struct.pack("<d", v) for k, v in m.items()}) for step, m in rows]


def single_controller_run(
    journal: Path | None, *, rules: dict[str, object] = RULES, steps: int = 11, log_every: int = 3
) -> MemoryAdapter:
    """A controller ingesting WORKERS exported partials per step (ranks 0..WORKERS-1) plus its own records."""
    mem = MemoryAdapter()
    workers = [MetricBus(dist=None, rules=rules) for _ in range(WORKERS)]
    with MetricBus(dist=None, rules=rules, adapters=[mem], strict=True, log_every=log_every,
                   journal=None if journal is None else str(journal)) as bus:
        for step in range(steps):
            for rank, worker in enumerate(workers):
                log_step(worker, step, rank)
            bus.ingest([w.export() for w in workers])
            log_step(bus, step, WORKERS)
            bus.commit(step)
    return mem


def test_single_controller_replay_equals_live_bitwise(tmp_path: Path) -> None:
    """Every emitted value of a replay is the live value, bit for bit, including the partial last window."""
    live = single_controller_run(tmp_path / "j")
    again = MemoryAdapter()
    replay(tmp_path / "j", [again])
    assert bits(again.rows) == bits(live.rows)
    assert live.rows[-1][0] == 10  # 11 commits, log_every 3: the last window is partial


def test_reaggregation_equals_a_run_with_the_corrected_spec(tmp_path: Path) -> None:
    """Journaled with pg_loss 'mean', replayed with micro:sum,rank:mean == logged with that spec from the start."""
    single_controller_run(tmp_path / "j")
    corrected = single_controller_run(None, rules={**RULES, "pg_loss": parse_spec_text("micro:sum,rank:mean",
                                                                                       metric="pg_loss")})
    fixed = MemoryAdapter()
    replay(tmp_path / "j", [fixed], rules=[parse_rule("pg_loss=micro:sum,rank:mean")])
    assert bits(fixed.rows) == bits(corrected.rows)
    naive = MemoryAdapter()
    replay(tmp_path / "j", [naive])
    assert naive.series("pg_loss") != fixed.series("pg_loss")


def test_rule_override_can_change_the_emitted_names(tmp_path: Path) -> None:
    """An override to a list spec emits name/<kind> for each kind."""
    single_controller_run(tmp_path / "j", steps=3, log_every=1)
    rows = list(emitted(read_journal(tmp_path / "j"), rules=[parse_rule("loss=min,max")]))
    assert {"loss/min", "loss/max"} <= set(rows[0][1])
    assert "loss" not in rows[0][1]


def test_steps_selects_commits(tmp_path: Path) -> None:
    """A step range replays only those commits (half-open)."""
    live = single_controller_run(tmp_path / "j", log_every=1)
    rows = list(emitted(read_journal(tmp_path / "j"), steps=StepRange(3, 6)))
    assert bits(rows) == bits([r for r in live.rows if 3 <= r[0] < 6])


def test_multi_rank_gloo_replay_equals_live_bitwise(tmp_path: Path) -> None:
    """Two gloo ranks journal their own partials; replaying both files equals what rank 0 delivered live."""
    pytest.importorskip("metricbus.dist", reason="metricbus.dist (torch.distributed transport) is not available")
    mp = pytest.importorskip("torch.multiprocessing")
    from metricbus.adapters.jsonl import read_jsonl

    from tests.journal_workers import gloo_rank

    journal, live = tmp_path / "j", tmp_path / "live.jsonl"
    mp.spawn(gloo_rank, args=(2, str(tmp_path / "init"), str(journal), str(live), 10), nprocs=2, join=True)
    assert sorted(p.name for p in journal.glob("rank-*.mbj")) == ["rank-00000.mbj", "rank-00001.mbj"]
    assert read_journal(journal).ranks == [0, 1]
    again = MemoryAdapter()
    replay(journal, [again])
    assert bits(again.rows) == bits(read_jsonl(live))
    assert len(again.rows) == 4


def test_per_rank_files_merge_in_rank_order(tmp_path: Path) -> None:
    """Two rank files, each with its own partials (as torch.distributed ranks write), replay like one controller."""
    from metricbus.adapter import RunInfo
    from metricbus.journal import open_journal
    from metricbus.rules import Rules

    run = RunInfo()  # torch.distributed ranks share one run (the writer's id)
    writers = [
        open_journal(path=str(tmp_path / "ranks"), fsync="never", rank=r, run=run, rules=Rules(RULES).items(),
                     log_every=3)
        for r in (0, 1)
    ]
    workers = [MetricBus(dist=None, rules=RULES) for _ in writers]
    live = MemoryAdapter()
    with MetricBus(dist=None, rules=RULES, adapters=[live], strict=True, log_every=3) as controller:
        for step in range(8):
            parts = []
            for rank, (worker, writer) in enumerate(zip(workers, writers, strict=True)):
                log_step(worker, step, rank)
                part = worker.export()
                writer.append(step=step, entries=[(rank, part)])
                parts.append(part)
            controller.ingest(parts)
            controller.commit(step)
    for writer in writers:
        writer.close()
    again = MemoryAdapter()
    replay(tmp_path / "ranks", [again])
    assert read_journal(tmp_path / "ranks").ranks == [0, 1]
    assert bits(again.rows) == bits(live.rows)
