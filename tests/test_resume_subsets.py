"""Resumes by different sets of ranks (ranks 0..1, then rank 0 alone, ...): replay is the timeline live emitted, each
step from the last run that committed it, with only that run's ranks; nothing lost, nothing doubled."""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

from metricbus import MetricBus
from metricbus.adapter import RunInfo
from metricbus.errors import JournalWarning
from metricbus.journal import open_journal, read_journal, stream_journal
from metricbus.replay import emitted

RUN = RunInfo(id="subsets")
Plan = list[tuple[int, int, range]]  # (run, ranks, steps journaled by every rank)


def value(run: int, rank: int, step: int) -> float:
    """What ``rank`` logs at ``step`` in ``run``: the sum over ranks says which run and ranks a step came from."""
    return 1000.0 * run + 10.0**rank + step / 1000


def _partial(x: float) -> Any:
    bus = MetricBus(dist=None, rules={"x": "sum"})
    bus.log("x", x)
    partial = bus.export()
    bus.close()
    return partial


def _session(path: Path, run: int, ranks: int, steps: range) -> None:
    """One run (the first, or a resume) on ``ranks`` ranks: their writers open together, as the ranks' buses do."""
    writers = [open_journal(path=path, fsync="never", rank=r, run=RUN, rules=[], log_every=1, world=ranks)
               for r in range(ranks)]
    for step in steps:
        for rank, writer in enumerate(writers):
            writer.append(step=step, entries=[(rank, _partial(value(run, rank, step)))])
    for writer in writers:
        writer.close()
    time.sleep(0.05)  # the next run starts after this one ended (a restart takes seconds)


def reference(plan: Plan) -> list[tuple[int, float]]:
    """The timeline live emitted: each run's first step replaces every step from there on."""
    timeline: dict[int, float] = {}
    for run, ranks, steps in plan:
        timeline = {s: v for s, v in timeline.items() if s < steps.start}
        timeline.update({s: sum(value(run, r, s) for r in range(ranks)) for s in steps})
    return sorted(timeline.items())


def replayed(path: Path) -> list[tuple[int, float]]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", JournalWarning)
        return [(step, out["x"]) for step, out in emitted(read_journal(path))]


def test_a_rank_absent_from_a_resume_below_its_later_segment_is_replaced(tmp_path: Path) -> None:
    """Ranks 0 and 1 to step 9, both again from step 7, then rank 0 alone from step 4: rank 1's steps 7..12 (its
    segment starting above 4) are replaced too; they were merged into steps 7..10 and added steps 11 and 12."""
    plan = [(1, 2, range(10)), (2, 2, range(7, 13)), (3, 1, range(4, 11))]
    for run, ranks, steps in plan:
        _session(tmp_path, run, ranks, steps)
    assert replayed(tmp_path) == reference(plan)
    assert stream_journal(tmp_path).last_step == 10


def test_a_resume_at_the_step_of_one_that_added_a_rank_replaces_that_ranks_steps(tmp_path: Path) -> None:
    """Rank 0 to step 9; ranks 0 and 1 from step 5 (killed at step 7); rank 0 alone from step 5 again: rank 1's
    steps 5..7 are the killed run's, not the last one's, and are replaced."""
    plan = [(1, 1, range(10)), (2, 2, range(5, 8)), (3, 1, range(5, 12))]
    for run, ranks, steps in plan:
        _session(tmp_path, run, ranks, steps)
    assert replayed(tmp_path) == reference(plan)


def test_alternating_rank_sets_replay_the_live_timeline(tmp_path: Path) -> None:
    """Two ranks, one, two, one, two again, resumed at steps going back and forth (twice at one step)."""
    plan = [(1, 2, range(10)), (2, 1, range(6, 12)), (3, 2, range(3, 9)), (4, 1, range(8, 14)),
            (5, 2, range(8, 10)), (6, 1, range(8, 15))]
    for run, ranks, steps in plan:
        _session(tmp_path, run, ranks, steps)
    assert replayed(tmp_path) == reference(plan)
    assert stream_journal(tmp_path).last_step == 14


# -- real ranks, a resume killed ---------------------------------------------------------------------------------------


def _rank(  # noqa: PLR0917 (mp.Process passes arguments positionally)
    rank: int, world: int, init: str, journal: str, live: str, run: int, steps: range, kill: int | None
) -> None:
    """One torch.distributed rank of ``run``: resumes the journal, commits ``steps``; SIGKILLs itself once its
    commit at step ``kill`` returned. Rank 1's host clock is an hour ahead (hosts whose clocks differ)."""
    import torch.distributed as tdist
    from metricbus.adapters.jsonl import JsonlAdapter

    if rank == 1:
        real = time.time_ns
        time.time_ns = lambda: real() + 3600 * 10**9

    tdist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    bus = MetricBus(dist="torch", rules={"x": "sum"}, journal=journal, resume=True, fsync="never", strict=True,
                    adapters=[JsonlAdapter(path=live)])
    for step in steps:
        bus.log("x", value(run, rank, step))
        bus.commit(step)
        if step == kill:
            os.kill(os.getpid(), signal.SIGKILL)
    bus.close()
    tdist.destroy_process_group()


def _ranks(tmp_path: Path, run: int, world: int, steps: range, kill: int | None = None) -> list[int | None]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    init = str(tmp_path / f"init-{run}")
    args = (world, init, str(tmp_path / "j"), str(tmp_path / "live.jsonl"), run, steps, kill)
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def test_a_killed_resume_that_added_a_rank_resumed_again_is_the_live_timeline(tmp_path: Path) -> None:
    """Found reviewing resumes: rank 0 to step 9; ranks 0 and 1 resume at step 5 and are SIGKILLed after step 7;
    rank 0 alone resumes at step 5 again. Replay merged the killed run's rank 1 into steps 5..7 (5011.01 where live
    had 3001.005); now replay, and what the jsonl backend holds after the resumes' rewinds, are the live timeline.
    Rank 1's clock is an hour ahead of rank 0's: every rank's journal header holds the writer rank's clock at the
    bus's build (each host's own clock matched rank 1's segment to the wrong run)."""
    assert _ranks(tmp_path, 1, 1, range(10)) == [0]
    assert _ranks(tmp_path, 2, 2, range(5, 20), kill=7) == [-signal.SIGKILL] * 2
    assert _ranks(tmp_path, 3, 1, range(5, 12)) == [0]
    want = reference([(1, 1, range(10)), (2, 2, range(5, 8)), (3, 1, range(5, 12))])
    assert replayed(tmp_path / "j") == want
    rows = [json.loads(line) for line in (tmp_path / "live.jsonl").read_text().splitlines()]
    assert [(row["step"], row["metrics"]["x"]) for row in rows] == want
