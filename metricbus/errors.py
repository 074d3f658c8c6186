"""The metricbus exception hierarchy.

Every error names the metric (or config location, or adapter) it is about and says what is valid.
"""

from __future__ import annotations


class MetricBusError(Exception):
    """Base class of every error metricbus raises on purpose."""


class MetricValueError(MetricBusError, ValueError):
    """A value or weight that has the right type but is not acceptable (negative weight, NaN under nan='error')."""


class RejectedMetricsError(MetricValueError):
    """An adapter wrote a step's other metrics, but its backend refuses some of its metric names (a name the backend
    keeps for itself, two names landing on one backend name). ``rejected``: each refused metric -> why and what is
    valid; ``metric``: the first of them. The step counts as delivered to that adapter (retrying it would write the
    other metrics twice and refuse the same names again); the delivery reports each refused name once."""

    def __init__(self, message: str, *, rejected: dict[str, str]) -> None:
        super().__init__(message)
        self.rejected: dict[str, str] = dict(rejected)
        self.metric: str | None = next(iter(self.rejected), None)


class MetricTypeError(MetricBusError, TypeError):
    """A value of a type metricbus cannot record (None, str, complex, object, ragged lists)."""


class SpecError(MetricBusError, ValueError):
    """An aggregation spec that is malformed, names an unknown kind, or conflicts with the spec already fixed."""


class StepError(MetricBusError, ValueError):
    """A commit step that is not an int greater than the previous one."""


class ClosedError(MetricBusError, RuntimeError):
    """The bus was used after close()."""


class ConfigError(MetricBusError, ValueError):
    """A configuration entry that is unknown or invalid; the message names where it is."""


class AdapterError(MetricBusError, RuntimeError):
    """A backend adapter failed; raised only by strict buses (others report through logging)."""


class AdapterNotFoundError(MetricBusError, LookupError):
    """No adapter is registered under the requested name, or its backend is not installed."""


class DistributedError(MetricBusError, RuntimeError):
    """Ranks disagree (different specs for one name) or the process group cannot be used.

    ``refused``: where every rank refused a commit because of some metrics (their specs disagree), those metrics and
    why; the commit's other records stay buffered.
    """

    def __init__(self, message: str, *, refused: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.refused: dict[str, str] = dict(refused or {})


class JournalError(MetricBusError, ValueError):
    """A journal file that is missing, foreign, or from a newer format."""


class MetricBusWarning(UserWarning):
    """Something was not done as asked but nothing already committed is lost (e.g. records left uncommitted at exit)."""


class JournalWarning(UserWarning):
    """A journal file has a torn or damaged record; it was skipped."""
