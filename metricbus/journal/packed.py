"""A commit's raw rows as packed partials (:class:`metricbus.partial.Packed`), without a Summary per entry.

Replay hands these to :func:`metricbus.packed_ranks.rank_levels`, which reduces them column-wise: the same partials
:attr:`metricbus.journal.reader.Commit.partials` decodes, in the same rank order (a later file's entries of a rank
replace an earlier one's), with each name's spec passed through ``respec`` (replay's rule overrides). A commit whose
ranks log the same names is read as one :class:`metricbus.packed_ranks.Ranks` instead (:meth:`PackedRows.ranks`):
views of its rows, no Partial per rank.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from metricbus.journal.scan import Names, RawPart, entries_of
from metricbus.packed_ranks import Ranks
from metricbus.partial import Packed, Partial, from_packed
from metricbus.sketch import Sketch
from metricbus.spec import Spec
from metricbus.summary import N_FIELDS, Summary

Respec = Callable[[str, Spec], Spec]
# (the names table, the ids of one rank's rows) -> (names, specs, known rows or None, layout, single, the table,
# the specs by name)
_Key = tuple[int, bytes]
_Held = tuple[tuple[str, ...], tuple[Spec, ...], object, bytes, bool, Names, dict[str, Spec]]
_LAYOUTS_KEPT = 64


class PackedRows:
    """Turns commits' raw rows into packed partials, remembering each row layout it has seen."""

    def __init__(self, respec: Respec) -> None:
        self._respec = respec
        self._layouts: dict[_Key, _Held] = {}

    def partials(self, parts: tuple[RawPart, ...]) -> list[Partial]:
        """Each rank's partial of one commit, in rank order."""
        by_rank: dict[int, Partial] = {}
        for part in parts:
            rows = part.rows
            if not len(rows):
                continue
            ranks = rows["rank"]
            cuts = np.flatnonzero(ranks[1:] != ranks[:-1]) + 1
            starts = [0, *cuts.tolist()]
            order = ranks[starts].tolist()
            if len(set(order)) != len(order):  # a rank's rows are not contiguous: decode this part the slow way
                respec = self._respec
                for rank, entries in entries_of(part).items():
                    by_rank[rank] = Partial(tuple((name, respec(name, spec), s) for name, spec, s in entries))
                continue
            for rank, start, stop in zip(order, starts, [*starts[1:], len(rows)], strict=True):
                by_rank[rank] = self._partial(part, start, stop)
        return [by_rank[rank] for rank in sorted(by_rank)]

    def ranks(self, parts: tuple[RawPart, ...]) -> tuple[Ranks, dict[str, Spec]] | None:
        """A commit's rows as one :class:`Ranks`, with its specs by name (not to be changed: one rank file's are
        shared by the commits of its layout), where they allow it: no rests, two or more ranks, ascending through
        the parts, each part's ranks with the same name ids in the same order (what a writer's commits are, commit
        after commit). Else None (use :meth:`partials`)."""
        groups: list[tuple[Packed, Any]] = []
        specs: list[dict[str, Spec]] = []
        last = -1
        for part in parts:
            rows = part.rows
            if part.rests or not len(rows):
                return None
            ranks = rows["rank"]
            n = int(np.argmax(ranks != ranks[0])) or len(rows)  # the first rank's entries
            if len(rows) % n:
                return None
            by_rank = ranks.reshape(-1, n)
            ids = rows["id"].reshape(-1, n)
            ascending = int(by_rank[0, 0]) > last and (by_rank[1:, 0] > by_rank[:-1, 0]).all()
            if not (ascending and (by_rank == by_rank[:, :1]).all() and (ids == ids[0]).all()):
                return None
            last = int(by_rank[-1, 0])
            names, kinds, known, layout, single, _, by_name = self._held(part.names, ids[0])
            fields = rows["fields"].reshape(-1, n, N_FIELDS).transpose(2, 0, 1)  # (N_FIELDS, R, n), a view
            if known is not None:
                fields = fields[:, :, known]
            groups.append((Packed(names, kinds, fields[:, 0, :], (), layout, single), fields))
            specs.append(by_name)
        if sum(fields.shape[1] for _, fields in groups) < 2:
            return None
        return Ranks(tuple(groups)), specs[0] if len(specs) == 1 else {k: v for s in specs for k, v in s.items()}

    def specs(self, partials: list[Partial]) -> dict[str, Spec]:
        """The specs of a commit's partials, by name."""
        out: dict[str, Spec] = {}
        seen: set[bytes] = set()
        for partial in partials:
            packed = partial.packed
            if packed.layout not in seen:  # partials of one layout have the same names and specs
                seen.add(packed.layout)
                out.update(zip(packed.names, packed.specs, strict=True))
        return out

    def _partial(self, part: RawPart, start: int, stop: int) -> Partial:
        rows = part.rows[start:stop]
        names, specs, known, layout, single, _, _ = self._held(part.names, rows["id"])
        fields = rows["fields"].T
        rests: list[tuple[int, tuple[tuple[float, ...], ...]]] = []
        sketches: list[tuple[int, Sketch]] = []
        if part.rests:
            kept = range(len(rows)) if known is None else known.tolist()  # type: ignore[attr-defined]
            position = {row: i for i, row in enumerate(kept)}
            for index, flat in part.rests.items():
                if start <= index < stop and index - start in position:
                    entry = Summary.from_tuple(rows["fields"][index - start].tolist(), flat)
                    if entry.rest:
                        rests.append((position[index - start], entry.rest))
                    if entry.sketch is not None:
                        sketches.append((position[index - start], entry.sketch))
        if known is not None:
            fields = fields[:, known]
        return from_packed(Packed(names, specs, fields, tuple(rests), layout, single, tuple(sketches)), frozenset())

    def _held(self, table: Names, ids: Any) -> _Held:
        """What this row layout (one rank's name ids, a numpy array, under ``table``) decides."""
        key = (id(table), ids.tobytes())
        held = self._layouts.get(key)
        if held is None:
            if len(self._layouts) >= _LAYOUTS_KEPT:  # a name table read again at a checkpoint makes new keys
                self._layouts.clear()
            held = self._layouts[key] = self._layout(table, ids.tolist(), key)
        return held

    def _layout(self, table: Names, ids: list[int], key: _Key) -> _Held:
        respec = self._respec
        keep = [i for i, ident in enumerate(ids) if ident in table]
        names = tuple(table[ids[i]][0] for i in keep)
        specs = tuple(respec(table[ids[i]][0], table[ids[i]][1]) for i in keep)
        digest = hashlib.blake2b(struct.pack("<Q", key[0]) + key[1], digest_size=16).digest()
        known = None if len(keep) == len(ids) else np.array(keep, dtype=np.int64)
        return names, specs, known, digest, len(set(names)) == len(names), table, dict(zip(names, specs, strict=True))
