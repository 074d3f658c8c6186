"""Tensors logged on the device: no host sync in log(), exact stats at commit."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from metricbus import Agg, MetricBus  # noqa: E402
from metricbus.errors import MetricValueError  # noqa: E402
from metricbus.testing import MemoryAdapter  # noqa: E402


def test_log_tensors_never_syncs(no_host_sync: None) -> None:
    """log() of 0-d/n-d tensors of many dtypes, tensor and scalar weights, touches no host-sync call."""
    bus = MetricBus(dist=None)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.float64):
        bus.log("x", torch.ones(3, dtype=dtype))
    bus.log("y", torch.tensor(2.0), weight=torch.tensor(3.0))
    bus.log("y", torch.arange(4.0).reshape(2, 2), weight=0.5)
    bus.log("n", torch.tensor([1.0, float("nan")]), agg="max")


def test_tensor_stats_match_host_reference() -> None:
    """Every kind from tensors equals the same records logged as floats."""
    values = [3.0, -1.0, 2.5, 7.0, 0.25, 4.0]
    for kind in ("mean", "sum", "min", "max", "count", "std", "first", "last"):
        dev, host = MetricBus(dist=None), MetricBus(dist=None)
        dev.log("x", torch.tensor(values[:2]), agg=kind)
        dev.log("x", torch.tensor(values[2:]).reshape(2, 2), agg=kind)
        host.log("x", values, agg=kind)
        assert math.isclose(dev.commit()["x"], host.commit()["x"], rel_tol=1e-12), kind


def test_weighted_and_nan() -> None:
    """Tensor weights weigh the mean; NaN propagates into max; ignore masks it."""
    bus = MetricBus(dist=None)
    bus.log("w", torch.tensor([1.0, 3.0]), weight=torch.tensor([3.0, 1.0]))
    bus.log("m", torch.tensor([1.0, float("nan")]), agg="max")
    bus.log("i", torch.tensor([1.0, float("nan"), 3.0]), agg="mean")
    out = bus.commit()
    assert out["w"] == 1.5
    assert math.isnan(out["m"])
    assert math.isnan(out["i"])
    ignore = MetricBus(dist=None, nan="ignore")
    ignore.log("i", torch.tensor([1.0, float("nan"), 3.0]))
    assert ignore.commit()["i"] == 2.0


def test_bad_tensor_weight_raises_at_commit() -> None:
    """A negative tensor weight is reported at commit, naming the metric."""
    bus = MetricBus(dist=None)
    bus.log("w", torch.tensor([1.0]), weight=torch.tensor([-1.0]))
    with pytest.raises(MetricValueError, match="'w'"):
        bus.commit()


def _both(bus: MetricBus) -> None:
    """Floats, numpy and tensors in one update: some names only on the host, some only on the device, one on both."""
    import numpy as np

    bus.log("host", [1.0, 2.0])
    bus.log("arr", np.array([4.0, 8.0]))
    bus.log("dev", torch.tensor([3.0, 5.0]))
    bus.log("dev_w", torch.tensor([1.0, 4.0]), weight=torch.tensor([3.0, 1.0]))
    bus.log("mixed", 2.0)
    bus.log("mixed", torch.tensor([6.0, 10.0]), agg="mean")


def test_host_and_device_metrics_of_one_update_commit_together() -> None:
    """Names logged only on the device join the host's columns; a name on both merges host first; the values (exact
    small integers, so both paths are exact) equal the same records logged as floats."""
    dev, host = MetricBus(dist=None), MetricBus(dist=None)
    _both(dev)
    host.log("host", [1.0, 2.0])
    host.log("arr", [4.0, 8.0])
    host.log("dev", [3.0, 5.0])
    host.log("dev_w", [1.0, 4.0], weight=[3.0, 1.0])
    host.log("mixed", [2.0, 6.0, 10.0])
    want = host.commit()
    assert dev.commit() == want == {"arr": 6.0, "dev": 4.0, "dev_w": 1.75, "host": 1.5, "mixed": 6.0}
    _both(dev)  # the same shape again: the columns' cached layouts are reused
    assert dev.commit() == want


def test_an_exported_partial_with_device_metrics_ingests_to_the_same_values() -> None:
    """export() of a worker that logged floats and tensors; ingest() on a driver gives what the worker commits."""
    worker, alone, driver = MetricBus(dist=None), MetricBus(dist=None), MetricBus(dist=None)
    _both(worker)
    _both(alone)
    driver.ingest([worker.export()])
    assert driver.commit() == alone.commit()


def test_a_bad_tensor_weight_in_a_later_update_drops_that_metric_only() -> None:
    """Two updates; a negative tensor weight in the second: the error names the metric, its host records of the
    first update go with it, and every other metric (host and device) commits."""
    mem = MemoryAdapter()
    bus = MetricBus(dist=None, adapters=[mem])
    with bus.update():
        bus.log("w", 1.0)
        bus.log("d", torch.tensor([2.0]))
        bus.log("h", 3.0)
    with bus.update():
        bus.log("w", torch.tensor([1.0]), weight=torch.tensor([-1.0]))
        bus.log("d", torch.tensor([4.0]))
    with pytest.raises(MetricValueError, match=r"'w'.*negative"):
        bus.commit(step=0)
    bus.close()
    assert mem.rows == [(0, {"d": 3.0, "h": 3.0})]


def test_weighted_tensors_over_updates_replay_bit_for_bit(tmp_path: Path) -> None:
    """Tensor weights in two updates a commit (their merged weight has a remainder) and a batch of zero weights:
    every committed value, NaN included, is bit for bit what replay of the journal gives, and nothing warns."""
    import struct
    import warnings

    from metricbus.journal import read_journal
    from metricbus.replay import emitted

    gen = torch.Generator().manual_seed(0)
    bus = MetricBus(dist=None, journal=str(tmp_path / "j"))
    live = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(20):
            for _ in range(2):
                with bus.update():
                    for i in range(10):
                        x = torch.randn(64, generator=gen, dtype=torch.float64) + 3
                        bus.log(f"loss{i}", x, weight=torch.rand(64, generator=gen, dtype=torch.float64))
            live.append(bus.commit(step=step))
        bus.log("masked", torch.tensor([2.5, 3.0]), weight=torch.zeros(2))  # alone in its commit: in columns
        live.append(bus.commit(step=20))
        bus.close()
    replayed = [metrics for _, metrics in emitted(read_journal(tmp_path / "j"))]

    def bits(rows: list[dict[str, float]]) -> list[dict[str, bytes]]:
        return [{k: struct.pack("<d", v) for k, v in row.items()} for row in rows]

    assert bits(live) == bits(replayed)
    assert math.isnan(live[20]["masked"])
    assert live[0]["loss0"] != round(live[0]["loss0"], 12)  # not a small-integer case


def test_device_metrics_join_the_host_columns_of_an_update() -> None:
    """Ten host metrics held in columns and three tensor-logged ones in one update (the columns joined), over two
    commits; the values equal the same records logged as floats (exact small integers)."""
    from metricbus.collect import Collector
    from metricbus.micro_columns import MicroUpdate

    joined = []
    real = Collector.take

    def spy(self: Collector) -> Any:
        updates, errors = real(self)
        joined.extend(type(u) is MicroUpdate and len(u.names) == 13 for u in updates)
        return updates, errors

    dev, host = MetricBus(dist=None), MetricBus(dist=None)
    Collector.take = spy  # type: ignore[method-assign]
    try:
        for step in range(2):
            for i in range(10):
                for v in (1.0, 2.0, float(i)):
                    dev.log(f"h{i}", v)
                    host.log(f"h{i}", v)
            for j in range(3):
                dev.log(f"d{j}", torch.tensor([float(j), 4.0, 8.0]))
                host.log(f"d{j}", [float(j), 4.0, 8.0])
            assert dev.commit(step=step) == host.commit(step=step)
    finally:
        Collector.take = real  # type: ignore[method-assign]
    assert joined[-1]



def _logged(bus: MetricBus, source: str, value: float) -> list[float]:
    """Log ``value`` to a first, a last and a mean metric as a tensor ("t"), a float ("h") or a list of two ("l");
    the records that makes, in order."""
    records = [value, value + 0.5] if source == "l" else [value]
    raw: Any = torch.tensor(records) if source == "t" else value if source == "h" else records
    for kind in ("first", "last", "mean"):
        bus.log(kind, raw, agg=kind)
    return records


@pytest.mark.parametrize("seed", range(4))
def test_first_and_last_follow_log_order_across_tensors_and_floats(seed: int, tmp_path: Path) -> None:
    """A metric logged as tensors and as floats takes ``first`` and ``last`` from the records logged first and
    last, whichever source, over one to three updates per commit (50 random orders per seed); a worker's export()
    ingested on a driver and the journal's replay give the same values."""
    from metricbus.journal import read_journal
    from metricbus.replay import emitted

    rng = random.Random(seed)
    journal = tmp_path / "j"
    bus, driver = MetricBus(dist=None, journal=str(journal)), MetricBus(dist=None)
    live = {}
    for step in range(50):
        worker = MetricBus(dist=None)
        records: list[float] = []
        for update in range(rng.randint(1, 3)):
            if update:
                bus.end_update()
                worker.end_update()
            for _ in range(rng.randint(1, 5)):
                source, value = rng.choice("htl"), float(rng.randint(-9, 9))
                records += _logged(bus, source, value)
                _logged(worker, source, value)
        live[step] = bus.commit(step)
        assert (live[step]["first"], live[step]["last"]) == (records[0], records[-1]), records
        driver.ingest([worker.export()])
        assert driver.commit(step) == live[step]
        worker.close()
    bus.close()
    assert dict(emitted(read_journal(journal))) == live


@pytest.mark.parametrize("seed", range(3))
def test_first_and_last_under_nan_ignore_skip_what_was_dropped(seed: int) -> None:
    """Under nan='ignore', NaN records (as floats, or tensors whose every value is NaN) count for neither first nor
    last, whichever source logged what around them (100 random orders per seed)."""
    rng = random.Random(seed)
    ignore = {"first": Agg(micro="first", nan="ignore"), "last": Agg(micro="last", nan="ignore")}
    for _ in range(100):
        bus = MetricBus(dist=None)
        kept: list[float] = []
        for _ in range(rng.randint(1, 6)):
            value = rng.choice([math.nan, float(rng.randint(-9, 9))])
            raw: Any = torch.tensor([value]) if rng.random() < 0.5 else value
            for kind, spec in ignore.items():
                bus.log(kind, raw, agg=spec)
            if not math.isnan(value):
                kept.append(value)
        out = bus.commit()
        assert out == ({"first": kept[0], "last": kept[-1]} if kept else {}), kept
