"""Counter-examples found by hypothesis hunting against the public API (explore mode), each an explicit test."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from metricbus import Agg, MetricBus
from metricbus.errors import SpecError
from metricbus.replay import replay
from metricbus.testing import MemoryAdapter


def bits(rows: list[tuple[int, dict[str, float]]]) -> list[tuple[int, dict[str, bytes]]]:
    """Rows with every float as its 8 bytes (so NaN == NaN and -0.0 != 0.0)."""
    return [(step, {k: struct.pack("<d", v) for k, v in m.items()}) for step, m in rows]


def logged(journal: Path | None, spec: object) -> MemoryAdapter:
    """Two commits of ``x`` (three records, one update each) logged under ``spec``."""
    mem = MemoryAdapter()
    with MetricBus(adapters=[mem], dist=None, strict=True, journal=journal) as bus:
        bus.define("x", spec)
        for step in range(2):
            for x in (1.0, 2.0 + step, -4.0):
                bus.log("x", x)
            bus.commit(step=step)
    return mem


@pytest.mark.parametrize("spec", ["sum", ["mean", "max"], Agg(micro="sum", rank="mean")])
def test_replay_rules_take_the_spec_forms_a_bus_takes(tmp_path: Path, spec: object) -> None:
    """replay(rules={"x": "sum"}) raised AttributeError ('str' has no 'nan'): it now re-aggregates as a bus would."""
    logged(tmp_path / "j", "mean")
    again = MemoryAdapter()
    replay(tmp_path / "j", [again], rules={"x": spec})
    assert bits(again.rows) == bits(logged(None, spec).rows)


def test_replay_rule_with_an_unknown_kind_is_a_spec_error(tmp_path: Path) -> None:
    """A replay rule naming no kind is a SpecError naming the pattern and the valid kinds, not an AttributeError."""
    logged(tmp_path / "j", "mean")
    with pytest.raises(SpecError, match=r"'x'.*valid kinds|'x'.*use"):
        replay(tmp_path / "j", [MemoryAdapter()], rules={"x": "average"})


def test_weighted_mean_of_negative_zeros_whose_weights_sum_to_two_components(tmp_path: Path) -> None:
    """-0.0 records weighted 1 and 1e300 (Σw = 1e300 + 1, two components) gave mean +0.0 (the exact division of
    the int 0 lost the sign): every product w·x is -0.0, so the mean is -0.0, logged, ingested and replayed."""
    worker = MetricBus(dist=None)
    worker.log("x", -0.0, weight=1.0)
    mem = MemoryAdapter()
    with MetricBus(adapters=[mem], dist=None, strict=True, journal=tmp_path / "j") as bus:
        bus.log("x", -0.0, weight=1.0)
        bus.log("x", -0.0, weight=1e300)
        assert struct.pack("<d", bus.commit(step=0)["x"]) == struct.pack("<d", -0.0)
        other = MetricBus(dist=None)
        other.log("x", -0.0, weight=1e300)
        bus.ingest([worker.export(), other.export()])
        assert struct.pack("<d", bus.commit(step=1)["x"]) == struct.pack("<d", -0.0)
        other.close()
    worker.close()
    again = MemoryAdapter()
    replay(tmp_path / "j", [again])
    assert bits(again.rows) == bits(mem.rows) == bits([(0, {"x": -0.0}), (1, {"x": -0.0})])
