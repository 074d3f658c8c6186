"""The TensorBoard adapter, read back with TensorBoard's own EventAccumulator and its HTTP server."""

from __future__ import annotations

import shutil
import sys
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from backend_env import free_port, get_json, isolate_env, poll_until, start_server, stop_server, wait_http
from metricbus.adapters.tensorboard import RUN_TEXT_TAG, TensorBoardAdapter

from metricbus.adapter import RunInfo
from metricbus.registry import make_adapter


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path."""
    return isolate_env(monkeypatch, tmp_path)


def _points(*, steps: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "train/loss": rng.normal(size=steps),
        "train/acc": rng.uniform(size=steps),
        "lr": np.geomspace(1, 1e-6, steps),
    }


def _write_run(log_dir: Path, series: dict[str, np.ndarray], *, step_offset: int = 0) -> None:
    adapter = TensorBoardAdapter(log_dir=log_dir)
    adapter.open(run=RunInfo(project="p", name="tb", tags=("a",), config={"lr": 0.1, "opt": {"beta": 0.9}}))
    steps = len(next(iter(series.values())))
    for i in range(steps):
        adapter.write(step=i + step_offset, metrics={key: float(values[i]) for key, values in series.items()})
    adapter.flush()
    adapter.close(status="finished")


def _accumulator(log_dir: Path) -> object:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_every_point_reads_back_as_float32(tmp_path: Path) -> None:
    """12,000 steps of three scalars (more than the reader's default 10,000) all come back, as float32."""
    series = _points(steps=12_000)
    _write_run(tmp_path / "tb", series, step_offset=5)
    acc = _accumulator(tmp_path / "tb")
    assert sorted(acc.Tags()["scalars"]) == sorted(series)  # type: ignore[attr-defined]
    for key, values in series.items():
        events = acc.Scalars(key)  # type: ignore[attr-defined]
        assert [e.step for e in events] == list(range(5, 5 + len(values)))
        np.testing.assert_array_equal(np.array([e.value for e in events], dtype=np.float32), values.astype(np.float32))


def test_run_metadata_is_written_as_text(tmp_path: Path) -> None:
    """The run's project, name, tags and config land in one text summary."""
    _write_run(tmp_path / "tb", _points(steps=2))
    acc = _accumulator(tmp_path / "tb")
    (event,) = acc.Tensors(RUN_TEXT_TAG)  # type: ignore[attr-defined]
    text = event.tensor_proto.string_val[0].decode()
    for fragment in ('"project": "p"', '"name": "tb"', '"beta": 0.9', '"a"'):
        assert fragment in text


def test_uri_spec_sets_log_dir(tmp_path: Path) -> None:
    """``tensorboard:<dir>`` builds an adapter writing under that folder."""
    adapter = make_adapter(f"tensorboard:{tmp_path / 'exp'}")
    assert isinstance(adapter, TensorBoardAdapter)
    assert adapter.log_dir == str(tmp_path / "exp")


@pytest.mark.slow
def test_tensorboard_server_serves_the_scalars(tmp_path: Path) -> None:
    """A real ``tensorboard`` process serves every written point over HTTP."""
    series = _points(steps=300)
    log_dir = tmp_path / "tb"
    _write_run(log_dir, series)
    exe = shutil.which("tensorboard", path=str(Path(sys.executable).parent))
    assert exe is not None
    port = free_port()
    args = [exe, "--logdir", str(log_dir), "--host", "127.0.0.1", "--port", str(port)]
    args += ["--samples_per_plugin", "scalars=100000"]
    proc = start_server(args, log=tmp_path / "tensorboard.log")
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/data/runs", proc=proc)
        poll_until(lambda: "." in get_json(f"{base}/data/runs"), what="tensorboard lists the run")
        for key, values in series.items():
            url = f"{base}/data/plugin/scalars/scalars?" + urllib.parse.urlencode({"run": ".", "tag": key})
            rows = get_json(url)
            assert [int(step) for _, step, _ in rows] == list(range(len(values)))
            got = np.array([value for _, _, value in rows], dtype=np.float32)
            np.testing.assert_array_equal(got, values.astype(np.float32))
    finally:
        stop_server(proc)
