"""Metric-name mapping: what each backend accepts, decided once per name and cached.

A :class:`NameMapper` turns a metricbus name into a backend name. Two different metricbus names that map to the
same backend name would silently merge two series, so the mapper raises
:class:`~metricbus.errors.MetricValueError` naming both the first time the second one is seen.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from typing import TypeVar

from metricbus.errors import MetricValueError, RejectedMetricsError

V = TypeVar("V")

MLFLOW_MAX_KEY_CHARS = 250
_MLFLOW_BAD_CHARS = re.compile(r"[^A-Za-z0-9_\-. :/]")


def mlflow_key(name: str) -> str:
    """Map ``name`` to a metric, param or tag key that MLflow accepts.

    MLflow (``mlflow.utils.validation``) takes letters, digits and ``_ - . space : /`` and refuses a key that
    ``posixpath.normpath`` changes or that normalizes to ``.`` or to something starting with ``..`` or ``/``. So:
    other characters become ``_``; empty path segments (``a//b``, a leading or trailing ``/``) are dropped; the
    key is cut to 250 characters (without leaving a trailing ``/``); then every segment made only of dots
    (``.``, ``..``, ``...``) becomes as many ``_``, and so do the leading dots of a key starting with ``..``
    (``..x`` -> ``__x``). The empty name becomes ``_``.
    """
    text = _MLFLOW_BAD_CHARS.sub("_", name)
    key = "/".join(seg for seg in text.split("/") if seg)[:MLFLOW_MAX_KEY_CHARS].rstrip("/")
    segments = ["_" * len(seg) if not seg.strip(".") else seg for seg in key.split("/")]
    first = segments[0]
    if first.startswith(".."):
        dots = len(first) - len(first.lstrip("."))
        segments[0] = "_" * dots + first[dots:]
    return "/".join(segments) or "_"


def passthrough(name: str) -> str:
    """Keep the name unchanged (TensorBoard and wandb accept any non-empty string)."""
    return name or "_"


class NameMapper:
    """Caches ``name -> backend name``; refuses two names that land on one backend name, and the names the backend
    keeps for itself (``reserved``: backend name -> what the backend uses it for)."""

    def __init__(
        self, *, backend: str, rule: Callable[[str], str], reserved: Mapping[str, str] | None = None
    ) -> None:
        self._backend = backend
        self._rule = rule
        self._reserved = dict(reserved or {})
        self._forward: dict[tuple[str, str | None], str] = {}
        # backend name -> the source that owns it, or the digest (:func:`source_digest`) of one an earlier process
        # recorded (:meth:`own`) whose name was too long to keep
        self._owner: dict[str, tuple[str, str | None] | str] = {}

    def own(self, mapped: str, source: tuple[str, str | None] | str) -> None:
        """Record that ``source`` (``(name, part_of)``, or its :func:`source_digest`) owns ``mapped`` already: an
        earlier process wrote it into the run, so another name that maps to ``mapped`` is a collision even when it
        comes first in this process."""
        self._owner[mapped] = source

    def __call__(self, name: str, *, part_of: str | None = None) -> str:
        """The backend name for ``name``; raises MetricValueError on a collision or a reserved name.

        ``part_of``: ``name`` is not a metric of its own but a part the adapter writes for metric ``part_of``
        (MLflow's ``x/p50`` of a histogram ``x``), so a metric really named ``name`` is a collision, not the same
        series.
        """
        source = (name, part_of)
        mapped = self._forward.get(source)
        if mapped is not None:
            return mapped
        mapped = self._rule(name)
        use = self._reserved.get(mapped)
        if use is not None:
            raise MetricValueError(
                f"metric name {_describe(source)} maps to {self._backend} name {mapped!r}, which {self._backend} "
                f"keeps for {use}; rename the metric (reserved: {', '.join(map(repr, self._reserved))})"
            )
        owner = self._owner.get(mapped)
        if isinstance(owner, str) and owner == source_digest(source):
            owner = source  # the long name an earlier process recorded by its digest
        if owner is not None and owner != source:
            raise MetricValueError(
                f"metric names {_describe(owner)} and {_describe(source)} both map to {self._backend} name "
                f"{mapped!r}; rename one of them so the two series stay apart"
            )
        self._owner[mapped] = source
        self._forward[source] = mapped
        return mapped


    def split(self, metrics: Mapping[str, V]) -> tuple[dict[str, V], dict[str, str]]:
        """``({backend name: value}, {refused metric: why})`` of one step's ``metrics``: a name this mapper refuses
        (reserved, colliding) leaves the step's other metrics to be written (see :meth:`refused`)."""
        mapped: dict[str, V] = {}
        rejected: dict[str, str] = {}
        for name, value in metrics.items():
            try:
                mapped[self(name)] = value
            except MetricValueError as exc:
                rejected[name] = str(exc)
        return mapped, rejected

    def refused(self, step: int, rejected: Mapping[str, str], *, wrote: int) -> RejectedMetricsError:
        """The error an adapter raises after writing the ``wrote`` other metrics of ``step`` without the
        ``rejected`` ones (:meth:`split`)."""
        names = ", ".join(map(repr, rejected))
        reasons = "; ".join(rejected.values())
        other = f"its other {wrote} metric{'s were' if wrote != 1 else ' was'} written" if wrote else "it had no other"
        return RejectedMetricsError(
            f"{self._backend} refuses metric{'s' if len(rejected) > 1 else ''} {names} at step {step} ({other}): "
            f"{reasons}",
            rejected=dict(rejected),
        )


def source_digest(source: tuple[str, str | None]) -> str:
    """``sha256:<hex>`` of ``(name, part_of)``: what a run records of a source whose name is too long to keep."""
    return "sha256:" + hashlib.sha256(json.dumps(list(source)).encode()).hexdigest()


def _describe(source: tuple[str, str | None] | str) -> str:
    if isinstance(source, str):
        return f"(a name an earlier process wrote, recorded as {source})"
    name, part_of = source
    return repr(name) if part_of is None else f"{name!r} (written for metric {part_of!r})"


def mlflow_mapper() -> NameMapper:
    """A fresh mapper for MLflow keys."""
    return NameMapper(backend="MLflow", rule=mlflow_key)


def passthrough_mapper(*, backend: str, reserved: Mapping[str, str] | None = None) -> NameMapper:
    """A fresh pass-through mapper (TensorBoard, wandb) refusing the backend's ``reserved`` names."""
    return NameMapper(backend=backend, rule=passthrough, reserved=reserved)
