"""The TensorBoard adapter: plain scalar events, written without torch or TensorFlow.

Scalars go through ``tensorboard.summary.writer.event_file_writer.EventFileWriter`` as
``Summary.Value(tag=..., simple_value=...)``, so ``EventAccumulator.Scalars()`` and the scalars dashboard see them
(TensorBoard stores them as float32). Run metadata (project, name, tags, config) is written once at open as a
text summary with tag ``metricbus/run``, shown in the Text dashboard.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from metricbus.adapter import RunInfo, Status
from metricbus.errors import AdapterNotFoundError

from ._names import NameMapper, passthrough_mapper

RUN_TEXT_TAG = "metricbus/run"


def _run_markdown(run: RunInfo) -> str:
    meta = {"project": run.project, "name": run.name, "tags": list(run.tags), "config": dict(run.config)}
    return "```json\n" + json.dumps(meta, indent=2, sort_keys=True, default=repr) + "\n```"


class TensorBoardAdapter:
    """Writes one scalar event per metric per step under ``log_dir``."""

    name = "tensorboard"

    def __init__(self, *, log_dir: str | os.PathLike[str] = "runs/metricbus/tensorboard") -> None:
        self._log_dir = os.fspath(log_dir)
        self._names: NameMapper = passthrough_mapper(backend="TensorBoard")
        self._writer: Any = None
        self._event: Any = None
        self._summary: Any = None

    @property
    def log_dir(self) -> str:
        """The folder the event file is written to."""
        return self._log_dir

    def open(self, *, run: RunInfo) -> None:
        """Create the event file and write the run metadata as text."""
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.plugins.text import summary_v2 as text_summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as exc:
            raise AdapterNotFoundError(
                f"the tensorboard adapter needs the tensorboard package: pip install 'metricbus[tensorboard]' ({exc})"
            ) from exc
        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        os.makedirs(self._log_dir, exist_ok=True)
        self._writer = EventFileWriter(self._log_dir)
        text = text_summary.text_pb(RUN_TEXT_TAG, _run_markdown(run))
        self._writer.add_event(self._event(wall_time=time.time(), step=0, summary=text))

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Write one event holding every metric of ``step`` as a simple scalar."""
        if self._writer is None:
            raise RuntimeError("TensorBoardAdapter.write() before open()")
        value = self._summary.Value
        names = self._names
        summary = self._summary(value=[value(tag=names(key), simple_value=val) for key, val in metrics.items()])
        self._writer.add_event(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        """Flush pending events to the event file."""
        if self._writer is not None:
            self._writer.flush()

    def close(self, *, status: Status) -> None:
        """Flush and close the event file (TensorBoard has no run status)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
