"""The "P" frame (format 5): one worker's commit of unit-weight summaries, column by column, its redundancy left out.

Most commits are one worker's (a single-process bus, or a torch.distributed rank writing its own file) and hold
micro-level summaries of plain, unit-weight records. Of such a summary's 12 fields four follow from others:
``weight`` is ``count``, ``weight_lo`` is 0.0, ``total`` is ``wsum`` and ``total_lo`` is ``wsum_lo`` (which is 0.0
unless a sum needed a second component), and ``count`` is often the same for every metric. An "S" frame stores all
of them per entry, with its rank, 104 bytes an entry; a "P" frame stores each field once per column and such
columns not at all (52 bytes an entry, 60 with ``wsum_lo``), so ``commit()`` hands about half the bytes to the
kernel and its CRC covers half as many. Layout, after the type byte::

    <q step> <I n> <I rank> <12 B column codes> <B ids code> the name ids by their code:
      0  listed: n * <I id>
      1  consecutive: <I first id> (a layout's names registered together, as a bus's first commit registers them)
    then column 0 .. 11 of the fields, each by its code:
      0  stored: n * <d>
      1  every entry +0.0 (no bytes)
      2  every entry the same: one <d>
      3 + j  a copy of column j (j before it; no bytes)

Every column is bit for bit what the writer had (NaN payloads and -0.0 included): a code other than "stored" is
written only where the bytes say it holds. :class:`CompactFrame` writes the scheme above (a commit it does not fit,
e.g. a weighted metric's, is an "S" frame) and, where every count is 1 (each metric logged once: its value is
``wsum``, ``min``, ``max``, ``first`` and ``last``, and ``m2`` is +0.0), codes that store ``wsum`` alone (8 bytes an
entry); :func:`compact_rows` reads any valid codes, so both are format 5.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from metricbus.journal.checksum import crc32
from metricbus.journal.format import ENTRIES, FRAME
from metricbus.native import speedups
from metricbus.summary import N_FIELDS

STORED, ZERO, SAME, COPY = 0, 1, 2, 3  # column codes (COPY + j: a copy of column j)
LISTED, CONSECUTIVE = 0, 1  # ids codes
HEAD = struct.Struct("<qII")  # step, n, rank (after the type byte)
_IDS_AT = HEAD.size + N_FIELDS  # the ids code follows the column codes, the ids follow it
_FIRST = struct.Struct("<I")
_KIND_STEP = struct.Struct("<cq")
_PAIR = struct.Struct("<II")
_NATIVE = sys.byteorder == "little"  # the frame's doubles are the fields' own bytes
_ZERO8 = bytes(8)
_ONE = struct.pack("<d", 1.0)
# what a count column decides: a steady commit's first three columns, the column, the heads (per wsum_lo nonzero
# or zero, what follows the step up to wsum), the one-record scheme's heads where every count is 1 (else None)
_Count = tuple[bytes, bytes, tuple[bytes, bytes], tuple[bytes, bytes] | None]
_crc32 = crc32


def _codes(*, same_count: bool, zero_lo: bool, single: bool) -> bytes:
    """The writer's codes: count (column 0) stored or the same for all, wsum_lo (4) stored or zero; ``single``
    (every count 1): m2 zero and min, max, first, last copies of wsum."""
    tail = (ZERO, *(COPY + 3,) * 4) if single else (STORED,) * 5
    return bytes((
        SAME if same_count else STORED,  # count
        COPY + 0,  # weight = count
        ZERO,  # weight_lo
        STORED,  # wsum
        ZERO if zero_lo else STORED,  # wsum_lo
        COPY + 3,  # total = wsum
        COPY + 4,  # total_lo = wsum_lo
        *tail,  # m2, min, max, first, last
    ))


class CompactFrame:
    """Writes the "P" frames of one layout (its ``layout`` digest, from worker ``rank``, with name ``ids``).

    :meth:`frame` checks on the fields' bytes that the scheme holds and joins the frame: the head kept for the last
    count column, the columns stored, the CRC. A steady commit (the count column of the one before) needs two
    comparisons: its first three columns against the last count, count again and zeros (count unchanged, ``weight``
    is ``count``, ``weight_lo`` is +0.0), and ``(total, total_lo)`` against ``(wsum, wsum_lo)``; one more where
    every count is 1 (m2 zero, min .. last equal to wsum: then only wsum is stored)."""

    __slots__ = ("_count", "_head", "_n", "_size", "_width", "_zero", "layout", "rank")

    def __init__(self, *, layout: bytes, rank: int, ids: Any) -> None:
        self.layout = layout
        self.rank = rank
        self._n = n = len(ids)
        self._width = 8 * n  # one column's bytes
        # the fields' bytes (none fits where the frame's doubles would not be the fields' own bytes, or no entry)
        self._size = N_FIELDS * self._width if n and _NATIVE else -1
        self._zero = bytes(self._width)
        listed = np.asarray(ids, dtype="<u4")
        if n and bool((listed.astype(np.int64) == int(listed[0]) + np.arange(n)).all()):
            ids_piece = bytes((CONSECUTIVE,)) + _FIRST.pack(int(listed[0]))
        else:
            ids_piece = bytes((LISTED,)) + listed.tobytes()
        self._head = _PAIR.pack(n, rank), ids_piece
        # what the last count column decides (:meth:`_recount`); at first no commit starts with it
        never = bytes(self._size + 2)
        self._count: _Count = (never, never, (b"", b""), None)

    def _recount(self, column: bytes) -> _Count:
        """The count column changed (the first commit; rarely later): what it decides (see ``_Count``)."""
        same = column == column[:8] * self._n
        head, ids = self._head
        piece = column[:8] if same else column
        nonzero, zero, one_nonzero, one_zero = (
            head + _codes(same_count=same, zero_lo=z, single=single) + ids + piece
            for single in (False, True)
            for z in (False, True)
        )
        single = (one_nonzero, one_zero) if same and piece == _ONE else None
        self._count = (column + column + self._zero, column, (nonzero, zero), single)
        return self._count

    def frame(self, step: int, fields: Any) -> bytes | None:
        """The frame of ``step`` of ``fields`` (a (N_FIELDS, n) float64 array), or None where the scheme fails."""
        raw = fields.tobytes()
        if len(raw) != self._size:
            return None
        count = self._count
        if not raw.startswith(count[0]):  # count, weight = count, weight_lo = +0.0, as in the last commit
            if not raw.startswith(count[1]):
                count = self._recount(raw[: self._width])
            if not raw.startswith(count[0]):  # weight is not count, or weight_lo not +0.0
                return None
        w = self._width
        sums = raw[3 * w : 5 * w]  # wsum, wsum_lo
        if not raw.startswith(sums, 5 * w):  # (total, total_lo) == (wsum, wsum_lo)
            return None
        single = count[3]
        if single is not None and raw.startswith(self._zero, 7 * w) and raw.endswith(sums[:w] * 4):
            heads, stored = single, b""  # one record each: m2 +0.0, min = max = first = last = wsum
        else:
            heads, stored = count[2], raw[7 * w :]  # m2, min, max, first, last
        if raw.startswith(self._zero, 4 * w):
            payload = b"".join((_step(b"P", step), heads[1], sums[:w], stored))
        else:
            payload = b"".join((_step(b"P", step), heads[0], sums, stored))
        return _frame(len(payload), _crc32(payload)) + payload

    def frame_into(self, target: Any, where: int, step: int, fields: Any) -> int:
        """:meth:`frame` built straight into the writable buffer ``target`` at offset ``where``, the same bytes, its
        head last (the compiled module's ``compact_into``): its size. 0 where nothing was written: no compiled
        module, no room before the end of ``target``, or a commit :meth:`frame` must take (the scheme fails, or the
        count column changed: it recounts). Where the CRC function raises, so does this, and the frame's bytes in
        ``target`` are zeros (as the stage's are past the bytes staged)."""
        if _into is None:
            return 0
        return _into(target, where, fields, self._count, step, _crc32)


_into: Callable[..., int] | None = None if speedups is None else speedups.compact_into
_step = _KIND_STEP.pack
_frame = FRAME.pack


def _gather(codes: bytes, n: int) -> tuple[Any, int]:
    """Where each field of each entry is in a "P" body's doubles (followed by one +0.0), as a (N_FIELDS, n) index
    array, and how many doubles the body holds; ValueError for an invalid code."""
    index = np.empty((N_FIELDS, n), dtype=np.intp)
    columns: list[tuple[int, int]] = []  # per column: (code, where its doubles start)
    held = 0
    for i, code in enumerate(codes):
        columns.append((code, held))
        if code == STORED:
            held += n
        elif code == SAME:
            held += 1
        elif code != ZERO and not COPY <= code < COPY + i:
            raise ValueError(f"column {i} of a compact commit has an invalid code {code}")
    for i, (code, start) in enumerate(columns):
        if code == STORED:
            index[i] = np.arange(start, start + n)
        elif code == SAME:
            index[i] = start
        elif code == ZERO:
            index[i] = held  # the +0.0 after the body's doubles
        else:
            index[i] = index[code - COPY]
    return index, held


_GATHERS: dict[tuple[bytes, int], tuple[Any, int]] = {}
_GATHERS_KEPT = 64


def _gathered(codes: bytes, n: int) -> tuple[Any, int]:
    """:func:`_gather`, remembered."""
    key = (codes, n)
    held = _GATHERS.get(key)
    if held is None:
        if len(_GATHERS) >= _GATHERS_KEPT:
            _GATHERS.clear()
        held = _GATHERS[key] = _gather(codes, n)
    return held


def _ids(body: bytes | memoryview, at: int, n: int) -> tuple[Any, int]:
    """The name ids of the "P" body whose ids code is at ``at`` (a uint32 array), and where its doubles start;
    ValueError for an invalid code or a body too short for its ids."""
    code = body[at]
    if code == LISTED:
        end = at + 1 + 4 * n
        if len(body) < end:
            raise ValueError(f"a compact commit of {n} entries cannot be {len(body)} bytes long")
        return np.frombuffer(body, dtype="<u4", count=n, offset=at + 1), end
    if code != CONSECUTIVE:
        raise ValueError(f"a compact commit has an invalid ids code {code}")
    (first,) = _FIRST.unpack_from(body, at + 1)
    if first + n > 1 << 32:
        raise ValueError(f"a compact commit's {n} consecutive ids from {first} pass 2**32")
    return np.arange(first, first + n, dtype=np.int64).astype("<u4"), at + 1 + _FIRST.size


def _fits(n: int, size: int) -> bool:
    """Whether ``n`` entries fit a "P" body of ``size`` bytes: every frame stores each entry's wsum (8 bytes), so a
    frame that says more entries is damage, read before anything is allocated for them (a 34-byte frame could
    otherwise say 2**32 - 1 entries without stored columns)."""
    return 8 * n <= size


def compact_rows(body: bytes | memoryview) -> tuple[int, Any]:
    """``(step, rows)`` of a "P" body (after its type byte): rows of :data:`~metricbus.journal.format.ENTRIES`, as
    an "S" frame's read; ValueError or struct.error if the body is inconsistent."""
    step, n, rank = HEAD.unpack_from(body, 0)
    if len(body) <= _IDS_AT or not _fits(n, len(body)):
        raise ValueError(f"a compact commit of {n} entries cannot be {len(body)} bytes long")
    ids, doubles = _ids(body, _IDS_AT, n)
    index, count = _gathered(bytes(body[HEAD.size : _IDS_AT]), n)
    if len(body) != doubles + 8 * count:
        raise ValueError(f"a compact commit of {n} entries cannot be {len(body)} bytes long")
    values = np.frombuffer(bytes(body[doubles:]) + _ZERO8, dtype="<f8")
    fields = values[index]  # (N_FIELDS, n): every field's bytes, copied
    if n and not np.isfinite(fields[0]).all():
        raise ValueError("a summary count that is not finite")
    rows = np.empty(n, dtype=ENTRIES)
    rows["rank"] = rank
    rows["id"] = ids
    rows["fields"] = fields.T
    rows.flags.writeable = False
    return int(step), rows


def _run_head(span: bytes | memoryview, k: int) -> tuple[int, int, Any, Any, int, int, int] | None:
    """What :func:`compact_run` reads of its ``k`` frames before their doubles: ``(n, rank, ids, index, count,
    doubles, stride)`` (the entries; their rank and name ids; :func:`_gather`'s index and count; where a payload's
    doubles start; a frame's bytes with its head), or None where they do not share their head, or are too short
    for a head or for the entries it says (:func:`_fits`)."""
    length = (len(span) + FRAME.size) // k - FRAME.size
    if length <= 1 + _IDS_AT:  # shorter than a "P" head (damage): read frame by frame
        return None
    _, n, rank = HEAD.unpack_from(span, 1)
    if not _fits(n, length):
        return None
    try:
        ids, doubles = _ids(span, 1 + _IDS_AT, n)  # where a payload's doubles start
        index, count = _gathered(bytes(span[1 + HEAD.size : 1 + _IDS_AT]), n)
    except ValueError:
        return None
    if length != doubles + 8 * count:
        return None
    stride = length + FRAME.size
    payloads = np.ndarray((k, length), np.uint8, span, 0, (stride, 1))
    heads = payloads[:, 1 + 8 : doubles]  # after the type and the step
    if not (heads == heads[0]).all():
        return None
    return n, rank, ids, index, count, doubles, stride


def compact_run(span: bytes | memoryview, k: int) -> Any:
    """``k`` "P" frames one after the other, all of one length (``span``: from the first payload to the end of the
    last, as :meth:`metricbus.journal.frames.FrameSource.frames` yields a run), as one array of what
    :func:`~metricbus.journal.frames.run_of` gives for "S" frames (per commit its ``step``, ``n`` and ``rows``), when
    they share their head (entries, rank, codes and name ids); else None (read them one at a time)."""
    head = _run_head(span, k)
    if head is None:
        return None
    n, rank, ids, index, count, doubles, stride = head
    values = np.zeros((k, count + 1))  # each commit's doubles, then the +0.0 ZERO columns read
    values[:, :count] = np.ndarray((k, count), "<f8", span, doubles, (stride, 8))
    fields = values[:, index]  # (k, N_FIELDS, n)
    if n and not np.isfinite(fields[:, 0]).all():
        return None
    run = np.empty(k, dtype=np.dtype([("step", "<i8"), ("n", "<u4"), ("rows", ENTRIES, (n,))]))
    run["step"] = np.ndarray((k,), "<i8", span, 1, (stride,))
    run["n"] = n
    rows = run["rows"]
    rows["rank"] = rank
    rows["id"] = ids
    rows["fields"] = fields.transpose(0, 2, 1)
    run.flags.writeable = False
    return run


def compact_steps(span: bytes | memoryview, k: int) -> Any:
    """The ``step`` of :func:`compact_run`'s array (a (k,) int64 array, copied), read without the rest of the frames:
    where it gives an array whose counts are all finite; else None. (A reader's first pass needs only the steps.)"""
    head = _run_head(span, k)
    if head is None:
        return None
    n, _, _, index, count, doubles, stride = head
    if n:
        column = index[0]
        stored = column[column < count]  # the count column's doubles (none where it is the +0.0 ZERO column)
        counts = np.ndarray((k, count), "<f8", span, doubles, (stride, 8))[:, stored]
        if not np.isfinite(counts).all():
            return None
    return np.ndarray((k,), "<i8", span, 1, (stride,)).copy()
