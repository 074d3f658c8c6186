"""Read TensorBoard event folders back with TensorBoard's own readers (for the TensorBoard adapter tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def legacy_accumulator(log_dir: str | Path) -> Any:
    """``event_accumulator.EventAccumulator`` (what tbparse and most scripts use), every event kept, loaded."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def multiplexer_accumulator(log_dir: str | Path) -> Any:
    """``plugin_event_accumulator.EventAccumulator`` (what ``tensorboard --load_fast=false`` serves from), loaded."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return acc


def tensor_points(acc: Any, tag: str) -> list[tuple[int, float]]:
    """``[(step, value)]`` of a tag's scalar tensors, each value the float the tensor holds (float64 stays float64)."""
    from tensorboard.util import tensor_util

    return [(event.step, tensor_util.make_ndarray(event.tensor_proto).item()) for event in acc.Tensors(tag)]


def read_tensors(log_dir: str | Path, tag: str) -> list[tuple[int, float]]:
    """``[(step, value)]`` of ``tag`` through the legacy reader's ``Tensors()``."""
    return tensor_points(legacy_accumulator(log_dir), tag)


def histogram_points(acc: Any, tag: str) -> list[tuple[int, list[float], list[float]]]:
    """``[(step, bucket_limit, bucket)]`` of a tag's histograms through the legacy reader's ``Histograms()``."""
    return [
        (event.step, list(event.histogram_value.bucket_limit), list(event.histogram_value.bucket))
        for event in acc.Histograms(tag)
    ]


def histogram_rows(acc: Any, tag: str) -> list[tuple[int, list[list[float]]]]:
    """``[(step, [[left, right, count], ...])]`` of a tag as the histogram plugin gets it from the multiplexer's
    reader (``histo`` values converted to the plugin's float32 tensors)."""
    from tensorboard.util import tensor_util

    return [(event.step, tensor_util.make_ndarray(event.tensor_proto).tolist()) for event in acc.Tensors(tag)]
