"""The journal's byte format: magic, frames, a commit's entries, and the JSON of specs, runs and headers.

File format (version 5), little-endian::

    magic   b"MBJOURN\\x00"                      8 bytes, once
    frame   <I length> <I crc32(payload)> payload   repeated; payload[0] is the frame type
      b"H" + JSON  header: format, metricbus version, rank, run metadata, rules, log_every (again after a restart),
                   ``opened_unix_ns`` (when the writer opened the file; since this version: which segments of the
                   rank files one run or resume wrote, :func:`metricbus.journal.reader.sessions`; read where present);
                   written twice in a row (the reader keeps one of two identical adjacent copies)
      b"N" + JSON  name table rows: [[id, name, spec], ...]; the rows a commit introduces are written twice, just
                   before it, and the whole table again once ``CHECKPOINT_BYTES`` were written since the last time
      b"S" + <q step> <I n> n * (<I rank> <I id> <12d summary fields>)     a commit, no entry has a rest
      b"R" + the body of an "S" frame, then the rests of its entries that have one:
             <I m> m * (<I entry index> <I k>) <K d>                    indexes increasing, K = the sum of the k
      b"P" + <q step> <I n> <I rank> <12 B codes> n * <I id> then the 12 summary fields column by column, each
             stored, left out or stored once as its code says      a commit of one worker's unit-weight entries
             (:mod:`metricbus.journal.compact`)
      b"G" + <q first step> <q last step>   every commit of this writer in that range failed to be journaled
                                            (written with the next write that succeeds)
      b"L" + n * (<q first step> <q last step>)   the commits whose write failed (one at each step of each
                        range; a repeated step is a range of its own), written with the next write that succeeds or
                        at close, before the commit it carries: the reader counts each as an empty commit there, so
                        ``log_every`` windows stay the live ones. A reader without it skips it
      b"W" + n * <q step>   with ``log_every`` n > 1: the steps of the n commits of the window that ends with the
                        commit before it (in the same write), failed ones included, so a reader that lost one of them
                        to damage counts it still, as an empty commit at its step. A reader without it skips it
      b"K" + <q step>   a writer's first commit is at ``step``: written with it (before it, in the same write), so a
                        reader that loses that commit still knows where the segment starts and which of the file's
                        earlier steps it replaces. A reader without it skips it (an unknown type) and reads the
                        segment's start off its first readable commit, as before

An entry is one Summary of one worker's metric; a name may repeat within a commit (one entry per optimizer update
of that worker, in update order) and entries keep their order. ``Summary.rest_flat()`` (the terms that make a
sum exact beyond its ``hi``/``lo`` pair) is stored bit for bit in an "R" frame, so a commit with no rest is the
same "S" frame as in format 1 (or a "P" frame, below) and costs the same to write. A commit is always one frame, so
one CRC covers its entries and their rests together.

Damage. Any single frame can be lost (a flipped byte, a torn or partial write) and cost at most the commit it holds:
the header and every name-table addition have a second copy, and the reader resynchronises on the next frame whose
CRC is valid. A commit refers to names by id instead of carrying them (a commit of 50 metrics would grow from ~5 KB
by ~3 KB of JSON, and ``commit()`` would pay for the encoding); the price is that losing *both* copies of an
addition loses the entries naming it until the next checkpoint of the whole table (at most ``CHECKPOINT_BYTES`` of
file, ~0.5% of it for 50 names). A writer that could not write a commit writes a "G" frame with its next write, so
the reader reports the hole instead of presenting the journal as complete.

Format 5 adds "P" frames: a commit of one worker whose entries are unit-weight summaries without rests or sketches
(the usual commit) stores each field once per column and leaves out the columns that follow from others (``weight``
is ``count``, ``total`` is ``wsum``, ...), about half an "S" frame's bytes; other commits are "S" or "R" frames as
before. Format 4 adds sketches (the state of the quantile and ``hist`` kinds): an entry with one has its
``Sketch.to_ints()`` after its rest floats in an "R" frame (``rest_flat()`` says how). Format 3 is format 4 without
sketches. Format 2 has no "G" frames and writes its header and name-table additions once; format 1 has no "R"
frames either and its chains have four levels (no ``update``). All are read as they are. A reader refuses newer
formats: a format-4 reader would skip "P" frames (an unknown type) and lose those commits, a format-3 one would take
a sketch for damage, a format-2 one would read a journal with holes as complete, a format-1 one would skip "R"
frames.
"""

from __future__ import annotations

import itertools
import json
import operator
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from metricbus._version import __version__
from metricbus.adapter import RunInfo
from metricbus.journal.checksum import crc32
from metricbus.spec import Chain, Spec, check_nan
from metricbus.summary import N_FIELDS

if TYPE_CHECKING:
    from metricbus.partial import Partial

FORMAT_VERSION = 5
MAGIC = b"MBJOURN\x00"
SUFFIX = ".mbj"
FSYNC_MODES = ("commit", "interval", "never")
FSYNC_INTERVAL_S = 1.0
FRAME_TYPES = b"HNSRGPKLW"
CHECKPOINT_BYTES = 1 << 20  # the whole name table is written again after this many bytes
MAX_FRAME = 1 << 30
FRAME = struct.Struct("<II")
STEP = struct.Struct("<qI")
GAP = struct.Struct("<qq")
SEGMENT = struct.Struct("<q")
LOST = struct.Struct("<qq")
MAX_LOST = 1 << 20  # the steps an "L" or "W" frame may name: more is damage (a reader never builds more)
ENTRY = struct.Struct(f"<II{N_FIELDS}d")
_COUNT = struct.Struct("<I")
# A Summary's as_tuple() fields, read as one C slice: Summary is a NamedTuple whose first N_FIELDS fields are those,
# in that order (count packs as a double). ~2.5x cheaper than an attrgetter of the twelve names, per entry.
SUMMARY_FIELDS = operator.itemgetter(slice(0, N_FIELDS))

# One unpacked entry: (rank, name id, the 12 summary fields, the entry's rest_flat()).
Row = tuple[int, int, Sequence[float], tuple[float, ...]]


def rank_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """The file rank ``rank`` writes in ``directory``."""
    return Path(directory) / f"rank-{rank:05d}{SUFFIX}"


def lock_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """Where the writer holding rank ``rank``'s file in ``directory`` leaves its PID (the lock is on the file)."""
    return rank_file(directory, rank).with_name(f"rank-{rank:05d}{SUFFIX}.lock")


def check_fsync(fsync: object) -> str:
    """Return ``fsync`` if valid, else raise ValueError listing the valid modes."""
    if fsync not in FSYNC_MODES:
        raise ValueError(f"unknown fsync mode {fsync!r}; use one of {', '.join(FSYNC_MODES)} (default interval)")
    return str(fsync)


def frame(kind: bytes, body: bytes) -> bytes:
    """One frame: length, CRC32 and the payload ``kind + body``."""
    payload = kind + body
    return FRAME.pack(len(payload), crc32(payload)) + payload


def names_frame(rows: Sequence[Sequence[Any]]) -> bytes:
    """An "N" frame of name table rows ``[id, name, spec JSON]``."""
    return frame(b"N", json.dumps(rows).encode())


def gap_frame(first: int, last: int) -> bytes:
    """A "G" frame: the commits of steps ``first..last`` (inclusive) were not journaled, or not known to be on disk
    (a write or an fsync failed)."""
    return frame(b"G", GAP.pack(first, last))


def lost_frame(ranges: Sequence[tuple[int, int]]) -> bytes:
    """An "L" frame: one failed commit at each step of each ``(first, last)`` range."""
    return frame(b"L", b"".join(LOST.pack(first, last) for first, last in ranges))


def lost_steps(body: bytes | memoryview) -> list[int]:
    """The steps of an "L" frame's failed commits, in order; ValueError if its body is not whole ranges."""
    if len(body) % LOST.size:
        raise ValueError(f"an 'L' frame body of {len(body)} bytes is not whole (first, last) ranges")
    steps: list[int] = []
    for first, last in LOST.iter_unpack(body):
        if last < first or last - first >= MAX_LOST - len(steps):
            raise ValueError(f"an 'L' frame range {first}..{last} goes back or passes {MAX_LOST} commits")
        steps.extend(range(first, last + 1))
    return steps


def window_frame(steps: Sequence[int]) -> bytes:
    """A "W" frame: the steps of a ``log_every`` window's commits."""
    return frame(b"W", struct.pack(f"<{len(steps)}q", *steps))


def window_steps(body: bytes | memoryview) -> list[int]:
    """The steps of a "W" frame, in order; ValueError if its body is not whole steps or they go back."""
    if not body or len(body) % 8 or len(body) > 8 * MAX_LOST:
        raise ValueError(f"a 'W' frame body of {len(body)} bytes is not whole steps, at most {MAX_LOST}")
    steps = list(struct.unpack(f"<{len(body) // 8}q", body))
    if any(b < a for a, b in itertools.pairwise(steps)):
        raise ValueError("the steps of a 'W' frame go back")
    return steps


def segment_frame(step: int) -> bytes:
    """A "K" frame: this writer's first commit is at ``step``."""
    return frame(b"K", SEGMENT.pack(step))


# -- a commit's entries ------------------------------------------------------------------------------------------


_S_CRC = crc32(b"S")


def entries_layout(n: int) -> struct.Struct:
    """The layout of ``n`` entries of an "S" body, after its step and count (writers build it once per count)."""
    return struct.Struct("<" + f"II{N_FIELDS}d" * n)


ENTRIES = np.dtype([("rank", "<u4"), ("id", "<u4"), ("fields", "<f8", (N_FIELDS,))])  # ENTRY, as numpy packs it


def packed_entries(rank: int, ids: Any) -> Any:
    """Entries of an "S" body as a numpy array (``ENTRIES``): ``rank`` and ``ids`` (one per entry) filled in; the
    caller sets ``["fields"]`` (the transpose of a (N_FIELDS, n) array) and takes ``tobytes()``."""
    out = np.empty(len(ids), dtype=ENTRIES)
    out["rank"] = rank
    out["id"] = ids
    return out


class SteadyFrame:
    """The "S" frame of one commit shape (each part's rank and name ids, in order), allocated once: a commit of that
    shape copies its parts' fields into it, sets its step, count and CRC, and writes ``data``. Byte for byte
    :func:`body_frame` of the same entries; ``data`` is overwritten by the next :meth:`fill`."""

    __slots__ = ("_count", "_fields", "_length", "_payload", "data")

    def __init__(self, parts: Sequence[tuple[int, Any]]) -> None:
        self._count = sum(len(ids) for _, ids in parts)
        rows = np.concatenate([packed_entries(rank, ids) for rank, ids in parts]) if parts else np.empty(0, ENTRIES)
        head = FRAME.size + 1 + STEP.size
        self.data = bytearray(head + rows.nbytes)
        self.data[FRAME.size] = ord("S")
        self.data[head:] = rows.tobytes()
        self._payload = memoryview(self.data)[FRAME.size + 1 :]  # what the CRC covers after b"S"
        self._length = len(self.data) - FRAME.size
        self._fields: list[Any] = []  # per part, its fields' slots as a (N_FIELDS, n) view of ``data``
        offset = head + ENTRY.size - 8 * N_FIELDS  # an entry's fields follow its rank and id
        for _, ids in parts:
            shape = (N_FIELDS, len(ids))
            self._fields.append(np.ndarray(shape, "<f8", buffer=self.data, offset=offset, strides=(8, ENTRY.size)))
            offset += len(ids) * ENTRY.size

    def fill(self, step: int, entries: Sequence[tuple[int, Partial]]) -> bytearray:
        """``data`` holding the commit of ``step`` of ``entries``: partials of this shape, each of a packed form."""
        fields = self._fields
        if len(fields) == 1:  # one worker: the usual commit
            fields[0][...] = entries[0][1].packed.fields
        else:
            for slots, (_, partial) in zip(fields, entries, strict=True):
                slots[...] = partial.packed.fields
        data = self.data
        _pack_step(data, _STEP_AT, step, self._count)
        _pack_frame(data, 0, self._length, _crc32(self._payload, _S_CRC))
        return data


_STEP_AT = FRAME.size + 1
_pack_step = STEP.pack_into
_pack_frame = FRAME.pack_into
_crc32 = crc32


def body_frame(body: bytes, rests: Sequence[tuple[int, Sequence[float]]]) -> bytes:
    """A commit's frame of its packed "S" ``body`` (step, n, entries) and ``rests`` (index, floats)."""
    if not rests:  # frame(b"S", body), copying the body once: its CRC continues from b"S"'s
        return b"".join((FRAME.pack(len(body) + 1, crc32(body, _S_CRC)), b"S", body))
    lengths = [x for index, rest in rests for x in (index, len(rest))]
    floats = [x for _, rest in rests for x in rest]
    extra = struct.pack(f"<I{len(lengths)}I{len(floats)}d", len(rests), *lengths, *floats)
    return frame(b"R", body + extra)


def unpack_commit(kind: bytes, body: bytes) -> tuple[int, list[Row]]:
    """``(step, rows)`` of an "S" or "R" body; raise ValueError or struct.error if it is inconsistent."""
    step, n = STEP.unpack_from(body, 0)
    end = STEP.size + n * ENTRY.size
    if len(body) < end or (kind == b"S" and len(body) != end):
        raise ValueError(f"a commit of {n} entries cannot be {len(body)} bytes long")
    rows: list[Row] = [(e[0], e[1], e[2:], ()) for e in ENTRY.iter_unpack(body[STEP.size : end])]
    if kind == b"R":
        (m,) = _COUNT.unpack_from(body, end)
        lengths = struct.unpack_from(f"<{2 * m}I", body, end + _COUNT.size)
        pos = end + _COUNT.size + 8 * m
        if len(body) != pos + 8 * sum(lengths[1::2]):
            raise ValueError(f"the rests of a commit of {n} entries cannot end at byte {len(body)}")
        last = -1
        for index, k in zip(lengths[::2], lengths[1::2], strict=True):
            if not last < index < n:
                raise ValueError(f"rest of entry {index} out of order or range ({n} entries)")
            rank, ident, fields, _ = rows[index]
            rows[index] = (rank, ident, fields, struct.unpack_from(f"<{k}d", body, pos))
            pos += 8 * k
            last = index
    return step, rows


# -- JSON parts ----------------------------------------------------------------------------------------------------


def spec_to_json(spec: Spec) -> dict[str, Any]:
    """An exact, version-stable form of ``spec``."""
    return {"chains": [[c.micro, c.update, c.rank, c.step, c.suffix] for c in spec.chains], "nan": spec.nan}


def spec_from_json(data: Any) -> Spec:
    """Inverse of :func:`spec_to_json`; also reads format 1's four-level chains (update = micro). Equal JSON gives
    the same Spec object (a name table is written again at every checkpoint)."""
    try:
        key = (tuple(tuple(c) for c in data["chains"]), data.get("nan"))
        held = _SPECS.get(key)
    except TypeError:  # not hashable: malformed, the general path below raises the right error
        key, held = None, None
    if held is not None:
        return held
    spec = _spec_from_json(data)
    if key is not None:
        if len(_SPECS) >= _SPECS_KEPT:
            _SPECS.clear()
        _SPECS[key] = spec
    return spec


_SPECS: dict[Any, Spec] = {}
_SPECS_KEPT = 4096


def _spec_from_json(data: Any) -> Spec:
    chains = tuple(
        Chain(*(str(f) for f in c)) if len(c) == 5 else Chain(str(c[0]), str(c[0]), *(str(f) for f in c[1:]))
        for c in data["chains"]
    )
    nan = data.get("nan")
    return Spec(chains, None if nan is None else check_nan(nan, metric="journal"))


def run_to_json(run: RunInfo) -> dict[str, Any]:
    """Run metadata as JSON (config values that are not JSON become their ``str``)."""
    return {
        "project": run.project,
        "name": run.name,
        "tags": list(run.tags),
        "config": json.loads(json.dumps(dict(run.config), default=str)),
        "start_time_unix_ns": run.start_time_unix_ns,
        "id": run.id,
    }


def run_from_json(data: Any) -> RunInfo:
    """Inverse of :func:`run_to_json`."""
    return RunInfo(
        project=str(data.get("project", "metricbus")),
        name=data.get("name"),
        tags=tuple(data.get("tags", ())),
        config=dict(data.get("config", {})),
        start_time_unix_ns=int(data.get("start_time_unix_ns", 0)),
        id=str(data.get("id") or ""),  # format 1-3 journals before run ids: a fresh id
    )


def make_header(
    *, rank: int, run: RunInfo, rules: Sequence[tuple[str, Spec]], log_every: int, world: int = 1
) -> dict[str, Any]:
    """A file header; its keys are stable across versions (readers of any version look them up by name). ``world``
    (written where above 1, read where present): how many ranks journal a file each, so a reader names a missing one.
    :func:`~metricbus.journal.writer.open_journal` adds ``opened_unix_ns``."""
    header: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "metricbus": __version__,
        "rank": int(rank),
        "run": run_to_json(run),
        "rules": [[pattern, spec_to_json(spec)] for pattern, spec in rules],
        "log_every": int(log_every),
    }
    if world > 1:
        header["world"] = int(world)
    return header
