"""Replay's step level in columns for ``log_every > 1``: the windows of a run of commits of one shape, merged at once.

The live bus merges each window of ``log_every`` commits metric by metric (``Summary.merge`` of each commit's
rank-level state into the window's, in commit order; :meth:`metricbus.reduce.StepReducer.commit_ranked`) and emits
the step kinds of the result at the window's last commit. For a run whose layout is windowable
(:attr:`~metricbus.replay_columns.ColumnLayout.windowable`), every whole window inside it is merged here in columns
instead: the run's rank-level states (:meth:`~metricbus.replay_columns.ColumnLayout.states`), then, for all its
windows and metrics together, ``log_every - 1`` calls of :func:`metricbus.update_columns.merge_columns` (bit for
bit ``Summary.merge``, the same left fold), then the kinds (:mod:`metricbus.column_kinds`, the scalar kind where
an element is not settled: no records, a field not finite, a division the columns cannot decide).

Which commits: the window the reducer has open when the run starts is completed by the run's first commits, and the
commits after the run's last whole window start the next one; those, the commits of a window where a rank-level
state has a rest (a third component, which the columns do not hold), and every commit of a run whose window merge
would need one, go to the reducer as rank-level results (per metric, as the old path gives them), so its state is
what it would have been. A segment's first commit (a resumed writer) starts a window afresh, as the replay loop
resets the reducer there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from metricbus.column_merge import single_columns
from metricbus.fixed import Array
from metricbus.replay_columns import ColumnLayout, row_summary
from metricbus.summary import N_FIELDS
from metricbus.update_columns import merge_columns


class Timed(Protocol):
    """A commit as replay reads it once reduced: its step and whether a resumed writer starts there."""

    @property
    def step(self) -> int: ...

    @property
    def starts_segment(self) -> bool: ...


def windows(
    layout: ColumnLayout, fields: Array, commits: Sequence[Timed], *, pending: int, log_every: int, emitted: Any
) -> list[Any]:
    """Each commit's level: ``emitted(metrics)`` for a commit of a whole window merged here (its last commit's
    metrics; ``{}`` for the others), else its rank-level results. ``fields``: the run's rows (T, rows, N_FIELDS);
    ``pending``: the commits of the reducer's open window when the run starts."""
    starts = _window_starts(commits, pending=pending, log_every=log_every)
    merged = None
    if len(starts):  # (none: a run shorter than a window, as with a log_every of hundreds)
        states, held = layout.states(fields)
        # a window holding a state with a rest (its commit not ``held``) is left to the reducer
        starts = starts[held[starts[:, None] + np.arange(log_every)].all(axis=1)]
        merged = _merge(states, starts, log_every) if len(starts) else None
    out: list[Any] = [None] * len(commits)
    if merged is not None:
        for start, metrics in zip(starts.tolist(), _emit(layout, merged, len(starts)), strict=True):
            for t in range(start, start + log_every - 1):
                out[t] = emitted({})
            out[start + log_every - 1] = emitted(metrics)
    rest = [t for t, level in enumerate(out) if level is None]
    if rest:  # by the scalar rank level, as the old path gives them (second moments included)
        for t, ranked in zip(rest, layout.ranked(fields, rest), strict=True):
            out[t] = ranked
    return out


def _window_starts(commits: Sequence[Timed], *, pending: int, log_every: int) -> Array:
    """The first commit of each whole window inside the run: after the commits that complete the reducer's open
    window, in each segment (a commit that starts one opens a fresh window)."""
    cuts = [t for t, commit in enumerate(commits) if commit.starts_segment and t] + [len(commits)]
    starts: list[int] = []
    begin, open_ = 0, 0 if commits and commits[0].starts_segment else pending
    for end in cuts:
        first = begin + (log_every - open_) % log_every
        starts.extend(range(first, end - log_every + 1, log_every))
        begin, open_ = end, 0
    return np.array(starts, dtype=np.int64)


def _merge(states: Array, starts: Array, log_every: int) -> Array | None:
    """The merged state of each window (N_FIELDS, windows * metrics), or None where a merge needs a component the
    columns do not hold."""
    block = states[starts[:, None] + np.arange(log_every)]  # (windows, log_every, metrics, N_FIELDS)
    acc: Array | None = np.ascontiguousarray(block[:, 0].reshape(-1, N_FIELDS).T)
    for j in range(1, log_every):
        acc = merge_columns(acc, np.ascontiguousarray(block[:, j].reshape(-1, N_FIELDS).T))
        if acc is None:
            return None
    return acc


def _emit(layout: ColumnLayout, acc: Array, count: int) -> list[dict[str, float]]:
    """Each window's emitted ``{key: value}`` (sorted by key; a metric no commit of the window has is left out): the
    column kinds where they settle a value of a window's state as one worker's (:func:`single_columns`: records and
    finite fields), the scalar kind of its Summary elsewhere."""
    states = acc.T.reshape(count, len(layout.names), N_FIELDS)  # (windows, metrics, N_FIELDS)
    out, done = layout.values(*single_columns(states))
    empty = states[..., 0] == 0  # no records in the window
    done |= empty[:, layout.metric_of]
    keys = layout.keys
    for w, k in zip(*np.nonzero(~done), strict=True):
        out[w][keys[k]] = layout.plans[k].emit(row_summary(states[w, layout.metric_of[k]].tolist()))
    if empty.any():
        for w, m in zip(*np.nonzero(empty), strict=True):
            for k in np.flatnonzero(layout.metric_of == m).tolist():
                del out[w][keys[k]]
    return out
