"""Accepted values (numbers, bools, numpy, torch) and clear errors for everything else."""

from __future__ import annotations

import math

import numpy as np
import pytest

from metricbus import MetricBus, MetricTypeError, MetricValueError


def bus(**options: object) -> MetricBus:
    """A strict local bus with no adapters."""
    return MetricBus(dist=None, strict=True, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, 3.0),
        (2.5, 2.5),
        (True, 1.0),
        (np.float32(0.5), 0.5),
        (np.int64(4), 4.0),
        (np.bool_(True), 1.0),
        (np.array([1.0, 2.0, 6.0]), 3.0),
        (np.array([[1, 2], [3, 6]], dtype=np.int32), 3.0),
        ([1.0, 2, True], 4 / 3),
        ((2.0, 4.0), 3.0),
    ],
)
def test_python_and_numpy_values_are_accepted(value: object, expected: float) -> None:
    """Numbers, bools, numpy scalars and arrays (each element a record) are recorded."""
    b = bus()
    b.log("x", value)
    assert b.commit()["x"] == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int8", "bool", "bfloat16"])
def test_cpu_torch_tensors_of_real_dtype_are_accepted(dtype: str) -> None:
    """torch tensors of real dtype are recorded element-wise."""
    torch = pytest.importorskip("torch")
    b = bus()
    b.log("x", torch.tensor([1, 0, 1, 1]).to(getattr(torch, dtype)), agg="sum")
    assert b.commit() == {"x": 3.0}


def test_zero_dim_torch_tensor_is_one_record() -> None:
    """A 0-d tensor (a loss) is one record."""
    torch = pytest.importorskip("torch")
    b = bus()
    b.log("loss", torch.tensor(0.25), agg="count")
    assert b.commit() == {"loss": 1.0}


def test_complex_torch_tensor_is_a_type_error() -> None:
    """A complex tensor is rejected naming the metric."""
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="'z'"):
        bus().log("z", torch.tensor([1 + 2j]))


@pytest.mark.parametrize(
    "value",
    [None, "0.5", b"1", 1 + 2j, np.complex128(1), object(), [[1.0, 2.0], [3.0]], {"a": 1.0}, np.array(["a"])],
    ids=["None", "str", "bytes", "complex", "np-complex", "object", "ragged", "dict", "str-array"],
)
def test_bad_values_are_type_errors_naming_the_metric(value: object) -> None:
    """None, str, complex, object, ragged lists... raise TypeError naming the metric; nothing is lost."""
    b = bus()
    b.log("loss", 1.0)
    with pytest.raises(TypeError, match="'loss'"):
        b.log("loss", value)
    assert b.commit() == {"loss": 1.0}


def test_type_errors_are_metricbus_errors() -> None:
    """The TypeError is a MetricTypeError."""
    with pytest.raises(MetricTypeError):
        bus().log("x", None)


@pytest.mark.parametrize("weight", [-1.0, math.nan, math.inf, np.array([1.0, -2.0])])
def test_bad_weights_are_value_errors(weight: object) -> None:
    """Negative, NaN or infinite weights raise ValueError naming the metric; nothing is lost."""
    b = bus()
    b.log("w", 2.0, weight=3.0)
    with pytest.raises(ValueError, match="'w'"):
        b.log("w", [1.0, 2.0], weight=weight)
    assert b.commit() == {"w": 2.0}


def test_weight_that_does_not_broadcast_is_a_value_error() -> None:
    """A weight array of the wrong shape raises MetricValueError naming the metric and shapes."""
    b = bus()
    with pytest.raises(MetricValueError, match=r"'w'.*broadcast"):
        b.log("w", [1.0, 2.0, 3.0], weight=[1.0, 2.0])


def test_weight_broadcasts_over_the_value() -> None:
    """A scalar weight applies to every element; an array weight element-wise."""
    b = bus()
    b.log("a", [1.0, 3.0], weight=2.0)
    b.log("b", [1.0, 3.0], weight=[3.0, 1.0])
    assert b.commit() == {"a": 2.0, "b": 1.5}


def test_weight_is_ignored_by_kinds_other_than_mean_and_std() -> None:
    """sum/min/max/count ignore the weight."""
    b = bus()
    b.log("x", [1.0, 3.0], weight=[5.0, 0.0], agg=["sum", "min", "max", "count", "mean"])
    assert b.commit() == {"x/count": 2.0, "x/max": 3.0, "x/mean": 1.0, "x/min": 1.0, "x/sum": 4.0}


def test_bad_weight_in_dict_call_records_nothing() -> None:
    """A dict call whose weight fails records none of its metrics."""
    b = bus()
    b.log("a", 1.0)
    with pytest.raises(ValueError, match="weight"):
        b.log({"a": 5.0, "b": 5.0}, weight=-1.0)
    assert b.commit() == {"a": 1.0}


def test_weight_may_be_a_numpy_scalar_or_torch_tensor() -> None:
    """Weights accept numpy scalars and real torch tensors like values do."""
    torch = pytest.importorskip("torch")
    b = bus()
    b.log("a", [1.0, 3.0], weight=np.int64(2))
    b.log("b", torch.tensor([1.0, 3.0]), weight=torch.tensor([3, 1]))
    assert b.commit() == {"a": 2.0, "b": 1.5}


def test_an_int_beyond_the_double_range_is_a_clear_error_naming_the_metric() -> None:
    """Review finding: these raised a raw OverflowError / TypeError without the metric's name."""
    bus = MetricBus(dist=None)
    bus.log("kept", 1.0)
    with pytest.raises(MetricValueError, match=r"value for 'x' is an integer of 1101 bits, beyond the double range"):
        bus.log("x", 2**1100)
    with pytest.raises(MetricValueError, match=r"weight for 'x' is an integer of 16610 bits"):
        bus.log("x", 1.0, weight=10**5000)
    with pytest.raises(MetricValueError, match=r"value for 'a' is an integer"):
        bus.log({"a": -(2**2000)})
    with pytest.raises(MetricTypeError, match=r"log\(dict\) takes the values in the dict"):
        bus.log({"a": 1.0}, 2.0)
    with pytest.raises(MetricTypeError, match=r"ingest\(\) takes an iterable of Partial objects from export\(\), got"):
        bus.ingest(None)  # type: ignore[arg-type]
    assert bus.commit() == {"kept": 1.0}
    bus.close()
