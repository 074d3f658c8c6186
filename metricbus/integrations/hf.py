"""Hugging Face Transformers ``Trainer``: the exact token-mean loss over each logging window, across gradient
accumulation and ranks.

Importing this module imports ``transformers`` (its ``TrainerCallback`` is the base class); ``import metricbus``
never does.

* :class:`MetricBusCallback` owns the bus. ``on_train_begin`` builds it (on every process: under DDP ``dist="auto"``
  uses the process group the Trainer initialized), ``on_optimizer_step`` ends an update, ``on_log`` of a training
  log commits at ``state.global_step`` (the Trainer's own logging decision, so ``logging_steps``,
  ``logging_first_step`` and ``logging_strategy`` apply as configured; ``logging_steps`` is the window, so a bus with
  ``log_every > 1`` is refused), an evaluation's log commits its own values alone (``commit(only=...)``: the
  micro-batches of the open training window stay for its log), ``on_train_end`` commits what is left and
  flushes: every step is delivered (written and flushed by each adapter) when ``train()`` returns. The bus stays
  open, so a ``trainer.evaluate()`` after ``train()`` is logged at ``state.global_step`` and flushed before
  ``evaluate()`` returns (as Hugging Face's ``WandbCallback`` leaves its run open). A bus the callback built is
  closed by the next ``train()`` (which builds a new one), by :meth:`MetricBusCallback.close`, or at the latest at
  interpreter exit (as ``"failed"`` when the interpreter exits on an uncaught exception); a bus you passed in is
  yours to close. The other numbers of the Trainer's logs (``grad_norm``, ``learning_rate``, ``epoch``, eval
  metrics) are forwarded as logged; the training logs' and the end-of-training summary's (``train_runtime``,
  ``total_flos``, ...) under the prefix, so ``train_runtime`` is one series, the summary's at the last step.
* :class:`MetricBusTrainerMixin` (``class MyTrainer(MetricBusTrainerMixin, Trainer)``) logs, for every training
  micro-batch, its per-token losses (float32, recomputed from the logits as the model's ``ForCausalLMLoss`` does:
  labels shifted, ``-100`` ignored) with the label mask as weight, under ``train/loss`` (spec ``"mean"``), and
  its label-token count under ``train/tokens`` (spec ``"sum"``). A ``mean`` state keeps Σw·x and Σw through the
  micro, update, rank and step levels, so the emitted ``train/loss`` is Σ token losses / Σ tokens over every
  micro-batch of the window on every rank. The Trainer's ``loss`` is a float32 sum of per-update means averaged
  over the steps of the window (a mean of means when ``logging_steps > 1``).

Callbacks never see micro-batch losses (the Trainer only hands them its running float32 sum), hence the mixin.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any

from transformers import TrainerCallback

from metricbus.adapter import Status
from metricbus.bus import CLOSE_TIMEOUT_S, MetricBus
from metricbus.config import load_source, require_source
from metricbus.errors import ConfigError, MetricBusError, MetricValueError, SpecError

IGNORE_INDEX = -100
_REPLACED = frozenset({"loss", "train_loss"})  # the Trainer's float32 means of update means
# Trainer.log adds these to every log (training, evaluation, the end-of-training summary): one series each
_EVERY_LOG = frozenset({"epoch", "num_input_tokens_seen"})
# Only the end-of-training summary has these (Trainer._finalize_training): its log is named like a training log
_SUMMARY = frozenset({"total_flos", "train_samples_per_second", "train_steps_per_second"})
# What a training log (include_num_input_tokens_seen) and the summary both have: at the last step, the summary's
_LAST_FROM_SUMMARY = frozenset({"train_runtime"})
_log = logging.getLogger("metricbus.hf")


class HFIntegrationError(MetricBusError, RuntimeError):
    """The Trainer is not set up the way this integration needs (e.g. the mixin without the callback)."""


def token_losses(logits: Any, labels: Any, *, shift: bool, ignore_index: int = IGNORE_INDEX) -> tuple[Any, Any]:
    """Per-token cross-entropy (float32, detached) and the mask of counted tokens, as ``ForCausalLMLoss`` has them.

    ``shift=True`` predicts ``labels[..., 1:]`` from ``logits[..., :-1, :]`` (causal LM); the last position and every
    ``ignore_index`` label have loss 0 and mask False. ``labels`` may already be shifted (``shift=False``).
    """
    import torch
    from torch.nn import functional

    with torch.no_grad():
        if shift:
            labels = functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        flat = logits.detach().float().reshape(-1, logits.shape[-1])
        target = labels.reshape(-1).to(flat.device)
        losses = functional.cross_entropy(flat, target, ignore_index=ignore_index, reduction="none")
    return losses, target != ignore_index


class MetricBusCallback(TrainerCallback):
    """Owns the bus of a ``Trainer`` run: update boundaries, commits at the Trainer's logging steps, a flush at the end.

    ``bus``: a bus you built (built on every process, before training) and close yourself, after the last
    ``train()`` or ``evaluate()`` that logs into it (on every process: under DDP ``close()`` is a collective); a
    later ``train()`` may use it again only from a step at or after its last one (resuming from a checkpoint).
    Else one is built at each ``train()``'s ``on_train_begin`` (or at an ``evaluate()`` before it, which that
    ``train()`` keeps) from ``config`` (a path, a mapping, or None for ``$METRICBUS_CONFIG``/``$METRICBUS_ADAPTERS``)
    with the Trainer's ``run_name`` and sanitized arguments as the run, unless the config has a ``run``; it stays
    open after ``train()`` for ``evaluate()`` and is closed by the next ``train()``, by :meth:`close`, or at
    interpreter exit.
    ``prefix`` starts every name this integration logs (``train/loss``, ``train/tokens``, ``train/grad_norm``).
    """

    def __init__(self, bus: MetricBus | None = None, *, config: Any = None, prefix: str = "train/") -> None:
        self.bus = bus
        self.config = config
        self.prefix = prefix
        self.loss_name = f"{prefix}loss"
        self.tokens_name = f"{prefix}tokens"
        self._reported: set[str] = set()
        self._step_values: dict[str, float] = {}  # what on_log committed at bus.last_step
        self._built = False  # whether the callback built the bus (it then builds a new one for another train())
        self._training = False  # between on_train_begin and on_train_end: logs after it are flushed at once
        self._trained = False  # whether the bus served a train() (a bus built by an evaluate() before it has not)
        # Whether MetricBusTrainerMixin logged a micro-batch since the last training log / in this train(): where it
        # did not (no mixin, labels not under 'labels', a compute_loss that bypasses it) the Trainer's own loss is
        # forwarded, with a warning, rather than dropped.
        self._window_micro = False
        self._train_micro = False
        if bus is not None:
            self._declare(bus)

    def _declare(self, bus: MetricBus) -> None:
        bus.define(self.loss_name, "mean")  # weighted by the label mask: the exact token mean
        bus.define(self.tokens_name, "sum")

    def ensure_bus(self, args: Any) -> MetricBus:
        """The bus, built from the config on first use (again for a later ``train()``, which closed the last one)."""
        if self.bus is None or (self._built and self.bus.closed):
            require_source(self.config, how="pass MetricBusCallback(config=...) or MetricBusCallback(bus)")
            given, _ = load_source(self.config)
            overrides: dict[str, Any] = {}
            if "run" not in given:
                overrides["run"] = {"name": args.run_name, "config": args.to_sanitized_dict()}
            bus = MetricBus.from_config(self.config, **overrides)
            if bus.log_every > 1:  # every process alike (a collective bus's ranks agree on it)
                bus.close()
                raise HFIntegrationError(_window_message(bus.log_every, "the config"))
            self.bus = bus
            self._built = True
            self._trained = False
            self._step_values = {}
            self._declare(self.bus)
        return self.bus

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the bus an earlier ``train()`` built and build this one's (every process: a collective bus needs
        every rank), or keep the one an ``evaluate()`` before it built; a bus passed in must be open and not past
        the Trainer's step."""
        if self._trained:
            self.close(status="failed" if self._training else "finished")  # still training: that train() raised
        bus = self.ensure_bus(args)
        if bus.closed:
            raise HFIntegrationError(
                "MetricBusCallback: the bus it was given is closed; pass a new MetricBus for this train(), or none "
                "to have the callback build one from the config"
            )
        if bus.log_every > 1:
            raise HFIntegrationError(_window_message(bus.log_every, "the bus it was given"))
        last = bus.last_step
        if last is not None and state.global_step < last:
            raise HFIntegrationError(
                f"MetricBusCallback: the bus it was given already holds step {last} and this train() starts at step "
                f"{state.global_step} (a run's steps never go back); pass a new MetricBus for this train(), or none "
                "to have the callback build one from the config"
            )
        self._training = self._trained = True
        self._window_micro = self._train_micro = False

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The micro-batches since the last optimizer step are one update."""
        if self.bus is not None and not self.bus.closed:
            self.bus.end_update()

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        """A training log commits the window at ``state.global_step``; other logs are committed there too."""
        if not logs:
            return
        logs = _as_logged(logs, state)
        bus = self.bus
        if bus is None:  # an evaluate() before train(): build the bus now (the train() after it keeps it)
            try:
                bus = self.ensure_bus(args)
            except ConfigError as exc:
                self._report("config", f"a log at step {state.global_step} is not logged: {exc}")
                return
        if bus.closed:  # closed by its owner (or callback.close()) before this log, e.g. an evaluate() after it
            names = ", ".join(repr(key) for key in sorted(logs)[:6])
            self._report(
                "closed", f"a log at step {state.global_step} is not logged ({names}): the bus was closed before it; "
                "close the bus after the last evaluate() that should log into it",
            )  # fmt: skip
            return
        if bus.log_every > 1:  # refused by train() at its start; an evaluate() outside train() would be windowed too
            raise HFIntegrationError(_window_message(bus.log_every, "the bus it was given"))
        training = "loss" in logs  # the Trainer's periodic training log (eval logs have eval_*)
        # The end-of-training summary (train_runtime, train_*_per_second, total_flos, train_loss, train_mem_*) is named
        # under the prefix like a training log: its train_runtime and the training logs' (include_num_input_tokens_seen)
        # are one series. It still commits its own values alone, as an evaluation does.
        summary = not training and not _SUMMARY.isdisjoint(logs)
        prefixed_log = training or summary
        # The last training log (the Trainer stops after this step) is followed at its step by the summary, whose
        # train_runtime is the whole train()'s: that is the series' point at this step, not the one taken before it.
        held = _LAST_FROM_SUMMARY if training and getattr(control, "should_training_stop", False) else frozenset()
        step = state.global_step
        last = bus.last_step
        if last is not None and step < last:  # checked first: nothing of this log stays buffered
            self._report("step", f"a log at step {step} below the last committed step {last} is left out")
            return
        # Every log of a step repeats 'epoch' (training, each evaluation, the end-of-training summary), and a second
        # evaluate() at a step repeats its names: a name the bus already holds at this step would make the commit
        # refuse and keep the records for the next commit, at a later step. Leave it out here instead.
        again = self._step_values if step == last else {}
        logged: dict[str, float] = {}
        exact = self._window_micro if training else self._train_micro  # the mixin's train/loss replaces HF's
        if training:
            self._window_micro = False
        for key, value in logs.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or key in held:
                continue  # strings are not metrics; a held value comes with the summary
            if key in _REPLACED:
                if exact:
                    continue  # the Trainer's loss is replaced by the exact one
                self._report(
                    "no-micro", f"the Trainer's {key!r} at step {step} is logged as it is (a mean of update means, "
                    "not the exact token mean): no micro-batch loss was logged for it; subclass "
                    "MetricBusTrainerMixin before Trainer (class MyTrainer(MetricBusTrainerMixin, Trainer)), keep "
                    "the labels under 'labels', and call super().compute_loss() from an override",
                )  # fmt: skip
            # 'epoch' (and 'num_input_tokens_seen') is in every log of a step: one name for it, so the training
            # log's and an evaluation's (or the end-of-training summary's) are one series and the repeat is left out.
            prefixed = prefixed_log or key in _EVERY_LOG
            name, number = (f"{self.prefix}{key}" if prefixed else key), float(value)
            if name in again:
                # The same value again (the Trainer's 'epoch') is no news; nor is the summary's train_runtime where
                # this step's training log gave the series its point (a stop decided after that log, e.g. by
                # EarlyStoppingCallback at the evaluation that follows it, so the log did not leave it out).
                if again[name] != number and not (summary and key in _LAST_FROM_SUMMARY):
                    self._report(f"again:{name}", f"{name!r} was already logged at step {step}; this value is left out")
                continue
            try:
                bus.log(name, number)
            except (MetricValueError, SpecError) as exc:  # nan="error", an output name clash: report, keep training
                self._report(f"value:{name}", f"{name!r} at step {step} is left out: {exc}")
                continue
            logged[name] = number
        try:
            # An evaluation (or the end-of-training summary) commits its own values alone: the micro-batches logged
            # since the last training log stay buffered for the next one, so its window is the one without it.
            bus.commit(step=step, only=None if training else logged)
        except MetricBusError as exc:  # e.g. a nan="error" value found at commit: report, keep training
            self._report(type(exc).__name__, f"commit at step {step}: {exc}")
        self._step_values = {**again, **logged}
        if not self._training:  # an evaluate() outside train(): delivered by the time it returns
            self._flush(f"the log at step {step}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Commit the micro-batches after the last logging step at the final step, then flush (the bus stays open
        for an ``evaluate()`` after ``train()``)."""
        self._training = False
        bus = self.bus
        if bus is None or bus.closed:
            return
        last = bus.last_step
        if last is None or state.global_step > last or self._window_micro:  # (an evaluation's commit left them)
            if last is None or state.global_step > last:
                self._step_values = {}  # the step holds only the mixin's records, never a forwarded name
            bus.commit(step=state.global_step)
            self._window_micro = False
        self._flush("train()")

    def micro_logged(self) -> None:
        """The mixin logged a micro-batch's token losses: this window's and this train()'s loss is the exact one."""
        self._window_micro = self._train_micro = True

    def close(self, *, status: Status = "finished") -> None:
        """Close the bus this callback built (under DDP on every process: a collective); a bus passed in is left
        to its owner. Without this call the next ``train()`` or interpreter exit closes it."""
        if self._built and self.bus is not None and not self.bus.closed:
            self.bus.close(status=status)

    def _flush(self, what: str) -> None:
        if self.bus is not None and not self.bus.flush():
            self._report(
                "flush", f"not every step of {what} was delivered within {CLOSE_TIMEOUT_S:.0f} s; delivery goes on, "
                "and closing the bus waits for it",
            )  # fmt: skip

    def _report(self, kind: str, message: str) -> None:
        if kind not in self._reported:
            self._reported.add(kind)
            _log.warning("metricbus Trainer callback: %s (reported once)", message)


def _as_logged(logs: Any, state: Any) -> Any:
    """The log as ``Trainer.log`` made it: the copy it appended to ``state.log_history`` just before ``on_log``.

    The callbacks share one ``logs`` dict, and HF's ``PrinterCallback`` (``disable_tqdm=True``) and the notebook
    progress callback pop ``total_flos`` from it: a callback added after them (``trainer.add_callback``) would never
    see it. The copy is used where it is this log (its step, every key of ``logs`` with the same value), else ``logs``.
    """
    history = getattr(state, "log_history", None)
    entry = history[-1] if history else None
    if not isinstance(entry, dict) or entry.get("step") != state.global_step:
        return logs
    missing = object()
    for key, value in logs.items():
        kept = entry.get(key, missing)
        if kept is not value and kept != value:
            return logs
    return {key: value for key, value in entry.items() if key != "step" or key in logs}


def _window_message(every: int, what: str) -> str:
    return (
        f"MetricBusCallback: {what} has log_every={every}; the Trainer's logging_steps is the window here (each "
        "training log commits the micro-batches since the last one; evaluations commit apart), so build the bus "
        f"with log_every=1 and set TrainingArguments(logging_steps=...) to the window you want (x{every})"
    )


class MetricBusTrainerMixin:
    """Put before ``Trainer``: ``class MyTrainer(MetricBusTrainerMixin, Trainer)``, with a
    :class:`MetricBusCallback` in ``callbacks``. Logs each training micro-batch's token losses (see the module).

    The per-token losses are recomputed from ``outputs.logits`` under ``no_grad`` (one extra cross-entropy over
    the logits: memory of one ``[tokens, vocab]`` float32 tensor). Override :meth:`metricbus_token_losses` for a
    model whose loss is not a cross-entropy over ``labels``.
    """

    _metricbus_callback: MetricBusCallback | None = None
    _metricbus_shift: bool | None = None

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """``Trainer.compute_loss``, plus the micro-batch's token losses logged while training."""
        labels = inputs.get("labels")  # Trainer.compute_loss may pop it
        shift_labels = inputs.get("shift_labels")
        loss, outputs = super().compute_loss(  # type: ignore[misc]
            model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
        )
        if model.training and (labels is not None or shift_labels is not None):
            callback = self.metricbus_callback()
            bus = callback.ensure_bus(self.args)  # type: ignore[attr-defined]
            losses, mask = self.metricbus_token_losses(outputs, labels, shift_labels)
            bus.log(callback.loss_name, losses, weight=mask)
            bus.log(callback.tokens_name, mask.sum())
            callback.micro_logged()
        return (loss, outputs) if return_outputs else loss

    def metricbus_token_losses(self, outputs: Any, labels: Any, shift_labels: Any) -> tuple[Any, Any]:
        """(per-token losses, mask of counted tokens) of one micro-batch, as the model's loss counts them."""
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
        if shift_labels is not None:
            return token_losses(logits, shift_labels, shift=False)
        return token_losses(logits, labels, shift=self._metricbus_shifts())

    def _metricbus_shifts(self) -> bool:
        """Whether the model's loss shifts labels: its ``loss_function`` is ``ForCausalLMLoss`` (decoder only).

        Not the Trainer's ``_loss_shifts_labels``: it looks the model's ``loss_type`` up, which is None for
        ``GPT2LMHeadModel`` (the name holds no ``ForCausalLM``), while its ``loss_function`` falls back to
        ``ForCausalLMLoss`` all the same.
        """
        if self._metricbus_shift is None:
            from transformers.loss.loss_utils import ForCausalLMLoss

            model = getattr(self, "model", None)
            config = getattr(model, "config", None)
            try:
                loss_function = getattr(model, "loss_function", None)
            except (AttributeError, KeyError):  # a model without the loss mapping
                loss_function = None
            decoder_only = not getattr(config, "is_encoder_decoder", False)
            self._metricbus_shift = loss_function is ForCausalLMLoss and decoder_only
        return self._metricbus_shift

    def metricbus_callback(self) -> MetricBusCallback:
        """The :class:`MetricBusCallback` among the Trainer's callbacks."""
        if self._metricbus_callback is None:
            handler = getattr(self, "callback_handler", None)
            found = [cb for cb in getattr(handler, "callbacks", ()) if isinstance(cb, MetricBusCallback)]
            if len(found) != 1:
                raise HFIntegrationError(
                    f"MetricBusTrainerMixin needs exactly one MetricBusCallback in the Trainer's callbacks, found "
                    f"{len(found)}: pass Trainer(..., callbacks=[MetricBusCallback(...)])"
                )
            self._metricbus_callback = found[0]
        return self._metricbus_callback
