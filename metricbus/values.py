"""Turning what a caller logs into flat lists of float records and weights, with clear errors.

Accepted: Python ints, floats and bools; numpy scalars and arrays of real dtype; (possibly nested) lists and
tuples of those; torch tensors of real dtype (recognised without importing torch). Everything else is a
:class:`~metricbus.errors.MetricTypeError` that names the metric.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from metricbus.errors import MetricTypeError, MetricValueError

_REAL_DTYPE_KINDS = frozenset("fiub")


def is_tensor(value: object) -> bool:
    """True for a torch.Tensor, detected without importing torch."""
    cls = type(value)
    return cls.__module__.startswith("torch") and hasattr(value, "detach") and hasattr(value, "dtype")


def _type_error(metric: str, value: object, why: str = "") -> MetricTypeError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return MetricTypeError(
        f"cannot log {shown} ({type(value).__name__}) as {metric!r}{why}; log a real number, a bool, "
        "or a numpy array / torch tensor / list of real numbers"
    )


def _array(metric: str, value: Any) -> np.ndarray[Any, Any]:
    if isinstance(value, np.ndarray):
        array = value
    elif is_tensor(value):
        if value.is_complex():
            raise _type_error(metric, value, " (complex tensor)")
        array = value.detach().to(device="cpu").double().numpy()
    else:
        try:
            array = np.asarray(value)
        except ValueError as exc:  # numpy 2 refuses ragged nesting
            raise _type_error(metric, value, " (ragged nested lists)") from exc
    if array.dtype.kind not in _REAL_DTYPE_KINDS:
        raise _type_error(metric, value, f" (dtype {array.dtype})")
    return array


def to_values(metric: str, value: object) -> list[float]:
    """The records of ``value`` as floats (one per element)."""
    cls = type(value)
    if cls is float:
        return [value]  # type: ignore[list-item]
    if cls is int or cls is bool or (isinstance(value, (float, int)) and not isinstance(value, complex)):
        return [_real(metric, value, "value")]  # (float/int subclasses too)
    if isinstance(value, np.generic):
        if value.dtype.kind not in _REAL_DTYPE_KINDS:
            raise _type_error(metric, value, f" (dtype {value.dtype})")
        return [float(value)]
    if value is None or isinstance(value, (str, bytes, complex, dict, set)):
        raise _type_error(metric, value)
    if isinstance(value, (list, tuple, np.ndarray)) or is_tensor(value):
        array = _array(metric, value)
        return array.astype(np.float64, copy=False).ravel().tolist()
    raise _type_error(metric, value)


def _real(metric: str, value: Any, what: str) -> float:
    """``float(value)``; an int beyond the double range is a MetricValueError naming ``metric``."""
    try:
        return float(value)
    except OverflowError:
        raise MetricValueError(
            f"{what} for {metric!r} is an integer of {int(value).bit_length()} bits, beyond the double range "
            "(|x| <= 1.8e308, 1024 bits): log a float"
        ) from None


def to_weights(metric: str, weight: object, n: int, value: Any) -> list[float] | None:
    """Weights broadcast to ``n`` records, validated (finite, >= 0); None when no weight was given."""
    if weight is None:
        return None
    if isinstance(weight, (int, float, np.generic)) and not isinstance(weight, complex):
        w = _real(metric, weight, "weight")
        _check_weight(metric, w)
        return [w] * n
    try:
        array = _array(metric, weight)
    except MetricTypeError as exc:
        raise MetricValueError(f"weight {weight!r} for {metric!r} is not a real number or array") from exc
    shape = tuple(value.shape) if is_tensor(value) else np.shape(value)
    try:
        flat = np.broadcast_to(array, shape).astype(np.float64).ravel()
    except ValueError as exc:
        raise MetricValueError(
            f"weight of shape {array.shape} for {metric!r} does not broadcast to the value's shape {shape}"
        ) from exc
    if flat.size and (not np.all(np.isfinite(flat)) or np.any(flat < 0)):
        bad = flat[~np.isfinite(flat) | (flat < 0)][0]
        _check_weight(metric, float(bad))
    return flat.tolist()


def _check_weight(metric: str, w: float) -> None:
    if not math.isfinite(w) or w < 0:
        raise MetricValueError(f"weight {w!r} for {metric!r} is invalid; weights must be finite and >= 0")


def drop_nonfinite(values: list[float], weights: list[float] | None) -> tuple[list[float], list[float] | None]:
    """The records whose value is finite (for nan='ignore')."""
    keep = [i for i, x in enumerate(values) if math.isfinite(x)]
    if len(keep) == len(values):
        return values, weights
    return [values[i] for i in keep], (None if weights is None else [weights[i] for i in keep])


def check_finite(metric: str, values: list[float]) -> None:
    """Raise for a non-finite value (for nan='error')."""
    for x in values:
        if not math.isfinite(x):
            raise MetricValueError(f"non-finite value {x!r} logged for {metric!r} under nan='error'")
