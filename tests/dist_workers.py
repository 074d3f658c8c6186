"""Worker functions that tests/test_dist.py spawns (module level, so torch.multiprocessing can pickle them)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as tdist

from metricbus import Agg, MetricBus
from metricbus.errors import DistributedError, StepError


def init_gloo(rank: int, size: int, port: int) -> None:
    """Join the gloo process group of ``size`` ranks on 127.0.0.1:``port`` as ``rank``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)


def split_worker(  # noqa: PLR0917  (mp.Process passes arguments positionally)
    rank: int, size: int, port: int, micros: tuple[int, ...], records: dict[str, list[float]], out: Any
) -> None:
    """For each ``micro`` of ``micros``, one bus after another on the group: log this rank's contiguous share of
    every metric's records in ``micro`` batches, commit, then commit a step where nothing was logged anywhere."""
    init_gloo(rank, size, port)
    try:
        results = {}
        for micro in micros:
            bus = MetricBus(dist="torch")
            for name in sorted(records, reverse=rank % 2 == 1):  # different logging orders per rank
                values = records[name]
                share = values[rank * len(values) // size : (rank + 1) * len(values) // size]
                for m in range(micro):
                    chunk = share[m * len(share) // micro : (m + 1) * len(share) // micro]
                    if chunk:
                        bus.log(name, chunk, agg=name.split("/")[0])
            results[micro] = (bus.commit(step=0), bus.commit(step=1))
            bus.close()
        out.put((rank, results))
    finally:
        tdist.destroy_process_group()


def conflict_worker(rank: int, size: int, port: int, out: Any) -> None:
    """Rank 1 uses another spec for 'x': every rank must raise DistributedError."""
    init_gloo(rank, size, port)
    try:
        bus = MetricBus(dist="torch")
        bus.log("x", 1.0, agg="sum" if rank == 1 else "mean")
        try:
            bus.commit()
            out.put((rank, "no error"))
        except DistributedError as exc:
            out.put((rank, str(exc)))
        bus.close()
    finally:
        tdist.destroy_process_group()


def pg_loss_worker(rank: int, size: int, port: int, tokens: list[list[list[float]]], out: Any) -> None:
    """Seed case: pre-scaled per-micro loss sums with Agg(micro='sum', rank='mean')."""
    init_gloo(rank, size, port)
    try:
        bus = MetricBus(dist="torch")
        mine = tokens[rank]
        n = sum(len(m) for m in mine)
        for micro in mine:
            bus.log("pg_loss", sum(micro) / n, agg=Agg(micro="sum", rank="mean"))
        out.put((rank, bus.commit()))
        bus.close()
    finally:
        tdist.destroy_process_group()


COUNT_STEPS = 20  # count_worker's commits: past one refresh of the one-pass guess (metricbus.one_pass.REFRESH)


def count_worker(rank: int, size: int, port: int, out: Any) -> None:
    """Count torch.distributed calls and bytes per commit for 10 and 1000 metrics (mean), and 10 metrics whose rank
    level reads ``max``; the 10 metrics' steps 2**20 + 1 apart (a step counting tokens: the step check's limbs take
    any stride)."""
    init_gloo(rank, size, port)
    try:
        names = (
            "all_gather_single",
            "all_gather_into_tensor",
            "all_gather_object",
            "all_reduce",
            "broadcast",
            "barrier",
            "all_gather",
            "gather",
            "reduce",
            "broadcast_object_list",
            "reduce_scatter",
        )
        calls: dict[str, int] = {}
        sent: dict[str, int] = {}  # bytes of the tensors handed to each kind of call
        import metricbus.dist as mdist

        real = {n: getattr(tdist, n) for n in names if hasattr(tdist, n)}
        for n, fn in real.items():

            def wrap(*a: Any, _n: str = n, _fn: Any = fn, **k: Any) -> Any:
                calls[_n] = calls.get(_n, 0) + 1
                tensors = [t for t in a if hasattr(t, "element_size")]
                sent[_n] = sent.get(_n, 0) + sum(t.numel() * t.element_size() for t in tensors[-1:])
                return _fn(*a, **k)

            setattr(tdist, n, wrap)
        assert mdist  # the transport looks functions up on torch.distributed at call time
        result = {}
        for label, k, rules in ((10, 10, None), (1000, 1000, None), ("max", 10, {f"m{i}": "max" for i in range(10)})):
            bus = MetricBus(dist="torch", rules=rules)
            for step in range(COUNT_STEPS):
                for i in range(k):
                    bus.log(f"m{i}", float(i + rank + step))
                calls.clear()
                sent.clear()
                got = bus.commit(step=step * (2**20 + 1) if label == 10 else step)
                result[(label, step)] = (dict(calls), got[f"m{k - 1}"], dict(sent))
            bus.close()
        out.put((rank, result))
    finally:
        tdist.destroy_process_group()


def updates_worker(  # noqa: PLR0917  (mp.Process passes arguments positionally)
    rank: int, size: int, port: int, plan: Any, journal: str, out: Any
) -> None:
    """Log this rank's share of ``plan`` (steps x updates x micro-batches of (name, value, weight)) with the
    ``plan["logger"]`` function (``module:function``; default tests.update_plan's log_rank); commit each step."""
    import importlib

    module, _, function = plan.get("logger", "tests.update_plan:log_rank").partition(":")
    log_rank = getattr(importlib.import_module(module), function)
    init_gloo(rank, size, port)
    try:
        bus = MetricBus(dist="torch", journal=journal, rules=plan["rules"])
        rows = []
        for step in range(len(plan["steps"])):
            log_rank(bus, plan, step=step, rank=rank)
            rows.append(bus.commit(step=step))
        bus.close()
        out.put((rank, rows))
    finally:
        tdist.destroy_process_group()


def review_worker(rank: int, size: int, port: int, scenario: str, out: Any) -> None:
    """Review scenarios on 2 ranks; puts (rank, what happened)."""
    import math
    import time

    import torch

    from metricbus import AdapterError, MetricValueError

    init_gloo(rank, size, port)
    got: list[Any] = []
    try:
        if scenario == "collision":  # rank 0's x as [mean, max] emits x/mean; rank 1 logs a plain x/mean
            bus = MetricBus(dist="torch")
            bus.log("x" if rank == 0 else "x/mean", 1.0, agg=["mean", "max"] if rank == 0 else None)
            try:
                got.append(bus.commit())
            except DistributedError as exc:
                got.append(str(exc))
            bus.close()
        elif scenario == "adopt":  # rank 0 declares 'x' as sum; rank 1 logs it with only the default: both use sum
            bus = MetricBus(dist="torch")
            bus.log("x", float(rank + 1), agg="sum" if rank == 0 else None)
            got.append(bus.commit())
            bus.log("x", 10.0)
            got.extend([bus.commit(), str(bus.spec_of("x"))])
            bus.close()
        elif scenario == "strict":  # a strict adapter fails on rank 0 only: ranks stay in step, nothing hangs

            class Bad:
                name = "bad"

                def open(self, *, run: Any) -> None:
                    pass

                def write(self, *, step: int, metrics: Any) -> None:
                    raise RuntimeError("down")

                def flush(self) -> None:
                    pass

                def close(self, *, status: Any) -> None:
                    pass

            bus = MetricBus(dist="torch", adapters=[Bad()], strict=True)
            for step in range(4):
                bus.log("x", float(rank + 10 * step))
                try:
                    got.append(bus.commit(step=step))
                except AdapterError:
                    got.append("AdapterError")
                time.sleep(0.3)
            try:
                bus.close()
            except AdapterError:
                got.append("AdapterError at close")
        elif scenario == "nan":  # rank 1 declares nan="ignore": the adopted policy applies on rank 0 next commit
            bus = MetricBus(dist="torch")
            bus.log("x", 1.0, agg=Agg(nan="ignore") if rank == 1 else None)
            got.append(bus.commit())
            bus.log("x", math.nan if rank == 0 else 3.0)
            got.append(bus.commit())
            bus.close()
        elif scenario == "late":  # rank 0 commits x with the default; rank 1's rule says sum: refused everywhere
            bus = MetricBus(dist="torch", rules={"x": "sum"} if rank == 1 else None)
            if rank == 0:
                bus.log("x", 1.0)
            got.append(bus.commit())
            bus.log("x", 2.0)
            try:
                got.append(bus.commit())
            except DistributedError as exc:
                got.append(f"DistributedError: {exc}")
            bus.close()
        elif scenario == "badweight":  # rank 1's tensor weight is negative: 't' is dropped on every rank
            bus = MetricBus(dist="torch")
            bus.log("ok", 1.0)
            weight = torch.tensor([-1.0 if rank == 1 else 1.0])
            bus.log("t", torch.tensor([1.0 + rank]), weight=weight)
            try:
                got.append(bus.commit())
            except MetricValueError as exc:
                got.append(f"MetricValueError: {exc}")
            bus.log("t", 5.0)
            got.append(bus.commit())
            bus.close()
        elif scenario == "samestep":  # eval at the training step; rank 0 logs a train name again: both ranks raise
            from metricbus import StepError

            bus = MetricBus(dist="torch")
            bus.log("train/x", float(rank))
            got.append(bus.commit(1))
            bus.log("eval/x", float(rank))
            got.append(bus.commit(1))
            if rank == 0:
                bus.log("train/x", 10.0)
            try:
                got.append(bus.commit(1))
            except StepError as exc:
                got.append(f"StepError: {exc}")
            got.append(bus.commit(2))  # rank 0's record was kept
            bus.close()
        elif scenario.startswith("resume:"):  # 10 steps, then a resume at step 5 with other values, one timeline
            journal = scenario.split(":", 1)[1]
            for start, stop, scale in ((0, 10, 1.0), (5, 8, 100.0)):
                bus = MetricBus(dist="torch", journal=journal, resume=start > 0)
                for step in range(start, stop):
                    bus.log("x", scale * step + rank)
                    bus.commit(step)
                got.append(bus.run.id)
                bus.close()
        out.put((rank, got))
    finally:
        tdist.destroy_process_group()


def sketch_worker(rank: int, size: int, port: int, out: Any) -> None:
    """Ten distribution metrics (p50/p99/hist) per rank: the calls and bytes of a steady commit, and the results."""
    import numpy as np

    init_gloo(rank, size, port)
    try:
        calls: dict[str, int] = {}
        sent: dict[str, int] = {}
        real = tdist.all_reduce

        def counted(tensor: Any, *a: Any, **k: Any) -> Any:
            calls["all_reduce"] = calls.get("all_reduce", 0) + 1
            sent["all_reduce"] = sent.get("all_reduce", 0) + tensor.numel() * tensor.element_size()
            return real(tensor, *a, **k)

        tdist.all_reduce = counted
        bus = MetricBus(dist="torch")
        for i in range(10):
            bus.define(f"d{i}", ["mean", "p50", "p99", "hist"])
        rows = []
        for step in range(3):
            for i in range(10):
                rng = np.random.default_rng(1000 * step + 10 * rank + i)
                bus.log(f"d{i}", rng.lognormal(3.0, 1.0, 64 * (rank + 1)))
            calls.clear()
            sent.clear()
            rows.append(bus.commit(step=step))
            steady = {"calls": dict(calls), "bytes": sent.get("all_reduce", 0)}
        bus.close()
        out.put((rank, {**steady, "rows": rows}))
    finally:
        tdist.all_reduce = real
        tdist.destroy_process_group()


def late_sketch_worker(rank: int, size: int, port: int, out: Any) -> None:
    """Rank 0 declares 'x' with p50; the others log it under the default: two commits' results."""
    init_gloo(rank, size, port)
    try:
        bus = MetricBus(dist="torch")
        if rank == 0:
            bus.define("x", ["mean", "p50"])
        rows = []
        for step in range(2):
            bus.log("x", [float(rank + 1), float(rank + 2 + step)])
            rows.append(bus.commit(step=step))
        bus.close()
        out.put((rank, rows))
    finally:
        tdist.destroy_process_group()


def late_rule_worker(rank: int, size: int, port: int, out: Any) -> None:
    """Rank 0 commits 'x' under the default; rank 1 (a rule: p90) logs it at the next step: what each rank raises."""
    from metricbus.errors import DistributedError

    init_gloo(rank, size, port)
    try:
        bus = MetricBus(dist="torch", rules={"x": "p90"} if rank == 1 else None)
        raised = ""
        try:
            for step in range(2):
                if (rank, step) != (1, 0):
                    bus.log("x", float(rank + step))
                bus.commit(step=step)
        except DistributedError as exc:
            raised = str(exc)
        bus.close(status="failed")
        out.put((rank, raised))
    finally:
        tdist.destroy_process_group()


def guess_worker(rank: int, size: int, port: int, plan: Any, out: Any) -> None:
    """Log ``plan`` as updates_worker does (tests.test_bitwise's log_share); per commit, count the all_reduces issued
    asynchronously (the guessed sums pass and its maxima) and those issued one at a time."""
    from tests.test_bitwise import log_share

    init_gloo(rank, size, port)
    try:
        counts = {"async": 0, "sync": 0}
        real = tdist.all_reduce

        def counted(*a: Any, **k: Any) -> Any:
            counts["async" if k.get("async_op") else "sync"] += 1
            return real(*a, **k)

        tdist.all_reduce = counted  # type: ignore[assignment]
        bus = MetricBus(dist="torch", rules=plan["rules"])
        rows, calls = [], []
        for step in range(len(plan["steps"])):
            log_share(bus, plan, step=step, rank=rank)
            counts.update(dict.fromkeys(counts, 0))
            rows.append(bus.commit(step=step))
            calls.append(dict(counts))
        bus.close()
        out.put((rank, (rows, calls)))
    finally:
        tdist.destroy_process_group()


def step_mismatch_worker(rank: int, size: int, port: int, journal: str, out: Any) -> None:
    """Commits where the ranks pass different steps (in one-pass commits, from a step far away, and with a MAX pass):
    what each commit returned, or its DistributedError's message."""
    init_gloo(rank, size, port)
    try:
        bus = MetricBus(dist="torch", journal=journal)
        plan = [(s, s) for s in range(6)]  # steady: the one-pass commits start
        plan += [(6, 7), (7, 7), (10, 10 + 2**30), (2**31, 2**31)]
        plan += [(2**31 + 1, 2**31 + 1), (2**31 + 2, 2**31 + 3), (2**31 + 3, 2**31 + 3)]  # these with a p50 metric
        results: list[Any] = []
        for i, steps in enumerate(plan):
            bus.log("x", float(10 * rank + i))
            if i >= 10:
                bus.log("m", float(rank - i), agg="p50")  # sketched: a MAX pass every commit
            try:
                results.append((steps[rank], bus.commit(steps[rank])))
            except DistributedError as exc:
                results.append((steps[rank], str(exc)))
        bus.close()
        out.put((rank, results))
    finally:
        tdist.destroy_process_group()


def step_mismatch_rejected_worker(rank: int, size: int, port: int, out: Any) -> None:
    """A commit with different steps in which rank 0's tensor records of 'y' are bad (NaN under nan='error'): every
    rank raises, 'y' is dropped on every rank (not kept for the next commit), 'z' is kept."""
    import math

    import torch

    init_gloo(rank, size, port)
    try:
        bus = MetricBus(dist="torch")
        results: list[Any] = []
        spec = Agg(micro="mean", nan="error")
        bus.log("y", torch.tensor([1.0]), agg=spec)
        bus.log("z", 1.0)
        results.append(bus.commit(0))
        bus.log("y", torch.tensor([math.nan if rank == 0 else 5.0]), agg=spec)
        bus.log("z", 2.0)
        try:
            bus.commit(1 + rank)
            results.append("no error")
        except DistributedError as exc:
            results.append(str(exc))
        results.append(bus.commit(3))
        bus.close()
        out.put((rank, results))
    finally:
        tdist.destroy_process_group()


def invalid_step_worker(rank: int, size: int, port: int, out: Any) -> None:
    """Step 5; then rank 1's step below its last (rank 0's valid); rank 0's a bool; both ranks the same invalid step;
    then step 6: what each returned or raised ("Type: message")."""
    init_gloo(rank, size, port)
    try:
        bus = MetricBus(dist="torch")
        results: list[Any] = []
        bus.log("x", float(rank))
        results.append(bus.commit(5))
        per_update = Agg(micro="sum", update="mean")  # the refused commits end no update: one sum of 4 records
        for i, step in enumerate([(6, 4)[rank], (True, 6)[rank], 2], start=1):
            bus.log("x", float(10 * rank + i))
            bus.log("u", 1.0, agg=per_update)
            try:
                results.append(bus.commit(step))
            except (StepError, DistributedError) as exc:
                results.append(f"{type(exc).__name__}: {exc}")
        bus.log("x", float(10 * rank + 4))
        bus.log("u", 1.0, agg=per_update)
        results.append(bus.commit(6))
        bus.close()
        out.put((rank, results))
    finally:
        tdist.destroy_process_group()


def spec_disagreement_worker(rank: int, size: int, port: int, out: Any) -> None:
    """'x' declared mean on rank 0 and sum on rank 1, 'y' sum on both, 'z' whose tensor records rank 1 must drop
    (NaN under nan='error'): the commit's error, then the next commit."""
    import math

    import torch

    init_gloo(rank, size, port)
    try:
        bus = MetricBus(dist="torch", nan="error")
        results: list[Any] = []
        bus.log("x", 1.0, agg=("mean", "sum")[rank])
        bus.log("y", 1.0 + 10 * rank, agg="sum")
        bus.log("z", torch.tensor([(2.0, math.nan)[rank]]))
        try:
            bus.commit(0)
            results.append("no error")
        except DistributedError as exc:
            results.append(str(exc))
        results.append(bus.commit(1))
        bus.close()
        out.put((rank, results))
    finally:
        tdist.destroy_process_group()


def all_invalid_step_worker(rank: int, size: int, port: int, out: Any) -> None:
    """Every rank's first commit step invalid (a bool), then 'f' (logged under the default) declared max: a refused
    commit seals no spec, so the declaration still replaces the default, as in one process."""
    init_gloo(rank, size, port)
    try:
        bus = MetricBus(dist="torch")
        results: list[Any] = []
        bus.log("f", float(rank))
        try:
            bus.commit(True)  # type: ignore[arg-type]
            results.append("no error")
        except StepError as exc:
            results.append(str(exc))
        bus.log("f", 7.0, agg="max")
        results.append(bus.commit(0))
        bus.close()
        out.put((rank, results))
    finally:
        tdist.destroy_process_group()
