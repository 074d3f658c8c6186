"""The JSON Lines adapter: exact round trip, non-finite values, strict JSON on disk."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from metricbus.adapters.jsonl import JsonlAdapter, read_jsonl

from metricbus.adapter import RunInfo
from metricbus.errors import ConfigError
from metricbus.histogram import Histogram
from metricbus.journal import adapter_key
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
def test_resume_cuts_the_lines_after_the_acknowledged_step(jsonl_path: Path, after_step: int | None, kept: int) -> None:
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


RUN_ID = "20261203-150237-df2645"


def test_default_path_is_a_per_run_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a path the file is runs/<project>/<run id>/metrics.jsonl, decided at open, one per run."""
    monkeypatch.chdir(tmp_path)
    first, second = JsonlAdapter(), make_adapter("jsonl")
    assert isinstance(second, JsonlAdapter)
    assert first.path is None
    for adapter, run_id in [(first, RUN_ID), (second, "20261203-150238-000001")]:
        adapter.open(run=RunInfo(project="ppo", id=run_id))
        adapter.write(step=0, metrics={"loss": 0.5})
        adapter.close(status="finished")
    assert first.path == Path("runs", "ppo", RUN_ID, "metrics.jsonl")
    assert second.path == Path("runs", "ppo", "20261203-150238-000001", "metrics.jsonl")
    assert read_jsonl(tmp_path / "runs" / "ppo" / RUN_ID / "metrics.jsonl") == [(0, {"loss": 0.5})]
    assert read_jsonl(tmp_path / str(second.path)) == [(0, {"loss": 0.5})]


@pytest.mark.parametrize("spec", ["jsonl:", "jsonl:  "])
def test_an_empty_path_is_a_config_error(spec: str) -> None:
    """'jsonl:' with nothing after it fails at construction, saying what is valid."""
    with pytest.raises(ConfigError, match=r"path is empty.*'jsonl:out.jsonl'.*'jsonl'"):
        make_adapter(spec)


def test_a_directory_path_is_a_config_error(tmp_path: Path) -> None:
    """A path that is an existing folder fails at construction, suggesting a file in it."""
    with pytest.raises(ConfigError, match=r"is a directory; give a file in it.*metrics.jsonl"):
        JsonlAdapter(path=tmp_path)


def test_identity_is_the_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """identity names the file by its absolute path once it is known (empty before a per-run open)."""
    monkeypatch.chdir(tmp_path)
    adapter = JsonlAdapter()
    assert dict(adapter.identity) == {}
    adapter.open(run=RunInfo(project="p", id=RUN_ID))
    assert dict(adapter.identity) == {"path": str(tmp_path / "runs" / "p" / RUN_ID / "metrics.jsonl")}
    adapter.close(status="finished")
    assert dict(JsonlAdapter(path="rel/out.jsonl").identity) == {"path": str(tmp_path / "rel" / "out.jsonl")}


def test_the_cursor_key_does_not_change_at_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A per-run adapter keeps one delivery cursor: its key is the same before and after open decides the path."""
    monkeypatch.chdir(tmp_path)
    adapter = JsonlAdapter()
    before = adapter_key(adapter)
    adapter.open(run=RunInfo(id=RUN_ID))
    assert adapter_key(adapter) == before
    adapter.close(status="finished")
    assert adapter_key(JsonlAdapter(path="a.jsonl")) != adapter_key(JsonlAdapter(path="b.jsonl"))


def test_resume_with_identity_writes_to_that_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter without a path resumes into the file its identity names (cut after the step), whatever the run."""
    monkeypatch.chdir(tmp_path)
    live = JsonlAdapter()
    _write(live, _lines(range(10)))
    later = JsonlAdapter()
    later.resume(after_step=4, identity=live.identity)
    assert read_jsonl(tmp_path / str(live.path)) == _lines(range(5))
    later.open(run=RunInfo(project="elsewhere", id=RUN_ID))
    for step, metrics in _lines(range(5, 12)):
        later.write(step=step, metrics=metrics)
    later.close(status="finished")
    assert later.path == tmp_path / str(live.path)
    assert read_jsonl(tmp_path / str(live.path)) == _lines(range(12))
    assert not (tmp_path / "runs" / "elsewhere").exists()


def test_resume_without_identity_cuts_the_per_run_file_at_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a path or identity the cut waits for open(), which names the run's file from its id."""
    monkeypatch.chdir(tmp_path)
    run = RunInfo(project="p", id=RUN_ID)
    first = JsonlAdapter()
    first.open(run=run)
    for step, metrics in _lines(range(8)):
        first.write(step=step, metrics=metrics)
    first.close(status="failed")
    again = JsonlAdapter()
    again.resume(after_step=2)
    assert len(read_jsonl(tmp_path / str(first.path))) == 8  # nothing cut before the file is known
    again.open(run=run)
    again.close(status="finished")
    assert read_jsonl(tmp_path / str(first.path)) == _lines(range(3))


def test_a_given_path_wins_over_identity(tmp_path: Path) -> None:
    """resume's identity does not redirect an adapter that was given its path."""
    mine, other = tmp_path / "mine.jsonl", tmp_path / "other.jsonl"
    _write(JsonlAdapter(path=mine), _lines(range(5)))
    _write(JsonlAdapter(path=other), _lines(range(5)))
    adapter = JsonlAdapter(path=mine)
    adapter.resume(after_step=1, identity={"path": str(other)})
    assert adapter.path == mine
    assert read_jsonl(mine) == _lines(range(2))
    assert read_jsonl(other) == _lines(range(5))


def test_rewind_cuts_from_the_step_and_appends_after(jsonl_path: Path) -> None:
    """rewind(step=S) drops every line of a step >= S; the steps sent again follow the earlier lines."""
    adapter = JsonlAdapter(path=jsonl_path)
    adapter.open(run=RunInfo())
    for step, metrics in _lines(range(10)):
        adapter.write(step=step, metrics=metrics)
    adapter.rewind(step=6)
    assert read_jsonl(jsonl_path) == _lines(range(6))
    redone = [(step, {"loss": -step / 8}) for step in range(6, 9)]
    for step, metrics in redone:
        adapter.write(step=step, metrics=metrics)
    adapter.flush()
    adapter.close(status="finished")
    assert read_jsonl(jsonl_path) == _lines(range(6)) + redone


def test_rewind_below_every_step_empties_the_file(jsonl_path: Path) -> None:
    """Rewinding to the first step (or before) leaves an empty file that later writes fill."""
    adapter = JsonlAdapter(path=jsonl_path)
    adapter.open(run=RunInfo())
    for step, metrics in _lines(range(3)):
        adapter.write(step=step, metrics=metrics)
    adapter.rewind(step=0)
    adapter.write(step=0, metrics={"loss": 9.0})
    adapter.close(status="finished")
    assert read_jsonl(jsonl_path) == [(0, {"loss": 9.0})]


def test_rewind_before_open_raises(jsonl_path: Path) -> None:
    """rewind() comes between writes; before open() it is an error, not a silent no-op."""
    with pytest.raises(RuntimeError, match="before open"):
        JsonlAdapter(path=jsonl_path).rewind(step=3)


TRAIN_EVAL = [(3, {"train/loss": 0.5}), (3, {"eval/loss": 0.75}), (4, {"train/loss": 0.25})]


def test_two_writes_at_one_step_read_back_as_two_lines(jsonl_path: Path) -> None:
    """Training then evaluation at one step (disjoint names): both lines, in order."""
    _write(JsonlAdapter(path=jsonl_path), TRAIN_EVAL)
    assert read_jsonl(jsonl_path) == TRAIN_EVAL


@pytest.mark.parametrize(("step", "kept"), [(4, 2), (3, 0)])
def test_rewind_keeps_or_drops_both_lines_of_a_step(jsonl_path: Path, step: int, kept: int) -> None:
    """Both lines of an earlier step survive a rewind past it; rewinding to that step drops both."""
    adapter = JsonlAdapter(path=jsonl_path)
    adapter.open(run=RunInfo())
    for at, metrics in TRAIN_EVAL:
        adapter.write(step=at, metrics=metrics)
    adapter.rewind(step=step)
    adapter.close(status="finished")
    assert read_jsonl(jsonl_path) == TRAIN_EVAL[:kept]


def test_resume_keeps_both_lines_of_the_acknowledged_step(jsonl_path: Path) -> None:
    """Cutting after an acknowledged step keeps every line of that step."""
    _write(JsonlAdapter(path=jsonl_path), TRAIN_EVAL)
    JsonlAdapter(path=jsonl_path).resume(after_step=3)
    assert read_jsonl(jsonl_path) == TRAIN_EVAL[:2]


HIST = Histogram(
    9.0,
    edges=(-0.25, 0.1, 0.123456789, 1e300),
    counts=(3, 0, 6),
    quantiles=(("p50", 0.1), ("p90", 0.123456789), ("p99", 1e300)),
)


def test_histogram_is_a_json_object(jsonl_path: Path) -> None:
    """A Histogram is written as an object of its count, edges, counts and quantiles, next to the plain floats."""
    _write(JsonlAdapter(path=jsonl_path), [(4, {"loss": 0.5, "len/hist": HIST})])
    (record,) = [json.loads(line) for line in jsonl_path.read_text(encoding="utf-8").splitlines()]
    assert record["metrics"] == {
        "loss": 0.5,
        "len/hist": {
            "count": 9.0,
            "edges": [-0.25, 0.1, 0.123456789, 1e300],
            "counts": [3, 0, 6],
            "quantiles": {"p50": 0.1, "p90": 0.123456789, "p99": 1e300},
        },
    }


def test_histogram_reads_back_as_the_same_histogram(jsonl_path: Path) -> None:
    """read_jsonl gives back a Histogram with the same count, edges, counts and quantiles (NaN ones too)."""
    nan_quantiles = Histogram(0.0, edges=(), counts=(), quantiles=(("p50", math.nan), ("p99", math.inf)))
    _write(JsonlAdapter(path=jsonl_path), [(0, {"h": HIST, "x": 1.5}), (1, {"h": nan_quantiles})])
    ((_, first), (_, second)) = read_jsonl(jsonl_path)
    assert isinstance(first["h"], Histogram)
    assert (float(first["h"]), first["h"].edges, first["h"].counts) == (9.0, HIST.edges, HIST.counts)
    assert first["h"].quantiles == HIST.quantiles
    assert first["x"] == 1.5
    back = second["h"]
    assert isinstance(back, Histogram)
    assert (float(back), back.edges, back.counts) == (0.0, (), ())
    assert [name for name, _ in back.quantiles] == ["p50", "p99"]
    assert math.isnan(back.quantiles[0][1])
    assert back.quantiles[1][1] == math.inf


def test_edges_and_counts_object_reads_back(jsonl_path: Path) -> None:
    """An object with only edges and counts reads back as a Histogram of sum(counts) records, no quantiles."""
    jsonl_path.parent.mkdir()
    jsonl_path.write_text('{"step":2,"time_unix_ns":1,"metrics":{"h":{"edges":[0,1,2],"counts":[4,1]}}}\n')
    ((step, metrics),) = read_jsonl(jsonl_path)
    assert step == 2
    assert metrics["h"] == Histogram(5.0, edges=(0.0, 1.0, 2.0), counts=(4, 1), quantiles=())


def test_resume_cuts_lines_holding_histograms(jsonl_path: Path) -> None:
    """Lines holding histograms are cut by a resume like any other line."""
    _write(JsonlAdapter(path=jsonl_path), [(step, {"h": HIST}) for step in range(5)])
    adapter = JsonlAdapter(path=jsonl_path)
    adapter.resume(after_step=2)
    _write(adapter, [(3, {"x": 1.0})])
    assert [(step, list(metrics)) for step, metrics in read_jsonl(jsonl_path)] == [
        (0, ["h"]),
        (1, ["h"]),
        (2, ["h"]),
        (3, ["x"]),
    ]
