"""The Weights & Biases adapter: ``wandb.init`` at open, ``run.log(metrics, step=step)`` per write.

**One metricbus run is one wandb run.** The run is opened with ``id=run.id`` and ``resume="allow"``, so a trainer
resumed on the same journal and ``metricbus sync`` write into the same wandb run id. Offline, each process writes
its own folder ``<dir>/wandb/offline-run-<time>-<id>/`` (``<dir>``: the ``dir`` option, else ``WANDB_DIR``, else
the working directory), every one with that run id; ``wandb sync`` uploads them.

**wandb's own settings are respected as** ``wandb.init`` **does**: an adapter option wins, then wandb's settings
(``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_RUN_ID``, ``WANDB_NAME``, ``WANDB_TAGS``, ``WANDB_RUN_GROUP``,
``WANDB_JOB_TYPE``, ``WANDB_NOTES``, ``WANDB_MODE``, ``WANDB_DIR`` and wandb's settings files, as ``wandb.setup``
loaded them), then metricbus's run (``run.project``, ``run.id``, ``run.name``, ``run.tags``). After ``resume()``,
the run id, project and entity its ``identity`` names come right after the options, so the same wandb run is
reopened even if the environment changed. ``resume`` is always ``"allow"`` (``WANDB_RESUME`` is overridden). A
replay calls ``new_run()`` first: its run id is then ``run.id`` (its own) whatever ``WANDB_RUN_ID`` says.

**attach=True** logs into the ``wandb.run`` the trainer started: no ``wandb.init``, the run is not finished at close
(the trainer owns it), its name, tags and config stay as the trainer set them, and it is never rewound. Without
attach the adapter's run is created with ``reinit="create_new"``: a run the trainer has active is left alone
(wandb's default, ``"return_previous"`` outside notebooks, would hand back that run, and the adapter would log
into it and finish it), and ``wandb.run`` stays the trainer's.

**Rows.** Writes at one step (training, then evaluation) merge into one history row: wandb keeps a step's row open
until a later step arrives or the run finishes, and drops, with a warning, a step lower than one it closed.
``flush()`` therefore leaves the last written step's row open and waits until every closed row is in the run's
``.wandb`` file. wandb-core writes that file every ``x_transaction_log_flush_interval`` seconds (15 by default;
the adapter sets 0.1 unless that setting is set), and a process killed before then loses what was not written.
The last step's row reaches the file with the next step or at close; a crash before then loses it although
``flush()`` returned. The wait is skipped for attached runs, ``shared`` and ``disabled`` modes,
``x_skip_transaction_log``, TensorBoard syncing and an interval over 1 s. ``close()`` waits (bounded) until the
exit record is in the file: ``run.finish()`` can return before it is.

**Steps sent again after a resume are written once.** The delivery cursor lags the ``.wandb`` file (a row is
acknowledged about once a second), so after a kill the steps after ``after_step`` come again although the earlier
process's file holds most of them. At open after ``resume()``, the complete history records of every earlier folder
of the run id next to the identity's ``dir`` (``offline-run-*`` and ``run-*``) are read once, in start order, a
rewound folder hiding the earlier folders' rows after its branch point; a (key, value) sent again at a step after
``after_step`` that such a row already holds with the same value (bitwise, NaN equal to NaN) is not logged again,
and a write left with nothing is not logged at all. A different value is logged. ``rewind(step=S)`` forgets what was
read for the steps ``>= S``.

**rewind(step=S)** finishes the run and opens it again with ``resume_from="<id>?_step=<S-1>"`` (wandb's run rewind,
beta), so steps from S on are logged again. Offline this makes one more folder, whose run record carries the branch
point (run id, ``_step``, S-1) and whose history starts at S; by wandb's documentation the server truncates the
run's history there when it receives it (not checked against a server here).

``mode`` is checked at construction against what wandb accepts. System-stats sampling is off
(``x_disable_stats=True``), so no ``wandb-symon`` process is spawned. Metric names are passed through, except
the names wandb keeps for itself (:data:`RESERVED_KEYS`): a step holding one is logged without it, and ``write()``
then raises :class:`~metricbus.errors.RejectedMetricsError` naming it (the delivery reports it once per name and
counts the step as delivered).

**Histograms.** A :class:`~metricbus.histogram.Histogram` (the ``hist`` kind) is logged as
``wandb.Histogram(np_histogram=(counts, edges))`` in the step's row, next to its scalars (neighbouring bins merged
when there are more than wandb's 512; one without bins is not logged: wandb refuses it). wandb-core writes it as
three history items, ``nested_key`` ``[name, "_type"]`` (``"histogram"``), ``[name, "values"]`` (the counts) and
``[name, "bins"]`` (the edges); a resume compares them like floats.
"""

from __future__ import annotations

import difflib
import glob
import importlib.util
import json
import math
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from metricbus.adapter import RunInfo, Status
from metricbus.errors import AdapterNotFoundError, ConfigError, MetricValueError
from metricbus.histogram import Histogram

from ._names import NameMapper, passthrough_mapper

MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")
"""What wandb 0.31 accepts as ``mode`` (``wandb.Settings.mode``; ``dryrun`` is offline, ``run`` online)."""
PROJECT_MAX_CHARS = 128
PROJECT_BAD_CHARS = "/\\#?%:"  # wandb.Settings.validate_project
FLUSH_INTERVAL_S = 0.1  # the adapter's x_transaction_log_flush_interval (wandb's default is 15 s)
WAIT_INTERVAL_MAX_S = 1.0  # flush() waits for the file only when wandb writes it at least this often
FILE_WAIT_S = 10.0  # how long flush() and close() wait for wandb-core to write the file
HISTOGRAM_MAX_BINS = 512  # wandb.Histogram.MAX_LENGTH: it refuses more bins
_STRING_OPTIONS = ("project", "entity", "group", "job_type", "notes", "mode")
_RUN_OPTIONS = (*_STRING_OPTIONS, "dir")  # options that configure wandb.init, meaningless with attach=True
_IDENTITY_KEYS = ("run_id", "project", "entity")
RESERVED_KEYS = {
    "_step": "the row's step (wandb.log drops a metric of that name)",
    "_runtime": "the run's time (wandb-core overwrites a metric of that name)",
    "_timestamp": "the row's wall time (wandb.log takes a metric of that name for it)",
    "_wandb": "its own run data in the summary (runtime, ...; a metric of that name replaces it there)",
}
"""History keys wandb 0.31 fills itself (``interface.publish_partial_history``, wandb-core): a metric of that name
would be lost or would overwrite them, so the adapter refuses it."""


def _check_options(options: Mapping[str, Any]) -> None:
    """Raise ConfigError naming the first invalid option and what is valid."""
    for key in _STRING_OPTIONS:
        value = options[key]
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"wandb option {key!r} must be a string or None, not {type(value).__name__}")
    if options["dir"] is not None and not isinstance(options["dir"], (str, os.PathLike)):
        raise ConfigError(f"wandb option 'dir' must be a path or None, not {type(options['dir']).__name__}")
    if not isinstance(options["attach"], bool):
        raise ConfigError(f"wandb option 'attach' must be True or False, not {options['attach']!r}")
    mode = options["mode"]
    if mode is not None and mode not in MODES:
        close = difflib.get_close_matches(mode, MODES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"unknown wandb mode {mode!r}; {hint}use one of {', '.join(MODES)} (or None: wandb's own)")
    project = options["project"]
    if project is not None and (len(project) > PROJECT_MAX_CHARS or any(c in project for c in PROJECT_BAD_CHARS)):
        raise ConfigError(
            f"invalid wandb project {project!r}: at most {PROJECT_MAX_CHARS} characters, none of {PROJECT_BAD_CHARS}"
        )
    given = [key for key in _RUN_OPTIONS if options[key] is not None]
    if options["attach"] and given:
        raise ConfigError(
            f"wandb option attach=True logs into the run the trainer started, so {', '.join(given)} cannot be set"
        )


def _pick(option: Any, kept: Any, wandb_value: Any, fallback: Any) -> Any:
    """What to pass to ``wandb.init``: the option, else the resumed run's, else None where wandb's settings name a
    value (wandb applies it), else metricbus's."""
    if option is not None:
        return option
    if kept is not None:
        return kept
    return None if wandb_value is not None else fallback


class WandbAdapter:
    """Logs one wandb history row per step."""

    name = "wandb"

    def __init__(
        self,
        *,
        project: str | None = None,
        mode: str | None = None,
        dir: str | os.PathLike[str] | None = None,  # named like wandb.init's own keyword
        entity: str | None = None,
        group: str | None = None,
        job_type: str | None = None,
        notes: str | None = None,
        attach: bool = False,
    ) -> None:
        _check_options(
            {
                "project": project,
                "mode": mode,
                "dir": dir,
                "entity": entity,
                "group": group,
                "job_type": job_type,
                "notes": notes,
                "attach": attach,
            }
        )
        if importlib.util.find_spec("wandb") is None:
            raise AdapterNotFoundError("the wandb adapter needs wandb: pip install 'metricbus[wandb]'")
        self._project, self._mode, self._entity = project, mode, entity
        self._dir = None if dir is None else os.fspath(dir)
        self._group, self._job_type, self._notes, self._attach = group, job_type, notes, attach
        self._names: NameMapper = passthrough_mapper(backend="wandb", reserved=RESERVED_KEYS)
        self._run: Any = None
        self._info: RunInfo | None = None
        self._kept: dict[str, str] = {}  # run_id, project, entity of the run to reopen (resume, rewind)
        self._own_id = False  # new_run(): the run id is run.id, whatever wandb's settings name
        self._resuming = False
        self._after_step: int | None = None  # resume()'s cursor
        self._written: dict[int, dict[str, Any]] = {}  # step -> {wandb key: value} earlier folders already hold
        self._identity: dict[str, str] | None = None
        self._kept_dir: str | None = None  # the resumed identity's run folder
        self._file: _RunFile | None = None  # the run's .wandb file, when flush() waits for it
        self._first_step = 0  # wandb drops the steps below this one (a resumed or rewound run)
        self._open_step: int | None = None  # the last step written: wandb keeps its row open
        self._closed_step: int | None = None  # the last step whose row wandb closed (it goes to the file)

    @property
    def project(self) -> str | None:
        """The wandb project given (None: wandb's settings, else the run's project)."""
        return self._project

    @property
    def run(self) -> Any:
        """The ``wandb.Run`` once open (its ``dir``, ``id``, ... are useful in tests)."""
        return self._run

    @property
    def identity(self) -> Mapping[str, str] | None:
        """The wandb run after open: ``run_id``, ``project``, ``entity`` (if known) and ``dir`` (its run folder)."""
        return self._identity

    def resume(self, *, after_step: int | None, identity: Mapping[str, str] | None = None) -> None:
        """Reopen the run ``identity`` names (else the run's id); config values may change.

        The steps after ``after_step`` come again with the values they had (from the journal). Offline they are
        written again, into the new folder; online, ``resume="allow"`` continues after the run's last step on the
        server (wandb.init's documentation), so wandb drops those the server holds (not checked against a server).
        """
        self._resuming = True  # resume="allow" continues the run; nothing is cut, steps held are skipped at write
        self._after_step = None if after_step is None else int(after_step)
        self._kept = {key: str(identity[key]) for key in _IDENTITY_KEYS if identity and identity.get(key)}
        self._kept_dir = str(identity["dir"]) if identity and identity.get("dir") else None

    def new_run(self, *, live: Sequence[Mapping[str, str]]) -> None:
        """Before a replay's open: start the run of ``run.id`` (a new one), not the one ``WANDB_RUN_ID`` (or a
        settings file) names: a trainer's environment names the live run. ``attach=True`` is refused. ``live`` is not
        needed: a replay's run id is its own."""
        if self._attach:
            raise ConfigError(
                "wandb option attach=True logs into the run the trainer started, but a replay opens a run of its "
                "own and never writes into the live one; leave attach out for the replay (metricbus sync is what "
                "writes into the live run)"
            )
        self._own_id = True
        self._kept = {}

    def open(self, *, run: RunInfo) -> None:
        """Start (or, with attach=True, take) the wandb run."""
        try:
            import wandb
        except ImportError as exc:
            raise AdapterNotFoundError(
                f"the wandb adapter needs wandb: pip install 'metricbus[wandb]' ({exc})"
            ) from exc
        self._info = run
        if not self._attach:
            _check_config(run.config)
            self._start(wandb, rewind_to=None)
            self._written = self._read_written() if self._resuming else {}
            return
        active = wandb.run
        if active is None:
            raise ConfigError(
                "wandb option attach=True, but no wandb run is active in this process: call wandb.init() before "
                "the bus opens, or leave attach False so the adapter starts its own run"
            )
        self._run, self._file, self._first_step = active, None, 0
        self._identity = self._identity_of(active, active.settings)

    def _start(self, wandb: Any, *, rewind_to: int | None) -> None:
        """``wandb.init`` the run: resume="allow", or rewound so that ``rewind_to`` is its next step."""
        run, kept = self._info, self._kept
        assert run is not None
        own = wandb.setup().settings  # wandb's settings, from its files and WANDB_* variables, as it loaded them
        settings: dict[str, Any] = {"x_disable_stats": True}
        if "x_transaction_log_flush_interval" not in own.model_fields_set:
            settings["x_transaction_log_flush_interval"] = FLUSH_INTERVAL_S
        run_id = _pick(None, kept.get("run_id"), None if self._own_id else own.run_id, run.id)
        branch: dict[str, Any] = {"resume": "allow"}
        if rewind_to is not None:  # resume and resume_from exclude each other
            branch = {"resume_from": f"{run_id}?_step={rewind_to - 1}"}
        self._run = wandb.init(
            id=run_id,
            project=_pick(self._project, kept.get("project"), own.project, run.project),
            entity=self._entity or kept.get("entity"),
            name=_pick(None, None, own.run_name, run.name),
            tags=_pick(None, None, own.run_tags, list(run.tags) or None),
            config=dict(run.config),
            allow_val_change=True if self._resuming or rewind_to is not None else None,
            group=self._group,
            job_type=self._job_type,
            notes=self._notes,
            mode=self._mode,
            dir=self._dir,
            settings=wandb.Settings(**settings),  # a new one each time: wandb.init writes into it
            reinit="create_new",  # leave a run the trainer has active alone (see the module docstring)
            **branch,
        )
        current = self._run.settings  # a deep copy: read once
        self._identity = self._identity_of(self._run, current)
        self._kept = {key: self._identity[key] for key in _IDENTITY_KEYS if key in self._identity}
        self._first_step = int(self._run.starting_step or 0)
        self._open_step = self._closed_step = None
        interval = current.x_transaction_log_flush_interval
        writes_file = current.mode in ("online", "offline", "dryrun", "run") and not current.x_skip_transaction_log
        writes_file = writes_file and not wandb.patched["tensorboard"]  # TensorBoard syncing drops the given steps
        self._file = _RunFile(current.sync_file) if writes_file and 0 < interval <= WAIT_INTERVAL_MAX_S else None

    def _read_written(self) -> dict[int, dict[str, Any]]:
        """The rows after the resume cursor that earlier folders of this run id (next to the resumed ``dir``) hold."""
        current, old = self._identity or {}, self._kept_dir
        run_id = current.get("run_id")
        if not old or not run_id:
            return {}
        folders = []
        for path in Path(old).parent.glob("*/" + glob.escape(f"run-{run_id}.wandb")):
            name = path.parent.name
            if name.startswith(("offline-run-", "run-")) and str(path.parent) != current.get("dir"):
                folders.append(_history_of(str(path), after=self._after_step))
        written: dict[int, dict[str, Any]] = {}
        after = self._after_step
        for _, branch, rows in sorted(folders, key=lambda folder: folder[0]):
            if branch is not None:  # a rewound folder: the earlier folders' rows after its branch point are gone
                written = {step: row for step, row in written.items() if step <= branch}
            for step, row in rows.items():
                if after is None or step > after:
                    written.setdefault(step, {}).update(row)
        return written

    @staticmethod
    def _identity_of(run: Any, settings: Any) -> dict[str, str]:
        identity = {"run_id": str(run.id), "project": str(run.project)}
        if run.entity:
            identity["entity"] = str(run.entity)
        if settings.mode != "disabled":
            identity["dir"] = str(settings.sync_dir)
        return identity

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Log ``metrics`` into the row of ``step`` (a second write at one step joins the same row)."""
        if self._run is None:
            raise RuntimeError("WandbAdapter.write() without an open run")
        if not metrics:
            return
        names, step = self._names, int(step)
        if step < 0:  # wandb-core drops a row at a negative step without an error
            raise MetricValueError(
                f"step {step} is negative; wandb keeps only steps >= 0 (it drops the others without an error), so "
                f"commit steps from 0 on to log to wandb"
            )
        mapped, rejected = names.split(metrics)
        self._log_row(step, {key: _logged(value) for key, value in mapped.items()})
        if rejected:  # the step's other metrics are in the row (see the module docstring)
            raise names.refused(step, rejected, wrote=len(mapped))

    def _log_row(self, step: int, row: dict[str, Any]) -> None:
        """``run.log(row, step=step)`` without what the run already holds, and the open/closed row bookkeeping."""
        assert self._run is not None
        held = self._written.get(step) if self._written else None
        if held:  # drop what an earlier folder of the run already holds at this step (see the module docstring)
            row = {key: value for key, value in row.items() if key not in held or not _same(held[key], value)}
        row = {key: value for key, value in row.items() if value is not None}
        if not row:
            return
        if any(isinstance(value, dict) for value in row.values()):
            import wandb

            row = {
                key: _wandb_histogram(wandb, value) if isinstance(value, dict) else value for key, value in row.items()
            }
        self._run.log(row, step=step)
        if self._open_step is None or step > self._open_step:
            if self._open_step is not None and self._open_step >= self._first_step:
                self._closed_step = self._open_step  # wandb closed that row when this later step arrived
            self._open_step = step

    def flush(self) -> None:
        """Wait until every closed row is in the run's ``.wandb`` file (the last step's row stays open)."""
        file, step = self._file, self._closed_step
        if file is not None and step is not None:
            file.wait(lambda: file.last_step is not None and file.last_step >= step, f"the row of step {step}")

    @property
    def durable_step(self) -> int | None:
        """The last step whose row is in the run file after ``flush()``: the last step's row stays open until a
        later step or ``close()``, so the delivery cursor acknowledges it only then (a kill before loses no
        acknowledged row). Without a file to follow (attached, disabled), what ``flush()`` covers."""
        if self._file is None:
            return self._open_step
        return self._closed_step

    def rewind(self, *, step: int) -> None:
        """Finish the run and reopen it rewound to ``step`` (``resume_from``); attached runs are left as they are."""
        if self._run is None:
            raise RuntimeError("WandbAdapter.rewind() without an open run")
        if self._attach:
            return
        import wandb

        self._written = {held: row for held, row in self._written.items() if held < step}
        self._finish(exit_code=0)
        self._start(wandb, rewind_to=int(step))

    def close(self, *, status: Status) -> None:
        """Finish the run with exit code 0 (finished) or 1 (failed); an attached run is left running."""
        if self._run is not None and not self._attach:
            self._finish(exit_code=0 if status == "finished" else 1)
        self._run = None

    def _finish(self, *, exit_code: int) -> None:
        """``run.finish``, then wait until the exit record is in the file (finish can return before it is)."""
        run, file = self._run, self._file
        self._run = None
        run.finish(exit_code=exit_code)
        if file is not None:
            file.wait(lambda: file.exited, "the exit record")


BLOCK_BYTES = 32 * 1024
HEADER_BYTES = 7  # b":W&B", then <HB: 0xBEE1, version
CHUNK = struct.Struct("<IHB")  # crc32 of type + data, data length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class _RunFile:
    """Follows a run's ``.wandb`` file as wandb-core writes it: the highest history ``_step`` and the exit record.

    The file is LevelDB-log framed (32 KiB blocks of chunks ``<IHB`` + data) around ``wandb_internal_pb2.Record``
    protobufs. Each :meth:`read` parses only the complete records after the last one read.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.last_step: int | None = None
        self.exited = False
        self._pos = HEADER_BYTES  # where the next unread record starts

    def read(self) -> None:
        from wandb.proto import wandb_internal_pb2

        try:
            with open(self.path, "rb") as file:
                file.seek(self._pos)
                data = file.read()
        except FileNotFoundError:
            return
        for payload, end in _records(data, self._pos):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated at import, no stub
            record.ParseFromString(payload)
            kind = record.WhichOneof("record_type")
            if kind == "history" and record.history.HasField("step"):
                step = record.history.step.num
                self.last_step = step if self.last_step is None else max(self.last_step, step)
            elif kind == "exit":
                self.exited = True
            self._pos = end

    def wait(self, done: Callable[[], bool], what: str) -> None:
        """Read until ``done()``; TimeoutError after :data:`FILE_WAIT_S`."""
        deadline = time.monotonic() + FILE_WAIT_S
        while True:
            self.read()
            if done():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"wandb did not write {what} to {self.path} within {FILE_WAIT_S:g} s")
            time.sleep(0.005)


def _check_config(config: Mapping[str, Any]) -> None:
    """Raise ConfigError naming the first config key whose value wandb cannot store, and what it can: wandb turns a
    value into JSON at ``wandb.init`` (``wandb.util.json_friendly_val``, then ``json_friendly``) and fails there with a
    TypeError that names neither the key nor the value (``object()``, ``...``, ``NotImplemented``)."""
    for key, value in config.items():
        bad = _unstorable(str(key), value)
        if bad is not None:
            where, leaf, exc = bad
            raise ConfigError(
                f"wandb: config key {where!r} holds {leaf!r} (type {type(leaf).__name__}), which wandb cannot store "
                f"({exc}); wandb keeps a config as JSON: give a bool, int, float, str or None, a list or dict of "
                f"them (numpy values, tensors, dataclasses, dates and objects of your own classes wandb converts "
                f"itself), or str(value)"
            ) from exc


def _unstorable(where: str, value: Any) -> tuple[str, Any, Exception] | None:
    """``(dotted key, leaf, error)`` of the first leaf of ``value`` (at config key ``where``) that wandb cannot turn
    into JSON, or None where it can."""
    from wandb.util import json_dumps_safer, json_friendly, json_friendly_val

    try:
        json_dumps_safer(json_friendly(json_friendly_val(value))[0])
        return None
    except (TypeError, ValueError, OverflowError) as exc:
        error = exc
    if isinstance(value, Mapping):
        parts: Iterable[tuple[str, Any]] = ((f"{where}.{inner}", item) for inner, item in value.items())
    elif isinstance(value, (list, tuple)):
        parts = ((f"{where}[{index}]", item) for index, item in enumerate(value))
    else:
        parts = ()
    for inner_where, item in parts:
        bad = _unstorable(inner_where, item)
        if bad is not None:
            return bad
    return where, value, error


def _logged(value: float) -> Any:
    """``value`` as the adapter logs it: a float, or for a :class:`~metricbus.histogram.Histogram` the JSON that
    ``wandb.Histogram`` stores (``{"_type": "histogram", "values": counts, "bins": edges}``, neighbouring bins merged
    down to wandb's 512), or None for a histogram without bins (wandb refuses one; it is not logged)."""
    if not isinstance(value, Histogram):
        return value
    counts, edges = list(value.counts), list(value.edges)
    if not counts:
        return None
    size = -(-len(counts) // HISTOGRAM_MAX_BINS)
    if size > 1:
        counts = [sum(counts[i : i + size]) for i in range(0, len(counts), size)]
        edges = [*edges[::size][: len(counts)], edges[-1]]
    return {"_type": "histogram", "values": counts, "bins": edges}


def _wandb_histogram(wandb: Any, value: dict[str, Any]) -> Any:
    """The ``wandb.Histogram`` of what :func:`_logged` made of a Histogram."""
    return wandb.Histogram(np_histogram=(value["values"], value["bins"]))


def _same(held: Any, value: Any) -> bool:
    """Whether two metric values are the same float, bit for bit (every NaN equal to every NaN), or the same
    histogram (what :func:`_logged` makes of it, read back from a run file)."""
    if isinstance(value, dict):
        return bool(held == value)
    try:
        a, b = float(held), float(value)
    except (TypeError, ValueError):
        return False
    return (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b)


READ_BYTES = 128 * BLOCK_BYTES  # how much of a run file _history_of reads at a time (4 MiB)


def _history_of(path: str, *, after: int | None) -> tuple[tuple[int, int], int | None, dict[int, dict[str, Any]]]:
    """A ``.wandb`` file's (start time, rewind branch ``_step`` or None, {step: {key: value}} of the steps after
    ``after``, every step for None), complete records only (a killed process's file ends without an exit record,
    maybe inside a record). Read :data:`READ_BYTES` at a time, the items of an acknowledged step never decoded: a long
    run's file is read at resume in bounded memory, and in about a tenth of the time decoding every row took."""
    from wandb.proto import wandb_internal_pb2

    start, branch = (0, 0), None
    rows: dict[int, dict[str, Any]] = {}
    try:
        for payload, _ in _assemble(_file_chunks(path)):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated at import, no stub
            record.ParseFromString(payload)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                start = (record.run.start_time.seconds, record.run.start_time.nanos)
                if record.run.branch_point.metric == "_step":
                    branch = int(record.run.branch_point.value)
            elif kind == "history" and record.history.HasField("step"):
                step = record.history.step.num
                if after is not None and step <= after:
                    continue
                row = rows.setdefault(step, {})
                for item in record.history.item:
                    keys: list[str] = [item.key] if item.key else list(item.nested_key)
                    if keys and keys[0] not in RESERVED_KEYS:  # wandb's own; a user's "_x" is compared like any key
                        _put(row, keys, json.loads(item.value_json, parse_int=float))  # "-0" is -0.0
    except OSError:
        return (0, 0), None, {}
    return start, branch, rows


def _file_chunks(path: str) -> Iterator[tuple[int | None, bytes, int]]:
    """:func:`_chunks` of the run file ``path``, read :data:`READ_BYTES` at a time, each read ending at a block
    boundary (no chunk spans two reads)."""
    with open(path, "rb") as file:
        pos = file.seek(HEADER_BYTES)
        while data := file.read(READ_BYTES - pos % READ_BYTES):
            yield from _chunks(data, pos)
            pos += len(data)


def _put(row: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``row[path[0]][path[1]]...`` to ``value``: wandb-core writes a logged dict (a histogram's ``_type``,
    ``values`` and ``bins``) as one item per leaf, each with its ``nested_key`` path."""
    for part in path[:-1]:
        inner = row.get(part)
        if not isinstance(inner, dict):
            inner = row[part] = {}
        row = inner
    row[path[-1]] = value


def _records(data: bytes, start: int) -> Iterator[tuple[bytes, int]]:
    """``(payload, end offset)`` of each complete record in ``data`` (read from file offset ``start``)."""
    return _assemble(_chunks(data, start))


def _assemble(chunks: Iterable[tuple[int | None, bytes, int]]) -> Iterator[tuple[bytes, int]]:
    """``(payload, end offset)`` of each record the ``chunks`` complete; ends at a torn or damaged chunk."""
    parts: list[bytes] = []
    for kind, body, pos in chunks:
        if kind is None:
            return
        if kind == FULL:
            yield body, pos
        elif kind == FIRST:
            parts = [body]
        elif kind == MIDDLE:
            parts.append(body)
        elif kind == LAST:
            yield b"".join([*parts, body]), pos
            parts = []


def _chunks(data: bytes, start: int) -> Iterator[tuple[int | None, bytes, int]]:
    """``(type, body, end offset)`` of each complete chunk in ``data`` (read from file offset ``start``), block
    trailers and zero padding skipped; a last ``(None, b"", offset)`` where a chunk is torn or damaged (not written
    completely yet, or the end of a killed process's file)."""
    pos = start
    while True:
        room = BLOCK_BYTES - pos % BLOCK_BYTES
        at = pos - start
        if room < CHUNK.size:  # a block's trailer, too small for a chunk header
            if at + room > len(data):
                return
            pos += room
            continue
        if at + CHUNK.size > len(data):
            if at < len(data):
                yield None, b"", pos
            return
        crc, length, kind = CHUNK.unpack_from(data, at)
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += room
            continue
        body = data[at + CHUNK.size : at + CHUNK.size + length]
        if len(body) < length or zlib.crc32(bytes([kind]) + body) != crc:
            yield None, b"", pos
            return
        pos += CHUNK.size + length
        yield kind, body, pos
