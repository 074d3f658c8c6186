"""What ``ingest()`` checks of a batch against the specs it settles: the ``nan=`` policy each metric ends up with.

A worker summarises its records under its own policy before they travel: under ``"propagate"`` a NaN or ±inf
record is in the summary (its ``min``/``max`` are not finite), and no receiver can take it out again. So where the
settled policy of a name is ``"error"`` or ``"ignore"`` and an ingested summary of it holds a non-finite record, the
receiver cannot apply it: ``"error"`` is a :class:`~metricbus.errors.MetricValueError` (as a NaN logged here would
be), ``"ignore"`` a :class:`~metricbus.errors.SpecError` (the workers must drop them: give them the same policy);
either way nothing of the call is ingested, and the message names the metric and the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from metricbus.errors import MetricValueError, SpecError
from metricbus.partial import Partial

_COUNT, _LOWEST, _HIGHEST = 0, 8, 9  # a Summary's count, min and max among its fields (Summary.as_tuple())


def check_ingested_nan(partials: Sequence[Partial], *, nan_of: Callable[[str], str], first_worker: int) -> None:
    """Raise where a summary in ``partials`` (workers ``first_worker``, ...) holds a non-finite record of a name
    whose settled policy (``nan_of``) is not ``"propagate"``."""
    strict_of: dict[bytes, list[int]] = {}  # per layout (equal names in the same order): its entries to check
    for i, part in enumerate(partials):
        packed = part.packed
        strict = strict_of.get(packed.layout)
        if strict is None:
            strict = strict_of[packed.layout] = [j for j, n in enumerate(packed.names) if nan_of(n) != "propagate"]
        if not strict:
            continue
        fields = packed.fields[:, strict]
        # (an entry of no record, all of its records dropped there, has min +inf and max -inf: it holds none)
        held = (fields[_COUNT] > 0) & ~(np.isfinite(fields[_LOWEST]) & np.isfinite(fields[_HIGHEST]))
        if not held.any():
            continue
        name = packed.names[strict[int(np.flatnonzero(held)[0])]]
        policy = nan_of(name)
        where = f"ingested worker {first_worker + i}'s records of {name!r}"
        if policy == "error":
            raise MetricValueError(
                f"{where} hold a NaN or infinite value, and {name!r} has nan='error'; nothing of this ingest() "
                "was taken (the worker logged them under nan='propagate': give it the same nan= policy to have it "
                "raise where they are logged)"
            )
        raise SpecError(
            f"{where} hold a NaN or infinite value the worker kept, but {name!r} has nan={policy!r} here, which "
            "cannot drop them from a worker's summary; give the workers the same nan= policy (a rule or agg= with "
            f"nan={policy!r}). Nothing of this ingest() was taken"
        )
