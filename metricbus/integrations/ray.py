"""Ray single-controller systems (verl's shape): gather the workers' exported partials for the driver's bus.

Each worker actor logs into its own ``MetricBus(dist=None)`` and returns ``bus.export()`` from its remote method,
directly or inside its result (``{"metrics": part}``, or a verl ``DataProto`` whose ``meta_info["metrics"]`` is the
partial). The driver passes the result refs here, in worker order, and ingests what comes back::

    refs = {f"actor_{r}": w.update_actor.remote(shard) for r, (w, shard) in enumerate(zip(workers, shards))}
    driver.ingest(gather_partials(refs, timeout_s=600))
    driver.commit(step=step)

A worker that died, raised, timed out or returned no partial makes :func:`gather_partials` raise
:class:`~metricbus.errors.DistributedError` naming every such worker; nothing of that step is returned, so the
driver ingests a step from all of its workers or not at all, and everything it committed before is untouched.

Ray is never imported here: an ``ObjectRef`` can only exist once the caller has imported ``ray``, so the module is
looked up in ``sys.modules`` (results that are already values, e.g. from a multiprocessing fallback, need no Ray).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from metricbus.errors import DistributedError
from metricbus.partial import Partial

__all__ = ["VERL_KEY", "gather_partials", "partial_of", "partials_in"]

VERL_KEY = "metricbus"  # a verl rank's partial: DataProto(meta_info={"metrics": {VERL_KEY: bus.export()}})

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MAX_REASON = 300  # characters of a Ray error kept in the message; the whole error is the exception's __cause__
# ray.wait converts its timeout to int64 milliseconds: 1e18 s (or inf) overflows there. A wait this long is unbounded.
_UNBOUNDED_S = 1e15


def gather_partials(
    results: Mapping[str, Any] | Sequence[Any], *, timeout_s: float | None = None, key: str = "metrics"
) -> list[Partial]:
    """The workers' partials, in the order of ``results``, ready for ``driver.ingest()``.

    ``results`` maps worker names to what each worker's remote call returned (Ray ``ObjectRef``s, or values), or
    lists them in worker order (named ``worker 0``, ``worker 1``, ...). Each result is a
    :class:`~metricbus.partial.Partial`, a mapping holding one under ``key``, or an object whose ``meta_info``
    mapping holds one there (verl's ``DataProto``); there a mapping may hold it under ``"metricbus"``, or a list
    of them, one per rank, as verl's worker groups merge ``meta_info={"metrics": {"metricbus": bus.export()}}``
    (see :func:`partials_in`): each counts as one worker, in that order. ``timeout_s`` bounds the whole wait
    (``None`` or ``math.inf``: no bound; a dead actor is reported as soon as Ray knows, without a timeout).

    Raises ``ValueError`` when two workers' results are the same ``ObjectRef`` or ``Partial`` (ingested twice, it
    would count as two workers). Raises :class:`~metricbus.errors.DistributedError` naming each worker that died,
    raised, did not finish within ``timeout_s`` or returned no partial, with Ray's reason; then nothing is
    returned, so the step is ingested from all of its workers or not at all.
    """
    if timeout_s is not None and (isinstance(timeout_s, bool) or not timeout_s >= 0):
        raise ValueError(f"gather_partials: timeout_s={timeout_s!r}; use a number of seconds >= 0, or None")
    if timeout_s is not None and timeout_s >= _UNBOUNDED_S:
        timeout_s = None  # math.inf: no bound (Ray itself would raise OverflowError)
    if isinstance(results, Mapping):
        names = [f"worker {name!r} (index {i})" for i, name in enumerate(results)]
        items = list(results.values())
    else:
        items = list(results)
        names = [f"worker {i}" for i in range(len(items))]
    ray: Any = sys.modules.get("ray")  # see the module docstring: no ObjectRef exists unless ray was imported
    _refuse_repeats(names, [item if ray is not None and isinstance(item, ray.ObjectRef) else None for item in items])
    values, failed, causes = _fetch(items, timeout_s=timeout_s)
    out: list[Partial] = []
    held: list[str] = []  # each partial's worker, for _refuse_repeats
    for i, value in enumerate(values):
        if i in failed:
            continue
        parts = partials_in(value, key=key)
        if parts is None:
            failed[i] = _no_partial(value, key=key)
            continue
        out.extend(parts)
        held.extend(names[i] if len(parts) == 1 else f"{names[i]}, rank {j}" for j in range(len(parts)))
    _refuse_repeats(held, [id(part) for part in out])
    if failed:
        lines = "\n".join(f"  {names[i]}: {failed[i]}" for i in sorted(failed))
        error = DistributedError(
            f"gather_partials: {len(failed)} of {len(items)} workers gave no metrics for this step; none of the "
            f"step's partials were returned (the driver's committed steps are untouched):\n{lines}"
        )
        raise error from (causes[min(causes)] if causes else None)
    return out


def _refuse_repeats(names: list[str], keys: list[Any]) -> None:
    """ValueError naming the first two workers whose results are one and the same (an ObjectRef, or a Partial):
    ingested twice, that worker would count as two ranks (its sums doubled, its weight in means too)."""
    seen: dict[Any, int] = {}
    for i, key in enumerate(keys):
        if key is None:
            continue
        if key in seen:
            raise ValueError(
                f"gather_partials: {names[seen[key]]} and {names[i]} hold the same result; each worker's partial "
                "must be given once (ingested twice it counts as two workers): give each worker its own result"
            )
        seen[key] = i


def partial_of(result: Any, *, key: str = "metrics") -> Partial | None:
    """The partial in one worker's result: the result itself, ``result[key]``, or ``result.meta_info[key]``."""
    parts = partials_in(result, key=key)
    return parts[0] if parts is not None and len(parts) == 1 else None


def partials_in(result: Any, *, key: str = "metrics") -> list[Partial] | None:
    """The partials in one result, each a worker in order: the result itself, ``result[key]``, or
    ``result.meta_info[key]``; there, a Partial, or (what verl's ``DataProto.concat`` makes of the ranks'
    ``meta_info={"metrics": {"metricbus": bus.export()}}`` when a worker group merges them) a mapping whose
    ``"metricbus"`` holds one or a list of them. None where there is none."""
    if isinstance(result, Partial):
        return [result]
    meta = getattr(result, "meta_info", None)
    if isinstance(meta, Mapping):  # verl's DataProto(meta_info={"metrics": ...})
        result = meta
    if not isinstance(result, Mapping):
        return None
    found = result.get(key)
    if isinstance(found, Mapping):  # verl's metrics dict, the partial under "metricbus" (one rank, or merged)
        found = found.get(VERL_KEY)
    if isinstance(found, Partial):
        return [found]
    if isinstance(found, (list, tuple)) and found and all(isinstance(part, Partial) for part in found):
        return list(found)
    return None


def _fetch(
    items: list[Any], *, timeout_s: float | None
) -> tuple[list[Any], dict[int, str], dict[int, BaseException]]:
    """Each item's value (ObjectRefs resolved), and why each failed item failed, by index."""
    ray: Any = sys.modules.get("ray")
    values = list(items)
    failed: dict[int, str] = {}
    causes: dict[int, BaseException] = {}
    refs = {i: item for i, item in enumerate(items) if ray is not None and isinstance(item, ray.ObjectRef)}
    if not refs:
        return values, failed, causes
    unique = list(refs.values())  # each ref once: gather_partials refused repeats
    ready, _ = ray.wait(unique, num_returns=len(unique), timeout=timeout_s)
    done = set(ready)
    for i, ref in refs.items():
        if ref not in done:
            failed[i] = f"did not finish within timeout_s={timeout_s} s (still running, hung, or not scheduled)"
            continue
        try:
            values[i] = ray.get(ref)
        except ray.exceptions.RayError as exc:
            failed[i] = _reason(exc, ray.exceptions)
            causes[i] = exc
    return values, failed, causes


def _reason(exc: BaseException, errors: Any) -> str:
    """One line saying what Ray reported: the worker's own exception, or how its actor died."""
    cause = getattr(exc, "cause", None) if isinstance(exc, errors.RayTaskError) else None
    if isinstance(cause, BaseException):
        text = f"raised {type(cause).__name__}: {cause}"
    else:
        lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
        pid = next((line for line in lines if line.startswith("pid:")), None)
        text = " ".join(dict.fromkeys([*lines[:1], *([pid] if pid else []), *lines[-1:]]))  # first, pid, last
        verb = "died" if isinstance(exc, errors.RayActorError) else "failed"
        text = f"{verb} ({type(exc).__name__}): {text}"
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def _no_partial(value: Any, *, key: str) -> str:
    """What a result without a partial held instead, and what to return."""
    meta = getattr(value, "meta_info", None)
    where = meta if isinstance(meta, Mapping) else value
    if isinstance(where, Mapping) and key in where:
        got = f"its {key!r} is a {type(where[key]).__name__}"  # e.g. verl's per-micro-batch lists
    elif isinstance(where, Mapping):
        got = f"a {type(where).__name__} without {key!r} (keys: {', '.join(sorted(map(str, where))[:8])})"
    else:
        got = f"a {type(value).__name__}"
    return f"returned no Partial: {got}; return bus.export(), or {{{key!r}: bus.export()}}"
