"""The rank level over real torch.distributed processes (gloo on 127.0.0.1)."""

from __future__ import annotations

import math
import random
import socket
from typing import Any

import pytest

torch = pytest.importorskip("torch")
mp = torch.multiprocessing

from metricbus import MetricBus  # noqa: E402
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
        for _ in range(size * (2 if fn is dist_workers.split_worker else 1)):
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
    for micro in (1, 2, 8):
        results = _spawn(dist_workers.split_worker, size, micro, RECORDS)
        for rank in range(size):
            first, empty = results[rank]
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
    results = _spawn(dist_workers.collision_worker, 2)
    for rank in range(2):
        assert "x/mean" in results[rank], results[rank]
        assert "emit" in results[rank]


def test_a_ranks_default_gives_way_to_another_ranks_declaration() -> None:
    """Rank 0 declares 'x' as sum, rank 1 logs it with the default: both reduce with sum."""
    results = _spawn(dist_workers.adopt_worker, 2)
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


def test_collective_count_is_flat_in_metrics() -> None:
    """A steady-state commit makes the same collective calls for 10 and 1,000 metrics: one all_gather."""
    results = _spawn(dist_workers.count_worker, 2)
    for rank in range(2):
        got = results[rank]
        assert got[(10, 2)][0] == got[(1000, 2)][0] == {"all_gather_single": 1}
        assert got[(10, 1)][0] == {"all_gather_single": 1}
        assert got[(1000, 0)][0] == {"all_gather_single": 2}  # new keys: +1 byte gather
        assert got[(1000, 2)][1] == 999 + 2 + 0.5
