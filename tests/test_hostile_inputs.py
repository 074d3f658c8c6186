"""Hostile inputs found by review: each is refused at log() or commit() naming the metric, changes no spec, and
loses nothing already logged."""

from __future__ import annotations

import math

import numpy as np
import pytest

from metricbus import Agg, ConfigError, MetricBus, MetricTypeError, MetricValueError, SpecError, StepError


def bus() -> MetricBus:
    """A local bus with no adapters."""
    return MetricBus(dist=None)


@pytest.mark.parametrize("value", [np.ma.array([1.0, 2.0], mask=[False, True]), np.ma.masked])
def test_a_masked_array_is_refused_at_log(value: object) -> None:
    """Before, it was accepted and commit() failed with a raw struct.error, losing every metric of the commit."""
    b = bus()
    b.log("good", 1.0)
    with pytest.raises(MetricTypeError, match=r"'x' \(a masked array: log value.compressed\(\)"):
        b.log("x", value)
    with pytest.raises(MetricValueError, match=r"weight masked_array\(.* for 'w' is not a real number"):
        b.log("w", [1.0, 2.0], weight=np.ma.array([1.0, 2.0], mask=[False, True]))
    assert b.commit(0) == {"good": 1.0}
    b.close()


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
def test_a_numpy_matrix_is_its_elements() -> None:
    b = bus()
    b.log("m", np.matrix([[1.0, 2.0], [3.0, 6.0]]))
    assert b.commit(0) == {"m": 3.0}
    b.close()


def test_python_ints_beyond_int64_in_a_list_are_floats_as_scalars_are() -> None:
    b = bus()
    b.log("big", [2**70, 1])
    assert b.commit(0) == {"big": (float(2**70) + 1.0) / 2}
    with pytest.raises(MetricValueError, match="'big' is an integer of 2001 bits"):
        b.log("big", [2**2000, 1])
    b.close()


def test_a_complex_numpy_weight_is_refused() -> None:
    b = bus()
    with pytest.raises(MetricValueError, match=r"weight .* for 'x' is not a real number \(dtype complex64\)"):
        b.log("x", 1.0, weight=np.complex64(1 + 2j))
    b.close()


def test_a_list_as_a_name_is_a_metric_type_error() -> None:
    b = bus()
    for value in (1.0, np.ones(2)):
        with pytest.raises(MetricTypeError, match="metric names must be non-empty strings"):
            b.log(["a"], value)  # type: ignore[arg-type]
    b.close()


@pytest.mark.parametrize(
    ("call", "kept"),
    [
        (lambda b: b.log("a", None, agg="sum"), {"a": 2.0}),
        (lambda b: b.log({"a": 2.0, "b": None}, agg="sum"), {"a": 2.0}),
        (lambda b: b.log("a", 2.0, agg=Agg(micro="sum", nan="error")), {"a": 2.0}),  # SpecError: nan= differs
    ],
)
def test_a_rejected_log_with_agg_changes_no_spec(call: object, kept: dict[str, float]) -> None:
    """Before, agg= replaced the default before the call's values were checked, so a refused call changed it."""
    b = bus()
    b.log("a", 1.0)
    b.log("a", 3.0)
    with pytest.raises((MetricTypeError, SpecError)):
        call(b)  # type: ignore[operator]
    assert str(b.spec_of("a")) == str(MetricBus(dist=None).spec_of("a"))
    b.log("a", math.nan)  # still under nan="propagate"
    assert math.isnan(b.commit(0)["a"])
    b.close()
    b = bus()
    b.log("a", 1.0)
    b.log("a", 3.0)
    with pytest.raises((MetricTypeError, SpecError)):
        call(b)  # type: ignore[operator]
    assert b.commit(0) == kept
    b.close()


def test_agg_changing_the_nan_policy_of_logged_records_is_refused() -> None:
    b = bus()
    b.log("a", [1.0, math.nan])
    with pytest.raises(SpecError, match=r"agg= in this log\(\) gives 'a' nan='error'.*nan='propagate'"):
        b.log("a", 2.0, agg=Agg(micro="mean", nan="error"))
    assert math.isnan(b.commit(0)["a"])
    b.close()


def test_define_changing_the_nan_policy_of_an_ended_update_is_refused() -> None:
    """Before, only records still buffered were seen: NaN was emitted under nan='error'."""
    b = bus()
    b.log("h", [1.0, math.nan])
    b.end_update()
    with pytest.raises(SpecError, match=r"the rule 'h' gives 'h' nan='error'.*nan='propagate'"):
        b.define("h", "mean", nan="error")
    assert math.isnan(b.commit(0)["h"])
    b.close()


def test_define_changing_the_nan_policy_of_tensor_records_is_refused() -> None:
    """Before, the tensor records logged under nan='propagate' were dropped at commit."""
    torch = pytest.importorskip("torch")
    b = bus()
    b.log("t", torch.tensor([1.0, math.nan]))
    with pytest.raises(SpecError, match=r"the rule 't' gives 't' nan='error'"):
        b.define("t", "mean", nan="error")
    assert math.isnan(b.commit(0)["t"])
    b.close()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tensors_of_no_plain_real_elements_are_refused_and_the_dict_records_nothing() -> None:
    """Before, a raw torch error naming no metric, and the dict's other values were kept."""
    torch = pytest.importorskip("torch")
    bad = {
        "sparse": torch.tensor([1.0, 0.0]).to_sparse(),
        "csr": torch.eye(2).to_sparse_csr(),
        "quantized": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8),
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "bits": torch.zeros(2, dtype=torch.uint8).view(torch.bits8),
    }
    b = bus()
    b.log("kept", 1.0)
    for name, tensor in bad.items():
        with pytest.raises(MetricTypeError, match=rf"tensor logged for {name!r}"):
            b.log({"a": torch.tensor([1.0, 2.0]), "b": 5.0, name: tensor})
        if name != "nested":
            with pytest.raises(MetricValueError, match=rf"weight tensor logged for {name!r}"):
                b.log(name, torch.ones(tuple(tensor.shape)), weight=tensor)
    assert b.commit(0) == {"kept": 1.0}
    b.close()


def test_a_bool_step_is_refused_and_keeps_the_records() -> None:
    b = bus()
    b.log("a", 1.0)
    with pytest.raises(StepError, match=r"got True \(a bool is not a step\)"):
        b.commit(step=True)
    assert b.commit(step=3) == {"a": 1.0}
    b.close()


def test_the_step_after_the_last_int64_is_refused_and_keeps_the_records() -> None:
    """Before, commit() emitted step 2**63 (and a journaled bus lost the records to a struct.error)."""
    b = bus()
    b.log("a", 1.0)
    b.commit(step=2**63 - 1)
    b.log("b", 2.0)
    with pytest.raises(StepError, match=r"the next step, 9223372036854775808, is out of range"):
        b.commit()
    assert b.commit(step=2**63 - 1) == {"b": 2.0}
    b.close()


@pytest.mark.parametrize(
    "options",
    [{"exit_timeout_s": 10**400}, {"write_timeout_s": math.inf}, {"queue_timeout_s": math.nan}],
)
def test_timeouts_a_thread_cannot_wait_are_config_errors(options: dict[str, object]) -> None:
    """Before, a raw OverflowError (10**400), or accepted (NaN; inf made a thread wait raise OverflowError)."""
    name = next(iter(options))
    with pytest.raises(ConfigError, match=rf"{name}: must be a number of seconds"):
        MetricBus(dist=None, **options)  # type: ignore[arg-type]


def test_a_one_element_tensor_is_not_a_step_as_a_one_element_array_is_not() -> None:
    """Before, commit(torch.tensor([7])) was step 7 while commit(np.array([9])) was a StepError."""
    torch = pytest.importorskip("torch")
    b = bus()
    b.log("a", 1.0)
    for step in (torch.tensor([7]), np.array([9])):
        with pytest.raises(StepError, match="commit step must be an int"):
            b.commit(step)
    assert b.commit(torch.tensor(3)) == {"a": 1.0}
    b.close()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_masked_tensor_is_refused_and_the_dict_records_nothing() -> None:
    """Before, a raw torch TypeError from the recording phase, with 'a' and 't' of the same call kept."""
    torch = pytest.importorskip("torch")
    from torch.masked import masked_tensor

    masked = masked_tensor(torch.tensor([1.0, 2.0]), torch.tensor([True, False]))
    b = bus()
    with pytest.raises(MetricTypeError, match=r"tensor logged for 'm' .* is a masked tensor"):
        b.log({"a": 1.0, "t": torch.tensor([2.0]), "m": masked, "z": 3.0})
    assert b.commit(0) == {}
    b.close()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_nested_tensor_weight_and_a_big_int_weight_name_the_metric() -> None:
    torch = pytest.importorskip("torch")
    b = bus()
    with pytest.raises(MetricValueError, match=r"the weight tensor logged for 'w' .* is a nested tensor"):
        b.log("w", torch.ones(2), weight=torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))
    with pytest.raises(MetricValueError, match=r"weight for 'bw' is an integer of 1329 bits"):
        b.log("bw", [1.0, 2.0], weight=[2**1328, 1])
    b.close()
