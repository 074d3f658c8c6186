"""The journal: every commit's micro-level summaries, appended durably per rank, readable by any later version.

Layout: a directory; rank ``r`` writes ``rank-{r:05d}.mbj`` (a single-controller bus writes every worker's
partials into its own file, each entry tagged with the worker's rank). Delivery cursors live in ``cursors/``.

File format (version 1), little-endian::

    magic   b"MBJOURN\\x00"                      8 bytes, once
    frame   <I length> <I crc32(payload)> payload   repeated; payload[0] is the frame type
      b"H" + JSON  header: format, metricbus version, rank, run metadata, rules, log_every (again after a restart)
      b"N" + JSON  name table additions: [[id, name, spec], ...], written once per (name, spec)
      b"S" + <q step> <I n> n * (<I rank> <I id> <12d summary fields>)    one frame per commit

A commit is one ``os.write`` of its frames (name table additions first), so when ``commit()`` returns its bytes
are in the operating system and survive SIGKILL. ``fsync`` decides what survives a power loss: ``"commit"``
(fsync every commit), ``"interval"`` (the default: fsync at most every ``FSYNC_INTERVAL_S`` seconds, and at close),
``"never"``. Every frame carries a CRC32: a torn or damaged frame is skipped with a :class:`JournalWarning`, and the
reader resynchronises on the next valid frame. Floats are stored as IEEE doubles, so they round-trip bit for bit.
"""

from __future__ import annotations

import json
import operator
import os
import struct
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metricbus.adapter import RunInfo
from metricbus.errors import JournalError
from metricbus.partial import Partial
from metricbus.spec import Chain, Spec, check_nan
from metricbus.summary import N_FIELDS, Summary

FORMAT_VERSION = 1
MAGIC = b"MBJOURN\x00"
SUFFIX = ".mbj"
FSYNC_MODES = ("commit", "interval", "never")
FSYNC_INTERVAL_S = 1.0
_FRAME = struct.Struct("<II")
_STEP = struct.Struct("<qI")
_ENTRY = struct.Struct(f"<II{N_FIELDS}d")
_MAX_FRAME = 1 << 30
# The Summary fields in as_tuple() order, read in one C call (count packs as a double).
_FIELDS = operator.attrgetter(
    "count", "weight", "weight_lo", "wsum", "wsum_lo", "total", "total_lo", "m2", "min", "max", "first", "last"
)


class JournalWarning(UserWarning):
    """A journal file has a torn or damaged record; it was skipped."""


def rank_file(directory: str | os.PathLike[str], rank: int) -> Path:
    """The file rank ``rank`` writes in ``directory``."""
    return Path(directory) / f"rank-{rank:05d}{SUFFIX}"


def spec_to_json(spec: Spec) -> dict[str, Any]:
    """An exact, version-stable form of ``spec``."""
    return {"chains": [[c.micro, c.update, c.rank, c.step, c.suffix] for c in spec.chains], "nan": spec.nan}


def spec_from_json(data: Any) -> Spec:
    """Inverse of :func:`spec_to_json`."""
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
    }


def run_from_json(data: Any) -> RunInfo:
    """Inverse of :func:`run_to_json`."""
    return RunInfo(
        project=str(data.get("project", "metricbus")),
        name=data.get("name"),
        tags=tuple(data.get("tags", ())),
        config=dict(data.get("config", {})),
        start_time_unix_ns=int(data.get("start_time_unix_ns", 0)),
    )


def _frame(kind: bytes, body: bytes) -> bytes:
    payload = kind + body
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def check_fsync(fsync: object) -> str:
    """Return ``fsync`` if valid, else raise ValueError listing the valid modes."""
    if fsync not in FSYNC_MODES:
        raise ValueError(f"unknown fsync mode {fsync!r}; use one of {', '.join(FSYNC_MODES)} (default interval)")
    return str(fsync)


# -- delivery cursors ------------------------------------------------------------------------------------------


def adapter_key(adapter: Any) -> str:
    """A file-name-safe key naming ``adapter`` by its name and options, so two adapters never share a cursor.

    An adapter may set ``cursor_key`` itself; otherwise the key is its name plus a hash of the values of its
    constructor options (paths made absolute), read back from same-named attributes (or ``_``-prefixed ones).
    """
    explicit = getattr(adapter, "cursor_key", None)
    name = str(getattr(adapter, "name", type(adapter).__name__))
    if isinstance(explicit, str) and explicit:
        ident = explicit
    else:
        from metricbus.registry import adapter_options

        try:
            options = adapter_options(type(adapter))
        except (TypeError, ValueError):
            options = []
        parts = []
        for option in options:
            value = getattr(adapter, option, getattr(adapter, f"_{option}", None))
            if isinstance(value, os.PathLike):
                value = os.path.abspath(os.fspath(value))
            parts.append(f"{option}={value!r}")
        ident = ";".join(parts)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]
    return f"{safe}-{zlib.crc32(ident.encode()):08x}"


class CursorStore:
    """Per adapter, the last step its backend acknowledged, in ``<journal>/cursors/<key>.json``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory) / "cursors"
        self._last: dict[str, int] = {}

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, adapter: Any) -> int | None:
        """The last acknowledged step of ``adapter`` (None: nothing yet)."""
        try:
            data = json.loads(self._path(adapter_key(adapter)).read_text(encoding="utf-8"))
            return int(data["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def advance(self, adapter: Any, step: int) -> None:
        """Record ``step`` as acknowledged (atomically: tmp file + rename); never moves backwards."""
        key = adapter_key(adapter)
        last = self._last.get(key)
        if last is None:
            last = self.get(adapter)
        if last is not None and step <= last:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self._path(key)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        name = str(getattr(adapter, "name", type(adapter).__name__))
        tmp.write_text(json.dumps({"adapter": name, "key": key, "step": int(step)}), encoding="utf-8")
        os.replace(tmp, target)
        self._last[key] = int(step)


# -- writing -----------------------------------------------------------------------------------------------------


class JournalWriter:
    """Appends one rank's commits to its file; ``delivered`` keeps the adapters' cursors."""

    def __init__(self, *, path: str | os.PathLike[str], fsync: str, rank: int, header: dict[str, Any]) -> None:
        self._fsync = check_fsync(fsync)
        self.directory = Path(path)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = rank_file(self.directory, rank)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._ids: dict[str, tuple[int, Spec]] = {}
        self._layouts: dict[int, struct.Struct] = {}  # one packing layout per entry count, built once
        self._next_id = 0
        self._last_sync = time.monotonic()
        self._cursors = CursorStore(self.directory)
        start = MAGIC if os.fstat(self._fd).st_size == 0 else b""
        self._write(start + _frame(b"H", json.dumps(header).encode()))
        if self._fsync != "never":
            os.fsync(self._fd)

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def append(self, *, step: int, entries: list[tuple[int, Partial]]) -> None:
        """Write one commit (all its entries) in one ``os.write``, before commit() returns."""
        if self._fd is None:
            return
        ids = self._ids
        new: list[list[Any]] = []
        flat: list[float] = [step, 0]
        fields = _FIELDS
        n = 0
        for rank, partial in entries:
            for name, spec, summary in partial.entries:
                known = ids.get(name)
                if known is None or (known[1] is not spec and known[1] != spec):
                    known = (self._next_id, spec)
                    self._next_id += 1
                    ids[name] = known
                    new.append([known[0], name, spec_to_json(spec)])
                flat.append(rank)
                flat.append(known[0])
                flat.extend(fields(summary))
                n += 1
        flat[1] = n
        layout = self._layouts.get(n)
        if layout is None:
            layout = self._layouts[n] = struct.Struct("<qI" + "II12d" * n)
        data = _frame(b"S", layout.pack(*flat))
        if new:
            data = _frame(b"N", json.dumps(new).encode()) + data
        self._write(data)
        if self._fsync == "commit":
            os.fsync(self._fd)
        elif self._fsync == "interval":
            now = time.monotonic()
            if now - self._last_sync >= FSYNC_INTERVAL_S:
                os.fsync(self._fd)
                self._last_sync = now

    def delivered(self, index: int, adapter: Any, step: int) -> None:
        """Advance ``adapter``'s cursor to ``step`` (called from its delivery thread after a successful write)."""
        self._cursors.advance(adapter, step)

    def close(self) -> None:
        """fsync (unless ``fsync="never"``) and close the file."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if self._fsync != "never":
                os.fsync(fd)
        finally:
            os.close(fd)


def open_journal(*, path: str | os.PathLike[str], fsync: str = "interval", bus: Any) -> JournalWriter:
    """The journal writer of ``bus`` (its rank, run, rules and log_every go into the header)."""
    from metricbus import __version__

    check_fsync(fsync)
    header = {
        "format": FORMAT_VERSION,
        "metricbus": __version__,
        "rank": int(bus._ranks.rank),
        "run": run_to_json(bus.run),
        "rules": [[pattern, spec_to_json(spec)] for pattern, spec in bus._rules.items()],
        "log_every": int(bus._log_every),
    }
    return JournalWriter(path=path, fsync=fsync, rank=int(bus._ranks.rank), header=header)


# -- reading -----------------------------------------------------------------------------------------------------


@dataclass
class RankFile:
    """What one journal file holds: its headers and, per step, the entries of each rank it wrote."""

    path: Path
    headers: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[int, dict[int, list[tuple[str, Spec, Summary]]]] = field(default_factory=dict)
    damaged: int = 0


def _warn(path: Path, what: str) -> None:
    warnings.warn(f"journal {path}: {what}", JournalWarning, stacklevel=3)


def _frames(path: Path, data: bytes, rf: RankFile) -> Iterator[tuple[int, bytes]]:
    pos, end = len(MAGIC), len(data)
    while pos < end:
        if pos + _FRAME.size <= end:
            length, crc = _FRAME.unpack_from(data, pos)
            stop = pos + _FRAME.size + length
            if 0 < length <= _MAX_FRAME and stop <= end:
                payload = data[pos + _FRAME.size : stop]
                if zlib.crc32(payload) == crc:
                    yield pos, payload
                    pos = stop
                    continue
        rf.damaged += 1
        resume = _resync(data, pos + 1)
        if resume is None:
            _warn(path, f"torn or damaged record at byte {pos}; skipped the last {end - pos} bytes")
            return
        _warn(path, f"damaged record at byte {pos}; skipped {resume - pos} bytes")
        pos = resume


def _resync(data: bytes, pos: int) -> int | None:
    """The next offset where a whole frame with a valid CRC starts."""
    end = len(data)
    while pos + _FRAME.size < end:
        length, crc = _FRAME.unpack_from(data, pos)
        stop = pos + _FRAME.size + length
        if (
            0 < length <= _MAX_FRAME
            and stop <= end
            and data[pos + _FRAME.size] in b"HNS"
            and zlib.crc32(data[pos + _FRAME.size : stop]) == crc
        ):
            return pos
        pos += 1
    return None


def read_rank_file(path: str | os.PathLike[str]) -> RankFile:
    """Read one journal file; raise JournalError if it is missing, foreign or from a newer format."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise JournalError(f"cannot read journal file {path}: {exc.strerror or exc}") from exc
    if not data.startswith(MAGIC):
        raise JournalError(f"{path} is not a metricbus journal file (bad magic)")
    rf = RankFile(path)
    names: dict[int, tuple[str, Spec]] = {}
    unknown = 0
    for pos, payload in _frames(path, data, rf):
        kind, body = payload[:1], payload[1:]
        try:
            if kind == b"H":
                header = json.loads(body)
                fmt = header.get("format")
                if not isinstance(fmt, int) or fmt > FORMAT_VERSION:
                    raise JournalError(
                        f"{path} has journal format {fmt!r}, newer than this metricbus reads ({FORMAT_VERSION}); "
                        "upgrade metricbus"
                    )
                rf.headers.append(header)
                names = {}  # a restarted writer numbers its names afresh
            elif kind == b"N":
                for ident, name, spec in json.loads(body):
                    names[int(ident)] = (str(name), spec_from_json(spec))
            elif kind == b"S":
                step, count = _STEP.unpack_from(body, 0)
                ranks = rf.steps.setdefault(step, {})  # a restarted run's later records of a step win
                seen: set[int] = set()
                for i in range(count):
                    rank, ident, *fields = _ENTRY.unpack_from(body, _STEP.size + i * _ENTRY.size)
                    if rank not in seen:
                        ranks[rank] = []
                        seen.add(rank)
                    known = names.get(ident)
                    if known is None:
                        unknown += 1
                        continue
                    ranks[rank].append((known[0], known[1], Summary.from_tuple(fields)))
                if count == 0:
                    ranks.setdefault(-1, [])  # a commit with nothing logged still counts in the window
            # other frame types: written by a newer minor version; skipped
        except JournalError:
            raise
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            rf.damaged += 1
            _warn(path, f"unreadable record at byte {pos} ({exc}); skipped")
    if not rf.headers:
        raise JournalError(f"{path} has no readable journal header")
    if unknown:
        _warn(path, f"{unknown} entries refer to a lost name table record; skipped")
    return rf


@dataclass
class Journal:
    """A whole journal directory: header of the lowest rank, and every commit's partials in rank order."""

    directory: Path
    header: dict[str, Any]
    files: list[RankFile]
    commits: list[tuple[int, list[Partial]]]
    ranks: list[int]

    @property
    def run(self) -> RunInfo:
        """The run metadata."""
        return run_from_json(self.header.get("run", {}))

    @property
    def log_every(self) -> int:
        """The bus's log_every."""
        return int(self.header.get("log_every", 1))

    @property
    def rules(self) -> list[tuple[str, Spec]]:
        """The bus's rules when the journal was written."""
        return [(str(p), spec_from_json(s)) for p, s in self.header.get("rules", [])]

    def metrics(self) -> dict[str, Spec]:
        """Every metric journaled and its spec (the last one seen)."""
        out: dict[str, Spec] = {}
        for _, partials in self.commits:
            for partial in partials:
                for name, spec, _ in partial.entries:
                    out[name] = spec
        return dict(sorted(out.items()))


def read_journal(directory: str | os.PathLike[str]) -> Journal:
    """Read every rank file of ``directory`` (or a single ``.mbj`` file) and merge them by step and rank."""
    directory = Path(directory)
    if directory.is_file():
        paths = [directory]
    elif directory.is_dir():
        paths = sorted(directory.glob(f"rank-*{SUFFIX}"))
        if not paths:
            raise JournalError(f"{directory} holds no journal files (rank-*{SUFFIX})")
    else:
        raise JournalError(f"no journal at {directory}")
    files = [read_rank_file(p) for p in paths]
    merged: dict[int, dict[int, list[tuple[str, Spec, Summary]]]] = {}
    for rf in files:
        for step, ranks in rf.steps.items():
            slot = merged.setdefault(step, {})
            for rank, entries in ranks.items():
                slot[rank] = entries
    all_ranks = sorted({r for ranks in merged.values() for r in ranks if r >= 0})
    commits = [
        (step, [Partial(tuple(merged[step][r])) for r in sorted(merged[step]) if r >= 0])
        for step in sorted(merged)
    ]
    first = min(files, key=lambda rf: int(rf.headers[0].get("rank", 0)))
    return Journal(directory, first.headers[-1], files, commits, all_ranks)
