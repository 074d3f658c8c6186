"""The adapter protocol: what a backend (console, TensorBoard, MLflow, wandb, ...) implements.

Four verbs, explicit keywords, no ``**kwargs``:

* ``open(run=RunInfo)``: start the backend run (project, name, tags, config).
* ``write(step=int, metrics={name: float})``: one emitted step; steps arrive strictly increasing, once each.
* ``flush()``: push buffered data to durable storage.
* ``close(status="finished" | "failed")``: end the run with that status.

The bus calls these with keyword arguments. An adapter raising is reported (or re-raised on a strict bus);
it never reaches the training loop otherwise. A step counts as delivered once ``flush()`` returned after its
``write()``, so ``flush()`` must make what was written durable.

Optional, looked up with ``getattr``:

* ``resume(after_step=int | None)``, called before ``open()`` when the journal has a delivery cursor for the
  adapter (and by ``metricbus sync``): the backend acknowledged the steps up to ``after_step``; drop anything
  written after it, because those steps are about to be sent again (the jsonl adapter cuts its file there).
* ``permanent_errors``: a tuple of exception types that mean "the backend rejects this step's data for good"
  (the step is skipped and recorded as a gap instead of retried).
* ``cursor_key``: a string naming the backend target, when two adapter objects must share one delivery cursor.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Protocol, runtime_checkable

Status = Literal["finished", "failed"]


def _frozen_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


@dataclass(frozen=True, slots=True)
class RunInfo:
    """Metadata of one run, handed to every adapter's ``open``."""

    project: str = "metricbus"
    name: str | None = None
    tags: tuple[str, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)
    start_time_unix_ns: int = field(default_factory=time.time_ns)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tags", tuple(self.tags))
        object.__setattr__(self, "config", _frozen_mapping(self.config))


@runtime_checkable
class Adapter(Protocol):
    """What every backend adapter implements."""

    name: str

    def open(self, *, run: RunInfo) -> None:
        """Start the backend run."""

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Record the emitted metrics of one step."""

    def flush(self) -> None:
        """Push buffered data out."""

    def close(self, *, status: Status) -> None:
        """End the run with ``status``."""
