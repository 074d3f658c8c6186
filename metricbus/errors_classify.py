"""Is a backend error worth retrying? One small table, used by :mod:`metricbus.delivery` for every adapter call.

``transient``: the same call may succeed later (a connection error, a timeout, HTTP 408/425/429/5xx): delivery
retries the same step with backoff. ``permanent``: the backend rejects this step's data and will reject it every
time (HTTP 4xx, MLflow ``INVALID_PARAMETER_VALUE``, protobuf's ``Value out of range`` for TensorBoard at step
2**63, a ValueError/TypeError from the adapter's own conversion): delivery skips the step for that adapter and
records the gap.

Decided in this order, first match wins:

1. the adapter's own ``permanent_errors`` (a tuple of exception types, a class or instance attribute);
2. an HTTP status carried by the exception (:data:`STATUS_ATTRIBUTES`; MLflow's ``get_http_status_code()`` maps
   its error codes: INVALID_PARAMETER_VALUE -> 400, REQUEST_LIMIT_EXCEEDED -> 429, INTERNAL_ERROR -> 500);
3. the exception's type, in :data:`BY_TYPE` order;
4. anything else is transient (retried, as before errors were classified).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

Kind = Literal["transient", "permanent"]

TRANSIENT_STATUS = frozenset({408, 425, 429})
"""4xx statuses that mean "try again later"; every other 4xx is permanent, every 5xx transient."""

STATUS_ATTRIBUTES: tuple[tuple[str, ...], ...] = (
    ("get_http_status_code",),  # mlflow.exceptions.MlflowException (a method)
    ("status_code",),  # httpx / requests-style errors
    ("response", "status_code"),  # requests.HTTPError
    ("code",),  # urllib.error.HTTPError
)

BY_TYPE: tuple[tuple[type[BaseException], Kind], ...] = (
    (ConnectionError, "transient"),
    (TimeoutError, "transient"),
    (OSError, "transient"),  # the network or the disk; retrying is cheap and a transient fault is likely
    (ValueError, "permanent"),  # the adapter's own conversion, protobuf range checks, name collisions
    (TypeError, "permanent"),
    (OverflowError, "permanent"),
)


def http_status(exc: BaseException) -> int | None:
    """The HTTP status ``exc`` carries (None: none, or not a plausible status)."""
    for path in STATUS_ATTRIBUTES:
        value: object = exc
        for attr in path:
            value = getattr(value, attr, None)
        if callable(value):
            try:
                value = value()
            except Exception:  # a status accessor that fails tells us nothing
                value = None
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
            return value
    return None


def classify(exc: BaseException, *, permanent: tuple[type[BaseException], ...] = ()) -> Kind:
    """``"transient"`` (retry the same step) or ``"permanent"`` (skip it, record the gap) for ``exc``."""
    if permanent and isinstance(exc, permanent):
        return "permanent"
    status = http_status(exc)
    if status is not None:
        return "permanent" if 400 <= status < 500 and status not in TRANSIENT_STATUS else "transient"
    for kind_type, kind in BY_TYPE:
        if isinstance(exc, kind_type):
            return kind
    return "transient"


def permanent_errors_of(adapter: object) -> tuple[type[BaseException], ...]:
    """The adapter's declared ``permanent_errors`` (checked: a tuple of exception types), else ``()``."""
    declared = getattr(adapter, "permanent_errors", ())
    if isinstance(declared, type):
        declared = (declared,)
    if not isinstance(declared, tuple) or not all(isinstance(t, type) and issubclass(t, BaseException)
                                                  for t in declared):
        raise TypeError(f"{type(adapter).__name__}.permanent_errors must be a tuple of exception types, "
                        f"got {declared!r}")
    return declared


def metric_named(exc: BaseException, names: Callable[[], list[str]]) -> str | None:
    """The metric ``exc`` is about: its ``metric`` attribute, else the first name its message quotes."""
    given = getattr(exc, "metric", None)
    if isinstance(given, str):
        return given
    text = str(exc)
    return next((n for n in names() if f"'{n}'" in text or f'"{n}"' in text), None)


def backoff_s(*, tries: int, base_s: float, cap_s: float) -> float:
    """How long to wait before trying a transient failure again after ``tries`` failed tries: ``base_s`` doubling,
    at most ``cap_s`` (live delivery and ``metricbus sync`` alike). Any number of tries: past 1,024 the doubling
    alone is beyond the double range (``2 ** 1024`` made a float raised OverflowError, which ended live delivery's
    worker after ~35 minutes of a backend down at the default 2 s cap): the cap."""
    if tries > 1024:
        return cap_s
    return min(cap_s, base_s * 2.0 ** (tries - 1))  # (a product beyond the double range is inf: the cap)
