"""The MLflow adapter: one MLflow run per metricbus run, one ``MlflowClient.log_batch`` per step (per 1000 metrics).

Where, decided when the adapter is built (the first match wins; an explicit option beats the environment):

* tracking store: ``tracking_uri`` > ``MLFLOW_TRACKING_URI`` > ``sqlite:///runs/metricbus/mlflow.db`` (relative to
  the working folder; the file store is in maintenance mode). The URI must use a scheme MLflow 3.17 tracks to
  (:data:`TRACKING_SCHEMES`, with a ``+driver`` for databases, plugins' ``mlflow.tracking_store`` schemes, or a
  plain folder path), else :class:`~metricbus.errors.ConfigError` names it and the valid schemes;
* experiment: ``experiment`` > ``MLFLOW_EXPERIMENT_NAME`` (checked against ``MLFLOW_EXPERIMENT_ID`` when both are
  set) > ``MLFLOW_EXPERIMENT_ID`` > ``run.project``; created when missing;
* run name (new runs only): ``run_name`` > ``run.name``.

Which run, at ``open()`` (the first match wins; a replay calls ``new_run()`` first, which leaves only 4 and 5, and
refuses ``attach=True``):

1. ``attach=True``: the run the trainer started with ``mlflow.start_run()`` (active in this thread, or in exactly
   one other thread: the bus opens adapters in worker threads), else ``MLFLOW_RUN_ID``, else the run of
   ``resume(identity=...)``, looked up in ``tracking_uri`` / ``MLFLOW_TRACKING_URI``, else in
   ``mlflow.get_tracking_uri()`` (MLflow's own default store, not metricbus's). metricbus never changes that run's
   status: the trainer owns it. No such run raises ConfigError;
2. ``MLFLOW_RUN_ID``: that run (it must be in the store, and in ``experiment`` if that option is given);
3. the run named by ``resume(identity=...)``, if the store holds it (and it is not deleted);
4. the oldest run of the experiment tagged ``metricbus.run_id = run.id``;
5. a new run tagged ``metricbus.run_id = run.id``.

A run found in 2-4 is set back to RUNNING, and ``close()`` ends it FINISHED or FAILED: a trainer killed mid-run
and completed by ``metricbus sync`` (same ``run.id``) is one run. ``identity`` is ``{"run_id", "tracking_uri",
"experiment_id"}``.

Params come from ``run.config`` flattened with ``.`` (``{"opt": {"lr": 0.1}}`` -> ``opt.lr``), cut to 6000
characters; a param the run already has is not logged again, and one whose value differs keeps its old value
(MLflow refuses to change a param) with a warning. Run tags become MLflow tags with the value ``"true"``. Metric,
param and tag keys go through :func:`metricbus.adapters._names.mlflow_key`; two metric names that would merge raise
``MetricValueError``. Which of the two owns the key is kept in the run, so a resumed trainer or a sync (a new process)
refuses the same one whichever comes first: a metric name that ``mlflow_key`` changes (``x@y`` -> ``x_y``), and a
histogram's quantile, records its key in a tag ``metricbus.name.<digest of the key>`` =
``{"key", "name"[, "part_of"]}`` (``{"key", "digest"}`` for a name too long for a tag) before its first point; a run
tagged ``metricbus.names = true`` (every run metricbus created, or reopened before it held a point) records every
owner, so a key it holds without such a tag belongs to the name equal to it. In a run without that tag (written by an
older metricbus, or a trainer's own run) such a key goes to the first name that comes, as before.

Histograms. MLflow has none: a :class:`~metricbus.histogram.Histogram` (the ``hist`` kind) under ``key`` is logged
as its quantiles, metrics ``<key>/p50``, ``<key>/p90``, ``<key>/p99`` (mapped like any name), instead of its count,
and the adapter warns once per such key (:class:`~metricbus.errors.MetricBusWarning`).

MLflow's metric history is append-only: nothing can be dropped. When a reopened run already holds points after
the resume cursor (``after_step``; every point without one), those keys' points after it are read once at open
(a SQL store selects those steps, up to :data:`MAX_STEPS_READ` of them, so a reopen costs what the cursor left, not
the run's length; a server's REST API has no such query and sends each key's whole history), and a point sent again
with the same key, step and value is not logged twice. ``rewind(step=S)`` reads the points at
steps ``>= S`` the same way (the old timeline a resume replays up to its checkpoint is logged once), logs the new
values next to the old ones and sets the tag ``metricbus.rewind`` to ``S``. ``get_metric_history`` then returns
both values at each step both timelines wrote, and the run's latest value (``run.data.metrics``, the one with the
largest (step, timestamp)) is the new one, unless the old timeline reached a larger step than the new one has.

Requests run past ``request_timeout_s``. MLflow's HTTP client retries a request to a server it cannot reach for
about four minutes (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, 7, with backoff) and waits up to 120 s for an answer, which
the bus would take for a hung call (``write_timeout_s``, 30 s) and stop the adapter for the rest of the run. So
``write`` sends each batch from a thread of its own and waits at most ``request_timeout_s`` (default 5 s) for it:
a request still running then raises :class:`TimeoutError`, which the bus retries with backoff; the retry first waits
for that request to end (again at most ``request_timeout_s``) and sends only what MLflow did not take. A point sent
again keeps the timestamp of its first request, so where that request failed on the client (MLflow's read timeout)
but the server committed it anyway, the SQL store (sqlite, or a server's database) holds the row once. A server
that is down for a while thus receives every step, in order, once each, when it is back, without a change to the
environment (MLflow's settings stay the trainer's). ``open`` and ``rewind`` wait as long for each of their requests
(a server that accepts the connection and never answers fails ``metricbus sync`` with TimeoutError after
``request_timeout_s``, not after MLflow's retries). A request a timeout gave up on goes on; ``open`` of the same run
in this process (the next sync) first waits for it (again at most ``request_timeout_s``, else TimeoutError), so
that it lands before, not after, what the new adapter writes (a step logged twice, a FINISHED run marked FAILED by
the earlier sync's late close).
Likewise a ``create_run`` a timeout gave up on: ``open`` of the same metricbus run in this process first waits for it
(else TimeoutError), so the run it creates is found and logged into, not a second one created beside it (the late
one left empty and RUNNING). Another process cannot see that request: it finds the run once the request landed.

Wide steps. MLflow takes at most 1000 metrics per batch (``MAX_METRICS_PER_BATCH``), and each batch is its own
request and transaction, so a step with more is sent as several batches by the adapter itself. When one of them
fails, MLflow already holds the batches before it; the retry of that step (the same ``write``) sends only the points
MLflow did not take, so each point lands once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from importlib.metadata import entry_points
from pathlib import Path
from types import MappingProxyType
from typing import Any
from urllib.parse import urlparse

from metricbus.adapter import RunInfo, Status
from metricbus.delivery import check_seconds
from metricbus.errors import AdapterNotFoundError, ConfigError, MetricBusWarning, MetricValueError
from metricbus.histogram import Histogram

from ._names import NameMapper, mlflow_key, mlflow_mapper, source_digest

logger = logging.getLogger(__name__)

MAX_PARAM_VALUE_CHARS = 6000
DEFAULT_TRACKING_URI = "sqlite:///runs/metricbus/mlflow.db"
RUN_ID_TAG = "metricbus.run_id"
PROJECT_TAG = "metricbus.project"
REWIND_TAG = "metricbus.rewind"
# which metric name owns a key another name also maps to (``x@y`` and ``x_y``): the tag OWNER_TAG + a digest of the
# key holds it for each key a renamed name (or a histogram's quantile) owns; a run tagged NAMES_TAG records all of
# them, so a key it holds without such a tag is owned by the name equal to it
OWNER_TAG, NAMES_TAG = "metricbus.name.", "metricbus.names"
MAX_TAG_VALUE_CHARS = 8000  # mlflow 3.17.2 mlflow/utils/validation.py MAX_TAG_VAL_LENGTH
MAX_TAGS_PER_BATCH = 100  # ... MAX_PARAMS_TAGS_PER_BATCH
# What mlflow 3.17.2 registers in mlflow/tracking/_tracking_service/utils.py, less "databricks-uc" and "uc" (it
# registers those only to refuse them as tracking stores). Database schemes also come with a driver: "mysql+pymysql".
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
TRACKING_SCHEMES = ("file", *DATABASE_SCHEMES, "http", "https", "databricks")
# mlflow 3.17.2 mlflow/utils/validation.py: a REST batch holds at most this many metrics. MlflowClient.log_batch splits
# a longer list into several requests itself, and a failure in a later one would leave the earlier ones applied.
MAX_METRICS_PER_BATCH = 1000
REQUEST_TIMEOUT_S = 5.0  # how long write() waits for one request (see the module docstring)
# a reopened run's points after the cursor: each key's steps after it are read STEPS_PER_READ at a time (a database
# caps the parameters of one query), its whole history where they are more than MAX_STEPS_READ
STEPS_PER_READ, MAX_STEPS_READ = 500, 5000
HISTORY_PAGE = 25_000  # a whole history is read this many points a request (MLflow's own page size)
INSTALL_HINT = "the mlflow adapter needs mlflow: pip install 'metricbus[mlflow]'"
_STATUS = {"finished": "FINISHED", "failed": "FAILED"}
_SQLITE_URI = re.compile(r"^sqlite(\+\w+)?:///(?P<path>[^?]*)")
_NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")  # get_run of a missing or malformed run id


def flatten_config(config: Mapping[str, Any], *, prefix: str = "") -> Iterator[tuple[str, str]]:
    """Yield ``(dotted.key, text)`` for every leaf of a nested mapping."""
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten_config(value, prefix=f"{path}.")
        elif isinstance(value, str):
            yield path, value
        else:
            try:
                yield path, json.dumps(value)
            except (TypeError, ValueError):
                yield path, repr(value)


def tracking_schemes() -> tuple[str, ...]:
    """The schemes MLflow tracks to: the built-in ones, then those of installed ``mlflow.tracking_store`` plugins."""
    plugins = sorted({ep.name for ep in entry_points(group="mlflow.tracking_store")} - set(TRACKING_SCHEMES))
    return TRACKING_SCHEMES + tuple(plugins)


def check_tracking_uri(uri: object, *, source: str) -> str:
    """``uri`` when MLflow can track to it; else ConfigError naming ``source`` and the valid schemes."""
    hint = "use a URI with one of the schemes " + ", ".join(tracking_schemes()) + " (or a local folder path)"
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(f"mlflow {source} must be a non-empty tracking URI, not {uri!r}; {hint}")
    try:
        scheme = urlparse(uri).scheme  # lower-cased, like MLflow's own lookup
    except ValueError as exc:
        raise ConfigError(f"mlflow {source} {uri!r} is not a URI ({exc}); {hint}") from None
    base, _, driver = scheme.partition("+")
    if len(scheme) <= 1 or scheme in TRACKING_SCHEMES or (base in DATABASE_SCHEMES and "+" not in driver):
        return uri  # a path (one letter: a Windows drive), a database with at most one driver, a built-in scheme
    if scheme in tracking_schemes():
        return uri
    raise ConfigError(f"mlflow {source} {uri!r} has the scheme {scheme!r}, which MLflow cannot track to; {hint}")


def _require_mlflow() -> None:
    """Raise AdapterNotFoundError when mlflow is not installed (found without importing it)."""
    try:
        spec = importlib.util.find_spec("mlflow")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise AdapterNotFoundError(INSTALL_HINT)


def _active_run_elsewhere() -> str | None:
    """The one run active in some other thread of this process (the bus opens adapters in worker threads).

    MLflow 3.17 keeps active runs per thread and has no public way to see another thread's, so this reads
    its ``fluent._active_run_stack``; None if that changes, or if no run or several are active.
    """
    from mlflow.tracking import fluent

    stacks: dict[int, list[Any]] = getattr(getattr(fluent, "_active_run_stack", None), "get_all_thread_values", dict)()
    run_ids = {stack[-1].info.run_id for stack in stacks.values() if stack}
    return run_ids.pop() if len(run_ids) == 1 else None


def _store_of(client: Any) -> Any:
    """The store of an ``MlflowClient`` (``MlflowClient._tracking_client.store``, mlflow 3.17), or None where MLflow
    moved it."""
    return getattr(getattr(client, "_tracking_client", None), "store", None)


def _steps_reader(client: Any) -> Callable[..., Any] | None:
    """The ``get_metric_history_bulk_interval_from_steps`` of the client's store where the store implements it (the
    SQL stores: one query), None where it only filters the whole history (AbstractStore's, which a REST store has),
    or where MLflow moved it (``MlflowClient._tracking_client.store``, mlflow 3.17)."""
    try:
        from mlflow.store.tracking.abstract_store import AbstractStore
    except ImportError:
        return None
    store = _store_of(client)
    name = "get_metric_history_bulk_interval_from_steps"
    own = getattr(type(store), name, None)
    if own is None or own is getattr(AbstractStore, name, None):
        return None
    method: Callable[..., Any] = getattr(store, name)
    return method


def _comparable(value: float) -> float:
    """``value`` as a store keeps it (sqlite clamps ±inf to ±max double); NaN becomes +inf so that NaN == NaN."""
    return math.inf if math.isnan(value) else max(-sys.float_info.max, min(sys.float_info.max, value))


class MlflowAdapter:
    """Logs one metricbus run into one MLflow run through ``MlflowClient``."""

    name = "mlflow"

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        attach: bool = False,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        _require_mlflow()
        if not isinstance(attach, bool):
            raise ConfigError(f"mlflow option attach must be true or false, not {attach!r}")
        try:
            self._request_timeout_s = check_seconds("request_timeout_s", request_timeout_s)
        except ValueError:
            raise ConfigError(
                f"mlflow option request_timeout_s must be a number of seconds > 0 (below the bus's write_timeout_s), "
                f"not {request_timeout_s!r}"
            ) from None
        self._pending: _Request | None = None  # a batch whose request write() stopped waiting for
        for option, value in (("experiment", experiment), ("run_name", run_name)):
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"mlflow option {option} must be a non-empty string or unset, not {value!r}")
        env_uri = os.environ.get("MLFLOW_TRACKING_URI") or None
        if tracking_uri is not None:
            self._tracking_uri: str | None = check_tracking_uri(tracking_uri, source="option tracking_uri")
        elif env_uri is not None:
            self._tracking_uri = check_tracking_uri(env_uri, source="environment variable MLFLOW_TRACKING_URI")
        else:  # an attached run lives where mlflow.start_run() put it: MLflow's own default, not ours
            self._tracking_uri = None if attach else DEFAULT_TRACKING_URI
        self._experiment = experiment
        self._env_experiment = (
            os.environ.get("MLFLOW_EXPERIMENT_NAME") or None,
            os.environ.get("MLFLOW_EXPERIMENT_ID") or None,
        )
        self._env_run_id = os.environ.get("MLFLOW_RUN_ID") or None
        self._run_name = run_name
        self._attach = attach
        self._resume_identity: Mapping[str, str] = {}
        self._after_step: int | None = None
        self._names: NameMapper = mlflow_mapper()
        self._recorded: set[str] = set()  # keys whose owner the run records (OWNER_TAG)
        self._client: Any = None
        self._bounded: Any = None  # the client whose calls wait at most request_timeout_s (open, rewind)
        self._metric: Any = None
        self._run_tag: Any = None
        self._mlflow_error: type[Exception] = Exception
        self._run_id: str | None = None
        self._identity: Mapping[str, str] = MappingProxyType({})
        self._held: dict[tuple[str, int], set[float]] = {}  # points a reopened run holds after the cursor
        # the points of step ``_sent_step`` MLflow took: a write retried after a failed batch skips them
        self._sent_step: int | None = None
        self._sent: dict[str, set[float]] = {}
        self._tried: dict[tuple[str, float], int] = {}  # (key, value) of step ``_sent_step`` -> its first timestamp
        self._warned: set[str] = set()  # histogram keys already warned about

    @property
    def request_timeout_s(self) -> float:
        """How long one call waits for its request (the bus refuses a value not below its ``write_timeout_s``)."""
        return self._request_timeout_s

    @property
    def run_id(self) -> str | None:
        """The MLflow run id once open."""
        return self._run_id

    @property
    def tracking_uri(self) -> str | None:
        """The configured store (option, else MLFLOW_TRACKING_URI, else the default; None: attach to MLflow's own)."""
        return self._tracking_uri

    @property
    def identity(self) -> Mapping[str, str]:
        """After open: ``run_id``, ``tracking_uri`` and ``experiment_id`` of the MLflow run (empty before)."""
        return self._identity

    def resume(self, *, after_step: int | None, identity: Mapping[str, str] | None = None) -> None:
        """Before open: MLflow acknowledged the steps up to ``after_step``; ``identity`` names the run written then."""
        self._after_step = None if after_step is None else int(after_step)
        self._resume_identity = dict(identity or {})

    def new_run(self, *, live: Sequence[Mapping[str, str]]) -> None:
        """Before a replay's open: log into the run of ``run.id`` (a new one), not the one ``MLFLOW_RUN_ID`` names
        (a trainer's environment names the live run); ``attach=True`` is refused. ``live`` is not needed: a replay's
        run id is its own."""
        if self._attach:
            raise ConfigError(
                "mlflow option attach=True logs into the run the trainer started (or MLFLOW_RUN_ID names), but a "
                "replay opens a run of its own and never writes into the live one; leave attach out for the replay "
                "(metricbus sync is what writes into the live run)"
            )
        self._env_run_id = None
        self._resume_identity = {}

    def open(self, *, run: RunInfo) -> None:
        """Find or create the one MLflow run of ``run.id`` (see the module docstring), tag it, log the config."""
        try:
            import mlflow
            from mlflow.entities import Metric, Param, RunTag
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise AdapterNotFoundError(f"{INSTALL_HINT} ({exc})") from exc
        self._metric, self._mlflow_error = Metric, MlflowException
        uri, run_id, source = self._named_run(mlflow)
        _ensure_sqlite_folder(uri)
        raw = MlflowClient(tracking_uri=uri)
        client = _Bounded(raw, timeout_s=self._request_timeout_s, uri=uri)  # no call waits on the store for minutes
        tags = {mlflow_key(tag): "true" for tag in run.tags} | {PROJECT_TAG: run.project, RUN_ID_TAG: run.id}
        landed = _LANDED[0]  # requests an earlier adapter left running that ended before the run is read below
        found = self._existing(client, run_id) if run_id else None
        if run_id and found is None and source != "resume identity":
            raise ConfigError(f"mlflow: {source} names run {run_id!r}, which {uri} does not hold (or it is deleted)")
        if found is None and self._attach:
            raise ConfigError(
                "mlflow option attach=True, but there is no MLflow run to attach to: call "
                "mlflow.start_run() before the bus is built, or set MLFLOW_RUN_ID"
            )
        if found is None:
            experiment_id = self._experiment_id(client, run, uri)
            # a create_run an earlier adapter of this process sent for this run (a timeout gave up on it, and it may
            # still land): waited for first, so that its run is found below instead of a second one created beside it
            creating = f"create:{uri}:{experiment_id}:{run.id}"
            self._wait_for_earlier(creating, subject=f"the MLflow run of metricbus run {run.id!r}")
            found = self._tagged_run(client, experiment_id, run.id)
        created = found is None
        if created:
            client.run_id = creating  # the request is listed in _IN_FLIGHT under that name while it runs
            found = client.create_run(
                experiment_id,
                start_time=run.start_time_unix_ns // 1_000_000,
                tags=tags | {NAMES_TAG: "true"},  # every key's owner is recorded from the first point on
                run_name=self._run_name or run.name,
            )
        self._check_experiment(client, found, source)
        self._run_id = client.run_id = str(found.info.run_id)
        self._wait_for_earlier(self._run_id)
        if not created and _LANDED[0] != landed:  # one may have landed after ``found`` was read: read it again
            found = client.get_run(self._run_id)
        self._client, self._bounded = raw, client  # from here on, close() marks the run (FAILED if open fails)
        if not created and not self._attach and found.info.status != "RUNNING":
            client.update_run(self._run_id, status="RUNNING")
        if not created and not found.data.metrics:  # no point yet: every key's owner is recorded from now on
            tags[NAMES_TAG] = "true"
        new_tags = [] if created else [RunTag(key, value) for key, value in tags.items()]
        self._run_tag = RunTag
        self._recorded = set() if created else self._recorded_owners(found)
        client.log_batch(self._run_id, params=self._new_params(found, run, Param), tags=new_tags)
        self._identity = MappingProxyType(
            {"run_id": self._run_id, "tracking_uri": uri, "experiment_id": str(found.info.experiment_id)}
        )
        self._held = {} if created else self._held_points(client, found, self._after_step)

    def _wait_for_earlier(self, run_id: str, *, subject: str | None = None) -> None:
        """Wait (at most ``request_timeout_s`` in all) for the requests to ``run_id`` that earlier adapters of this
        process left running when a timeout gave up on them (a sync that timed out, then another one): they land
        before this adapter reads what the run holds and marks it RUNNING, not after what it writes (``open`` reads
        the run again where one ended after it first read it). TimeoutError naming them when some are still running
        then. ``subject``: what ``run_id`` names in that error (a run not created yet)."""
        deadline = time.monotonic() + self._request_timeout_s
        with _IN_FLIGHT_LOCK:
            earlier = list(_IN_FLIGHT.get(run_id, ()))
        running = [r for r in earlier if not r.done.wait(max(0.0, deadline - time.monotonic()))]
        if running:
            said = ", ".join(sorted({r.what for r in running}))
            subject = subject or f"MLflow run {run_id}"
            raise TimeoutError(
                f"{subject}: {said} that an earlier adapter sent (and a timeout gave up on) did not end "
                f"within request_timeout_s={self._request_timeout_s:g} s; nothing is written into the run until it "
                f"did (it would land after this adapter's requests): run sync again once the server answers"
            )

    def _named_run(self, mlflow: Any) -> tuple[str, str | None, str]:
        """(tracking URI, run id or None, what named it) from attach, MLFLOW_RUN_ID or the resume identity."""
        fluent_uri = self._tracking_uri or str(mlflow.get_tracking_uri())
        if self._attach:
            active = mlflow.active_run()
            run_id = active.info.run_id if active else _active_run_elsewhere()
            if run_id:
                return fluent_uri, str(run_id), "the active MLflow run"
        if self._env_run_id:
            return fluent_uri, self._env_run_id, "environment variable MLFLOW_RUN_ID"
        resumed = self._resume_identity.get("run_id")
        uri = self._tracking_uri or self._resume_identity.get("tracking_uri") or fluent_uri
        return uri, resumed or None, "resume identity"

    def _existing(self, client: Any, run_id: str) -> Any:
        """The run ``run_id`` of this store, or None if it has no such run or the run is deleted."""
        try:
            found = client.get_run(run_id)
        except self._mlflow_error as exc:
            if getattr(exc, "error_code", None) in _NOT_FOUND:
                return None
            raise
        return None if found.info.lifecycle_stage == "deleted" else found

    def _experiment_id(self, client: Any, run: RunInfo, uri: str) -> str:
        """The experiment id from the option, MLFLOW_EXPERIMENT_NAME/_ID or ``run.project``; created if missing."""
        name, wanted_id = (self._experiment, None) if self._experiment else self._env_experiment
        if name is None and wanted_id is None:
            name = run.project
        if name is None:
            try:
                return str(client.get_experiment(wanted_id).experiment_id)
            except self._mlflow_error as exc:
                raise ConfigError(
                    f"mlflow: environment variable MLFLOW_EXPERIMENT_ID={wanted_id!r} names no "
                    f"experiment in {uri}; unset it or set MLFLOW_EXPERIMENT_NAME"
                ) from exc
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return str(client.create_experiment(name))
            except self._mlflow_error:  # another process created it meanwhile
                experiment = client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        if wanted_id is not None and experiment.experiment_id != wanted_id:
            raise ConfigError(
                f"mlflow: MLFLOW_EXPERIMENT_NAME={name!r} is experiment {experiment.experiment_id} in "
                f"{uri}, but MLFLOW_EXPERIMENT_ID={wanted_id!r}; unset one of them"
            )
        if experiment.lifecycle_stage == "deleted":
            raise ConfigError(
                f"mlflow: experiment {name!r} in {uri} is deleted; restore it (mlflow experiments "
                f"restore --experiment-id {experiment.experiment_id}) or pick another"
            )
        return str(experiment.experiment_id)

    def _tagged_run(self, client: Any, experiment_id: str, metricbus_id: str) -> Any:
        """The oldest active run of the experiment tagged ``metricbus.run_id = metricbus_id``, or None."""
        quote = "'" if "'" not in metricbus_id else '"'
        if quote in metricbus_id:
            raise ConfigError(f"run id {metricbus_id!r} holds both quote characters; MLflow cannot search for it")
        found = client.search_runs(
            [experiment_id],
            filter_string=f"tags.`{RUN_ID_TAG}` = {quote}{metricbus_id}{quote}",
            max_results=1,
            order_by=["attributes.start_time ASC"],
        )
        return found[0] if found else None

    def _check_experiment(self, client: Any, found: Any, source: str) -> None:
        """A run named by MLFLOW_RUN_ID or attach must be in the ``experiment`` option's experiment, if given."""
        if self._experiment and source != "resume identity":
            name = client.get_experiment(found.info.experiment_id).name
            if name != self._experiment:
                raise ConfigError(
                    f"mlflow: {source} names run {found.info.run_id} of experiment {name!r}, but the "
                    f"option experiment is {self._experiment!r}; drop one of them"
                )

    def _new_params(self, found: Any, run: RunInfo, param: Any) -> list[Any]:
        """The config params the run lacks; a differing value already there is kept (MLflow cannot change it). Two
        config keys that land on one param key (``{"opt": {"lr": 1}, "opt.lr": 2}``, ``"a?b"`` and ``"a_b"``): the
        first one's value is logged, with a warning naming both (MLflow refuses a batch holding a key twice, which
        would keep the run from opening)."""
        have, params, kept, clashes = found.data.params, [], [], []
        first: dict[str, str] = {}  # param key -> the config key that gave it
        for key, text in flatten_config(run.config):
            name, value = mlflow_key(key), text[:MAX_PARAM_VALUE_CHARS]
            if name in first:
                earlier = first[name]
                clashes.append(f"{key!r} twice" if earlier == key else f"{earlier!r} and {key!r} (both {name!r})")
                continue
            first[name] = key
            if name not in have:
                params.append(param(name, value))
            elif have[name] != value:
                kept.append(f"{name}={have[name]!r} (new {value!r})")
        if clashes:
            logger.warning(
                "mlflow run %s: config keys that give one MLflow param: %s; the first one's value is logged",
                found.info.run_id,
                "; ".join(clashes),
            )
        if kept:
            logger.warning(
                "mlflow run %s keeps its params %s: MLflow refuses to change a param's value",
                found.info.run_id,
                ", ".join(kept),
            )
        return params

    def _recorded_owners(self, found: Any) -> set[str]:
        """The keys whose owner run ``found`` records (OWNER_TAG), each given to the name mapper as owned by it; in
        a run that records every owner (NAMES_TAG), a key it holds without one is owned by the name equal to it. A
        name that maps to a key another one owns is then refused whichever of the two comes first in this process
        (a run an older metricbus wrote, without NAMES_TAG, leaves its untagged keys to the first name that comes)."""
        recorded: set[str] = set()
        data = found.data
        for tag, text in data.tags.items():
            if not tag.startswith(OWNER_TAG):
                continue
            try:
                owner = json.loads(text)
                key, digest, name, part_of = owner["key"], owner.get("digest"), owner.get("name"), owner.get("part_of")
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # not a tag metricbus wrote
            if not isinstance(key, str):
                continue
            if isinstance(digest, str):
                self._names.own(key, digest)
            elif isinstance(name, str) and (part_of is None or isinstance(part_of, str)):
                self._names.own(key, (name, part_of))
            else:
                continue
            recorded.add(key)
        if data.tags.get(NAMES_TAG) == "true":
            for key in data.metrics:
                if key not in recorded:
                    self._names.own(key, (key, None))
        return recorded

    def _owner_tag(self, key: str, name: str, part_of: str | None) -> Any:
        """The tag recording that metric ``name`` (a part written for ``part_of``) owns MLflow key ``key``."""
        owner = {"key": key, "name": name} | ({} if part_of is None else {"part_of": part_of})
        text = json.dumps(owner)
        if len(text) > MAX_TAG_VALUE_CHARS:  # a name of thousands of characters: its digest
            text = json.dumps({"key": key, "digest": source_digest((name, part_of))})
        return self._run_tag(OWNER_TAG + hashlib.sha256(key.encode()).hexdigest()[:16], text)

    def _held_points(self, client: Any, found: Any, after: int | None) -> dict[tuple[str, int], set[float]]:
        """The points run ``found`` holds after step ``after`` (every point for None), to not log them twice."""
        held: dict[tuple[str, int], set[float]] = {}
        run_id = found.info.run_id
        # the latest point of each key (largest (step, timestamp)): only keys with points after ``after`` are read,
        # and of each only the steps after it (MLflow's SQL stores select them; a key's whole history would make a
        # reopen as slow as the run is long); every point where that is not known
        latest = [(m.key, m.step) for m in found.data.to_proto().metrics if after is None or m.step > after]
        whole = [(run_id, key) for key, last in latest if after is None or last - after > MAX_STEPS_READ]
        tails = [
            (run_id, key, list(range(first, min(first + STEPS_PER_READ, last + 1))), 2**31 - 1)
            for key, last in latest
            if after is not None and last - after <= MAX_STEPS_READ
            for first in range(after + 1, last + 1, STEPS_PER_READ)
        ]
        read_tail = _steps_reader(client.client)
        if read_tail is None:  # a REST store (it has no such query) or MLflow changed: whole histories, filtered here
            whole += list(dict.fromkeys((run_id, key) for run_id, key, _, _ in tails))
            tails = []
        points = [p for history in client.histories(whole) for p in history]
        points += [p for at_steps in client.each(read_tail, tails) for p in at_steps] if tails else []
        for point in points:
            if after is None or point.step > after:
                held.setdefault((point.key, point.step), set()).add(_comparable(point.value))
        return held

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Log every metric of ``step``, in batches of at most MAX_METRICS_PER_BATCH; a retry after a failed batch
        sends only what MLflow did not take."""
        if self._client is None:
            raise RuntimeError("MlflowAdapter.write() before open()")
        self._settle()  # a request an earlier try left running: wait for it, keep what it logged
        metric, names, step = self._metric, self._names, int(step)
        if not -(2**63) <= step < 2**63:  # sqlite fails with an INTERNAL_ERROR, which would be retried for ever
            raise MetricValueError(f"step {step} is outside MLflow's int64 step range; MLflow cannot store it")
        if self._sent_step != step:
            self._sent_step, self._sent, self._tried = step, {}, {}
        # a point sent again has the timestamp it was first sent with: a request that failed on our side (a read
        # timeout) but that the server committed anyway holds the very same row, which MLflow's SQL stores do not
        # add twice (a new timestamp would make it a second point at this step)
        now_ms, tried = time.time_ns() // 1_000_000, self._tried
        batch = []
        rejected: dict[str, str] = {}  # a name MLflow cannot take (a collision): the step's others are written
        claims: dict[str, Any] = {}  # owner tags of the keys renamed names take in this step
        for key, value, of in self._points(metrics):
            try:
                name = names(key, part_of=of)
            except MetricValueError as exc:
                rejected[key] = str(exc)
                continue
            if (name != key or of is not None) and name not in self._recorded:
                claims[name] = self._owner_tag(name, key, of)
            number = float(value)
            batch.append(metric(name, number, tried.setdefault((name, _comparable(number)), now_ms), step))
        wrote = len(batch)
        if self._held:
            held = self._held
            batch = [m for m in batch if _comparable(m.value) not in held.get((m.key, step), ())]
        sent = self._sent
        if sent:  # this step was written before, or tried: what MLflow took then is not logged again
            batch = [m for m in batch if _comparable(m.value) not in sent.get(m.key, ())]
        owners = list(claims.values())
        for start in range(0, len(owners), MAX_TAGS_PER_BATCH):  # before the points: a run never holds them unowned
            tags = owners[start : start + MAX_TAGS_PER_BATCH]
            self._pending = _Request(partial(self._client.log_batch, self._run_id, tags=tags), step, [],
                                     what=f"the owner tags of step {step}", run_id=self._run_id)
            self._settle(own=True)
        self._recorded.update(claims)
        for start in range(0, len(batch), MAX_METRICS_PER_BATCH):
            # one request, one transaction: all or nothing
            part = batch[start : start + MAX_METRICS_PER_BATCH]
            self._pending = _Request(
                partial(self._client.log_batch, self._run_id, metrics=part), step, part, run_id=self._run_id
            )
            self._settle(own=True)
        if rejected:  # after the others reached MLflow: the step is delivered, these names never will be
            raise names.refused(step, rejected, wrote=wrote)

    def _settle(self, *, own: bool = False) -> None:
        """Wait (at most ``request_timeout_s``) for the pending request; once it ended, mark what it logged as sent.

        Still running: TimeoutError (transient: the bus retries the step, and the retry waits here again). ``own``:
        the request this write just sent, whose failure is raised; an earlier try's failure is only forgotten (its
        points are sent again)."""
        pending = self._pending
        if pending is None:
            return
        if not pending.done.wait(self._request_timeout_s):
            raise TimeoutError(
                f"MLflow did not answer the log_batch of step {pending.step} ({len(pending.part)} metrics) within "
                f"request_timeout_s={self._request_timeout_s:g} s; the request goes on, and the retry waits for it "
                f"before sending what MLflow did not take"
            )
        self._pending = None
        if pending.error is not None:
            if own:
                raise pending.error
            return
        if pending.step == self._sent_step:
            for m in pending.part:
                self._sent.setdefault(m.key, set()).add(_comparable(m.value))

    def _points(self, metrics: Mapping[str, float]) -> Iterator[tuple[str, float, str | None]]:
        """``(name, value, part_of)`` of every metric; a Histogram gives its quantiles ``<key>/p50``, ... with
        ``part_of=key`` (MLflow has no histograms; a metric really named ``<key>/p50`` is then a collision, not the
        same series), with a warning the first time each key is seen."""
        for key, value in metrics.items():
            if not isinstance(value, Histogram):
                yield key, value, None
                continue
            points = [(f"{key}/{suffix}", quantile, key) for suffix, quantile in value.quantiles]
            if key not in self._warned:
                # the rule alone: a quantile whose key another metric owns is refused by write(), not here
                names = ", ".join(repr(mlflow_key(name)) for name, _, _ in points) or "(none)"
                self._warned.add(key)
                message = f"MLflow has no histograms, so {key!r} is logged as its quantiles {names}"
                # stacklevel 1: writes run in a delivery thread, with no user code to point at
                warnings.warn(message, MetricBusWarning, stacklevel=1)
            yield from points

    def rewind(self, *, step: int) -> None:
        """Steps ``>= step`` come again: log them next to the old points (identical ones once), tag the rewind."""
        if self._client is None:
            raise RuntimeError("MlflowAdapter.rewind() before open()")
        client, step = self._bounded, int(step)
        self._settle()  # what a request left running logs is read back below, not sent again
        self._held = self._held_points(client, client.get_run(self._run_id), step - 1)
        self._sent_step, self._sent, self._tried = None, {}, {}  # what the new timeline holds is in _held now
        client.set_tag(self._run_id, REWIND_TAG, str(step))

    def flush(self) -> None:
        """Nothing to do: every batch is sent synchronously."""

    def close(self, *, status: Status) -> None:
        """Mark the run FINISHED or FAILED (an attached run is left to the trainer that started it). Like a batch,
        the request waits at most ``request_timeout_s``: a server that stopped answering raises TimeoutError (the
        request goes on; the run stays RUNNING until it ends or the next sync closes the run) instead of holding
        ``metricbus sync`` for MLflow's retries (minutes)."""
        if self._client is not None and self._run_id is not None:
            if not self._attach:
                state = _STATUS[status]
                send = partial(self._client.set_terminated, self._run_id, status=state)
                call = _Request(send, -1, [], what=f"the set_terminated({state})", run_id=self._run_id)
                if not call.done.wait(self._request_timeout_s):
                    raise TimeoutError(
                        f"MLflow did not answer the request to mark run {self._run_id} {state} within "
                        f"request_timeout_s={self._request_timeout_s:g} s; the run stays RUNNING until that request "
                        f"ends, or the next metricbus sync closes it"
                    )
                if call.error is not None:
                    raise call.error
            self._client = None


class _Request:
    """One request (``send``: the ``log_batch`` of ``part`` at ``step``, the run's ``set_terminated``, or any other call
    to the store, said by ``what``) running on a daemon thread of its own (a request hung in MLflow's retries never
    holds up the interpreter's exit); ``done`` is set when it ended, ``result`` is what it returned and ``error`` what
    it raised. One sent to a run (``run_id``) is listed in :data:`_IN_FLIGHT` until it ended, so that another adapter
    of this process reopening that run waits for it (see :meth:`MlflowAdapter._wait_for_earlier`)."""

    __slots__ = ("done", "error", "part", "result", "run_id", "step", "what")

    def __init__(
        self, send: Callable[[], object], step: int, part: list[Any], *, what: str = "", run_id: str | None = None
    ) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.result: Any = None
        self.step, self.part, self.what, self.run_id = step, part, what or f"the log_batch of step {step}", run_id
        if run_id is not None:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.setdefault(run_id, set()).add(self)
        threading.Thread(target=self._run, args=(send,), name="metricbus-mlflow-request", daemon=True).start()

    def _run(self, send: Callable[[], object]) -> None:
        try:
            self.result = send()
        except BaseException as exc:  # raised by write(), as if it had called log_batch itself
            self.error = exc
        finally:
            if self.run_id is not None:
                with _IN_FLIGHT_LOCK:
                    _IN_FLIGHT.get(self.run_id, set()).discard(self)
                    _LANDED[0] += 1
            self.done.set()


# run id -> the requests still running on that run, from any adapter of this process: a request a timeout gave up on
# goes on, and one that ends after another adapter reopened the run (a second sync) would land after what that one
# wrote (a step logged twice, a FINISHED run marked FAILED)
_IN_FLIGHT: dict[str, set[_Request]] = {}
_IN_FLIGHT_LOCK = threading.Lock()
# how many of those requests ended (any run): open() reads the run again where one ended after it read it (what that
# request logged or set, such as a late log_batch or FAILED, is then in what open() holds; else sent twice)
_LANDED = [0]


class _Bounded:
    """``MlflowClient`` whose every call runs as a :class:`_Request` waited for at most ``timeout_s``: one still
    running then raises TimeoutError naming the call and the store (``open`` and ``rewind`` make several requests, each
    of which MLflow's HTTP client would otherwise wait on for minutes). ``run_id``, once set, lists the calls as
    requests to that run."""

    def __init__(self, client: Any, *, timeout_s: float, uri: str) -> None:
        self.client, self.timeout_s, self.uri = client, timeout_s, uri
        self.run_id: str | None = None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        getattr(self.client, name)  # AttributeError now for a method the client lacks

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.each(name, [args], **kwargs)[0]

        return call

    def each(self, name: str | Callable[..., Any], calls: Sequence[tuple[Any, ...]], **kwargs: Any) -> list[Any]:
        """``client.<name>(*args, **kwargs)`` (or ``name(...)``, a method of its store) for each ``args`` of ``calls``,
        in order, on one thread (not one per call: reopening a run reads one history per metric key); each call waited
        for at most ``timeout_s``."""
        method = getattr(self.client, name) if isinstance(name, str) else name

        def work(request: Callable[[], None]) -> list[Any]:
            results = []
            for args in calls:
                request()
                results.append(method(*args, **kwargs))
            return results

        results: list[Any] = self._bounded(str(getattr(method, "__name__", name)), work)
        return results

    def histories(self, calls: Sequence[tuple[str, str]]) -> list[list[Any]]:
        """``client.get_metric_history(run_id, key)`` for each ``(run_id, key)`` of ``calls``, read page by page
        (MLflow's 25,000 points a request) where the store is reachable, each page waited for at most ``timeout_s``:
        a long run's history takes several requests, and a bound on their sum would keep it from ever being read."""
        store = _store_of(self.client)
        if store is None or not callable(getattr(store, "get_metric_history", None)):
            return self.each("get_metric_history", calls)

        def work(request: Callable[[], None]) -> list[list[Any]]:
            histories = []
            for run_id, key in calls:
                points: list[Any] = []
                token = None
                while True:
                    request()
                    page = store.get_metric_history(
                        run_id=run_id, metric_key=key, max_results=HISTORY_PAGE, page_token=token
                    )
                    points.extend(page)
                    token = getattr(page, "token", None)
                    if not token:
                        break
                histories.append(points)
            return histories

        read: list[list[Any]] = self._bounded("get_metric_history", work)
        return read

    def _bounded(self, name: str, work: Callable[[Callable[[], None]], Any]) -> Any:
        """``work(request)`` on a thread of its own, which calls ``request()`` before each request it sends; each
        request waited for at most ``timeout_s`` (TimeoutError then, and the thread sends no further request)."""
        started = [time.monotonic()]  # when the last request started
        stop = threading.Event()  # set when this gave up: the thread sends no further request

        def request() -> None:
            if stop.is_set():
                raise TimeoutError(f"{name}() given up on")
            started[0] = time.monotonic()

        call = _Request(lambda: work(request), -1, [], what=f"{name}()", run_id=self.run_id)
        while not call.done.wait(max(0.0, started[0] + self.timeout_s - time.monotonic())):
            if time.monotonic() >= started[0] + self.timeout_s:
                stop.set()
                raise TimeoutError(
                    f"MLflow at {self.uri} did not answer {name}() within request_timeout_s={self.timeout_s:g} s; "
                    f"the request goes on, and nothing more is sent (a later sync tries again)"
                )
        if call.error is not None:
            raise call.error
        return call.result


def _ensure_sqlite_folder(uri: str) -> None:
    """Create the folder of a sqlite database; ConfigError naming the URI when it cannot be created or written."""
    match = _SQLITE_URI.match(uri)
    if match is None or match["path"] in ("", ":memory:"):
        return
    folder = Path(match["path"]).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"mlflow tracking URI {uri!r}: cannot create the database folder {str(folder)!r} "
            f"({exc.strerror or exc}); use a writable path"
        ) from exc
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(
            f"mlflow tracking URI {uri!r}: the database folder {str(folder)!r} is not writable; use a writable path"
        )
