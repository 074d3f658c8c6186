"""Device-side accumulation of torch tensors: ``log()`` never synchronizes with the device.

Per metric and optimizer update, one running float64 state vector on the tensor's device, laid out as ``FIELDS``
(``count, weight, wsum, total, m2, min, max, first, last``, the host records before the first and before the last
record, then flags: ``bad_weight, nonfinite`` and whether a -0.0 or a +0.0 was logged, which give a zero min or max
its sign at commit, as :mod:`metricbus.signed_zero` orders them). Each ``log()`` summarises its
batch with torch ops and merges it in (Chan's update for m2, NaN propagated by ``torch.minimum``/``maximum``), with
no ``.item()``, ``.cpu()``, ``float()`` or data-dependent branch. At commit/export :meth:`DeviceStates.take_all`
stacks every metric's state of every update and does ONE device-to-host copy. Negative/non-finite tensor weights and
non-finite values under ``nan='error'`` are therefore detected at commit (after that copy); they are returned as
errors per metric, so the other metrics still commit. Device sums are plain float64 (no double-double remainder), so
tensor-logged sums are not bitwise split-invariant the way host-logged floats are. A metric logged in one update
with both floats and tensors: each tensor's ``add`` is told how many host records of its update came before it
(``host``), kept on the device as ``first``/``last`` are (a batch whose records ``nan='ignore'`` all dropped counts
for neither), so :meth:`DeviceStates.take_all` can say whether the update's ``first`` is a host record (some came
before the first tensor record) and its ``last`` one (more came after the last): log order across both sources.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import compress
from typing import Any

from metricbus.errors import MetricValueError
from metricbus.signed_zero import NEGATIVE_ZERO_BITS
from metricbus.summary import N_FIELDS

FIELDS = (
    "count", "weight", "wsum", "total", "m2", "min", "max", "first", "last", "host_first", "host_last",
    "bad_weight", "nonfinite", "negative_zero", "positive_zero",
)  # fmt: skip
_BAD_WEIGHT = FIELDS.index("bad_weight")
_NONFINITE = FIELDS.index("nonfinite")
_FLAGS = _BAD_WEIGHT  # from here on, flags merged by max
# whether a -0.0 (a +0.0) was logged: a zero min is -0.0 (a zero max +0.0) if so (metricbus.signed_zero)
_NEGATIVE_ZERO, _POSITIVE_ZERO = FIELDS.index("negative_zero"), FIELDS.index("positive_zero")
# where each of FIELDS up to "last" goes in Summary.as_tuple() (count, weight, wsum, total, m2, min, max, first, last)
_TO_FIELDS = [0, 1, 3, 5, 7, 8, 9, 10, 11]
_HOST_FIRST, _HOST_LAST = FIELDS.index("host_first"), FIELDS.index("host_last")


def check_device(metric: str, value: Any, what: str = "value") -> None:
    """Reject a tensor that holds no data (``meta`` device) at ``log()``, naming the metric."""
    if value.device.type == "meta":
        raise MetricValueError(
            f"cannot log a {what} on the 'meta' device for {metric!r}: it holds no data; log a tensor on the CPU "
            "or an accelerator"
        )


def check_weight(metric: str, value: Any, weight: Any) -> None:
    """Reject a tensor weight the records of ``value`` (a tensor) cannot take, naming the metric: a complex one, or
    one whose shape does not broadcast to the value's. Reads only dtypes and shapes, host-known metadata: no sync."""
    if weight.is_complex():
        raise MetricValueError(
            f"weight of dtype {weight.dtype} for {metric!r} is complex; weights must be real (a real tensor, array, "
            "list or number), finite and >= 0"
        )
    shape, target = tuple(weight.shape), tuple(value.shape)
    if not _broadcasts(shape, target):
        raise MetricValueError(
            f"weight of shape {shape} for {metric!r} does not broadcast to the value's shape {target}; give a weight "
            "of that shape, one that broadcasts to it (its trailing dimensions equal to the value's, or 1), or a scalar"
        )


def _broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """True if ``shape`` broadcasts to ``target`` (``torch.broadcast_to``'s rule, computed on the host)."""
    if len(shape) > len(target):
        return False
    return all(n in (1, m) for n, m in zip(reversed(shape), reversed(target), strict=False))


def _batch(value: Any, weight: Any, *, ignore: bool, host: int) -> Any:
    import torch

    x = value.detach().reshape(-1).to(torch.float64)
    if isinstance(weight, torch.Tensor):
        w = torch.broadcast_to(weight.detach().to(device=x.device, dtype=torch.float64), value.shape).reshape(-1)
    else:
        w = torch.full_like(x, 1.0 if weight is None else float(weight))
    bad_w = ((w < 0) | ~torch.isfinite(w)).any().to(torch.float64)
    bits = x.view(torch.int64)  # which zeros were logged: torch's min and max keep either of two tied zeros
    zeros = [(bits == NEGATIVE_ZERO_BITS).any().to(torch.float64), (bits == 0).any().to(torch.float64)]
    finite = torch.isfinite(x)
    nonfinite = (~finite).any().to(torch.float64)
    if ignore:
        keep = finite
        x = torch.where(keep, x, torch.zeros_like(x))
        w = torch.where(keep, w, torch.zeros_like(w))
        count = keep.sum().to(torch.float64)
        lo, hi = torch.where(keep, x, torch.inf).min(), torch.where(keep, x, -torch.inf).max()
        # index_select with an index tensor: indexing with a 0-d tensor may read the index on the host
        first = x.index_select(0, torch.argmax(keep.to(torch.int8)).reshape(1)).reshape(())
        last = x.flip(0).index_select(0, torch.argmax(keep.flip(0).to(torch.int8)).reshape(1)).reshape(())
        nonfinite = torch.zeros_like(nonfinite)
    else:
        # torch.full fills on the device; torch.tensor(..., device=) would copy from the host and wait for it
        count = torch.full((), float(x.numel()), dtype=torch.float64, device=x.device)
        lo, hi = torch.minimum(x.min(), torch.full((), torch.inf, dtype=torch.float64, device=x.device)), x.max()
        first, last = x[0], x[-1]
    weight_sum = w.sum()
    wsum = (w * x).sum()
    mean = torch.where(weight_sum > 0, wsum / weight_sum, torch.zeros_like(wsum))
    m2 = (w * (x - mean) ** 2).sum()
    before = torch.full((), float(host), dtype=torch.float64, device=x.device)
    return torch.stack([
        count, weight_sum, wsum, x.sum(), m2, lo, hi, first, last, before, before, bad_w, nonfinite, *zeros
    ])


def _merge(a: Any, b: Any) -> Any:
    import torch

    wa, wb = a[1], b[1]
    both = (wa > 0) & (wb > 0)
    delta = torch.where(both, b[2] / torch.where(both, wb, 1.0) - a[2] / torch.where(both, wa, 1.0), 0.0)
    m2 = a[4] + b[4] + torch.where(both, delta * delta * wa * wb / torch.where(both, wa + wb, 1.0), 0.0)
    has_a = a[0] > 0
    has_b = b[0] > 0
    return torch.cat([
        torch.stack([
            a[0] + b[0], wa + wb, a[2] + b[2], a[3] + b[3], m2,
            torch.minimum(a[5], b[5]), torch.maximum(a[6], b[6]),
            torch.where(has_a, a[7], b[7]), torch.where(has_b, b[8], a[8]),
            torch.where(has_a, a[9], b[9]), torch.where(has_b, b[10], a[10]),  # as first and last
        ]),
        torch.maximum(a[_FLAGS:], b[_FLAGS:]),
    ])


class DeviceStates:
    """The device states of every tensor-logged metric of one bus, per optimizer update."""

    def __init__(self) -> None:
        self._states: dict[str, Any] = {}  # the current update
        self._done: dict[int, dict[str, Any]] = {}  # finished updates of this commit, by update index

    def add(self, name: str, value: Any, weight: Any, *, nan: str, host: int = 0) -> None:
        """Merge a tensor batch into ``name``'s device state (no host sync; the caller checked the weight with
        :func:`check_weight`); ``host``: how many of its host records of this update came before it."""
        if value.numel() == 0:  # numel is host-known metadata
            return
        batch = _batch(value, weight, ignore=nan == "ignore", host=host)
        held = self._states.get(name)
        self._states[name] = batch if held is None else _merge(held, batch.to(held.device))

    def end_update(self, index: int) -> None:
        """The current update (number ``index`` of this commit) is finished."""
        if self._states:
            self._done[index] = self._states
            self._states = {}

    def shift(self, n: int) -> None:
        """``n`` updates were put back in front of this commit's finished ones: renumber."""
        self._done = {index + n: states for index, states in self._done.items()}

    def names(self) -> list[str]:
        """The metrics that hold device state."""
        return sorted({n for states in (self._states, *self._done.values()) for n in states})

    def take_all(
        self, *, nan_of: Callable[[str], str]
    ) -> tuple[dict[int, tuple[tuple[str, ...], Any, Any]], dict[str, MetricValueError]]:
        """Every finished update's micro summaries in columns, with ONE device-to-host copy: per update index,
        ``(names, fields, hosts)`` where ``fields[:, i]`` is the ``Summary.as_tuple()`` of name ``i`` (float64,
        shape ``(N_FIELDS, len(names))``) and ``hosts[:, i]`` how many of its host records of that update came
        before its first and before its last tensor record (float64, shape ``(2, len(names))``); and per metric
        (``nan_of``: its nan policy) the error that rejects it (left out of every update); reset. The caller ends
        the current update first."""
        import numpy as np
        import torch

        done, self._done = self._done, {}
        order = sorted(done)
        names_of = [tuple(done[u]) for u in order]
        states = [state for u in order for state in done[u].values()]
        if not states:
            return {}, {}
        device = states[0].device
        rows = torch.stack([state.to(device) for state in states]).cpu().numpy()
        keep = rows[:, 0] > 0
        errors: dict[str, MetricValueError] = {}
        flagged = np.flatnonzero((rows[:, _BAD_WEIGHT] != 0) | (rows[:, _NONFINITE] != 0)).tolist()
        if flagged:
            every = [name for names in names_of for name in names]
            for i in flagged:
                name = every[i]
                if rows[i, _BAD_WEIGHT]:
                    errors[name] = MetricValueError(
                        f"a tensor weight for {name!r} was negative or non-finite; weights must be finite and >= 0"
                    )
                elif nan_of(name) == "error" and name not in errors:
                    errors[name] = MetricValueError(f"non-finite tensor value logged for {name!r} under nan='error'")
            keep &= np.array([name not in errors for name in every])
        fields = np.zeros((N_FIELDS, len(states)))  # the *_lo remainders stay 0.0: device sums are plain float64
        fields[_TO_FIELDS] = rows[:, : len(_TO_FIELDS)].T
        for f, signed, logged in ((8, -0.0, _NEGATIVE_ZERO), (9, 0.0, _POSITIVE_ZERO)):  # -0.0 below +0.0
            fields[f] = np.where((fields[f] == 0.0) & (rows[:, logged] != 0), signed, fields[f])
        # every record -0.0 (a zero min, a max of -0.0): Σx and Σw·x are -0.0, as IEEE says (signed_zero.of_sum);
        # torch's sum of -0.0s is +0.0
        every_negative_zero = (fields[8] == 0.0) & (fields[9] == 0.0) & np.signbit(fields[9])
        if every_negative_zero.any():
            fields[[3, 5]] = np.where(every_negative_zero, -0.0, fields[[3, 5]])
        hosts = rows[:, [_HOST_FIRST, _HOST_LAST]].T
        out: dict[int, tuple[tuple[str, ...], Any, Any]] = {}
        start = 0
        for u, names in zip(order, names_of, strict=True):
            stop = start + len(names)
            part = keep[start:stop]
            if part.all():
                out[u] = (names, fields[:, start:stop], hosts[:, start:stop])
            elif part.any():
                kept = tuple(compress(names, part.tolist()))
                out[u] = (kept, fields[:, start:stop][:, part], hosts[:, start:stop][:, part])
            start = stop
        return out, errors

    def pending(self) -> bool:
        """True if any tensor was logged since the last :meth:`take_all`."""
        return bool(self._states or self._done)
