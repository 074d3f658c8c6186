"""A real single-controller run on a local Ray: worker actors export partials, the driver gathers and commits.

One local Ray per module (2 CPUs, no dashboard, no usage stats, its own temp dir), shut down at the end. The
actors are ``tests.ray_workers.PolicyWorker``: verl's actor worker shape, K updates of M micro-batches per call,
returning ``{"metrics": bus.export()}`` (or a DataProto-like ``meta_info``).
"""

from __future__ import annotations

import math
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from metricbus import DistributedError, MetricBus
from metricbus.integrations.ray import gather_partials
from metricbus.journal import read_journal
from metricbus.replay import emitted
from metricbus.testing import MemoryAdapter
from tests.ray_workers import RULES, Output, Plan, PolicyWorker, make_plan, single_process

TIMEOUT_S = 120
Rows = list[dict[str, float]]
MakeActors = Callable[..., list[Any]]


def bits(rows: Rows) -> list[dict[str, str]]:
    """Each value's exact bits (float.hex), so equality is bitwise."""
    return [{name: float(value).hex() for name, value in row.items()} for row in rows]


@pytest.fixture
def actors(ray_cluster: Any) -> Iterator[MakeActors]:
    """``actors(n, num_cpus=0)``: n ready PolicyWorker actors (ranks 0..n-1), killed when the test ends."""
    made: list[Any] = []

    def make(n: int, *, num_cpus: float = 0) -> list[Any]:
        cls = ray_cluster.remote(num_cpus=num_cpus)(PolicyWorker)
        new = [cls.remote(rank) for rank in range(n)]
        made.extend(new)
        ray_cluster.get([a.__ray_ready__.remote() for a in new], timeout=TIMEOUT_S)
        return new

    yield make
    for actor in made:
        ray_cluster.kill(actor)


def ray_run(workers: list[Any], plan: Plan, *, driver: MetricBus | None = None, first_step: int = 0) -> Rows:
    """The driver loop: each step, every actor updates its shard; gather, ingest in worker order, commit.

    Plan step i is committed as step ``first_step + i``."""
    bus = driver or MetricBus(dist=None, strict=True)  # no rules: the driver adopts the workers' declared specs
    rows = []
    for i, shards in enumerate(plan):
        refs = {
            f"actor_{r}": (w.update_actor_proto if r % 2 else w.update_actor).remote(i, shards[r])  # both shapes
            for r, w in enumerate(workers)
        }
        bus.ingest(gather_partials(refs, timeout_s=TIMEOUT_S))
        rows.append(bus.commit(step=first_step + i))
    if driver is None:
        bus.close()
    return rows


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gloo_run(plan: Plan) -> dict[int, Rows]:
    """The same plan over R torch.distributed (gloo) processes: each rank's committed rows."""
    torch = pytest.importorskip("torch")
    from tests import ray_workers

    size = len(plan[0])
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=ray_workers.gloo_worker, args=(r, size, port, plan, out)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=TIMEOUT_S) for _ in range(size))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def truth(plan: Plan, step: int) -> dict[str, float]:
    """The step's values computed directly on its unsplit data."""
    updates = len(plan[step][0])
    batches = [mb for rank in plan[step] for update in rank for mb in update]
    per_update = [
        math.fsum(mb.loss_sum for rank in plan[step] for mb in rank[k])
        / sum(mb.n for rank in plan[step] for mb in rank[k])
        for k in range(updates)
    ]
    lengths = [n for mb in batches for n in mb.lengths]
    return {
        "actor/pg_loss": math.fsum(per_update) / updates,
        "actor/pg_clipfrac": sum(mb.clipped for mb in batches) / sum(mb.n for mb in batches),
        "response_length/mean": math.fsum(lengths) / len(lengths),
        "response_length/max": max(lengths),
        "response_length/min": min(lengths),
        "batch/tokens": sum(lengths),
        "actor/grad_norm": max(math.sqrt(math.fsum(mb.loss_sum**2 for mb in update))
                               for rank in plan[step] for update in rank),
    }  # fmt: skip


@pytest.mark.parametrize(
    "layout",
    [(2, 3, 2, 0), (6, 2, 3, 0.33)],  # (R, M, K, CPUs per actor); 6 actors on 2 CPUs: a fractional CPU each
    ids=["2x3x2", "6x2x3-more-actors-than-cpus"],
)
def test_ray_actors_equal_torch_distributed_and_one_process_bitwise(
    actors: MakeActors, layout: tuple[int, int, int, float]
) -> None:
    """R Ray actors x K updates x M micro-batches: the driver's rows are the gloo ranks' and one bus's, bit for bit."""
    ranks, micro, updates, num_cpus = layout
    plan = make_plan(ranks=ranks, updates=updates, micro=micro, steps=3, seed=ranks)
    got = ray_run(actors(ranks, num_cpus=num_cpus), plan)
    one = single_process(plan)
    assert bits(got) == bits(one)
    dist = gloo_run(plan)
    for rank in range(ranks):
        assert bits(dist[rank]) == bits(got), rank
    for step, row in enumerate(got):
        for name, want in truth(plan, step).items():
            assert math.isclose(row[name], want, rel_tol=1e-13), (step, name, row[name], want)
        assert set(row) == set(truth(plan, step))


@pytest.mark.parametrize("death", ["os._exit", "ray.kill"])
def test_a_worker_that_dies_mid_step_is_named_and_committed_steps_are_kept(
    ray_cluster: Any, actors: MakeActors, tmp_path: Path, death: str
) -> None:
    """Actor 1 dies in step 1: the error names it; step 0 stays delivered and journaled; step 2 commits with the
    two survivors (re-sharded) and equals the one-process reduction of their data."""
    plan = make_plan(ranks=3, updates=2, micro=2, steps=2, seed=7)
    after = make_plan(ranks=2, updates=2, micro=2, steps=1, seed=8)  # step 2, over the survivors
    mem = MemoryAdapter()
    driver = MetricBus(dist=None, strict=True, adapters=[mem], journal=str(tmp_path / "journal"))
    workers = actors(3)
    first = ray_run(workers, plan[:1], driver=driver)
    if death == "os._exit":
        refs = {f"actor_{r}": w.update_actor.remote(1, plan[1][r], die_at=1 if r == 1 else None)
                for r, w in enumerate(workers)}  # fmt: skip
    else:
        refs = {f"actor_{r}": w.update_actor.remote(1, plan[1][r], pause_s=60.0 if r == 1 else 0.0)
                for r, w in enumerate(workers)}  # fmt: skip
        ray_cluster.wait([refs["actor_0"], refs["actor_2"]], num_returns=2, timeout=TIMEOUT_S)
        ray_cluster.kill(workers[1])
    with pytest.raises(DistributedError) as info:
        driver.ingest(gather_partials(refs, timeout_s=TIMEOUT_S))
    message = str(info.value)
    assert "1 of 3 workers" in message
    assert "worker 'actor_1' (index 1): died (ActorDiedError)" in message, message
    assert "actor_0" not in message
    assert "actor_2" not in message
    assert isinstance(info.value.__cause__, ray_cluster.exceptions.ActorDiedError)
    assert driver.flush()
    assert mem.rows == [(0, first[0])]
    survivors = [workers[0], workers[2]]
    (later,) = ray_run(survivors, after, driver=driver, first_step=2)
    driver.close()
    assert bits([later]) == bits(single_process(after))
    assert mem.rows == [(0, first[0]), (2, later)]
    assert [(step, row) for step, row in emitted(read_journal(tmp_path / "journal"))] == mem.rows


def test_a_worker_that_raises_is_named_with_its_exception(ray_cluster: Any, actors: MakeActors) -> None:
    """An exception inside an actor method: the error names the worker and the exception, not the others."""
    good, bad = actors(2)
    refs = [good.update_actor.remote(0, make_plan(ranks=1, updates=1, micro=1, steps=1)[0][0]), bad.fail.remote()]
    with pytest.raises(DistributedError, match=r"worker 1: raised ValueError: rank 1: bad shard") as info:
        gather_partials(refs)
    assert "worker 0" not in str(info.value)


def test_a_worker_that_returns_no_partial_is_named(ray_cluster: Any, actors: MakeActors) -> None:
    """A worker returning verl's plain per-micro-batch lists: named, with what it returned and what to return."""
    (worker,) = actors(1)
    shard = make_plan(ranks=1, updates=1, micro=2, steps=1)[0][0]
    with pytest.raises(DistributedError) as info:
        gather_partials({"critic": worker.legacy_metrics.remote(0, shard)})
    message = str(info.value)
    assert "worker 'critic' (index 0): returned no Partial: its 'metrics' is a dict; return bus.export()" in message


def test_a_worker_past_the_timeout_is_named(ray_cluster: Any, actors: MakeActors) -> None:
    """A worker still running at timeout_s is named; a finished one is not."""
    fast, slow = actors(2)
    shard = make_plan(ranks=1, updates=1, micro=1, steps=1)[0][0]
    done = fast.update_actor.remote(0, shard)
    ray_cluster.get(done, timeout=TIMEOUT_S)  # finished before the gather starts
    hung = slow.update_actor.remote(0, shard, pause_s=60.0)
    with pytest.raises(DistributedError, match=r"worker 1: did not finish within timeout_s=0.5 s") as info:
        gather_partials([done, hung], timeout_s=0.5)
    assert "worker 0" not in str(info.value)


def test_results_that_are_values_need_no_ray() -> None:
    """Partials given directly, under 'metrics', or in a DataProto-like meta_info come back in order."""
    parts = []
    for value in (1.0, 2.0, 3.0):
        bus = MetricBus(dist=None, rules=RULES)
        bus.log("batch/tokens", value)
        parts.append(bus.export())
    results = [parts[0], {"metrics": parts[1], "step": 0}, Output(meta_info={"metrics": parts[2]})]
    assert gather_partials(results) == parts
    assert gather_partials({"a": parts[0]}) == parts[:1]
    assert gather_partials([]) == []


def test_importing_the_integration_does_not_import_ray() -> None:
    """``import metricbus.integrations.ray`` leaves Ray unimported (it is an optional extra)."""
    probe = "import sys, metricbus.integrations.ray; print('ray' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == "False"


def test_a_result_without_the_key_lists_what_it_holds() -> None:
    """A result dict without 'metrics' (or a value that is no mapping): the error names the keys or the type."""
    with pytest.raises(DistributedError) as info:
        gather_partials({"a": {"loss": 1.0, "step": 0}, "b": 3.5})
    message = str(info.value)
    assert "worker 'a' (index 0): returned no Partial: a dict without 'metrics' (keys: loss, step)" in message
    assert "worker 'b' (index 1): returned no Partial: a float" in message


def test_a_negative_timeout_is_refused() -> None:
    """timeout_s must be None or a number of seconds >= 0; the error says so."""
    with pytest.raises(ValueError, match=r"timeout_s=-1; use a number of seconds >= 0, or None"):
        gather_partials([], timeout_s=-1)
