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


def _lines(steps: range) -> list[tuple[int, dict[str, float]]]:
    return [(step, {"loss": step / 8}) for step in steps]


def test_write_reaches_the_file_before_flush(jsonl_path: Path) -> None:
    """A written line is in the file (visible to another reader) as soon as write() returned."""
    adapter = JsonlAdapter(path=jsonl_path)
    adapter.open(run=RunInfo())
    adapter.write(step=0, metrics={"loss": 0.5})
    assert read_jsonl(jsonl_path) == [(0, {"loss": 0.5})]
    adapter.close(status="finished")


def test_flush_fsyncs_the_file(jsonl_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flush() makes the data durable: it fsyncs the file's descriptor."""
    synced: list[int] = []
    adapter = JsonlAdapter(path=jsonl_path)
    adapter.open(run=RunInfo())
    adapter.write(step=0, metrics={"loss": 0.5})
    monkeypatch.setattr("os.fsync", synced.append)
    adapter.flush()
    assert len(synced) == 1
    adapter.close(status="finished")


@pytest.mark.parametrize(("after_step", "kept"), [(None, 0), (-1, 0), (0, 1), (4, 5), (9, 10), (50, 10)])
def test_resume_cuts_the_lines_after_the_acknowledged_step(
    jsonl_path: Path, after_step: int | None, kept: int
) -> None:
    """resume(after_step=N) keeps exactly the lines of steps <= N (None: none); the next writes append after them."""
    _write(JsonlAdapter(path=jsonl_path), _lines(range(10)))
    adapter = JsonlAdapter(path=jsonl_path)
    adapter.resume(after_step=after_step)
    _write(adapter, _lines(range(kept, 12)))
    assert read_jsonl(jsonl_path) == _lines(range(12))


def test_resume_scans_back_across_blocks(jsonl_path: Path) -> None:
    """Cutting thousands of unacknowledged lines (more than one read block) keeps exactly the acknowledged ones."""
    _write(JsonlAdapter(path=jsonl_path), _lines(range(5000)))
    JsonlAdapter(path=jsonl_path).resume(after_step=1234)
    assert read_jsonl(jsonl_path) == _lines(range(1235))


def test_a_torn_last_line_is_cut_at_open(jsonl_path: Path) -> None:
    """A line without its newline (the writer died mid-line) is skipped by read_jsonl and cut before appending."""
    _write(JsonlAdapter(path=jsonl_path), _lines(range(3)))
    with jsonl_path.open("ab") as handle:
        handle.write(b'{"step":3,"time_unix_ns":1,"metr')
    assert read_jsonl(jsonl_path) == _lines(range(3))
    _write(JsonlAdapter(path=jsonl_path), _lines(range(3, 5)))
    assert read_jsonl(jsonl_path) == _lines(range(5))


def test_a_torn_line_after_the_acknowledged_step_is_cut_by_resume(jsonl_path: Path) -> None:
    """resume cuts unacknowledged lines and a torn last line together."""
    _write(JsonlAdapter(path=jsonl_path), _lines(range(6)))
    with jsonl_path.open("ab") as handle:
        handle.write(b'{"step":6')
    JsonlAdapter(path=jsonl_path).resume(after_step=2)
    assert read_jsonl(jsonl_path) == _lines(range(3))


def test_resume_of_a_missing_file_creates_nothing(jsonl_path: Path) -> None:
    """Resuming a file that does not exist yet is a no-op."""
    JsonlAdapter(path=jsonl_path).resume(after_step=3)
    assert not jsonl_path.exists()
