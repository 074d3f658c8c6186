"""The TensorBoard adapter: exact float64 scalars and the run's hyperparameters, written without torch or TensorFlow.

What it writes. Each metric of a step becomes a scalar-shaped ``DT_DOUBLE`` tensor summary with the scalars plugin's
metadata, so ``EventAccumulator(folder, size_guidance={"tensors": 0}).Tensors(tag)`` returns the committed float64
bit for bit (``tensor_util.make_ndarray(event.tensor_proto).item()``; NaN payloads, ±inf, -0.0, subnormals
included). ``Scalars(tag)`` has none of them: it lists float32 ``simple_value`` summaries only. TensorBoard's
multiplexer (``tensorboard --load_fast=false``) plots and serves them as float64; its default fast loader
(tensorboard-data-server 0.7.2) reads float32 scalars only and shows none of these tags. A
:class:`~metricbus.histogram.Histogram` (the ``hist`` kind) becomes a ``HistogramProto`` (``histo``) value instead,
for the histogram plugin: ``Histograms(tag)`` gives its right edges and counts as float64, the multiplexer's
``Tensors(tag)`` the plugin's ``[left, right, count]`` rows (float32). At open the run's project,
id, name, tags and config go into a text summary with tag ``metricbus/run``, and the config, flattened with ``.``
(bool, int, float and str kept, anything else as ``str()``; two keys that flatten to one name keep both values,
see :func:`hparams_of`), into an hparams session start (group = run id), both
at step 0. A metric under a tag the adapter keeps for these (:data:`RESERVED_TAGS`) is left out of its step's
event, and ``write()`` then raises :class:`~metricbus.errors.RejectedMetricsError` naming it (the delivery reports
it once per name and counts the step, whose other metrics were written, as delivered).

Where. ``log_dir=None`` (the default) means ``runs/<project>/<run id>/tensorboard`` under the working directory at
open: two runs never share it, and every process of one run (a resumed trainer, ``metricbus sync``) finds the same
one. An explicit ``log_dir`` is used as given. Each open starts a new event file whose name sorts after every event
file in the folder (TensorBoard reads a folder's files in name order). Each event is handed to the operating system
whole before ``write()`` returns (a killed process loses nothing it wrote), or, when that fails (a full disk), what
part of it reached the file is cut again before ``write()`` raises, so the retry's record follows a whole one (a torn
record in the middle of a file stops every reader there); ``flush()`` also ``fsync``s the file.

Resume and rewind. ``resume(after_step=N, identity=...)`` (before open) takes the folder from ``identity`` unless
``log_dir`` was given. At open (resume) and at ``rewind(step=S)``, the steps about to be sent again are hidden twice
over. (1) They are cut out of the event files this adapter wrote (first event's writer is ``metricbus``): every
event at a step ``> N`` (``>= S``; every event when ``N`` is None) and a torn last record go, so every reader sees
one value per step, the legacy ``EventAccumulator`` included (it never purges tensors). Other writers' files are
never changed. (2) The new event file starts as ``SummaryWriter(purge_step=P)`` starts one: a ``file_version`` and
a ``SessionLog(status=START)`` event at step ``P`` (``N + 1``, ``S``, or the smallest int64 when ``N`` is None), so
a running ``tensorboard --load_fast=false`` drops what it already loaded and other writers' later steps are hidden
from readers that honour START. The run text and hparams are written again when the cut removed them.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import numbers
import os
import re
import socket
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

from metricbus.adapter import RunInfo, Status, append_whole, is_live_target, run_folder
from metricbus.errors import AdapterNotFoundError, ConfigError
from metricbus.histogram import Histogram

from ._names import NameMapper, passthrough_mapper

RUN_TEXT_TAG = "metricbus/run"
WRITER = "metricbus"  # SourceMetadata.writer of the event files this adapter writes (and may cut)
HParamValue = bool | int | float | str
RESERVED_TAGS = {
    RUN_TEXT_TAG: "the run's text summary (project, id, name, tags, config)",
    "_hparams_/experiment": "the hparams plugin",
    "_hparams_/session_start_info": "the hparams plugin (the run's config)",
    "_hparams_/session_end_info": "the hparams plugin",
}
"""Tags the adapter (and the hparams plugin) writes for the run: a metric under one of them would take another
plugin's data (readers show it under that plugin, not as a scalar), so the adapter refuses it."""

logger = logging.getLogger(__name__)
_INSTALL = "pip install 'metricbus[tensorboard]'"
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_HEADER = struct.Struct("<QI")  # TFRecord: payload length, masked CRC-32C of the length; then payload, its CRC
_FOOTER_BYTES = 4
_FILE_SECONDS = re.compile(r"events\.out\.tfevents\.(\d+)\.")


def hparams_of(config: Mapping[str, Any], *, prefix: str = "") -> dict[str, HParamValue]:
    """Flatten a nested config with ``.``; bool, int, float and str stay, other leaves become ``str(value)``.

    Two leaves that flatten to one name (``{"a.b": 1, "a": {"b": 2}}``) both stay: the same value once; different
    values, the first under the dotted name and each later one under its key path written as JSON (``["a", "b"]``),
    so no config value is lost (:func:`hparams_clashes` names them)."""
    return _flatten(config, prefix=prefix)[0]


def hparams_clashes(config: Mapping[str, Any]) -> list[str]:
    """The config keys whose different values would flatten to one hparams name, each said once (see
    :func:`hparams_of`)."""
    return _flatten(config, prefix="")[1]


def _leaves(config: Mapping[str, Any], path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], HParamValue]]:
    for key, value in config.items():
        where = (*path, str(key))
        if isinstance(value, Mapping):
            yield from _leaves(value, where)
        elif isinstance(value, (bool, str)):
            yield where, value
        elif isinstance(value, numbers.Integral):
            yield where, int(value)
        elif isinstance(value, numbers.Real):
            yield where, float(value)
        else:
            yield where, str(value)


def _flatten(config: Mapping[str, Any], *, prefix: str) -> tuple[dict[str, HParamValue], list[str]]:
    flat: dict[str, HParamValue] = {}
    owner: dict[str, tuple[str, ...]] = {}
    clashes: list[str] = []
    for path, value in _leaves(config, ()):
        name = prefix + ".".join(path)
        if name in flat:
            held = flat[name]
            if type(held) is type(value) and held == value:
                continue  # the same value twice: nothing to keep apart
            earlier, plain = owner[name], prefix + json.dumps(list(path))
            name, count = plain, 1
            while name in flat:  # a key that is itself written as JSON: number the later one
                count += 1
                name = f"{plain}#{count}"
            clashes.append(f"{_path_text(earlier)} and {_path_text(path)} (kept as {name!r})")
        flat[name], owner[name] = value, path
    return flat, clashes


def _path_text(path: tuple[str, ...]) -> str:
    """A config key path as Python indexes it: ``config['a']['b']``, ``config['a.b']``."""
    return "config" + "".join(f"[{part!r}]" for part in path)


def _run_markdown(run: RunInfo) -> str:
    meta = {"project": run.project, "id": run.id, "name": run.name, "tags": list(run.tags), "config": dict(run.config)}
    return "```json\n" + json.dumps(meta, indent=2, sort_keys=True, default=repr) + "\n```"


def _checked_log_dir(log_dir: object) -> str | None:
    if log_dir is None:
        return None
    path = os.fspath(log_dir) if isinstance(log_dir, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path:
        raise ConfigError(
            f"tensorboard option log_dir={log_dir!r} is invalid; use a non-empty folder path (str or os.PathLike), "
            f"or None for runs/<project>/<run id>/tensorboard"
        )
    return path


def _next_event_file(folder: Path) -> Path:
    """A new event file name that sorts after every event file in ``folder`` (TensorBoard reads them in name order)."""
    newest = max((p.name for p in folder.iterdir() if "tfevents" in p.name), default="")
    seconds = int(time.time())
    match = _FILE_SECONDS.match(newest)
    if match:  # same second, or a clock behind the newest file: take its second, or the next one
        seconds = max(seconds, int(match[1]))
    for candidate in (seconds, seconds + 1):
        name = f"events.out.tfevents.{candidate:010d}.{socket.gethostname()}.{os.getpid()}.{WRITER}"
        if name > newest:
            return folder / name
    return folder / f"{newest}.{WRITER}"  # the newest name is not TensorBoard's pattern: extend it


def _records(handle: IO[bytes], crc: Any) -> Iterator[tuple[int, int, bytes]]:
    """``(start, end, payload)`` of each whole record; stops at a torn or damaged tail."""
    start = 0
    while True:
        header = handle.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        length, length_crc = _HEADER.unpack(header)
        if crc(header[:8]) != length_crc:
            return
        body = handle.read(length + _FOOTER_BYTES)
        if len(body) < length + _FOOTER_BYTES:
            return
        end = start + _HEADER.size + len(body)
        yield start, end, body[:length]
        start = end


def _scan(path: Path, *, before_step: int, pb: Any) -> tuple[list[tuple[int, int]], bool, bool] | None:
    """Kept byte spans, whether anything goes, whether the run text stays; None for a file metricbus did not write."""
    spans: list[tuple[int, int]] = []
    dropped, has_run_text, read_to = False, False, 0
    with path.open("rb") as handle:
        for index, (start, end, payload) in enumerate(_records(handle, pb.masked_crc32c)):
            try:
                event = pb.Event.FromString(payload)
            except pb.DecodeError:
                break  # a damaged record: it and everything after it go
            if index == 0 and event.source_metadata.writer != WRITER:
                return None
            read_to = end
            if index > 0 and event.step >= before_step:
                dropped = True
                continue
            has_run_text = has_run_text or any(value.tag == RUN_TEXT_TAG for value in event.summary.value)
            if spans and spans[-1][1] == start:
                spans[-1] = (spans[-1][0], end)
            else:
                spans.append((start, end))
        size = handle.seek(0, os.SEEK_END)
    if not spans:  # not even a first record: whose file it is cannot be told
        return None
    return spans, dropped or read_to != size, has_run_text


def _cut(folder: Path, *, before_step: int, pb: Any) -> bool:
    """Drop every event at a step ``>= before_step`` from metricbus's event files; True if the run text remains."""
    kept_run_text = False
    for path in sorted(p for p in folder.iterdir() if "tfevents" in p.name and p.is_file()):
        scanned = _scan(path, before_step=before_step, pb=pb)
        if scanned is None:
            continue
        spans, changed, has_run_text = scanned
        kept_run_text = kept_run_text or has_run_text
        if not changed:
            continue
        if len(spans) == 1 and spans[0][0] == 0:  # a prefix stays: truncating is atomic and cheap
            os.truncate(path, spans[0][1])
            continue
        temp = folder / f".{path.name.replace('tfevents', 'cut')}.tmp"  # no "tfevents": readers skip it
        with path.open("rb") as source, temp.open("wb") as target:
            for start, stop in spans:
                source.seek(start)
                target.write(source.read(stop - start))
            target.flush()
            os.fsync(target.fileno())
        os.replace(temp, path)
    return kept_run_text


def _protos() -> SimpleNamespace:
    """TensorBoard's protos and helpers, imported at open (importing metricbus imports no backend)."""
    try:
        from google.protobuf.message import DecodeError
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
        from tensorboard.plugins.hparams import summary_v2 as hparams_summary
        from tensorboard.plugins.scalar import metadata as scalar_metadata
        from tensorboard.plugins.text import summary_v2 as text_summary
    except ImportError as exc:
        raise AdapterNotFoundError(
            f"the tensorboard adapter needs the tensorboard package: {_INSTALL} ({exc})"
        ) from exc
    scalar = scalar_metadata.create_summary_metadata(display_name="", description="")
    scalar.data_class = summary_pb2.DATA_CLASS_SCALAR
    return SimpleNamespace(
        Event=event_pb2.Event,
        SessionLog=event_pb2.SessionLog,
        SourceMetadata=event_pb2.SourceMetadata,
        Summary=summary_pb2.Summary,
        HistogramProto=summary_pb2.HistogramProto,
        TensorProto=tensor_pb2.TensorProto,
        DT_DOUBLE=types_pb2.DT_DOUBLE,
        scalar_shape=tensor_shape_pb2.TensorShapeProto(),
        scalar_metadata=scalar,
        text_pb=text_summary.text_pb,
        hparams_pb=hparams_summary.hparams_pb,
        masked_crc32c=masked_crc32c,
        DecodeError=DecodeError,
    )


def _histo(value: Histogram, pb: Any) -> Any:
    """A ``HistogramProto`` of ``value`` (TensorBoard's histogram plugin): ``bucket_limit`` the right edges,
    ``bucket`` the counts. ``min`` and ``max`` are the outer edges of the outermost non-empty bins: readers convert
    the proto by dropping empty outer bins and taking ``min``/``max`` as the outer edges of what is left
    (``data_compat``), so this keeps every bin's edges exact. ``sum`` and ``sum_squares`` are not known exactly: they
    are approximated from the bin midpoints."""
    edges, counts = value.edges, value.counts
    held = [i for i, count in enumerate(counts) if count]
    if not held:  # no bins, or only empty ones: a histogram of nothing (readers show no buckets)
        return pb.HistogramProto(num=0, bucket_limit=edges[1:], bucket=counts)
    mids = [(edges[i] + edges[i + 1]) / 2 for i in range(len(counts))]
    return pb.HistogramProto(
        min=edges[held[0]],
        max=edges[held[-1] + 1],
        num=sum(counts),
        sum=sum(c * m for c, m in zip(counts, mids, strict=True)),
        sum_squares=sum(c * m * m for c, m in zip(counts, mids, strict=True)),
        bucket_limit=edges[1:],
        bucket=counts,
    )


class TensorBoardAdapter:
    """Writes one event per ``write()`` under ``log_dir`` (default ``runs/<project>/<run id>/tensorboard``)."""

    name = "tensorboard"

    def __init__(self, *, log_dir: str | os.PathLike[str] | None = None) -> None:
        self._log_dir = _checked_log_dir(log_dir)
        if importlib.util.find_spec("tensorboard") is None:
            raise AdapterNotFoundError(f"the tensorboard adapter needs the tensorboard package: {_INSTALL}")
        self._names: NameMapper = passthrough_mapper(backend="TensorBoard", reserved=RESERVED_TAGS)
        self._resumed_dir: str | None = None
        self._purge_step: int | None = None  # set by resume(): the first step open() hides
        self._folder: Path | None = None
        self._run: RunInfo | None = None
        self._pb: Any = None
        self._file: IO[bytes] | None = None  # unbuffered: each event is one record handed to the OS whole
        self._end = 0  # the file's size after its last whole record
        self._tags_in_file: set[str] = set()

    @property
    def log_dir(self) -> str | None:
        """The folder written to: as given, else the absolute folder decided at open (or named by resume)."""
        if self._log_dir is not None:
            return self._log_dir
        return str(self._folder) if self._folder is not None else self._resumed_dir

    @property
    def identity(self) -> Mapping[str, str] | None:
        """``{"log_dir": absolute folder}`` after open, None before."""
        return None if self._folder is None else {"log_dir": str(self._folder)}

    @property
    def cursor_key(self) -> str:
        """Names the delivery cursor: the given folder (absolute) or the per-run default; the same before and after
        open (``log_dir`` is not: None until the default folder is decided)."""
        return f"tensorboard:{os.path.abspath(self._log_dir) if self._log_dir else 'runs/<project>/<run id>'}"

    def resume(self, *, after_step: int | None, identity: Mapping[str, str] | None = None) -> None:
        """Before open: hide the steps after ``after_step`` (None: every step) at open; see the module doc."""
        self._purge_step = _INT64_MIN if after_step is None else int(after_step) + 1
        folder = (identity or {}).get("log_dir")
        if self._log_dir is None and isinstance(folder, str) and folder:
            self._resumed_dir = folder

    def new_run(self, *, live: Sequence[Mapping[str, str]]) -> None:
        """Before a replay's open: refuse a folder that is the live run's (``live``: its TensorBoard identities)."""
        if self._log_dir is None:  # the replay's own per-run folder
            return
        if is_live_target(self._log_dir, live=live, key="log_dir"):
            raise ConfigError(
                f"tensorboard: {self._log_dir!r} is the live run's folder (the journal's delivery cursor names it), "
                "and a replay opens a run of its own: it never adds events to the live folder, where each step would "
                "then be twice; give another folder (tensorboard:OTHER) or none (tensorboard: runs/<project>/<replay "
                "run id>/tensorboard); metricbus sync is what writes into the live run"
            )
        try:
            events = sorted(p.name for p in Path(self._log_dir).iterdir() if "tfevents" in p.name and p.is_file())
        except (FileNotFoundError, NotADirectoryError):
            events = []
        if events:
            raise ConfigError(
                f"tensorboard: {self._log_dir!r} already holds event files ({events[0]}"
                + (f" and {len(events) - 1} more" if len(events) > 1 else "")
                + ": an earlier replay's, or another run's), and a replay opens a run of its own: it never adds "
                "events to them, where a step replayed twice would then be twice; give a new folder "
                "(tensorboard:OTHER), none (tensorboard: runs/<project>/<replay run id>/tensorboard), or remove "
                "the event files first to replay into it again"
            )

    def open(self, *, run: RunInfo) -> None:
        """Decide the folder, hide the steps ``resume`` named, start an event file, write the run text and hparams."""
        pb = _protos()
        path = self._log_dir or self._resumed_dir or os.path.join(run_folder(run), "tensorboard")
        folder = Path(os.path.abspath(path))
        self._pb = pb
        try:
            folder.mkdir(parents=True, exist_ok=True)
            purge = self._purge_step
            has_run_text = purge is not None and _cut(folder, before_step=purge, pb=pb)
            self._start_file(folder, run, purge_step=purge, run_text=not has_run_text)
        except OSError as exc:
            message = f"cannot write TensorBoard events under {str(folder)!r}: {exc.strerror or exc}"
            raise (OSError(exc.errno, message) if exc.errno else OSError(message)) from exc
        self._folder, self._run = folder, run

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Write one event holding every metric of ``step``: a float64 scalar tensor, or a histogram for a
        :class:`~metricbus.histogram.Histogram`."""
        if self._file is None:
            raise RuntimeError("TensorBoardAdapter.write() before open()")
        pb, names, seen = self._pb, self._names, self._tags_in_file
        values, new_tags = [], []
        mapped, rejected = names.split(metrics)
        for tag, value in mapped.items():
            if isinstance(value, Histogram):  # a legacy histo value: readers give it the histogram plugin's metadata
                values.append(pb.Summary.Value(tag=tag, histo=_histo(value, pb)))
                continue
            tensor = pb.TensorProto(dtype=pb.DT_DOUBLE, tensor_shape=pb.scalar_shape, double_val=[float(value)])
            if tag in seen:
                values.append(pb.Summary.Value(tag=tag, tensor=tensor))
            else:  # as TensorFlow's writers do: the plugin metadata rides on a tag's first value in each file
                values.append(pb.Summary.Value(tag=tag, metadata=pb.scalar_metadata, tensor=tensor))
                new_tags.append(tag)
        if values:
            self._add(step=int(step), summary=pb.Summary(value=values))
            seen.update(new_tags)
        if rejected:  # the step's other metrics are in the event
            raise names.refused(int(step), rejected, wrote=len(mapped))

    def rewind(self, *, step: int) -> None:
        """Hide every event at a step ``>= step`` (cut from metricbus's files, purged by START); start a new file."""
        if self._file is None or self._folder is None or self._run is None:
            raise RuntimeError("TensorBoardAdapter.rewind() before open()")
        self._close_file()
        has_run_text = _cut(self._folder, before_step=int(step), pb=self._pb)
        self._start_file(self._folder, self._run, purge_step=int(step), run_text=not has_run_text)

    def flush(self) -> None:
        """Make every written event durable (flush, then ``fsync``)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self, *, status: Status) -> None:
        """Flush and close the event file (TensorBoard has no run status)."""
        self._close_file()

    def _close_file(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None

    def _add(self, **fields: Any) -> None:
        """Append one event as a TFRecord, whole: where a write fails, what part of it reached the file is cut."""
        assert self._file is not None
        crc = self._pb.masked_crc32c
        data = self._pb.Event(wall_time=time.time(), **fields).SerializeToString()
        length = struct.pack("<Q", len(data))
        record = b"".join((length, struct.pack("<I", crc(length)), data, struct.pack("<I", crc(data))))
        name = self._file.name
        self._end = append_whole(self._file.fileno(), record, start=self._end, nothing=lambda: OSError(
            errno.EIO, f"no byte of the event went to {name}"
        ))

    def _start_file(self, folder: Path, run: RunInfo, *, purge_step: int | None, run_text: bool) -> None:
        pb = self._pb
        self._file = _next_event_file(folder).open("xb", buffering=0)
        self._end, self._tags_in_file = 0, set()
        self._add(file_version="brain.Event:2", source_metadata=pb.SourceMetadata(writer=WRITER))
        if purge_step is not None and purge_step <= _INT64_MAX:
            self._add(step=purge_step, file_version="brain.Event:2")  # what SummaryWriter(purge_step=...) writes
            # TensorBoard's multiplexer takes a run's first START for a session start, not a restart: a second one
            # makes it purge whether or not an earlier file of the run had a START.
            for _ in range(2):
                self._add(step=purge_step, session_log=pb.SessionLog(status=pb.SessionLog.START))
        if run_text:
            self._add(step=0, summary=pb.text_pb(RUN_TEXT_TAG, _run_markdown(run)))
            hparams, clashes = _flatten(run.config, prefix="")
            if clashes:
                logger.warning("tensorboard: config keys that flatten to one hparams name: %s; both values are kept "
                               "(the later one under its key path as JSON)", "; ".join(clashes))
            if hparams:
                start_s = run.start_time_unix_ns / 1e9
                self._add(step=0, summary=pb.hparams_pb(hparams, trial_id=run.id, start_time_secs=start_s))
        self.flush()
