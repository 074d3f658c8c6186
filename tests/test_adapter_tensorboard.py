"""The TensorBoard adapter, read back with TensorBoard's own readers (EventAccumulator, the hparams plugin's
metadata parser) and its HTTP server."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backend_env import free_port, get_json, isolate_env, poll_until, start_server, stop_server, wait_http
from metricbus.adapters.tensorboard import RUN_TEXT_TAG, TensorBoardAdapter, hparams_of
from tb_reader import (
    histogram_points,
    histogram_rows,
    legacy_accumulator,
    multiplexer_accumulator,
    read_tensors,
    tensor_points,
)

from metricbus.adapter import RunInfo
from metricbus.errors import AdapterNotFoundError, ConfigError
from metricbus.histogram import Histogram
from metricbus.registry import make_adapter

HOSTILE = [
    1e39,  # beyond float32's range
    1e-40,  # a float32 subnormal
    5e-324,  # the smallest float64 subnormal
    -0.0,
    math.nan,
    math.inf,
    -math.inf,
    0.1,
    1.7976931348623157e308,
    2.2250738585072014e-308,
    1 + 2**-52,
    -123456789.123456789,
    struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000001))[0],  # a NaN with a payload
    struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000000))[0],  # a negative NaN
]
CONFIG = {"lr": 0.1, "opt": {"beta": 0.9, "name": "adam", "nesterov": True, "steps": 3}, "layers": [64, 64]}


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path; the working directory is tmp_path (default folders land there)."""
    monkeypatch.chdir(tmp_path)
    return isolate_env(monkeypatch, tmp_path)


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def _points(*, steps: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "train/loss": rng.normal(size=steps),
        "train/acc": rng.uniform(size=steps),
        "lr": np.geomspace(1, 1e-6, steps),
    }


def _run(**overrides: Any) -> RunInfo:
    fields: dict[str, Any] = {"project": "p", "name": "tb", "tags": ("a",), "config": CONFIG}
    return RunInfo(**(fields | overrides))


def _write_run(log_dir: Path, series: dict[str, np.ndarray], *, step_offset: int = 0) -> None:
    adapter = TensorBoardAdapter(log_dir=log_dir)
    adapter.open(run=_run())
    steps = len(next(iter(series.values())))
    for i in range(steps):
        adapter.write(step=i + step_offset, metrics={key: float(values[i]) for key, values in series.items()})
    adapter.flush()
    adapter.close(status="finished")


def _folder(adapter: TensorBoardAdapter) -> Path:
    assert adapter.log_dir is not None
    return Path(adapter.log_dir)


def _write_steps(adapter: TensorBoardAdapter, steps: range, *, base: float) -> None:
    for step in steps:
        adapter.write(step=step, metrics={"x": base + step})
    adapter.flush()


def test_hostile_values_read_back_bit_for_bit(tmp_path: Path) -> None:
    """1e39, 1e-40, 5e-324, -0.0, NaNs (payloads too) and ±inf come back from Tensors() as the same float64 bits."""
    adapter = TensorBoardAdapter(log_dir=tmp_path / "tb")
    adapter.open(run=_run())
    for step, value in enumerate(HOSTILE):
        adapter.write(step=step, metrics={"x": value})
    adapter.close(status="finished")
    for acc in (legacy_accumulator(tmp_path / "tb"), multiplexer_accumulator(tmp_path / "tb")):
        points = tensor_points(acc, "x")
        assert [step for step, _ in points] == list(range(len(HOSTILE)))
        assert [_bits(value) for _, value in points] == [_bits(value) for value in HOSTILE]
        (event,) = acc.Tensors("x")[:1]
        assert event.tensor_proto.dtype == 2  # DT_DOUBLE
        assert acc.SummaryMetadata("x").plugin_data.plugin_name == "scalars"


def test_every_point_reads_back_as_float64(tmp_path: Path) -> None:
    """12,000 steps of three metrics (more than the reader's default 10,000) all come back exactly."""
    series = _points(steps=12_000)
    _write_run(tmp_path / "tb", series, step_offset=5)
    acc = legacy_accumulator(tmp_path / "tb")
    assert acc.Tags()["scalars"] == []  # float64 tensors, not float32 simple values
    assert set(series) <= set(acc.Tags()["tensors"])
    for key, values in series.items():
        points = tensor_points(acc, key)
        assert [step for step, _ in points] == list(range(5, 5 + len(values)))
        assert [value for _, value in points] == values.tolist()


def test_two_writes_at_one_step_both_read_back(tmp_path: Path) -> None:
    """Training then evaluation metrics at the same step both land, each under its own tag."""
    adapter = TensorBoardAdapter(log_dir=tmp_path / "tb")
    adapter.open(run=_run())
    for step in range(3):
        adapter.write(step=step, metrics={"train/loss": 1.0 + step})
        adapter.write(step=step, metrics={"eval/loss": 2.0 + step})
    adapter.close(status="finished")
    assert read_tensors(tmp_path / "tb", "train/loss") == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert read_tensors(tmp_path / "tb", "eval/loss") == [(0, 2.0), (1, 3.0), (2, 4.0)]


def _hist(counts: tuple[int, ...], edges: tuple[float, ...]) -> Histogram:
    quantiles = (("p50", edges[len(edges) // 2]), ("p90", edges[-2]), ("p99", edges[-1])) if edges else ()
    return Histogram(float(sum(counts)), edges=edges, counts=counts, quantiles=quantiles)


def _write_histograms(log_dir: Path, rows: list[dict[str, float]]) -> None:
    adapter = TensorBoardAdapter(log_dir=log_dir)
    adapter.open(run=_run())
    for step, metrics in enumerate(rows):
        adapter.write(step=step, metrics=metrics)
    adapter.close(status="finished")


def test_histogram_reads_back_as_a_histogram(tmp_path: Path) -> None:
    """A Histogram is a histogram summary: Histograms() gives its right edges and counts exactly, the histogram
    plugin's rows its [left, right, count] bins; the scalars of the same step stay float64 tensors."""
    hists = [
        _hist((3, 0, 5, 1), (-0.3, 0.1, 0.7, 1.1, 2.5)),
        _hist((1, 1000, 7), (1e-3, 0.123456789, 17.5, 1e9)),
    ]
    _write_histograms(tmp_path / "tb", [{"loss": 0.5 + i, "len/hist": h} for i, h in enumerate(hists)])
    acc = legacy_accumulator(tmp_path / "tb")
    assert acc.Tags()["histograms"] == ["len/hist"]
    assert histogram_points(acc, "len/hist") == [(i, list(h.edges[1:]), list(h.counts)) for i, h in enumerate(hists)]
    for event, h in zip(acc.Histograms("len/hist"), hists, strict=True):
        assert (event.histogram_value.min, event.histogram_value.max) == (h.edges[0], h.edges[-1])
        assert event.histogram_value.num == sum(h.counts) == float(h)
    assert len(acc.CompressedHistograms("len/hist")) == len(hists)
    assert read_tensors(tmp_path / "tb", "loss") == [(0, 0.5), (1, 1.5)]
    plugin = multiplexer_accumulator(tmp_path / "tb")
    assert plugin.SummaryMetadata("len/hist").plugin_data.plugin_name == "histograms"
    want = [
        (
            i,
            [
                [np.float32(lo), np.float32(hi), c]
                for lo, hi, c in zip(h.edges[:-1], h.edges[1:], h.counts, strict=True)
            ],
        )
        for i, h in enumerate(hists)
    ]
    assert histogram_rows(plugin, "len/hist") == want


def test_histogram_with_empty_outer_bins_keeps_its_edges(tmp_path: Path) -> None:
    """Empty outermost bins: the plugin (which drops them) still gets the inner bins' exact edges."""
    h = _hist((0, 0, 4, 0, 2, 0), (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0))
    _write_histograms(tmp_path / "tb", [{"h": h}])
    assert histogram_points(legacy_accumulator(tmp_path / "tb"), "h") == [
        (0, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [0, 0, 4, 0, 2, 0])
    ]
    rows = histogram_rows(multiplexer_accumulator(tmp_path / "tb"), "h")
    assert rows == [(0, [[2.0, 3.0, 4.0], [3.0, 4.0, 0.0], [4.0, 5.0, 2.0]])]


def test_empty_histogram_has_no_buckets(tmp_path: Path) -> None:
    """A Histogram without bins (no finite records) is a histogram of nothing, not an error."""
    _write_histograms(
        tmp_path / "tb", [{"h": Histogram(0.0, edges=(), counts=(), quantiles=())}, {"h": _hist((2,), (1.0, 2.0))}]
    )
    assert histogram_points(legacy_accumulator(tmp_path / "tb"), "h") == [(0, [], []), (1, [2.0], [2])]
    assert histogram_rows(multiplexer_accumulator(tmp_path / "tb"), "h") == [(0, []), (1, [[1.0, 2.0, 2.0]])]


def test_run_metadata_is_written_as_text(tmp_path: Path) -> None:
    """The run's project, id, name, tags and config land in one text summary."""
    run = _run()
    adapter = TensorBoardAdapter(log_dir=tmp_path / "tb")
    adapter.open(run=run)
    adapter.close(status="finished")
    (event,) = legacy_accumulator(tmp_path / "tb").Tensors(RUN_TEXT_TAG)
    text = event.tensor_proto.string_val[0].decode()
    for fragment in ('"project": "p"', f'"id": "{run.id}"', '"name": "tb"', '"beta": 0.9', '"a"'):
        assert fragment in text


def test_config_is_written_as_hparams(tmp_path: Path) -> None:
    """The flattened config is one hparams session start, typed, read with the hparams plugin's own parser."""
    from tensorboard.plugins.hparams import metadata

    run = _run()
    adapter = TensorBoardAdapter(log_dir=tmp_path / "tb")
    adapter.open(run=run)
    adapter.close(status="finished")
    for acc in (legacy_accumulator(tmp_path / "tb"), multiplexer_accumulator(tmp_path / "tb")):
        content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
        assert list(content) == [metadata.SESSION_START_INFO_TAG]
        info = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
        values = {name: getattr(value, value.WhichOneof("kind")) for name, value in info.hparams.items()}
        expected = {"lr": 0.1, "opt.beta": 0.9, "opt.name": "adam", "opt.nesterov": True, "opt.steps": 3.0}
        assert values == expected | {"layers": "[64, 64]"}
        assert info.group_name == run.id
        assert info.start_time_secs == run.start_time_unix_ns / 1e9


def test_hparams_keep_scalars_and_stringify_the_rest() -> None:
    """Config leaves: bool, int, float and str stay; numpy numbers become int/float; others become str()."""
    config = {"a": {"b": {"c": np.int64(3)}}, "f": np.float32(0.5), "none": None, "t": (1, 2), "s": "x", "ok": False}
    assert hparams_of(config) == {"a.b.c": 3, "f": 0.5, "none": "None", "t": "(1, 2)", "s": "x", "ok": False}


def test_empty_config_writes_no_hparams(tmp_path: Path) -> None:
    """A run without config has no hparams session (the dashboard would show an empty one)."""
    adapter = TensorBoardAdapter(log_dir=tmp_path / "tb")
    adapter.open(run=_run(config={}))
    adapter.close(status="finished")
    assert "_hparams_/session_start_info" not in legacy_accumulator(tmp_path / "tb").Tags()["tensors"]


def test_default_folder_is_per_run(tmp_path: Path) -> None:
    """log_dir=None writes under runs/<project>/<run id>/tensorboard in the working directory, one per run."""
    first, second = RunInfo(project="proj"), RunInfo(project="proj")
    assert first.id != second.id
    folders = []
    for run in (first, second):
        adapter = TensorBoardAdapter()
        assert adapter.log_dir is None
        assert adapter.identity is None
        adapter.open(run=run)
        adapter.write(step=0, metrics={"x": 1.0})
        adapter.close(status="finished")
        expected = tmp_path / "runs" / "proj" / run.id / "tensorboard"
        assert adapter.log_dir == str(expected)
        assert adapter.identity == {"log_dir": str(expected)}
        assert read_tensors(expected, "x") == [(0, 1.0)]
        folders.append(expected)
    assert folders[0] != folders[1]


def test_explicit_log_dir_is_used_as_given(tmp_path: Path) -> None:
    """A relative log_dir is kept as given by log_dir and made absolute in identity."""
    adapter = TensorBoardAdapter(log_dir="exp")
    assert adapter.log_dir == "exp"
    adapter.open(run=_run())
    adapter.close(status="finished")
    assert adapter.log_dir == "exp"
    assert adapter.identity == {"log_dir": str(tmp_path / "exp")}


def test_uri_spec_sets_log_dir(tmp_path: Path) -> None:
    """``tensorboard:<dir>`` builds an adapter writing under that folder."""
    adapter = make_adapter(f"tensorboard:{tmp_path / 'exp'}")
    assert isinstance(adapter, TensorBoardAdapter)
    assert adapter.log_dir == str(tmp_path / "exp")


def test_resume_gives_one_timeline(tmp_path: Path) -> None:
    """A new adapter resumed after step 5 with the first one's identity: steps 0..12 once, the resent ones new."""
    run = RunInfo(project="proj", config=CONFIG)
    first = TensorBoardAdapter()
    first.open(run=run)
    _write_steps(first, range(10), base=0.0)  # steps 6..9 written but (say) never acknowledged; no close: a crash
    resumed = TensorBoardAdapter()
    resumed.resume(after_step=5, identity=first.identity)
    assert resumed.log_dir == first.log_dir
    resumed.open(run=run)
    _write_steps(resumed, range(6, 13), base=100.0)
    resumed.close(status="finished")
    expected = [(s, float(s)) for s in range(6)] + [(s, 100.0 + s) for s in range(6, 13)]
    for acc in (legacy_accumulator(_folder(first)), multiplexer_accumulator(_folder(first))):
        assert tensor_points(acc, "x") == expected
        assert len(acc.Tensors(RUN_TEXT_TAG)) == 1
        assert len(acc.Tensors("_hparams_/session_start_info")) == 1


def test_resume_uses_the_default_folder_of_the_same_run_id(tmp_path: Path) -> None:
    """Without identity, the same run id still leads a resumed adapter to the same default folder."""
    run = RunInfo(project="proj")
    first = TensorBoardAdapter()
    first.open(run=run)
    _write_steps(first, range(4), base=0.0)
    first.close(status="finished")
    resumed = TensorBoardAdapter()
    resumed.resume(after_step=1)
    resumed.open(run=run)
    _write_steps(resumed, range(2, 4), base=10.0)
    resumed.close(status="finished")
    assert resumed.log_dir == first.log_dir
    assert read_tensors(_folder(first), "x") == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]


def test_cursor_key_is_the_same_before_and_after_open(tmp_path: Path) -> None:
    """The journal's cursor file for the adapter does not move when open() decides the default folder."""
    from metricbus.journal import adapter_key

    for adapter in (TensorBoardAdapter(), TensorBoardAdapter(log_dir="exp")):
        before = adapter_key(adapter)
        adapter.open(run=_run())
        adapter.close(status="finished")
        assert adapter_key(adapter) == before
    assert adapter_key(TensorBoardAdapter(log_dir="a")) != adapter_key(TensorBoardAdapter(log_dir="b"))


def test_explicit_log_dir_wins_over_identity(tmp_path: Path) -> None:
    """An explicit log_dir is kept even when resume hands back another folder."""
    adapter = TensorBoardAdapter(log_dir=tmp_path / "mine")
    adapter.resume(after_step=3, identity={"log_dir": str(tmp_path / "other")})
    adapter.open(run=_run())
    adapter.close(status="finished")
    assert adapter.identity == {"log_dir": str(tmp_path / "mine")}
    assert not (tmp_path / "other").exists()


def test_resume_with_nothing_acknowledged_hides_everything(tmp_path: Path) -> None:
    """after_step=None: none of the earlier events is left, and the new run text and hparams are there once."""
    run = RunInfo(project="proj", config=CONFIG)
    first = TensorBoardAdapter()
    first.open(run=run)
    first.write(step=-3, metrics={"x": -3.0})
    _write_steps(first, range(5), base=0.0)
    resumed = TensorBoardAdapter()
    resumed.resume(after_step=None, identity=first.identity)
    resumed.open(run=run)
    _write_steps(resumed, range(2), base=50.0)
    resumed.close(status="finished")
    for acc in (legacy_accumulator(_folder(first)), multiplexer_accumulator(_folder(first))):
        assert tensor_points(acc, "x") == [(0, 50.0), (1, 51.0)]
        assert len(acc.Tensors(RUN_TEXT_TAG)) == 1
        assert len(acc.Tensors("_hparams_/session_start_info")) == 1


def test_rewind_keeps_only_the_new_values(tmp_path: Path) -> None:
    """rewind(step=4) after steps 0..9, then steps 4..7 again: 0..3 old, 4..7 new, 8..9 gone."""
    adapter = TensorBoardAdapter(log_dir=tmp_path / "tb")
    adapter.open(run=_run())
    _write_steps(adapter, range(10), base=0.0)
    adapter.write(step=9, metrics={"eval": 9.0})
    adapter.rewind(step=4)
    _write_steps(adapter, range(4, 8), base=100.0)
    adapter.close(status="finished")
    expected = [(s, float(s)) for s in range(4)] + [(s, 100.0 + s) for s in range(4, 8)]
    for acc in (legacy_accumulator(tmp_path / "tb"), multiplexer_accumulator(tmp_path / "tb")):
        assert tensor_points(acc, "x") == expected
        assert "eval" not in acc.Tags()["tensors"]
        assert len(acc.Tensors(RUN_TEXT_TAG)) == 1


def test_rewind_to_step_zero_keeps_the_run_metadata(tmp_path: Path) -> None:
    """rewind(step=0) hides every step but the run text and hparams (step 0 too) are there, once."""
    adapter = TensorBoardAdapter(log_dir=tmp_path / "tb")
    adapter.open(run=_run())
    _write_steps(adapter, range(3), base=0.0)
    adapter.rewind(step=0)
    _write_steps(adapter, range(2), base=10.0)
    adapter.close(status="finished")
    for acc in (legacy_accumulator(tmp_path / "tb"), multiplexer_accumulator(tmp_path / "tb")):
        assert tensor_points(acc, "x") == [(0, 10.0), (1, 11.0)]
        assert len(acc.Tensors(RUN_TEXT_TAG)) == 1
        assert len(acc.Tensors("_hparams_/session_start_info")) == 1


def test_a_running_reader_drops_the_old_steps(tmp_path: Path) -> None:
    """A multiplexer reader that loaded steps 0..9 before the resume drops 6..9 on reload (SessionLog START)."""
    run = RunInfo(project="proj")
    first = TensorBoardAdapter()
    first.open(run=run)
    _write_steps(first, range(10), base=0.0)
    live = multiplexer_accumulator(_folder(first))
    assert [step for step, _ in tensor_points(live, "x")] == list(range(10))
    resumed = TensorBoardAdapter()
    resumed.resume(after_step=5, identity=first.identity)
    resumed.open(run=run)
    _write_steps(resumed, range(6, 8), base=100.0)
    resumed.close(status="finished")
    live.Reload()
    assert tensor_points(live, "x") == [(s, float(s)) for s in range(6)] + [(6, 106.0), (7, 107.0)]


def test_resume_hides_another_writers_later_steps(tmp_path: Path) -> None:
    """Event files metricbus did not write are left as they are; their steps after after_step are purged by START."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    foreign = EventFileWriter(str(tmp_path / "tb"))
    for step in range(6):
        value = summary_pb2.Summary.Value(tag="other", simple_value=float(step))
        foreign.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=[value])))
    foreign.close()
    (path,) = (tmp_path / "tb").iterdir()
    before = path.read_bytes()
    adapter = TensorBoardAdapter(log_dir=tmp_path / "tb")
    adapter.resume(after_step=2)
    adapter.open(run=_run())
    adapter.close(status="finished")
    assert path.read_bytes() == before
    legacy = legacy_accumulator(tmp_path / "tb").Scalars("other")
    assert [(event.step, event.value) for event in legacy] == [(0, 0.0), (1, 1.0), (2, 2.0)]
    assert [step for step, _ in tensor_points(multiplexer_accumulator(tmp_path / "tb"), "other")] == [0, 1, 2]


def test_resume_cuts_a_torn_last_record(tmp_path: Path) -> None:
    """Half a record at the end of an event file (the writer died mid-write) is cut at resume; all else stays."""
    adapter = TensorBoardAdapter(log_dir=tmp_path / "tb")
    adapter.open(run=_run())
    _write_steps(adapter, range(3), base=0.0)
    adapter.close(status="finished")
    (path,) = (tmp_path / "tb").iterdir()
    size = path.stat().st_size
    with path.open("ab") as handle:
        handle.write(struct.pack("<Q", 100) + b"\x00\x01")
    resumed = TensorBoardAdapter(log_dir=tmp_path / "tb")
    resumed.resume(after_step=2)
    resumed.open(run=_run())
    _write_steps(resumed, range(3, 5), base=0.0)
    resumed.close(status="finished")
    assert path.stat().st_size == size
    assert read_tensors(tmp_path / "tb", "x") == [(s, float(s)) for s in range(5)]


@pytest.mark.parametrize("log_dir", [5, "", b"runs", ["runs"]])
def test_invalid_log_dir_is_a_config_error(log_dir: Any) -> None:
    """log_dir must be None or a non-empty str/PathLike; the message names the option and what is valid."""
    with pytest.raises(ConfigError, match=r"log_dir=.*non-empty folder path.*None"):
        TensorBoardAdapter(log_dir=log_dir)


def test_missing_tensorboard_fails_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the tensorboard package the constructor raises AdapterNotFoundError with the pip extra."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(AdapterNotFoundError, match=r"pip install 'metricbus\[tensorboard\]'"):
        TensorBoardAdapter()


def test_unwritable_log_dir_fails_at_open(tmp_path: Path) -> None:
    """A log_dir under a regular file fails in open() with an OSError naming the folder."""
    (tmp_path / "file").write_text("x")
    adapter = TensorBoardAdapter(log_dir=tmp_path / "file" / "tb")
    folder = re.escape(repr(str(tmp_path / "file" / "tb")))
    with pytest.raises(NotADirectoryError, match=rf"cannot write TensorBoard events under {folder}: Not a directory"):
        adapter.open(run=_run())


def test_writing_imports_neither_torch_nor_tensorflow(tmp_path: Path) -> None:
    """Opening, writing, rewinding and closing leave torch and TensorFlow unimported."""
    code = (
        "import sys\n"
        "from metricbus.adapters.tensorboard import TensorBoardAdapter\n"
        "from metricbus.adapter import RunInfo\n"
        "a = TensorBoardAdapter(log_dir='tb')\n"
        "a.open(run=RunInfo(config={'lr': 0.1}))\n"
        "a.write(step=0, metrics={'x': 1.0})\n"
        "a.rewind(step=0)\n"
        "a.close(status='finished')\n"
        "print(sorted(m for m in ('torch', 'tensorflow') if m in sys.modules))\n"
    )
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"


def _get_rows(base: str, tag: str) -> list[list[Any]]:
    query = urllib.parse.urlencode({"run": ".", "tag": tag})
    rows: list[list[Any]] = get_json(f"{base}/data/plugin/scalars/scalars?{query}")
    return rows


def _row_count(base: str, tag: str) -> int:
    try:
        return len(_get_rows(base, tag))
    except urllib.error.HTTPError:  # the tag is not loaded yet
        return 0


def _decode(value: float | str) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[value] if isinstance(value, str) else value


@pytest.mark.slow
def test_tensorboard_server_serves_exact_values_and_hparams(tmp_path: Path) -> None:
    """``tensorboard --load_fast=false`` serves every point as float64 (NaN/±inf as strings) and the hparams."""
    series = _points(steps=300)
    log_dir = tmp_path / "tb"
    _write_run(log_dir, series)
    adapter = TensorBoardAdapter(log_dir=log_dir)
    adapter.resume(after_step=299)
    adapter.open(run=_run())
    for step, value in enumerate(HOSTILE, start=300):
        adapter.write(step=step, metrics={"hostile": value})
    adapter.close(status="finished")
    exe = shutil.which("tensorboard", path=str(Path(sys.executable).parent))
    assert exe is not None
    port = free_port()
    args = [exe, "--logdir", str(log_dir), "--host", "127.0.0.1", "--port", str(port), "--load_fast", "false"]
    args += ["--samples_per_plugin", "scalars=100000"]
    proc = start_server(args, log=tmp_path / "tensorboard.log")
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/data/runs", proc=proc)
        poll_until(lambda: "." in get_json(f"{base}/data/runs"), what="tensorboard lists the run")
        # The run is listed before it is loaded; the last tag written (in the last file) is complete last.
        poll_until(lambda: _row_count(base, "hostile") == len(HOSTILE), what="tensorboard loads the run")
        for key, values in series.items():
            rows = _get_rows(base, key)
            assert [int(step) for _, step, _ in rows] == list(range(len(values)))
            assert [value for _, _, value in rows] == values.tolist()
        rows = _get_rows(base, "hostile")
        assert [int(step) for _, step, _ in rows] == list(range(300, 300 + len(HOSTILE)))
        got = [_decode(value) for _, _, value in rows]
        finite = [(g, h) for g, h in zip(got, HOSTILE, strict=True) if math.isfinite(h)]
        assert [_bits(g) for g, _ in finite] == [_bits(h) for _, h in finite]  # -0.0 and subnormals included
        assert [str(g) for g in got if not math.isfinite(g)] == ["nan", "inf", "-inf", "nan", "nan"]
        request = urllib.request.Request(
            f"{base}/data/plugin/hparams/experiment",
            data=json.dumps({"experimentName": ""}).encode(),
            headers={"Content-Type": "application/json", "X-Requested-With": "XMLHttpRequest"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            experiment = json.loads(response.read())
        names = {info["name"]: info["type"] for info in experiment["hparamInfos"]}
        assert names == {
            "lr": "DATA_TYPE_FLOAT64",
            "opt.beta": "DATA_TYPE_FLOAT64",
            "opt.steps": "DATA_TYPE_FLOAT64",
            "opt.name": "DATA_TYPE_STRING",
            "opt.nesterov": "DATA_TYPE_BOOL",
            "layers": "DATA_TYPE_STRING",
        }
    finally:
        stop_server(proc)
