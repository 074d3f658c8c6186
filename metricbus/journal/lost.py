"""A commit lost to damage in a journal of one file, between two commits at one step or at consecutive steps.

The first pass names the steps *between* the commits read around damaged bytes (``FileIndex.holes``); where those
two commits are at one step, or at steps ``S`` and ``S + 1``, no step lies between them, yet a commit may be lost:
a step's second commit (evaluation after training) or its first one. With other rank files the commits held at
each step are compared (:func:`metricbus.journal.reader.count_lost`); a journal of one file is compared with
itself: a step holding fewer commits than most steps do lost one, and the metrics the steps next to it hold that
it lacks were in it. So for a torn tail followed by a resume (the commit before the damage at step ``S``, the
resumed writer's first one after ``S``): a later commit at ``S`` may have been in it. :func:`lost_commits` says so,
so the warning names the step and the metrics instead of a byte offset only. One more pass over the file, only
where it has such damage; memory does not grow with its length.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from metricbus.journal.scan import FileIndex, file_commits


@dataclass(frozen=True, slots=True)
class Lost:
    """Damage between the commits at steps ``before`` and ``after``: the steps one of whose commits it held
    (``steps``: those of the two holding fewer commits than most steps) and the metrics that commit held, where
    the steps next to it say (else empty)."""

    before: int
    after: int
    steps: tuple[int, ...]
    metrics: tuple[str, ...]


def lost_commits(index: FileIndex) -> list[Lost]:
    """The damage of ``index`` (a journal's only file) between commits at one step or at consecutive steps."""
    mends: list[tuple[int, int, tuple[int, ...]]] = [
        (before, after, (before, after)) for before, after, _ in index.mends
        if before is not None and after <= before + 1
    ]
    for before, k in index.cuts:  # a torn tail, then a resume after it: a later commit at ``before`` may be lost
        if k < len(index.segments) and index.segments[k][0] > before:  # (else the resume replaced that step)
            mends.append((before, index.segments[k][0], (before,)))
    if not mends:
        return []
    around = {step + d for _, _, pair in mends for step in pair for d in (-1, 0, 1)}
    usual: Counter[int] = Counter()  # how many steps hold n commits
    counts: dict[int, int] = {}  # commits held at the steps of ``around``
    held: dict[int, list[frozenset[str]]] = {}  # the metrics of each commit at those steps
    current, n = None, 0
    for step, _, _, part in file_commits(index, decode=True):  # (kept commits: steps never go back)
        if step != current:
            if current is not None:
                usual[n] += 1
            current, n = step, 0
        n += 1
        if step in around:
            counts[step] = n
            if part is not None:
                names = part.names
                held.setdefault(step, []).append(
                    frozenset(names[i][0] for i in part.rows["id"].tolist() if i in names)
                )
    if current is not None:
        usual[n] += 1
    most = usual.most_common(1)[0][0] if usual else 1
    out = []
    for before, after, candidates in mends:
        steps = tuple(step for step in dict.fromkeys(candidates) if counts.get(step, 0) < most)
        if not steps:  # both hold as many as most steps: the damage held no commit (a name-table checkpoint), or
            continue  # the steps hold commits unevenly and the counts cannot say
        metrics: set[str] = set()
        if len(steps) == 1:
            (step,) = steps
            full = next((held[s] for s in (step - 1, step + 1) if counts.get(s) == most and s in held), None)
            if full is not None:
                metrics = set().union(*full) - set().union(*held.get(step, []))
        out.append(Lost(before, after, steps, tuple(sorted(metrics))))
    return out
