"""The rank level over real torch.distributed processes (gloo on 127.0.0.1)."""

from __future__ import annotations

import math
import random
import socket
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
mp = torch.multiprocessing

from metricbus import MetricBus, one_pass, rank_level, step_check  # noqa: E402
from metricbus.journal import read_journal  # noqa: E402
from metricbus.replay import emitted  # noqa: E402
from tests import dist_workers  # noqa: E402  (after the importorskip)

TIMEOUT_S = 120


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(fn: Any, size: int, *args: Any) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=fn, args=(r, size, port, *args, out)) for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, list[Any]] = {}
    try:
        for _ in range(size):
            rank, value = out.get(timeout=TIMEOUT_S)
            results.setdefault(rank, []).append(value)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {r: v if len(v) > 1 else v[0] for r, v in results.items()}


def _close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)


RECORDS = {
    f"{kind}/x": [random.Random(i).uniform(-1e3, 1e3) for i in range(48)]
    for kind in ("mean", "sum", "min", "max", "count", "std", "first")
}
RECORDS["sum/only_rank0"] = [1.5, 2.5]  # lands on rank 0 only when split over several ranks


def _local(micro: int) -> dict[str, float]:
    bus = MetricBus(dist=None)
    for name, values in RECORDS.items():
        for m in range(micro):
            chunk = values[m * len(values) // micro : (m + 1) * len(values) // micro]
            if chunk:
                bus.log(name, chunk, agg=name.split("/")[0])
    return bus.commit()


@pytest.mark.parametrize("size", [1, 2, 4])
def test_split_invariance_across_ranks(size: int) -> None:
    """R ranks x M micro-batches emit what one process emits for the whole data, identically on every rank."""
    reference = _local(1)
    results = _spawn(dist_workers.split_worker, size, (1, 2, 8), RECORDS)  # one group, a bus for each M in turn
    for rank in range(size):
        assert sorted(results[rank]) == [1, 2, 8]
        for micro, (first, empty) in results[rank].items():
            assert empty == {}
            assert set(first) == set(reference)
            for key, value in reference.items():
                assert _close(first[key], value), (size, micro, rank, key, first[key], value)


def test_conflicting_specs_raise_on_every_rank() -> None:
    """Two ranks with different specs for one name: every rank raises DistributedError naming it."""
    results = _spawn(dist_workers.conflict_worker, 2)
    for rank in range(2):
        assert "'x'" in results[rank]
        assert "disagree" in results[rank]
        assert "rank 0" in results[rank]
        assert "rank 1" in results[rank]


def test_an_output_name_collision_across_ranks_raises_on_every_rank() -> None:
    """Rank 0's x as [mean, max] and rank 1's plain x/mean: DistributedError on both ranks, no merged series."""
    results = _spawn(dist_workers.review_worker, 2, "collision")
    for rank in range(2):
        (message,) = results[rank]
        assert "x/mean" in message, message
        assert "emit" in message


def test_a_ranks_default_gives_way_to_another_ranks_declaration() -> None:
    """Rank 0 declares 'x' as sum, rank 1 logs it with the default: both reduce with sum."""
    results = _spawn(dist_workers.review_worker, 2, "adopt")
    for rank in range(2):
        first, second, spec = results[rank]
        assert first == {"x": 3.0}
        assert second == {"x": 20.0}
        assert spec == "sum"


def test_prescaled_pg_loss_is_global_token_mean() -> None:
    """Pre-scaled pg_loss with Agg(micro='sum', rank='mean') over 4 ranks is the unscaled per-token mean."""
    rng = random.Random(3)
    per_rank = 6
    tokens = [[[rng.uniform(-2, 2) for _ in range(per_rank // 2)] for _ in range(2)] for _ in range(4)]
    flat = [t for rank in tokens for micro in rank for t in micro]
    results = _spawn(dist_workers.pg_loss_worker, 4, tokens)
    for rank in range(4):
        assert math.isclose(results[rank]["pg_loss"], math.fsum(flat) / len(flat), rel_tol=1e-12)


@pytest.mark.parametrize("size", [2, 4])
def test_a_steady_commit_is_one_collective_of_o_k_bytes_whatever_r(size: int) -> None:
    """For 10 and 1,000 ``mean`` metrics, at 2 and 4 ranks: the first commit agrees the keys (two all_reduces and a
    byte gather), the next lays out the sums by the agreed maxima (two all_reduces), and from then on a commit is
    one all_reduce (the guessed sums with their checks, metricbus.one_pass) but every REFRESH-th, which agrees the
    maxima again (two). A layout that reads ``max`` at the rank level takes two all_reduces per steady commit. The
    bytes each rank hands them are bounded per metric (O(K)), with no term in R."""
    results = _spawn(dist_workers.count_worker, size)
    refresh = 2 + one_pass.REFRESH
    assert refresh + 1 < dist_workers.COUNT_STEPS
    for rank in range(size):
        got = results[rank]
        for label in (10, 1000, "max"):
            calls = [got[(label, step)][0] for step in range(dist_workers.COUNT_STEPS)]
            assert calls[0] == {"all_reduce": 2, "all_gather_single": 1}, label  # new keys: +1 byte gather
            assert calls[1] == {"all_reduce": 2}, label
            steady = [calls[step]["all_reduce"] for step in range(2, dist_workers.COUNT_STEPS)]
            if label == "max":
                assert steady == [2] * len(steady)
            else:
                assert steady == [2 if step == refresh else 1 for step in range(2, dist_workers.COUNT_STEPS)]
        assert got[(1000, 2)][1] == 999 + (size - 1) / 2 + 2
        small, large = got[(10, 2)][2]["all_reduce"], got[(1000, 2)][2]["all_reduce"]
        # per metric: NS fixed sums and the limbs of its exact sums (a few each for these values); the checks
        per_metric, checks = 8 * (rank_level.NS + 4 * 6), 8 * (1 + one_pass.LENGTH_BITS + step_check.N_SUM)
        assert 8 * rank_level.NS * 1000 < large <= per_metric * 1000 + checks
        assert small <= per_metric * 10 + checks
        paired = got[(1000, refresh)][2]["all_reduce"]  # both passes: NM maxima more per metric
        assert paired <= 8 * rank_level.NM * 1000 + 8 + per_metric * 1000


def test_a_strict_adapter_failure_on_the_writer_keeps_the_ranks_in_step() -> None:
    """Rank 0's strict adapter fails: rank 0 raises after each step; both ranks commit the same steps, no hang."""
    results = _spawn(dist_workers.review_worker, 2, "strict")
    for rank in range(2):
        values = [r for r in results[rank] if isinstance(r, dict)]
        assert len(results[rank]) >= 4
        if rank == 1:
            assert values == [{"x": 0.5}, {"x": 10.5}, {"x": 20.5}, {"x": 30.5}]
    assert "AdapterError" in results[0]


def test_an_adopted_nan_policy_applies_from_the_next_commit() -> None:
    """Rank 1 declares nan='ignore'; rank 0 logged x with the default: from the next commit NaN is ignored."""
    results = _spawn(dist_workers.review_worker, 2, "nan")
    for rank in range(2):
        assert results[rank][0] == {"x": 1.0}
        assert results[rank][1] == {"x": 3.0}


def test_a_declaration_after_the_default_was_committed_is_refused_on_every_rank() -> None:
    """As ingest() refuses it: rank 1's rule for a name already committed with the default is an error."""
    results = _spawn(dist_workers.review_worker, 2, "late")
    for rank in range(2):
        assert results[rank][0] == {"x": 1.0}
        assert results[rank][1].startswith("DistributedError"), results[rank][1]
        assert "'x'" in results[rank][1]


def test_a_metric_one_rank_drops_is_dropped_on_every_rank() -> None:
    """A negative tensor weight on rank 1: 't' is left out on both ranks (never rank 0's half), both raise."""
    results = _spawn(dist_workers.review_worker, 2, "badweight")
    for rank in range(2):
        first, second = results[rank]
        assert first.startswith("MetricValueError"), first
        assert "'t'" in first
        assert second == {"t": 5.0}


def test_a_name_committed_twice_at_one_step_raises_on_every_rank() -> None:
    """Training then evaluation at one step works across ranks; a name again at that step (on rank 0 only) raises
    StepError on both ranks (no hang) and the record is committed with the next step."""
    results = _spawn(dist_workers.review_worker, 2, "samestep")
    for rank in range(2):
        train, evaluation, again, later = results[rank]
        assert (train, evaluation) == ({"train/x": 0.5}, {"eval/x": 0.5})
        assert again.startswith("StepError: step 1: 'train/x' already committed"), again
        assert later == {"train/x": 10.0}


def test_a_resume_at_an_earlier_step_is_one_timeline_on_every_rank(tmp_path: Path) -> None:
    """Two ranks commit 0..9, then resume on the same journal at step 5: one run id, one timeline."""
    journal = tmp_path / "j"
    results = _spawn(dist_workers.review_worker, 2, f"resume:{journal}")
    ids = {run_id for rank in range(2) for run_id in results[rank]}
    assert len(ids) == 1
    replayed = read_journal(journal)
    assert replayed.run.id in ids
    assert list(emitted(replayed)) == [(s, {"x": 1.0 * s + 0.5}) for s in range(5)] + [
        (s, {"x": 100.0 * s + 0.5}) for s in range(5, 8)
    ]


@pytest.mark.parametrize("size", [2, 4])
def test_distributions_ride_the_same_two_collectives(size: int) -> None:
    """Ten quantile/hist metrics: a steady commit is still two all_reduces, every rank emits the same values, and
    they are the sketch of all ranks' records together (as one process would compute them)."""
    import numpy as np

    from metricbus.sketch import Sketch

    results = _spawn(dist_workers.sketch_worker, size)
    for rank in range(size):
        assert results[rank]["calls"] == {"all_reduce": 2}
        assert results[rank]["rows"] == results[0]["rows"]
    for step, row in enumerate(results[0]["rows"]):
        for i in range(10):
            data = np.concatenate(
                [np.random.default_rng(1000 * step + 10 * r + i).lognormal(3.0, 1.0, 64 * (r + 1)) for r in range(size)]
            )
            sketch = Sketch.of_values(data)
            assert row[f"d{i}/p50"] == sketch.quantile(0.5)
            assert row[f"d{i}/p99"] == sketch.quantile(0.99)
            assert row[f"d{i}/hist"].counts == sketch.histogram()[1]
            assert float(row[f"d{i}/hist"]) == len(data)
    # the sketches' counts span the data's key range (~35 keys per octave), not the number of ranks
    assert results[0]["bytes"] < 10 * 8 * (rank_level.NM + rank_level.NS + 4 * 6 + 8 + 35 * 16)


def test_a_rank_that_logged_before_a_distribution_was_declared_gives_nan_quantiles_once() -> None:
    """Rank 1 logs 'x' under the default while rank 0 declares ["mean", "p50"]: at the first commit rank 1 kept no
    sketch, so p50 is NaN on every rank (never the quantile of rank 0's records alone); from the next commit rank 1
    keeps one and p50 is the sketch's over both ranks."""
    from metricbus.sketch import Sketch

    results = _spawn(dist_workers.late_sketch_worker, 2)
    first, second = results[0]
    assert repr(results[1]) == repr(results[0])  # NaN included
    assert first["x/mean"] == 2.0
    assert math.isnan(first["x/p50"])
    assert second["x/p50"] == Sketch.of_values([1.0, 3.0, 2.0, 4.0]).quantile(0.5)


def test_a_ranks_distribution_rule_against_a_committed_default_raises_on_every_rank() -> None:
    """Rank 1's rule gives 'x' p90 after rank 0 committed it under the default: a DistributedError naming 'x' on
    every rank (rank 1's sketch of a column the agreement does not sketch is never sent)."""
    results = _spawn(dist_workers.late_rule_worker, 2)
    for rank in range(2):
        assert "'x'" in results[rank], results


def test_ranks_that_commit_different_steps_raise_on_every_rank(tmp_path: Path) -> None:
    """A commit where the ranks pass different steps raises DistributedError on every rank naming the lowest and the
    highest step (in a one-pass commit, from a step 2**30 away, and in a commit with a MAX pass); the records stay
    buffered and the next agreed commit holds them; the journal replays what was delivered."""
    journal = tmp_path / "j"
    results = _spawn(dist_workers.step_mismatch_worker, 2, str(journal))
    mismatched = {6: (6, 7), 8: (10, 10 + 2**30), 11: (2**31 + 2, 2**31 + 3)}
    for rank in range(2):
        for i, (step, got) in enumerate(results[rank]):
            if i in mismatched:
                lowest, highest = mismatched[i]
                assert got == (
                    f"commit(step={step}) on rank {rank}: the ranks committed different steps (lowest {lowest}, "
                    f"highest {highest}); every rank must commit the same step, or call commit() without one on "
                    f"every rank (a rank whose step was invalid raised a StepError, and shows here as step "
                    f"{results[rank][i - 1][0] - 1}). The records stay buffered"
                )
    live = [(step, got) for step, got in results[0] if isinstance(got, dict)]
    assert [step for step, _ in live] == [0, 1, 2, 3, 4, 5, 7, 2**31, 2**31 + 1, 2**31 + 3]
    assert live[6] == (7, {"x": (6 + 7 + 16 + 17) / 4})  # step 6's records kept, committed with step 7's
    assert live[-1][1]["x"] == (11 + 12 + 21 + 22) / 4
    assert -12.0 <= live[-1][1]["m"] <= -10.0  # the p50 of -12, -11 (twice) and -10, as its sketch gives it
    assert [s for s, _ in results[1] if isinstance(_, dict)] == [step for step, _ in live]
    assert list(emitted(read_journal(journal))) == live


def test_a_step_mismatch_drops_on_every_rank_what_one_rank_rejected() -> None:
    """Ranks with different steps, and rank 0's tensor records of 'y' bad: both ranks raise naming the steps and the
    dropped metric; the next commit holds 'z' kept from then, and no 'y' (dropped on every rank, never half-reduced)."""
    results = _spawn(dist_workers.step_mismatch_rejected_worker, 2)
    for rank in range(2):
        first, error, after = results[rank]
        assert first == {"y": 1.0, "z": 1.0}
        assert f"commit(step={1 + rank}) on rank {rank}: the ranks committed different steps (lowest 1, highest 2)" in (
            error
        )
        assert "The records stay buffered; the records of 'y' were dropped" in error
        assert after == {"z": 2.0}


def test_an_invalid_step_on_one_rank_raises_on_every_rank_and_keeps_the_records() -> None:
    """One rank's step below its last (or a bool) while the other's is valid: before, that rank raised alone and the
    other waited in the collective until the process group's timeout, then lost its records. Now every rank raises
    (the invalid one its StepError) and keeps its records; so does every rank passing the same invalid step."""
    results = _spawn(dist_workers.invalid_step_worker, 2)
    for rank in range(2):
        first, below, boolean, both, last = results[rank]
        assert first == {"x": 0.5}
        if rank == 1:
            assert below.startswith("StepError: commit step 4 is less than the last step 5")
            assert "on rank 1 of a torch.distributed group, whose other ranks raised too" in below
            assert "The records stay buffered" in below
        else:
            assert below.startswith("DistributedError: commit(step=6) on rank 0: the ranks committed different steps")
            assert "shows here as step 4" in below
        assert boolean.startswith("StepError: commit step must be an int" if rank == 0 else "DistributedError")
        assert both.startswith("StepError: commit step 2 is less than the last step 5")
        # every record since step 5, once; and one update (a refused commit ends none): 4.0, not the 1.0 of four
        assert last == {"x": (1 + 11 + 2 + 12 + 3 + 13 + 4 + 14) / 8, "u": 4.0}


def test_a_spec_disagreement_keeps_the_other_records_on_every_rank() -> None:
    """'x' declared mean on rank 0 and sum on rank 1: before, every record of every rank was lost, 'y' included. Now
    both raise naming 'x' as dropped, and 'z' (which rank 1 had to drop: dropped on every rank, never
    half-reduced); the next commit holds 'y'."""
    results = _spawn(dist_workers.spec_disagreement_worker, 2)
    for rank in range(2):
        error, after = results[rank]
        assert error.startswith(f"rank {rank}: the ranks disagree: 'x' has spec mean from rank 0")
        assert "The other records stay buffered; the records of 'x', 'z' were dropped" in error
        assert after == {"y": 1.0 + 11.0}


def test_a_commit_every_rank_refused_seals_no_spec() -> None:
    """Every rank's step invalid: the commit is aborted after its collectives, without agreeing any spec, so a
    declaration may still replace the default of a name it held (before, a SpecError: the default was sealed)."""
    results = _spawn(dist_workers.all_invalid_step_worker, 2)
    for rank in range(2):
        error, after = results[rank]
        assert error.startswith("commit step must be an int (or a numpy or torch integer), got True")
        assert after == {"f": 7.0}
