"""PyTorch Lightning: a callback that owns the reduction, and a ``Logger`` that routes Lightning's own metrics.

This module imports ``pytorch_lightning`` when it is imported (its classes subclass Lightning's); ``import
metricbus`` never imports it.

* :class:`MetricBusCallback` builds (or takes) a bus on every rank. The module logs raw per-micro-batch records in
  ``training_step`` (:func:`metricbus_log`, or ``callback.bus.log``; Lightning replaces a callback's ``log`` with
  the module's, so the callback has none); the callback ends an update at each batch that stepped an optimizer
  and commits on every rank (a collective under DDP) where Lightning logs: after the batch Lightning's loggers
  receive at step ``n`` (its count of batches that stepped, ``global_step - 1`` with one optimizer; a batch that
  steps two optimizers counts once) when ``(n + 1) % trainer.log_every_n_steps == 0``. One commit therefore covers
  the ``log_every_n_steps`` optimizer steps since the last one (each one update), so a logged ``"mean"`` is the
  exact weighted mean over all of them, not a sample of the last micro-batch. Commits are labelled ``n``, so both
  series line up. ``log_every_n_steps=0`` commits once, at the end.
* :class:`MetricBusLogger` is a ``Logger`` (rank 0 only, like Lightning's loggers) for the values Lightning has
  already reduced: they go through a ``MetricBus(dist=None)`` to its adapters and journal. Lightning logs one step
  several times: validation at the step of the training log before it, and (manual optimization, Lightning < 2.x)
  every micro-batch of an accumulating step. The logger merges the calls of one step, the last value of a name
  winning (what Lightning's own loggers end up showing), and commits a step once Lightning logs a later one (or at
  ``finalize``). The bus is built at the first ``log_metrics`` so that ``log_hyperparams`` (called first by
  Lightning) becomes the run config: MLflow params, wandb config, TensorBoard hparams.
"""

from __future__ import annotations

import inspect
import warnings
from argparse import Namespace
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.utilities.logger import _convert_params, _sanitize_callable_params
from pytorch_lightning.loggers.logger import Logger
from pytorch_lightning.utilities import rank_zero_only

from metricbus import shutdown
from metricbus.adapter import Adapter, RunInfo, Status
from metricbus.bus import CLOSE_TIMEOUT_S, MetricBus, as_step, check_wait_s
from metricbus.config import bus_options, require_source
from metricbus.delivery import WRITE_TIMEOUT_S
from metricbus.errors import (
    AdapterNotFoundError,
    ClosedError,
    ConfigError,
    MetricBusError,
    MetricBusWarning,
    MetricTypeError,
    MetricValueError,
    StepError,
)
from metricbus.options import BusOptions, check_request_timeouts
from metricbus.registry import get_adapter_class
from metricbus.spec import SpecLike
from metricbus.spec_table import check_name
from metricbus.values import to_values

__all__ = ["MetricBusCallback", "MetricBusLogger", "metricbus_log"]

_SCALARS = (str, int, float, bool, type(None))


class MetricBusCallback(pl.Callback):
    """Reduces what ``training_step`` logs per micro-batch exactly, over micro-batches, optimizer steps and ranks.

    ``MetricBusCallback(adapters=[...], rules={...})`` builds ``MetricBus(**options)`` at ``setup("fit")`` on every
    rank (after Lightning created the process group, so ``dist="auto"`` finds it); without ``adapters=`` the bus is
    ``MetricBus.from_config(None, **options)``: adapters and options from ``$METRICBUS_CONFIG`` /
    ``$METRICBUS_ADAPTERS`` (neither set, and no ``journal=``: :class:`~metricbus.errors.ConfigError` here, never a
    bus that delivers nowhere); ``MetricBusCallback(bus)`` uses
    a bus you built (single process, or one built after ``torch.distributed`` was initialized). The callback closes
    the bus when ``fit`` ends (``failed`` on an exception, on that rank alone): a bus passed in serves one ``fit``,
    a later ``fit`` with it fails at ``setup`` (:class:`~metricbus.errors.ClosedError`). Built from options, a new bus
    serves each ``fit``; with a journal, a later ``fit`` continues the journal's run (``resume=True``: its id, its
    backend runs) where the earlier one ended (the same Trainer, or ``fit(ckpt_path=...)``, which rewinds the run to
    the checkpoint's step); one that starts at or before that step from no checkpoint (a new Trainer from step 0)
    would rewind the run, erasing it, and is a :class:`~metricbus.errors.ConfigError` at its start. ``log_every`` is
    not an option: the window is ``trainer.log_every_n_steps``. Log training records through it: records logged in
    ``validation_step`` would join the next training commit (use Lightning's ``self.log`` and
    :class:`MetricBusLogger` for those).

    The bus's records are not in checkpoints: a run resumed from one taken mid-window (``ModelCheckpoint(
    every_n_train_steps=N)``, ``N`` not a multiple of the window) emits its first window without the steps before
    the checkpoint, with a :class:`~metricbus.errors.MetricBusWarning` at the resume (``checkpoint["metricbus"]``
    notes how many). The run that saved it committed them (at its next logging step, its end or its crash) unless it
    was killed first, so carrying them into the resumed window could count them twice.
    """

    def __init__(self, bus: MetricBus | None = None, **options: Any) -> None:
        if bus is not None and options:
            raise ConfigError(f"MetricBusCallback: pass a bus or bus options, not both (got {sorted(options)})")
        if "log_every" in options:
            raise ConfigError("MetricBusCallback: log_every: the commit window is trainer.log_every_n_steps")
        try:
            built = BusOptions.build(**options)  # validate now, with the bus's own messages, not at setup on every rank
        except TypeError as exc:
            raise ConfigError(f"MetricBusCallback: {exc}") from exc
        _check_request_timeouts("MetricBusCallback", built.adapters, built.write_timeout_s)
        # Without adapters the bus would deliver nowhere (no adapters by default): take them from the environment,
        # as the Hugging Face callback and the Accelerate tracker do, and refuse where there are none.
        self._from_env = bus is None and "adapters" not in options
        if self._from_env:
            if "journal" not in options:
                require_source(None, how="pass MetricBusCallback(adapters=[...]) or MetricBusCallback(bus)")
            env = bus_options(None, {**options, "log_every": 1})  # its mistakes now, naming the file or variable
            write_timeout_s = env.get("write_timeout_s", WRITE_TIMEOUT_S)
            _check_request_timeouts("MetricBusCallback", env.get("adapters", ()), write_timeout_s)
        self._owns = bus is None  # builds a bus for each fit(); else serves the one it was given, once
        self._bus = bus
        self._options = options
        self._seen_step = 0  # trainer.global_step at the last update boundary
        self._updates = 0  # updates ended since the last commit (the same count on every rank)
        self._rank = 0  # trainer.global_rank at setup('fit')
        self._continues: int | None = None  # a later fit() on a journal: the last step the earlier one committed

    @property
    def bus(self) -> MetricBus:
        """The bus the module logs into (built at ``setup("fit")`` unless one was passed)."""
        if self._bus is None:
            raise MetricBusError("MetricBusCallback: the bus is built at setup('fit'); log from training_step")
        return self._bus

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Build the bus for ``fit`` on every rank (the process group exists by now); a bus passed in must be open."""
        if stage != "fit":
            return
        if self._bus is None or (self._owns and self._bus.closed):
            options = {**self._options, "log_every": 1}
            if self._from_env:
                options = bus_options(None, options)  # (MetricBus.from_config's options: is there a journal?)
            earlier, self._continues = self._bus, None
            if earlier is not None and options.get("journal") is not None:
                # the journal holds the run of an earlier fit(): this one continues it (else JournalError)
                options["resume"], self._continues = True, earlier.last_step
            self._bus = MetricBus(**options)
        elif self._bus.closed:
            raise ClosedError(
                "MetricBusCallback: the bus it was given is closed at setup('fit') (the end of an earlier fit() "
                "closes it); pass a new MetricBus for this fit(), or bus options (MetricBusCallback(adapters=[...], "
                "...)) to have the callback build one at each fit()"
            )
        self._updates, self._rank = 0, trainer.global_rank

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start counting optimizer steps from where training starts (a restored checkpoint included)."""
        self._seen_step = trainer.global_step
        last, self._continues = self._continues, None
        start = _logging_step(trainer)
        if last is not None and start <= last and trainer.ckpt_path is None:
            self.bus.close()  # (nothing committed: the run and its backends are as the earlier fit() left them)
            raise ConfigError(
                f"MetricBusCallback: this fit() starts at Lightning step {start}, at or before step {last} that an "
                f"earlier fit() committed to the run of journal {self._options.get('journal') or 'from the config'}, "
                "and restores no checkpoint: its commits would rewind that run (its backends too) to step "
                f"{start}, erasing the earlier steps. To train more, call fit() again on the same Trainer (it goes on "
                "from its step) or pass fit(ckpt_path=...); for a new run, use a new MetricBusCallback with another "
                "journal directory"
            )

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint taken mid-window notes how many optimizer steps of the window it follows, as
        ``checkpoint["metricbus"][key]`` (see :func:`_state_key`; not ``state_dict``, which Lightning refuses for two
        callbacks of one type), so a run resumed from it says that its first window lacks them."""
        bus = self._bus
        if bus is not None and not bus.closed and self._updates:
            state = {"updates": self._updates, "last_step": bus.last_step}
            checkpoint.setdefault(_CHECKPOINT_KEY, {})[_state_key(trainer, self)] = state

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint taken mid-window: the window's records before it are not in it (warned, on rank 0)."""
        held = checkpoint.get(_CHECKPOINT_KEY)
        state = held.get(_state_key(trainer, self)) if isinstance(held, Mapping) else None
        if not isinstance(state, Mapping) or self._rank != 0:
            return
        since = "training started" if state.get("last_step") is None else f"the commit at step {state['last_step']}"
        warnings.warn(
            f"MetricBusCallback: the checkpoint was taken mid-window, {state.get('updates')} optimizer step(s) after "
            f"{since}; the bus's records of those steps are not in checkpoints (the run that saved it committed them "
            "at its next logging step, its end or its crash, unless it was killed first), so the first window after "
            "the resume is emitted without them (a checkpoint interval that is a multiple of log_every_n_steps keeps "
            "every window whole)",
            MetricBusWarning,
            stacklevel=2,
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """An optimizer step happened in this batch: end the update; commit at Lightning's logging steps."""
        step = trainer.global_step
        if step == self._seen_step:  # still accumulating
            return
        self._seen_step = step
        self.bus.end_update()
        self._updates += 1
        # Lightning's logging step counts batches that stepped, once per batch however many optimizers stepped
        # (global_step counts optimizer steps: 2 per batch for a GAN); Lightning logs this batch at ``logged`` when
        # ``(logged + 1) % log_every_n_steps == 0`` (LoggerConnector.should_update_logs).
        logged = _logging_step(trainer)
        every: int = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning at init
        if every > 0 and (logged + 1) % every == 0:
            self._commit(logged)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Commit the optimizer steps of an unfinished window (every rank decides alike from Lightning's counter)."""
        if self._updates:
            self._commit(_logging_step(trainer) - 1)  # counted past the last batch by now

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Close the bus when ``fit`` ends (a collective under DDP: every rank gets here)."""
        if stage == "fit" and self._bus is not None:
            self._bus.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Close this rank's bus as failed, without a collective (the other ranks may be anywhere). In one process
        the records of the unfinished window are committed first at Lightning's step of its last batch that
        stepped (close() alone would label them with the step after the last commit: the window's first step)."""
        bus = self._bus
        if bus is None:
            return
        try:
            if trainer.world_size == 1 and not bus.closed:
                last = bus.last_step
                step = max(_logging_step(trainer) - 1, 0 if last is None else last)
                self._commit(step)
        except MetricBusError:  # (never masks the exception that ends fit(): close() commits them at its step)
            pass
        finally:
            bus.close(status="failed")

    def _commit(self, step: int) -> None:
        self._updates = 0
        self.bus.commit(step=step)


_CHECKPOINT_KEY = "metricbus"


def _state_key(trainer: pl.Trainer, callback: MetricBusCallback) -> str:
    """``MetricBusCallback``, then ``MetricBusCallback[1]``, ... in the trainer's callback order: each callback
    reads back its own note of a checkpoint's window."""
    ours = [c for c in trainer.callbacks if isinstance(c, MetricBusCallback)]  # type: ignore[attr-defined]
    index = next((i for i, c in enumerate(ours) if c is callback), 0)
    return "MetricBusCallback" + (f"[{index}]" if index else "")


def _check_request_timeouts(who: str, adapters: Sequence[Any], write_timeout_s: float) -> None:
    """``check_request_timeouts`` on each adapter's effective ``request_timeout_s``: where a name or mapping leaves it
    at its default, the default of its class's constructor (read from the registry's class; no adapter is built),
    so an adapter left at a default the bus would refuse once it builds the adapters (at ``setup``, at the logger's
    first log) is refused at construction."""
    effective: list[Any] = []
    for spec in adapters:
        name = spec.partition(":")[0] if isinstance(spec, str) else spec.get("type") if isinstance(spec, Mapping) else 0
        if not isinstance(name, str) or (isinstance(spec, Mapping) and "request_timeout_s" in spec):
            effective.append(spec)
            continue
        try:
            param = inspect.signature(get_adapter_class(name)).parameters.get("request_timeout_s")
        except (AdapterNotFoundError, TypeError, ValueError):  # (the bus says what is wrong when it builds it)
            param = None
        default = None if param is None or param.default is param.empty else param.default
        effective.append(spec if default is None else {"type": f"{name}, at its default", "request_timeout_s": default})
    try:
        check_request_timeouts(effective, write_timeout_s=write_timeout_s)
    except ConfigError as exc:
        raise ConfigError(f"{who}: {exc}") from None


def _logging_step(trainer: pl.Trainer) -> int:
    """The step Lightning gives its loggers during ``fit`` (``LoggerConnector.log_metrics``): batches that stepped
    an optimizer, restored from a checkpoint. Lightning's own LearningRateMonitor reads the same counter."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def metricbus_log(
    module: pl.LightningModule, name: str, value: Any, *, weight: Any = None, agg: SpecLike | None = None
) -> None:
    """Log one micro-batch's record(s) through the trainer's :class:`MetricBusCallback` (from ``training_step``)."""
    for callback in module.trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, MetricBusCallback):
            callback.bus.log(name, value, weight=weight, agg=agg)
            return
    raise MetricBusError(f"metricbus_log({name!r}): the trainer has no MetricBusCallback; add one to callbacks=")


class MetricBusLogger(Logger):
    """A Lightning ``Logger`` that delivers Lightning's already-reduced metrics through metricbus's adapters.

    Runs on rank 0 only. ``version`` is the metricbus run id (``version=`` sets it). ``resume=True`` continues the
    run of ``journal`` (a trainer restarted from a checkpoint: its id, its backend runs; see ``MetricBus(resume=)``).
    ``save()`` waits up to ``save_timeout_s`` for delivery (default 0: adapters already write and flush each step
    from their threads; Lightning calls ``save()`` after every ``log_metrics``); ``finalize(status)`` commits the
    last step and closes the bus, ``"failed"`` as failed, anything else as finished. A later ``log_metrics``
    (``trainer.test`` after ``fit``) opens a bus on the same run id again. When its first step is at or below the
    last one committed (where Lightning logs ``validate()`` and ``test()`` after ``fit``; a second ``fit()`` with a
    new Trainer starts at 0), it moves to the one after it and that session's later steps by as much (a first step
    equal to the last one, the rest of a step that a mid-fit ``finalize()`` committed, moves alone), with a
    warning: the run's steps keep increasing, none merged into one, and a journal is not rewound (a resumed
    journal's first step at or below its last one is a restart from a checkpoint, which rewinds the backends). With
    ``journal=``, a session whose first step lies strictly between 0 and the last step (``fit(ckpt_path=...)`` from
    an earlier checkpoint) is that restart: its steps are kept and the resumed journal rewinds the backends to them.
    ``step=None`` (Fabric's default) is the step after the last one.
    """

    def __init__(
        self,
        *,
        adapters: Sequence[Adapter | str | Mapping[str, Any]] = ("console",),
        project: str = "lightning",
        name: str | None = None,
        version: str | None = None,
        tags: Sequence[str] = (),
        journal: str | None = None,
        resume: bool = False,
        strict: bool = False,
        on_open_error: str = "raise",
        save_timeout_s: float = 0.0,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ) -> None:
        super().__init__()
        self._run = RunInfo(project=project, name=name, tags=tuple(tags), id=version or "")
        self._options: dict[str, Any] = {
            "adapters": list(adapters), "journal": journal, "strict": strict, "on_open_error": on_open_error,
        }  # fmt: skip
        self._resume = resume
        built = BusOptions.build(**self._options, run=self._run, dist=None)  # at construction, not the first log
        _check_request_timeouts("MetricBusLogger", built.adapters, built.write_timeout_s)
        for option, seconds in (("save_timeout_s", save_timeout_s), ("close_timeout_s", close_timeout_s)):
            try:  # (else a bad one raised mid-fit at save(), or at finalize() once training was over)
                check_wait_s(option, seconds)
            except ConfigError:
                raise ConfigError(
                    f"MetricBusLogger({option}={seconds!r}): {option} must be a number of seconds >= 0 (math.inf: "
                    "no bound)"
                ) from None
        if resume and journal is None:  # MetricBus refuses it too, but only at the first log, mid-fit
            raise ConfigError("resume: needs a journal (the run to continue is read from it); pass journal=DIR")
        self._config: dict[str, Any] = {}
        self._bus: MetricBus | None = None
        self._finalized = False
        self._last_step: int | None = None  # the last step committed, kept across finalize()
        self._pending_step: int | None = None
        self._shift: int | None = 0  # added to each step given; None after finalize() (see _shifted)
        self._moved_upto: int | None = None  # the shift moves only the steps up to this one (None: every step)
        self._pending: dict[str, float] = {}
        self._save_timeout_s = save_timeout_s
        self._close_timeout_s = close_timeout_s
        self._warned: set[str] = set()
        self._tracked = False  # finalized at interpreter exit unless finalize() comes first (see _track)

    @property
    def name(self) -> str:
        """The run name, else the project."""
        return self._run.name or self._run.project

    @property
    def version(self) -> str:
        """The metricbus run id (the journal's, when a bus resumed one)."""
        return self._bus.run.id if self._bus is not None else self._run.id

    @property
    def bus(self) -> MetricBus:
        """The bus (built now if it is not yet: hyperparameters logged after this are not in the run config)."""
        if self._bus is None:
            journal = self._options["journal"]
            run = RunInfo(
                project=self._run.project, name=self._run.name, tags=self._run.tags, config=self._config,
                start_time_unix_ns=self._run.start_time_unix_ns, id=self._run.id,
            )  # fmt: skip
            # A bus closed by finalize() and opened again continues the same run (and journal).
            resume = self._resume or (self._finalized and journal is not None)
            self._bus = MetricBus(**self._options, run=run, dist=None, resume=resume)
            self._bus._before_close = self._on_bus_close  # logger.bus.close() by the user: as finalize()
            self._run = replace(self._run, id=self._bus.run.id)  # a resumed journal's run id, kept after finalize()
            self._track()  # again: newer than its bus, so the exit closes the logger (its buffered step) first
        return self._bus

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        """Keep ``params`` as the run config (nested mappings kept; other values as ``str``)."""
        if self._bus is not None:
            self._warn_once("hparams", "log_hyperparams after the first log_metrics: the run config is fixed")
            return
        self._config.update(_plain(_sanitize_callable_params(_convert_params(params))))

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Buffer ``metrics`` at ``step`` (last value per name wins); commit the previous step first.

        ``step=None`` (Fabric's ``log``/``log_dict`` default) is the step after the last one, as Lightning's own
        loggers auto-increment: each such call is a step of its own, never merged into the one before.
        """
        # Checked before anything is buffered: the step is committed at a later call, which would fail instead
        # (a valid one, mid-fit), and the step it held with it.
        given = None if step is None else _checked_step(metrics, step)
        _check_metrics(metrics, step)
        pending = self._pending_step
        if given is None:
            last = pending if pending is not None else self._last_step
            step = 0 if last is None else last + 1
        else:
            step = self._shifted(given, pending)
        if pending is not None and step < pending:
            self._warn_once("back", f"log_metrics(step={step}) after step {pending}: logged at step {pending}")
            step = pending
        if pending is not None and step > pending:
            self._commit_pending()
        self._pending_step = step
        self._pending.update(metrics)
        if not self._tracked:
            self._track()

    @rank_zero_only
    def save(self) -> None:
        """Wait up to ``save_timeout_s`` for every committed step to be delivered."""
        if self._bus is not None and self._save_timeout_s > 0:
            self._bus.flush(timeout_s=self._save_timeout_s)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Commit the last step and close the bus (``"failed"`` as failed, else finished)."""
        if self._bus is None and not self._pending and (self._finalized or not self._config):
            return  # nothing was logged (since the bus was closed): open no backend run
        if self._pending:
            self._commit_pending()
        closed: Status = "failed" if status == "failed" else "finished"
        self.bus.close(status=closed, timeout_s=self._close_timeout_s)
        self._bus = None
        self._finalized = True
        self._shift = None
        self._untrack()

    def _track(self) -> None:
        """Have the interpreter's exit (or SIGTERM) finalize this logger if ``finalize()`` is not called first (a
        Fabric loop, a script that logs by hand): the last step is buffered here until a later one or finalize."""
        shutdown.untrack(id(self))  # tracked again, as the newest: closed before the bus it built
        shutdown.track(id(self), self._finalize_at_exit)
        self._tracked = True

    def _untrack(self) -> None:
        if self._tracked:
            self._tracked = False
            shutdown.untrack(id(self))

    def _finalize_at_exit(self, status: Status) -> None:
        """``finalize()`` at interpreter exit: commit the buffered step, close the bus as ``status``."""
        self._tracked = False
        try:
            if self._pending:
                self._commit_pending()
        finally:
            if self._bus is not None:
                bus, self._bus = self._bus, None
                self._finalized, self._shift = True, None
                bus.close(status=status, timeout_s=self._close_timeout_s)

    def _on_bus_close(self) -> None:
        """The bus is being closed (``finalize()``, the exit, or ``logger.bus.close()`` by the user): commit the step
        held here first (else it was lost, and the exit raised ClosedError committing it), and continue as after
        ``finalize()``: a later ``log_metrics`` opens a bus on the same run again."""
        try:
            if self._pending:
                self._commit_pending()
        finally:
            self._bus = None
            self._finalized, self._shift = True, None
            self._untrack()

    def _shifted(self, step: int, pending: int | None) -> int:
        """``step`` moved by this session's shift, decided at its first step: after ``finalize()`` the bus reopens
        on the same run (the backends' run of its id, its journal), whose steps must keep increasing. A session
        that starts at or below the last step (``test()`` after ``fit()``, a second ``fit()`` with a new Trainer
        from step 0) is logged from the step after it, every step moved by the same amount: its steps stay apart
        (never merged into one) and the backends are not rewound (a resumed journal's first step at or below its
        last one is a restart from a checkpoint, which rewinds them, erasing what the earlier session logged)."""
        if self._shift is None:
            floor = pending if pending is not None else self._last_step
            # 0 < step < floor: neither a new Trainer (step 0) nor validate()/test() after fit() (the last step):
            # a fit(ckpt_path=...) restarted from a checkpoint, which the resumed journal rewinds the backends to
            restart = floor is not None and 0 < step < floor and self._options["journal"] is not None
            self._shift = 0 if floor is None or step > floor or restart else floor + 1 - step
            # first step == the last one (the rest of a step whose first calls a mid-fit finalize() committed:
            # Lightning's SLURM handler; test() after fit()): that step moves to the next one, later steps do not
            self._moved_upto = step if self._shift == 1 and step == floor and step > 0 else None  # (0: a new fit)
            if floor is not None and self._shift:
                hint = (
                    " (a fit(ckpt_path=...) from an earlier step is rewound to it only with journal=DIR)"
                    if 0 < step < floor else ""
                )
                later = (
                    "later steps as given" if self._moved_upto is not None
                    else f"and each later step of this session {self._shift} later than given"
                )
                self._warn_once(
                    f"reopen:{floor}", f"log_metrics(step={step}) after the run was finalized at step {floor}: "
                    f"logged at step {floor + 1}, {later}, so that the run's steps keep increasing{hint}",
                    stacklevel=4,
                )  # fmt: skip
        if self._moved_upto is not None and step > self._moved_upto:
            return step
        return step + self._shift

    def _commit_pending(self) -> None:
        metrics, self._pending = self._pending, {}
        step, self._pending_step = self._pending_step, None
        bus = self.bus
        bus.log(metrics)
        bus.commit(step=step)
        self._last_step = step

    def _warn_once(self, key: str, message: str, stacklevel: int = 3) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"MetricBusLogger: {message}", MetricBusWarning, stacklevel=stacklevel)


def _checked_step(metrics: Mapping[str, Any], step: Any) -> int:
    try:
        return as_step(step)
    except StepError as exc:
        raise StepError(
            f"MetricBusLogger.log_metrics({list(metrics)}, step={step!r}): {exc} (None: the next step); nothing of "
            "this call was logged"
        ) from None


def _check_metrics(metrics: Mapping[str, Any], step: Any) -> None:
    """A MetricTypeError or MetricValueError naming the first name or value the bus would refuse."""
    for name, value in metrics.items():
        try:
            check_name(name)
            to_values(name, value)
        except (MetricTypeError, MetricValueError) as exc:
            raise type(exc)(
                f"MetricBusLogger.log_metrics(step={step!r}): {exc}; nothing of this call was logged"
            ) from None


def _plain(params: Mapping[str, Any]) -> dict[str, Any]:
    """Hyperparameters as JSON-like data: mappings and lists kept, scalars kept, anything else as ``str``."""
    return {str(key): _plain_value(value) for key, value in params.items()}


def _plain_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return _plain(value)
    if isinstance(value, (list, tuple)):
        return [_plain_value(v) for v in value]
    return value if isinstance(value, _SCALARS) else str(value)
