"""Turning what a caller logs into flat lists of float records and weights, with clear errors.

Accepted: Python ints, floats and bools; other real numbers (``fractions.Fraction``, ``decimal.Decimal``, any
``numbers.Real``: each its nearest double); numpy scalars and arrays of real dtype; (possibly nested) lists and
tuples of those; torch tensors of real dtype (recognised without importing torch). Everything else is a
:class:`~metricbus.errors.MetricTypeError` that names the metric.
"""

from __future__ import annotations

import math
import numbers
from decimal import Decimal
from typing import Any

import numpy as np

from metricbus.errors import MetricTypeError, MetricValueError

_REAL_DTYPE_KINDS = frozenset("fiub")


def is_tensor(value: object) -> bool:
    """True for a torch.Tensor, detected without importing torch."""
    cls = type(value)
    return cls.__module__.startswith("torch") and hasattr(value, "detach") and hasattr(value, "dtype")


def _shown(value: object) -> str:
    """``repr(value)`` on one line, cut to 60 characters."""
    shown = " ".join(repr(value).split())
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _type_error(metric: str, value: object, why: str = "") -> MetricTypeError:
    return MetricTypeError(
        f"cannot log {_shown(value)} ({type(value).__name__}) as {metric!r}{why}; log a real number, a bool, "
        "or a numpy array / torch tensor / list of real numbers"
    )


# the torch dtypes whose elements are real numbers (besides the floating ones): each element one record
_TENSOR_INTEGERS = frozenset(
    f"torch.{kind}{bits}" for kind in ("int", "uint") for bits in (8, 16, 32, 64)
) | {"torch.bool"}


def check_tensor(metric: str, value: Any, what: str = "value") -> None:
    """Reject a tensor whose elements are not plain real numbers, naming the metric: complex, sparse or other
    non-strided layouts, nested, quantized, or of a dtype that is neither a float, an integer nor a bool (``bits8``).
    Reads only the tensor's metadata (no device sync). A value is a MetricTypeError, a weight a MetricValueError."""
    layout = str(value.layout)
    if type(value).__module__.startswith("torch.masked"):  # a MaskedTensor (strided, but no plain elements)
        why = "a masked tensor; log value.get_data()[value.get_mask()], its unmasked elements"
    elif value.is_complex():
        why = "complex; log a real tensor"
    elif layout != "torch.strided":
        why = f"a {layout} tensor; log value.to_dense()"
    elif getattr(value, "is_nested", False):
        why = "a nested tensor; log each of its tensors"
    elif value.is_quantized:
        why = "quantized; log value.dequantize()"
    elif not value.is_floating_point() and str(value.dtype) not in _TENSOR_INTEGERS:
        why = "not of a real dtype; log a tensor of floats, integers or bools"
    else:
        return
    error = MetricTypeError if what == "value" else MetricValueError
    raise error(f"the {what} tensor logged for {metric!r} (dtype {value.dtype}) is {why}")


def _array(metric: str, value: Any, what: str = "value") -> np.ndarray[Any, Any]:
    if type(value) is np.ndarray:
        array = value
    elif isinstance(value, np.ndarray):  # a subclass: np.matrix as its plain array; a masked array refused
        if isinstance(value, np.ma.MaskedArray):
            raise _type_error(
                metric, value, " (a masked array: log value.compressed() for its unmasked records, or value.filled(x))"
            )
        array = np.asarray(value)
    elif is_tensor(value):
        check_tensor(metric, value)
        array = value.detach().to(device="cpu").double().numpy()
    else:
        try:
            array = np.asarray(value)
        except ValueError as exc:  # numpy 2 refuses ragged nesting
            raise _type_error(metric, value, " (ragged nested lists)") from exc
    if array.dtype.kind == "O" and all(map(_is_real, array.flat)):
        # Python ints beyond int64 (or mixed with floats), Fractions, Decimals, numpy scalars mixed with those in a
        # list: each one as a float, as a scalar would be
        return np.array([_scalar(metric, x, what) for x in array.flat], dtype=np.float64).reshape(array.shape)
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
        if value.dtype.itemsize > 8:  # a longdouble
            return _doubles(metric, np.asarray(value)).ravel().tolist()
        return [float(value)]
    if _other_real(value):
        return [_real(metric, value, "value")]
    if value is None or isinstance(value, (str, bytes, complex, dict, set)):
        raise _type_error(metric, value)
    if isinstance(value, (list, tuple, np.ndarray)) or is_tensor(value):
        array = _array(metric, value)
        return _doubles(metric, array).ravel().tolist()
    raise _type_error(metric, value)


def _doubles(metric: str, array: np.ndarray[Any, Any], what: str = "value") -> np.ndarray[Any, Any]:
    """``array`` as float64; a finite longdouble beyond the double range is a MetricValueError naming ``metric`` (as
    an int beyond it is), never an infinity it did not hold."""
    if array.dtype.kind != "f" or array.dtype.itemsize <= 8:
        return array.astype(np.float64, copy=False)
    with np.errstate(over="ignore"):
        doubles = array.astype(np.float64)
    beyond = np.isinf(doubles) & np.isfinite(array)
    if beyond.any():
        raise MetricValueError(
            f"{what} {array[beyond].flat[0]!r} ({array.dtype}) for {metric!r} is beyond the double range "
            "(|x| <= 1.8e308): log a float"
        )
    return doubles


def _is_real(value: object) -> bool:
    """True for one real number: a Python int, float or bool, a numpy scalar of real dtype, or another real."""
    if type(value) in (int, float, bool):
        return True
    if isinstance(value, np.generic):
        return value.dtype.kind in _REAL_DTYPE_KINDS
    return _other_real(value)


def _scalar(metric: str, value: Any, what: str) -> float:
    """One real number (``_is_real``) as its nearest double, checked as ``to_values`` checks a scalar."""
    if isinstance(value, np.generic) and value.dtype.itemsize > 8:  # a longdouble
        return float(_doubles(metric, np.asarray(value), what).item())
    return _real(metric, value, what)


def _other_real(value: object) -> bool:
    """True for a real number that is neither a Python int, float or bool nor a numpy scalar: a ``Fraction``, a
    ``Decimal`` (not registered as ``numbers.Real``, but one), or another ``numbers.Real``."""
    return isinstance(value, (numbers.Real, Decimal)) and not isinstance(value, (int, float, np.generic))


def _real(metric: str, value: Any, what: str) -> float:
    """``float(value)``, the nearest double; an int, Fraction or Decimal beyond the double range (or a signaling NaN
    Decimal) is a MetricValueError naming ``metric``, never an infinity it did not hold."""
    try:
        x = float(value)
    except OverflowError:
        if isinstance(value, int):
            raise MetricValueError(
                f"{what} for {metric!r} is an integer of {int(value).bit_length()} bits, beyond the double range "
                "(|x| <= 1.8e308, 1024 bits): log a float"
            ) from None
        x = math.inf  # (a Fraction beyond the range) said below
    except ValueError as exc:  # Decimal('sNaN')
        raise MetricValueError(f"{what} {_shown(value)} for {metric!r} is not a number float() takes: {exc}") from None
    if x - x != 0.0 and x == x and type(value) is not float and not _infinite(value):  # noqa: PLR0124
        raise MetricValueError(
            f"{what} {_shown(value)} for {metric!r} is beyond the double range (|x| <= 1.8e308): log a float"
        )
    return x


def _infinite(value: Any) -> bool:
    """True if ``value`` itself is an infinity. Equality, not ``abs()``: a Decimal's arithmetic runs under the
    caller's decimal context, which may trap (``abs(Decimal('1e9999999'))`` raises ``decimal.Overflow`` under the
    default one); comparing for equality never signals."""
    if isinstance(value, Decimal):
        return value.is_infinite()
    return bool(value in (math.inf, -math.inf))


def to_weights(metric: str, weight: object, n: int, value: Any) -> list[float] | None:
    """Weights broadcast to ``n`` records, validated (finite, >= 0); None when no weight was given."""
    if weight is None:
        return None
    if (isinstance(weight, (int, float, np.generic)) and not isinstance(weight, complex)) or _other_real(weight):
        if isinstance(weight, np.generic) and weight.dtype.kind not in _REAL_DTYPE_KINDS:
            raise MetricValueError(f"weight {weight!r} for {metric!r} is not a real number (dtype {weight.dtype})")
        w = _real(metric, weight, "weight")
        _check_weight(metric, w)
        return [w] * n
    try:
        array = _array(metric, weight, "weight")
    except MetricTypeError as exc:
        raise MetricValueError(f"weight {_shown(weight)} for {metric!r} is not a real number or array") from exc
    shape = tuple(value.shape) if is_tensor(value) else np.shape(value)
    try:
        broadcast = np.broadcast_to(array, shape)
    except ValueError as exc:
        raise MetricValueError(
            f"weight of shape {array.shape} for {metric!r} does not broadcast to the value's shape {shape}"
        ) from exc
    flat = _doubles(metric, broadcast, "weight").ravel()  # (a longdouble beyond the double range: refused there)
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
