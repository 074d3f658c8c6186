"""The adapter protocol: what a backend (console, TensorBoard, MLflow, wandb, ...) implements.

Four verbs, explicit keywords, no ``**kwargs``:

* ``open(run=RunInfo)``: start the backend run (project, name, tags, config). ``run.id`` names the run: it is the
  same for every process that writes this run (a trainer restarted with ``resume=True`` on the same journal, and
  ``metricbus sync``), so an adapter opens the *same* backend run for the same id (wandb ``id=run.id``, MLflow the
  run tagged ``metricbus.run_id``, TensorBoard the folder ``runs/<project>/<id>/tensorboard`` by default).
* ``write(step=int, metrics={name: float})``: one emitted step. Steps never decrease; a step may come more than once
  (training, then evaluation, at one step) with disjoint metric names.
* ``flush()``: push buffered data to durable storage.
* ``close(status="finished" | "failed")``: end the run with that status.

The bus calls these with keyword arguments. An adapter raising is reported (or re-raised on a strict bus);
it never reaches the training loop otherwise. A ``write()`` whose backend refuses some metric names (reserved,
colliding) writes the step's other metrics, then raises :class:`~metricbus.errors.RejectedMetricsError` naming the
refused ones: the step counts as delivered, and each refused name is reported once.
A step counts as delivered once ``flush()`` returned after its
``write()``, so ``flush()`` must make what was written durable.

Optional, looked up with ``getattr``:

* ``resume(after_step=int | None, identity=Mapping[str, str] | None)``, called before ``open()`` when the journal
  has a delivery cursor for the adapter (and by ``metricbus sync``): the backend acknowledged the steps up to
  ``after_step``; drop anything written after it, because those steps are about to be sent again (the jsonl
  adapter cuts its file there). ``identity`` is what the adapter's ``identity`` said after its last open (the
  MLflow run id, ...); an adapter whose ``resume`` has no ``identity`` parameter is called without it.
* ``identity``: after ``open()``, a ``Mapping[str, str]`` naming the backend run (MLflow ``run_id``, wandb
  ``run_id``, TensorBoard ``log_dir``); kept in the adapter's cursor record and handed back to ``resume``.
* ``rewind(step=int)``, called between writes: a resumed run went back to ``step`` (a checkpoint), so every step
  ``>= step`` is about to be sent again with new values; hide or drop what the backend holds there (TensorBoard
  purges those events, jsonl cuts its file) or do nothing where the backend cannot (MLflow keeps both values).
* ``permanent_errors``: a tuple of exception types that mean "the backend rejects this step's data for good"
  (the step is skipped and recorded as a gap instead of retried).
* ``durable_step``: after ``flush()``, the last written step that is durable, when that can be less than the last
  one written (wandb keeps the last step's row open until a later step arrives); the cursor advances only to it.
  Everything written counts as durable once ``close()`` returned.
* ``cursor_key``: a string naming the backend target, when two adapter objects must share one delivery cursor.
* ``new_run(live=Sequence[Mapping[str, str]])``, called before ``open()`` by a replay, which opens a run of its own
  and must never write into the live run: open a new backend run of ``run.id`` even where the environment names an
  existing one (MLflow ``MLFLOW_RUN_ID``, wandb ``WANDB_RUN_ID``), and raise
  :class:`~metricbus.errors.ConfigError` where an option makes that impossible: ``attach=True``, or a target that
  ``live`` names (what the ``identity`` of the live run's adapters of this name said: its jsonl file, its
  TensorBoard folder).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Protocol, runtime_checkable

from metricbus.errors import ConfigError

Status = Literal["finished", "failed"]


def _frozen_mapping(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(value or {}))


def is_live_target(target: str | os.PathLike[str], *, live: Sequence[Mapping[str, str]], key: str) -> bool:
    """For an adapter's ``new_run``: True if ``target`` (a file or folder) is the one ``key`` names in one of the live
    run's identities ``live`` (the same file after symlinks)."""
    mine = os.path.realpath(target)
    return any(os.path.realpath(known[key]) == mine for known in live if known.get(key))


def run_folder(run: RunInfo) -> str:
    """``runs/<project>/<run id>``, the per-run folder of the jsonl and TensorBoard adapters (relative to the working
    directory). A project or id that would put it elsewhere (an absolute path, a ``..`` segment) is a
    :class:`~metricbus.errors.ConfigError` naming it: the adapter would write outside ``runs/``, or into another
    run's folder."""
    for what, value in (("project", run.project), ("id", run.id)):
        segments = value.replace(os.sep, "/").split("/")
        if os.path.isabs(value) or ".." in segments or "\0" in value:
            raise ConfigError(
                f"run {what} {value!r} cannot name the per-run folder runs/<project>/<run id>: it is an absolute path "
                f"or holds a '..' segment (or a NUL); give a {what} without them, or the adapter's own path "
                "(jsonl:PATH, tensorboard:DIR)"
            )
    return os.path.join("runs", run.project, run.id)


def append_whole(fd: int, data: bytes, *, start: int, nothing: Callable[[], OSError]) -> int:
    """Append ``data`` to the unbuffered file ``fd``, whose end is ``start``, whole before returning (the file end
    after it): where a write fails (a full disk), what part of ``data`` reached the file is cut again, the offset put
    back to ``start``, before the error is raised, so the retry's record follows a whole one (a torn record would
    stop the backend's readers, or be read twice). ``nothing()``: the error of a write that took no byte."""
    view = memoryview(data)
    try:
        while view:
            count = os.write(fd, view)
            if count <= 0:
                raise nothing()
            view = view[count:]
    except BaseException:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
            os.lseek(fd, start, os.SEEK_SET)
        raise
    return start + len(data)


def new_run_id(now_ns: int | None = None) -> str:
    """A fresh run id: UTC start time and 6 random hex digits, ``20261203-145959-a1b2c3`` (sorts by start time).

    Only letters, digits and ``-``: valid as a wandb run id, an MLflow tag value and a folder name.
    """
    seconds = (time.time_ns() if now_ns is None else now_ns) // 1_000_000_000
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(seconds)) + "-" + secrets.token_hex(3)


@dataclass(frozen=True, slots=True)
class RunInfo:
    """Metadata of one run, handed to every adapter's ``open``.

    ``id`` is the run's identity across processes: a bus resumed on the same journal, and ``metricbus sync``, see
    the id the journal header keeps, so every adapter writes into the same backend run. ``config`` holds the
    hyperparameters (MLflow params, wandb config, the TensorBoard hparams plugin).
    """

    project: str = "metricbus"
    name: str | None = None
    tags: tuple[str, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)
    start_time_unix_ns: int = field(default_factory=time.time_ns)
    id: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tags", tuple(self.tags))
        object.__setattr__(self, "config", _frozen_mapping(self.config))
        if not self.id:
            object.__setattr__(self, "id", new_run_id(self.start_time_unix_ns))


@runtime_checkable
class Adapter(Protocol):
    """What every backend adapter implements."""

    name: str

    def open(self, *, run: RunInfo) -> None:
        """Start the backend run."""

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Record the emitted metrics of one step (shared by every adapter, read-only: ``dict(metrics)`` to change
        a copy)."""

    def flush(self) -> None:
        """Push buffered data out."""

    def close(self, *, status: Status) -> None:
        """End the run with ``status``."""
