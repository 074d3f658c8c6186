"""verl integration: a ``Tracking`` backend, a declared ``reduce_metrics`` and a conversion of verl's ``Metric``.

Nothing here imports verl, numpy or torch at import time; verl's classes are only touched by
:func:`install_tracking_backend` (run by :mod:`metricbus.integrations.verl_plugin` on every ``import verl``).

* :class:`TrackingBackend` is a logger with verl's interface (``log(data, step)``, ``finish()``). Each ``log`` call
  is the records of that step, committed at that step, through a bus built from a ``metricbus`` section of the
  config verl hands to ``Tracking``, else from ``$METRICBUS_CONFIG`` (``$METRICBUS_ADAPTERS`` also works).
* :func:`reduce_metrics` has the signature and in-place behaviour of ``verl.utils.metric.reduce_metrics`` but picks
  each name's kind from declared rules (:data:`VERL_RULES`, first match wins) instead of substrings, so
  ``actor/minibatch_loss`` is a mean, not a min.
* :func:`metric_spec`, :func:`log_metric` and :func:`aggregate_dp` turn verl's ``Metric`` (a value list and an
  ``AggregationType``) into metricbus records and specs.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from metricbus.bus import MetricBus
from metricbus.config import ENV_ADAPTERS, ENV_CONFIG, load_source, plain
from metricbus.errors import ConfigError, MetricBusError, MetricTypeError, MetricValueError, SpecError
from metricbus.spec import Agg, Spec, SpecLike, parse_spec

BACKEND = "metricbus"  # the name in verl's ``trainer.logger``
SECTION = "metricbus"  # the key of the metricbus section in the config verl hands to Tracking
_INSTALLED = "_metricbus_backend_installed"
_TRACKING_PARAMS = ("self", "project_name", "experiment_name", "default_backend", "config")
_log = logging.getLogger("metricbus.verl")

# verl's ppo_loss / value_loss divide by the global batch (dp_size / batch_num_tokens / global_batch_size) and mark
# the loss AggregationType.SUM: its micro-batches add up to R x this rank's share, the mean over ranks is the
# update's loss, and the driver averages the updates (mini-batches).
PRESCALED_LOSS = Agg(micro="sum", update="mean", rank="mean")

VERL_RULES: tuple[tuple[str, SpecLike], ...] = (
    ("actor/pg_loss", PRESCALED_LOSS),
    ("actor/kl_loss", PRESCALED_LOSS),
    ("actor/entropy_loss", PRESCALED_LOSS),
    ("actor/loss", PRESCALED_LOSS),  # engine_workers: sum over micro-batches, all_reduce(AVG) over dp
    ("critic/vf_loss", PRESCALED_LOSS),
    ("critic/loss", PRESCALED_LOSS),
    # Statistics named by their kind: a last path segment max/min (response_length/max, moe/min_vio/max), a
    # segment starting max_/min_ (perf/max_memory_allocated_gb, max_reward) or a name ending _max/_min.
    ("*/max", "max"),
    ("*/min", "min"),
    ("*/max_*", "max"),
    ("*/min_*", "min"),
    ("max_*", "max"),
    ("min_*", "min"),
    ("*_max", "max"),
    ("*_min", "min"),
    # Local means, stated for the record (mean is also the default): clip fractions and ratios.
    ("*clipfrac*", "mean"),
    ("*clip_ratio*", "mean"),
)
"""The default rules for verl's metric names, in order (first match wins); anything else is a mean."""

# verl's AggregationType value -> spec. A Metric holds one worker's micro-batch values of one update.
_AGGREGATION_SPECS: Mapping[str, SpecLike] = {"mean": "mean", "sum": PRESCALED_LOSS, "min": "min", "max": "max"}


class VerlIntegrationError(MetricBusError, RuntimeError):
    """verl's Tracking does not have the shape this integration was written for (verl 0.9.x)."""


# -- Metric / AggregationType -----------------------------------------------------------------------------------


def metric_spec(aggregation: Any) -> SpecLike:
    """The metricbus spec of a verl ``AggregationType`` (or its value ``"mean"``, ``"sum"``, ``"min"``, ``"max"``).

    ``SUM`` is verl's mark of a loss pre-scaled by the global batch: :data:`PRESCALED_LOSS`.
    """
    key = getattr(aggregation, "value", aggregation)
    spec = _AGGREGATION_SPECS.get(key) if isinstance(key, str) else None
    if spec is None:
        raise SpecError(f"unknown verl aggregation {aggregation!r}; use one of {', '.join(_AGGREGATION_SPECS)}")
    return spec


def log_metric(bus: MetricBus, name: str, metric: Any) -> None:
    """Log a verl ``Metric``'s values on ``bus`` as records of ``name`` with the spec of its aggregation."""
    bus.log(name, list(metric.values), agg=metric_spec(metric.aggregation))


def aggregate_dp(metric_lists: Sequence[Any]) -> float:
    """Drop-in for ``Metric.aggregate_dp``: one verl ``Metric`` per data-parallel rank, reduced exactly.

    Each rank is a worker (its values one update); ranks may hold different micro-batch counts, where verl raises.
    With equal counts the result is verl's.
    """
    if not metric_lists:
        raise ValueError("Cannot aggregate an empty list of metrics.")
    kinds = {getattr(m.aggregation, "value", m.aggregation) for m in metric_lists}
    if len(kinds) > 1:
        raise SpecError(f"aggregate_dp() got metrics with different aggregations {sorted(map(str, kinds))}")
    parts = []
    for metric in metric_lists:
        with MetricBus(dist=None) as worker:
            log_metric(worker, "metric", metric)
            parts.append(worker.export())
    with MetricBus(dist=None) as driver:
        driver.ingest(parts)
        return driver.commit(step=0).get("metric", math.nan)


# -- reduce_metrics ---------------------------------------------------------------------------------------------


def _checked(rules: Mapping[str, SpecLike] | Iterable[tuple[str, SpecLike]]) -> dict[str, Spec]:
    """The rules parsed, each one value per name (a list spec would rename the key: refused)."""
    items = rules.items() if isinstance(rules, Mapping) else rules
    checked: dict[str, Spec] = {}
    for pattern, spec in items:
        parsed = parse_spec(spec, metric=pattern)
        if len(parsed.chains) != 1 or parsed.chains[0].suffix:
            raise SpecError(
                f"rule {pattern!r}: reduce_metrics() keeps each key and gives it one value; "
                f"use one kind or one Agg, not the list {spec!r}"
            )
        checked.setdefault(pattern, parsed)
    return checked


@functools.cache
def _default_rules() -> dict[str, Spec]:
    return _checked(VERL_RULES)


def _updates(value: Any) -> Sequence[Any]:
    """A plain value's elements, one per optimizer update: a list, tuple, 1-d array or tensor; a scalar is one."""
    if isinstance(value, (list, tuple)):
        return value
    return list(value) if getattr(value, "ndim", 0) else [value]


def reduce_metrics(
    metrics: dict[str, Any], *, rules: Mapping[str, SpecLike] | Iterable[tuple[str, SpecLike]] | None = None
) -> dict[str, Any]:
    """Reduce each value of ``metrics`` in place to one float, by declared rules; returns ``metrics``.

    A plain list holds one value per optimizer update (verl's driver gets one per mini-batch), so its elements are
    the updates of one worker and the rule's update-level kind reduces them. A verl ``Metric`` holds one worker's
    micro-batch values of one update and is reduced with the spec of its own aggregation (:func:`metric_spec`).
    ``rules`` (``{pattern: spec}`` or pairs; each one kind or one ``Agg``) replaces :data:`VERL_RULES`; to add to
    them, pass ``[(pattern, spec), *VERL_RULES]``. A key with no values becomes NaN (verl: NaN for a mean, an error
    for max/min). A value metricbus cannot record raises MetricTypeError and leaves ``metrics`` unchanged.
    """
    checked = _default_rules() if rules is None else _checked(rules)
    columns: dict[str, Sequence[Any]] = {}
    with MetricBus(rules=checked, dist=None) as bus:
        for name, value in metrics.items():
            if hasattr(value, "aggregation") and hasattr(value, "values"):
                log_metric(bus, name, value)  # micro-batches of the first update
            else:
                columns[name] = _updates(value)
        for i in range(max(map(len, columns.values()), default=0)):
            for name, column in columns.items():
                if i < len(column):
                    bus.log(name, column[i])
            bus.end_update()
        reduced = bus.commit(step=0)
    for name in metrics:
        metrics[name] = reduced.get(name, math.nan)
    return metrics


# -- the Tracking backend ---------------------------------------------------------------------------------------


def _section(config: Any) -> Any:
    """The ``metricbus`` section of verl's config (a dict or an OmegaConf DictConfig), or None."""
    getter = getattr(config, "get", None)
    return getter(SECTION) if callable(getter) else None


def _plain(config: Any) -> dict[str, Any]:
    """verl's config as a dict of plain values, without the metricbus section (the run's hyperparameters)."""
    config = plain(config)
    if not isinstance(config, Mapping):
        return {}
    return {str(key): value for key, value in config.items() if key != SECTION}


class TrackingBackend:
    """A verl ``Tracking`` logger that routes ``log(data, step)`` through a metricbus bus.

    Each ``log`` call logs every value (an array: each element one record) and commits at ``step``. Several calls
    at one step are fine when their names differ; a name logged twice at one step, a step below the last one, and
    a value metricbus cannot record are reported once each on the ``metricbus.verl`` logger and left out.
    """

    def __init__(self, bus: MetricBus) -> None:
        self.bus = bus
        self._step_names: set[str] = set()  # names committed at bus.last_step
        self._reported: set[tuple[str, str]] = set()

    @classmethod
    def from_verl(cls, project_name: str, experiment_name: str, config: Any = None) -> TrackingBackend:
        """Build the bus from ``config['metricbus']``, else ``$METRICBUS_CONFIG``; :data:`VERL_RULES` follow its
        own rules. Unless the config says otherwise, the run is ``project_name``/``experiment_name`` with verl's
        config as hyperparameters, and ``dist`` is None (only verl's driver logs)."""
        source = _section(config)
        if source is None and not os.environ.get(ENV_CONFIG) and not os.environ.get(ENV_ADAPTERS):
            raise ConfigError(
                f"trainer.logger names {BACKEND!r} but no metricbus config was found: set {ENV_CONFIG} to a config "
                f"file (an absolute path: verl logs from a Ray actor), {ENV_ADAPTERS} (e.g. 'jsonl,tensorboard'), "
                f"or add a {SECTION!r} section to the trainer config"
            )
        given, _ = load_source(source)
        overrides: dict[str, Any] = {}
        if "run" not in given:
            overrides["run"] = {"project": project_name, "name": experiment_name, "config": _plain(config)}
        if "dist" not in given:
            overrides["dist"] = None
        bus = MetricBus.from_config(source, **overrides)
        for pattern, spec in VERL_RULES:
            bus.define(pattern, spec)
        return cls(bus)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        """Log ``data`` as the records of ``step`` and commit them at ``step``."""
        step = operator.index(step)
        bus = self.bus
        last = bus.last_step
        if bus.closed or (last is not None and step < last):
            why = "the backend was finished" if bus.closed else f"step {step} is below the last step {last}"
            self._report("*", why, f"{len(data)} metrics at step {step} were not logged: {why}")
            return
        again = self._step_names if step == last else set()
        logged: set[str] = set()
        for name, value in data.items():
            if name in again:
                self._report(name, "again", f"{name!r} was already logged at step {step}; this value is left out")
                continue
            try:
                bus.log(name, value)
            except (MetricTypeError, MetricValueError, SpecError) as exc:  # SpecError: e.g. an output name clash
                self._report(name, "value", f"{name!r} at step {step} is left out: {exc}")
                continue
            logged.add(name)
        try:
            bus.commit(step=step)
        except MetricValueError as exc:  # a nan="error" record found at commit; the other metrics were committed
            self._report("*", "commit", f"step {step}: {exc}")
        self._step_names = again | logged

    def finish(self, exit_code: int = 0) -> None:
        """Close the bus (drains the adapters); a nonzero ``exit_code`` closes the run as failed."""
        self.bus.close(status="failed" if exit_code else "finished")

    def _report(self, name: str, kind: str, message: str) -> None:
        if (name, kind) not in self._reported:
            self._reported.add((name, kind))
            _log.warning("metricbus verl backend: %s (reported once)", message)


# -- installing into verl's Tracking ----------------------------------------------------------------------------


def _check_shape(tracking: Any) -> None:
    """Raise VerlIntegrationError unless ``tracking`` looks like verl 0.9's ``Tracking``."""
    problems = []
    if not isinstance(getattr(tracking, "supported_backend", None), list):
        problems.append("no supported_backend list")
    try:
        params = tuple(inspect.signature(tracking.__init__).parameters)
    except (TypeError, ValueError):
        params = ()
    if params != _TRACKING_PARAMS:
        problems.append(f"__init__{params} instead of {_TRACKING_PARAMS}")
    for verb in ("log", "finish"):
        if not callable(getattr(tracking, verb, None)):
            problems.append(f"no {verb}()")
    if problems:
        raise VerlIntegrationError(
            f"verl.utils.tracking.Tracking has {'; '.join(problems)}: this metricbus supports verl 0.9.x"
        )


def install_tracking_backend(tracking: Any = None) -> None:
    """Teach verl's ``Tracking`` (default: ``verl.utils.tracking.Tracking``) the ``"metricbus"`` backend.

    Adds the name to ``supported_backend``; ``Tracking(..., default_backend=[..., "metricbus"], config=cfg)`` then
    also builds :meth:`TrackingBackend.from_verl` into ``tracking.logger["metricbus"]``, and ``finish()`` closes it.
    Idempotent. Raises VerlIntegrationError when ``Tracking`` is not shaped like verl 0.9's.
    """
    if tracking is None:
        from verl.utils import tracking as module

        tracking = module.Tracking
    if vars(tracking).get(_INSTALLED):
        return
    _check_shape(tracking)
    original_init = tracking.__init__
    original_finish = tracking.finish
    finish_takes_code = "exit_code" in inspect.signature(original_finish).parameters

    @functools.wraps(original_init)
    def __init__(  # noqa: N807 - replaces Tracking.__init__
        self: Any, project_name: Any, experiment_name: Any, default_backend: Any = "console", config: Any = None
    ) -> None:
        original_init(self, project_name, experiment_name, default_backend, config)
        names = [default_backend] if isinstance(default_backend, str) else list(default_backend)
        if BACKEND in names:
            self.logger[BACKEND] = TrackingBackend.from_verl(project_name, experiment_name, config)

    @functools.wraps(original_finish)
    def finish(self: Any, exit_code: int = 0) -> None:
        try:
            if finish_takes_code:
                original_finish(self, exit_code=exit_code)
            else:
                original_finish(self)
        finally:
            backend = getattr(self, "logger", {}).get(BACKEND)
            if backend is not None:
                backend.finish(exit_code=exit_code)

    tracking.supported_backend = [*tracking.supported_backend, BACKEND]
    tracking.__init__ = __init__
    tracking.finish = finish
    setattr(tracking, _INSTALLED, True)
