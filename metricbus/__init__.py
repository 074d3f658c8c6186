"""metricbus: exact, declared hierarchical metric reduction (micro-batch -> rank -> step) for ML trainers.

Importing this package has no side effects: no threads, files or network until a bus is built.
"""

from metricbus._version import __version__
from metricbus.adapter import Adapter, RunInfo
from metricbus.bus import MetricBus
from metricbus.errors import (
    AdapterError,
    AdapterNotFoundError,
    ClosedError,
    ConfigError,
    DistributedError,
    JournalError,
    JournalWarning,
    MetricBusError,
    MetricBusWarning,
    MetricTypeError,
    MetricValueError,
    RejectedMetricsError,
    SpecError,
    StepError,
)
from metricbus.histogram import Histogram
from metricbus.kinds import quantile
from metricbus.partial import Partial
from metricbus.sketch import Sketch
from metricbus.spec import Agg
from metricbus.summary import Summary

__all__ = [
    "Adapter",
    "AdapterError",
    "AdapterNotFoundError",
    "Agg",
    "ClosedError",
    "ConfigError",
    "DistributedError",
    "Histogram",
    "JournalError",
    "JournalWarning",
    "MetricBus",
    "MetricBusError",
    "MetricBusWarning",
    "MetricTypeError",
    "MetricValueError",
    "Partial",
    "RejectedMetricsError",
    "RunInfo",
    "Sketch",
    "SpecError",
    "StepError",
    "Summary",
    "__version__",
    "quantile",
]
