"""The JSON Lines adapter: exact round trip, non-finite values, strict JSON on disk."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from metricbus.adapters.jsonl import JsonlAdapter, read_jsonl

from metricbus.adapter import RunInfo
from metricbus.registry import make_adapter


@pytest.fixture
def jsonl_path(tmp_path: Path) -> Path:
    """Where the adapter writes, in a folder that does not exist yet."""
    return tmp_path / "out" / "metrics.jsonl"


def _write(adapter: JsonlAdapter, points: list[tuple[int, dict[str, float]]]) -> None:
    adapter.open(run=RunInfo(name="t"))
    for step, metrics in points:
        adapter.write(step=step, metrics=metrics)
    adapter.flush()
    adapter.close(status="finished")


def test_round_trip_is_bit_exact(jsonl_path: Path) -> None:
    """Random doubles of every magnitude read back identical."""
    rng = random.Random(7)
    points = [
        (step, {f"m{i}": rng.uniform(-1, 1) * 10.0 ** rng.randint(-300, 300) for i in range(5)}) for step in range(200)
    ]
    _write(JsonlAdapter(path=jsonl_path), points)
    assert read_jsonl(jsonl_path) == points


def test_non_finite_values_round_trip(jsonl_path: Path) -> None:
    """NaN, +inf and -inf come back as the same floats."""
    _write(JsonlAdapter(path=jsonl_path), [(3, {"a": math.nan, "b": math.inf, "c": -math.inf, "d": -0.0})])
    ((step, metrics),) = read_jsonl(jsonl_path)
    assert step == 3
    assert math.isnan(metrics["a"])
    assert metrics["b"] == math.inf
    assert metrics["c"] == -math.inf
    assert math.copysign(1.0, metrics["d"]) == -1.0


def test_file_is_strict_json(jsonl_path: Path) -> None:
    """Every line parses with a parser that rejects NaN/Infinity tokens and has step, time and metrics."""
    _write(JsonlAdapter(path=jsonl_path), [(1, {"a": math.nan}), (2, {"a": 1.5})])

    def reject(token: str) -> None:
        raise AssertionError(f"non-standard JSON token {token}")

    lines = jsonl_path.read_text(encoding="utf-8").splitlines()
    records = [json.loads(line, parse_constant=reject) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["metrics"] == {"a": "NaN"}
    assert all(isinstance(r["time_unix_ns"], int) for r in records)


def test_uri_spec_sets_path(tmp_path: Path) -> None:
    """``jsonl:<path>`` builds an adapter writing to that path."""
    target = tmp_path / "x.jsonl"
    adapter = make_adapter(f"jsonl:{target}")
    assert isinstance(adapter, JsonlAdapter)
    _write(adapter, [(0, {"loss": 0.5})])
    assert read_jsonl(target) == [(0, {"loss": 0.5})]


def test_write_before_open_raises(jsonl_path: Path) -> None:
    """Writing to an adapter that was never opened is an error, not a silent drop."""
    with pytest.raises(RuntimeError, match="before open"):
        JsonlAdapter(path=jsonl_path).write(step=0, metrics={"a": 1.0})
