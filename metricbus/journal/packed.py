"""A commit's raw rows as packed partials (:class:`metricbus.partial.Packed`), without a Summary per entry.

Replay hands these to :func:`metricbus.packed_ranks.rank_levels`, which reduces them column-wise: the same partials
:attr:`metricbus.journal.reader.Commit.partials` decodes, in the same rank order (a later file's entries of a rank
replace an earlier one's), with each name's spec passed through ``respec`` (replay's rule overrides).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

import numpy as np

from metricbus.journal.scan import Names, RawPart, entries_of
from metricbus.partial import Packed, Partial, from_packed
from metricbus.sketch import Sketch
from metricbus.spec import Spec
from metricbus.summary import Summary

Respec = Callable[[str, Spec], Spec]
# (the names table, the ids of one rank's rows) -> (names, specs, known rows or None, layout, single, the table)
_Key = tuple[int, bytes]
_Held = tuple[tuple[str, ...], tuple[Spec, ...], object, bytes, bool, Names]
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
        ids = rows["id"]
        key = (id(part.names), ids.tobytes())
        held = self._layouts.get(key)
        if held is None:
            if len(self._layouts) >= _LAYOUTS_KEPT:  # a name table read again at a checkpoint makes new keys
                self._layouts.clear()
            held = self._layouts[key] = self._layout(part.names, ids.tolist(), key)
        names, specs, known, layout, single, _ = held
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

    def _layout(self, table: Names, ids: list[int], key: _Key) -> _Held:
        respec = self._respec
        keep = [i for i, ident in enumerate(ids) if ident in table]
        names = tuple(table[ids[i]][0] for i in keep)
        specs = tuple(respec(table[ids[i]][0], table[ids[i]][1]) for i in keep)
        digest = hashlib.blake2b(struct.pack("<Q", key[0]) + key[1], digest_size=16).digest()
        known = None if len(keep) == len(ids) else np.array(keep, dtype=np.int64)
        return names, specs, known, digest, len(set(names)) == len(names), table
