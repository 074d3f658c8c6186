"""Delivery cursors: per adapter, the last step its backend acknowledged, kept beside the journal's files.

A cursor never runs ahead of the data: it is advanced only after the adapter's ``flush()`` returned. It may lag
behind (a crash between the flush and the advance); an adapter that implements the optional
``resume(after_step=int | None)`` verb is told the cursor before it is opened (:func:`resume_adapter`) and drops
what it holds after that step, so the steps sent again are not duplicated.

A cursor moved back past steps its backend holds from an abandoned timeline (a run resumed from a checkpoint
without that backend's adapter, or whose catch-up of it failed) also keeps a *pending rewind*, the first of those
steps: the next sender (a resumed bus with that adapter, or ``metricbus sync``) calls the adapter's ``rewind`` there
before it writes again (else wandb, whose history only grows, would not take the new steps, and MLflow would not
tag the run rewound). The first step acknowledged at or after it clears it.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metricbus.errors import JournalError, JournalWarning


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


def resume_adapter(adapter: Any, after_step: int | None, identity: Mapping[str, str] | None = None) -> None:
    """Call ``adapter.resume(after_step=..., identity=...)`` if the adapter has that optional verb (before ``open()``).

    ``identity`` is passed only to a ``resume`` that has an ``identity`` parameter (adapters written before it
    existed take ``after_step`` alone).
    """
    resume = getattr(adapter, "resume", None)
    if not callable(resume):
        return
    if identity is not None and _takes_identity(resume):
        resume(after_step=after_step, identity=dict(identity))
    else:
        resume(after_step=after_step)


def _takes_identity(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "identity" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def identity_of(adapter: Any) -> dict[str, str] | None:
    """The adapter's optional ``identity`` (what names its backend run) as a plain dict, or None."""
    value = getattr(adapter, "identity", None)
    if callable(value):
        value = value()
    if not isinstance(value, Mapping):
        return None
    return {str(k): str(v) for k, v in value.items()}


_WARNED: set[tuple[Path, str]] = set()  # the damaged records warned about in this process, once each


def _damaged(path: Path, why: str) -> dict[str, Any]:
    """A damaged cursor record: warned about (once), and read as none (every step is sent again, never skipped)."""
    if (path, why) in _WARNED:
        return {}
    _WARNED.add((path, why))
    warnings.warn(
        f"delivery cursor {path} is damaged: {why}; read as nothing acknowledged, so every journaled step is sent "
        "to that adapter again",
        JournalWarning,
        stacklevel=4,
    )
    return {}


class CursorStore:
    """Per adapter, the last step its backend acknowledged and its backend run, in ``<journal>/cursors/<key>.json``.

    The record is ``{"adapter": name, "key": key, "step": int | null, "identity": {...} | null, "rewind": int |
    null}`` (``rewind``: the pending rewind, see the module docstring; absent in records written before it).
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory) / "cursors"
        self._held: dict[str, tuple[int | None, dict[str, str] | None]] = {}  # key -> (step, identity) last known
        self._pending: dict[str, int | None] = {}  # key -> its pending rewind, last known
        # False: this store is the only writer of its records (a live bus), so what it last wrote is what they hold.
        # True: another process (a `metricbus sync`, a resumed bus) may write them too: each change reads them first.
        self.shared = False

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def _record(self, adapter: Any) -> dict[str, Any]:
        """``adapter``'s record; {} where there is none, or (with a JournalWarning) where it is damaged."""
        return self._record_at(self._path(adapter_key(adapter)))

    def _record_at(self, path: Path) -> dict[str, Any]:
        """The record in ``path``; {} where there is none, or (with a JournalWarning) where it is damaged."""
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            return _damaged(path, f"unreadable ({exc})")
        try:
            data = json.loads(text)
        except ValueError:
            return _damaged(path, "not JSON")
        if not isinstance(data, dict):
            return _damaged(path, "not a JSON object")
        for field in ("step", "rewind"):
            value = data.get(field)
            if value is not None and (type(value) is not int or not -(2**63) <= value < 2**63):
                return _damaged(path, f"its {field} {value!r} is not an int64")
        return data

    def get(self, adapter: Any) -> int | None:
        """The last acknowledged step of ``adapter`` (None: nothing yet)."""
        step = self._record(adapter).get("step")
        return None if step is None else int(step)

    def identity(self, adapter: Any) -> dict[str, str] | None:
        """What ``adapter``'s ``identity`` said after its last open (None: never recorded)."""
        value = self._record(adapter).get("identity")
        return {str(k): str(v) for k, v in value.items()} if isinstance(value, dict) else None

    def resume(self, adapter: Any) -> int | None:
        """Tell ``adapter`` its cursor and identity (:func:`resume_adapter`) before it is opened; returns the cursor."""
        cursor = self.get(adapter)
        resume_adapter(adapter, cursor, self.identity(adapter))
        return cursor

    def _write(self, adapter: Any, *, step: int | None, identity: Mapping[str, str] | None) -> None:
        """Replace ``adapter``'s record atomically (tmp file + rename)."""
        name = str(getattr(adapter, "name", type(adapter).__name__))
        self._write_record(adapter_key(adapter), name, step=step, identity=identity)

    def _write_record(
        self, key: str, name: str, *, step: int | None, identity: Mapping[str, str] | None, rewind: int | None = None
    ) -> None:
        """Replace the record of ``key`` atomically (tmp file + rename); its pending rewind is ``rewind`` where one
        is given, else kept (cleared where ``step`` reaches it)."""
        if rewind is None:
            rewind = self._pending_of(key)
        if rewind is not None and step is not None and step >= rewind:
            rewind = None  # a step at or after it acknowledged: its sender rewound the backend first
        target = self._path(key)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        record = {
            "adapter": name,
            "key": key,
            "step": step,
            "identity": None if identity is None else dict(identity),
            "rewind": rewind,
        }
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(record), encoding="utf-8")
            os.replace(tmp, target)
        except OSError as exc:  # the journal's folder, not the backend: say where
            raise JournalError(
                f"cannot write the delivery cursor {target} ({exc.strerror or exc}); make {self.directory} a "
                "writable folder: until then what the backend acknowledges is not recorded, and the next sync or "
                "resume sends those steps again"
            ) from exc
        self._held[key] = (step, None if identity is None else dict(identity))
        self._pending[key] = rewind

    def _pending_of(self, key: str) -> int | None:
        """The pending rewind of ``key``'s record: read once, then kept as this store writes it."""
        if key not in self._pending or self.shared:
            value = self._record_at(self._path(key)).get("rewind")
            self._pending[key] = None if value is None else int(value)
        return self._pending[key]

    def pending_rewind(self, adapter: Any) -> int | None:
        """The step ``adapter``'s backend must be rewound to before anything is written to it again, or None
        (see the module docstring)."""
        return self._pending_of(adapter_key(adapter))

    def _current(self, adapter: Any) -> tuple[int | None, dict[str, str] | None]:
        """``(step, identity)`` of ``adapter``'s record: read once, then kept as this store writes it."""
        key = adapter_key(adapter)
        if key not in self._held or self.shared:
            self._held[key] = (self.get(adapter), self.identity(adapter))
        return self._held[key]

    def advance(self, adapter: Any, step: int) -> None:
        """Record ``step`` as acknowledged; never moves backwards (see :meth:`rewind`)."""
        last, identity = self._current(adapter)
        if last is not None and step <= last:
            return
        self._write(adapter, step=int(step), identity=identity)

    def rewind(self, adapter: Any, step: int | None, *, abandoned: bool = False) -> None:
        """Move the cursor back to ``step`` (None: nothing acknowledged) if it is past it: the steps after it are
        about to be sent again (a resume from a checkpoint, or a second commit at an acknowledged step).
        ``abandoned``: the backend holds those steps of a timeline a resume abandoned, so a pending rewind to the
        step after ``step`` is kept until one is acknowledged there (the sender's ``rewind`` may yet fail)."""
        last, identity = self._current(adapter)
        if last is None or (step is not None and last <= step):
            return
        key = adapter_key(adapter)
        name = str(getattr(adapter, "name", type(adapter).__name__))
        new = None if step is None else int(step)
        self._write_record(key, name, step=new, identity=identity, rewind=self._rewound(key, new, abandoned))

    def _rewound(self, key: str, step: int | None, abandoned: bool) -> int | None:
        """The pending rewind of ``key`` once its cursor moved back to ``step``: the lower of the one it had and,
        where the backend holds the abandoned steps after ``step``, the step after it (the lowest step where
        nothing is acknowledged)."""
        held = self._pending_of(key)
        if not abandoned:
            return held
        at = -(2**63) if step is None else step + 1
        return at if held is None else min(held, at)

    def others(self, adapters: Any) -> dict[str, int]:
        """``{key: step}`` of the records of adapters not among ``adapters`` that acknowledged a step (damaged
        records left out): backends this journal wrote to before whose adapter this bus does not have."""
        keys = {adapter_key(adapter) for adapter in adapters}
        found: dict[str, int] = {}
        for path in sorted(self.directory.glob("*.json")):
            key = path.name[: -len(".json")]
            if key in keys:
                continue
            step = self._record_at(path).get("step")
            if step is not None:
                found[key] = int(step)
        return found

    def identities(self, name: str) -> list[dict[str, str]]:
        """The identities recorded for the adapters named ``name`` (every record of that name, whatever its options):
        the backend runs, files and folders this journal's run wrote to through such an adapter."""
        found = []
        for path in sorted(self.directory.glob("*.json")):
            record = self._record_at(path)
            identity = record.get("identity")
            if record.get("adapter") == name and isinstance(identity, dict):
                found.append({str(k): str(v) for k, v in identity.items()})
        return found

    def rewind_other(self, key: str, step: int | None) -> None:
        """:meth:`rewind` for the record of ``key`` (an adapter this bus does not have, see :meth:`others`), whose
        backend holds the abandoned steps after ``step``: a pending rewind is kept."""
        record = self._record_at(self._path(key))
        last = record.get("step")
        if last is None or (step is not None and last <= step):
            return
        identity = record.get("identity")
        name = str(record.get("adapter") or key)
        kept = {str(k): str(v) for k, v in identity.items()} if isinstance(identity, dict) else None
        new = None if step is None else int(step)
        self._write_record(key, name, step=new, identity=kept, rewind=self._rewound(key, new, True))

    def set_identity(self, adapter: Any, identity: Mapping[str, str] | None) -> None:
        """Keep what names ``adapter``'s backend run (after it opened), so a later process opens the same run."""
        step, held = self._current(adapter)
        if identity is None or identity == held:
            return
        self._write(adapter, step=step, identity=identity)

    def _gaps_path(self, adapter: Any) -> Path:
        return self.directory / f"{adapter_key(adapter)}.gaps.jsonl"

    def add_gap(self, adapter: Any, step: int, reason: str) -> None:
        """Record that ``adapter``'s backend rejected ``step`` for good (so a later sync retries it after a fix)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"step": int(step), "reason": reason[:500]}) + "\n"
        with open(self._gaps_path(adapter), "a", encoding="utf-8") as file:
            file.write(line)

    def gaps(self, adapter: Any) -> set[int]:
        """The steps ``adapter``'s backend rejected and no sync has delivered since."""
        try:
            text = self._gaps_path(adapter).read_text(encoding="utf-8")
        except OSError:
            return set()
        except ValueError as exc:  # not UTF-8
            self._damaged_gap(adapter, f"unreadable ({exc})")
            return set()
        steps = set()
        for number, line in enumerate(text.splitlines(), 1):
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line
            if type(step) is int and -(2**63) <= step < 2**63:
                steps.add(step)
            else:  # a step 1e400 (int() raised OverflowError) or 3.7 (int() made it another step)
                self._damaged_gap(adapter, f"line {number}'s step {step!r} is not an int64")
        return steps

    def _damaged_gap(self, adapter: Any, why: str) -> None:
        """Warn (once) that ``adapter``'s gaps file is damaged: the steps it cannot read are not retried."""
        path = self._gaps_path(adapter)
        if (path, why) not in _WARNED:
            _WARNED.add((path, why))
            warnings.warn(f"delivery gaps file {path} is damaged: {why}; skipped, so sync does not retry what it "
                          "held there", JournalWarning, stacklevel=3)

    def clear_gaps(self, adapter: Any, steps: set[int]) -> None:
        """Forget the gaps at ``steps`` (a sync delivered them); atomically, like the cursor."""
        left = self.gaps(adapter) - steps
        path = self._gaps_path(adapter)
        if not left:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        lines = "".join(json.dumps({"step": s, "reason": "retry"}) + "\n" for s in sorted(left))
        tmp.write_text(lines, encoding="utf-8")
        os.replace(tmp, path)
