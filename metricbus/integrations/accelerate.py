"""Accelerate: a ``GeneralTracker`` named ``"metricbus"`` that delivers ``Accelerator.log`` through a bus.

Importing this module imports ``accelerate`` and registers the tracker with ``register_tracker_class`` (Accelerate
1.x releases that have it, 1.15 does), so ``Accelerator(log_with="metricbus")`` works; with an older Accelerate
pass an instance: ``Accelerator(log_with=[MetricBusTracker("proj")])`` (works in every version).

Delivery only: ``Accelerator.log`` runs on the main process with values already reduced by your code, so the bus
is built with ``dist=None`` (never a collective) and each ``log(values, step)`` is committed at ``step`` as given.
For exact reductions across micro-batches and ranks, log raw records to a ``MetricBus(dist="auto")`` yourself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from accelerate.tracking import GeneralTracker

from metricbus.bus import MetricBus, as_step
from metricbus.config import load_source, require_source
from metricbus.errors import MetricBusError, MetricTypeError, MetricValueError, SpecError, StepError

NAME = "metricbus"
_log = logging.getLogger("metricbus.accelerate")


class MetricBusTracker(GeneralTracker):  # type: ignore[misc]  # accelerate is untyped for mypy here
    """``log_with="metricbus"``: ``init_trackers(project, config=...)`` opens a bus whose run is ``project`` with
    ``config`` as hyperparameters; ``log(values, step)`` logs and commits at ``step``; ``end_training()`` closes it.

    The bus: ``bus=`` (one you built, ``dist=None``), else ``config_source`` (a path or mapping; with
    ``log_with="metricbus"`` pass it as ``init_kwargs={"metricbus": {"config_source": ...}}``), else
    ``$METRICBUS_CONFIG`` / ``$METRICBUS_ADAPTERS`` (none of them: ConfigError, never a bus that delivers nowhere).
    It is opened at ``start()`` and given the run config at ``store_init_configuration`` only if it has not opened
    yet, so a config passed to ``init_trackers`` reaches the backends: the bus is built on the first of
    ``store_init_configuration`` or ``log``.
    """

    name = NAME
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str = "metricbus", *, bus: MetricBus | None = None, config_source: Any = None) -> None:
        super().__init__()
        self.run_name = run_name
        self.config_source = config_source
        self._bus = bus
        self._step_names: set[str] = set()  # names this tracker committed at bus.last_step
        self._reported: set[str] = set()

    @property
    def tracker(self) -> MetricBus | None:
        """The bus (None until the first ``store_init_configuration`` or ``log``)."""
        return self._bus

    def start(self) -> None:
        """Nothing yet: the bus opens with the run config (``store_init_configuration``) or at the first log."""

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Open the bus with ``values`` as the run's hyperparameters (a bus passed in keeps its own run)."""
        if self._bus is None:
            self._bus = self._build(dict(values))

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log ``values`` (numbers; strings are left out) and commit them at ``step`` (None: the next step).

        A name already logged at ``step`` is reported once and left out (it would otherwise join the next step).
        """
        if kwargs:
            self._report("kwargs", f"log() keyword arguments {sorted(kwargs)} have no meaning here and are ignored")
        if step is not None:  # checked before logging: a step the commit refuses would leave the values buffered
            try:
                step = as_step(step)
            except StepError as exc:
                self._report("step-type", f"{len(values)} values at step {step!r} are left out: {exc}; None is the "
                             "next step")  # fmt: skip
                return
        bus = self._bus if self._bus is not None else self._open()
        last = bus.last_step
        if step is not None and last is not None and step < last:  # checked first: nothing stays buffered
            self._report("step", f"{len(values)} values at step {step} are left out: below the last step {last}")
            return
        # A name the bus already holds at this step would make the commit refuse and keep the records buffered
        # for the next commit, at another step: leave it out here instead.
        again = self._step_names if step is not None and step == last else set()
        logged: set[str] = set()
        for key, value in values.items():
            if key in again:
                self._report(f"again:{key}", f"{key!r} was already logged at step {step}; this value is left out")
                continue
            try:
                bus.log(key, value)
            except (MetricTypeError, MetricValueError, SpecError) as exc:  # SpecError: e.g. an output name clash
                self._report(f"value:{key}", f"{key!r} is left out: {exc}")
                continue
            logged.add(key)
        try:
            bus.commit(step=step)
        except MetricBusError as exc:  # e.g. a nan="error" value found at commit: the others are committed
            self._report(f"commit:{type(exc).__name__}", f"commit at step {step}: {exc}")
        self._step_names = again | logged

    def finish(self) -> None:
        """Close the bus: drains every adapter."""
        if self._bus is not None and not self._bus.closed:
            self._bus.close()

    def _open(self) -> MetricBus:
        self._bus = self._build({})
        return self._bus

    def _build(self, hyperparameters: dict[str, Any]) -> MetricBus:
        require_source(self.config_source, how='pass init_kwargs={"metricbus": {"config_source": ...}}')
        given, _ = load_source(self.config_source)
        overrides: dict[str, Any] = {}
        if "run" not in given:
            overrides["run"] = {"project": self.run_name, "config": hyperparameters}
        if "dist" not in given:
            overrides["dist"] = None  # Accelerator.log runs on the main process only
        return MetricBus.from_config(self.config_source, **overrides)

    def _report(self, kind: str, message: str) -> None:
        if kind not in self._reported:
            self._reported.add(kind)
            _log.warning("metricbus Accelerate tracker: %s (reported once)", message)


def register() -> bool:
    """Register :class:`MetricBusTracker` as ``"metricbus"`` with Accelerate; False where Accelerate has no
    ``register_tracker_class`` (pass an instance to ``log_with`` there). Idempotent."""
    from accelerate import tracking

    registrar = getattr(tracking, "register_tracker_class", None)
    if registrar is None:
        return False
    if tracking.LOGGER_TYPE_TO_CLASS.get(NAME) is not MetricBusTracker:
        registrar(MetricBusTracker)
    return True


REGISTERED = register()
"""Whether ``Accelerator(log_with="metricbus")`` resolves to :class:`MetricBusTracker` in this Accelerate."""
