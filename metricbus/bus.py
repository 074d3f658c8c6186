"""``MetricBus``: log raw records, commit a step, get exact declared reductions delivered to adapters.

``commit()`` is "reduce micro -> exchange ranks -> reduce ranks -> window steps -> hand to adapters",
each a short function elsewhere; this module holds the wiring and the input checks.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

from metricbus import shutdown
from metricbus.accumulate import FOLD_AT, Accumulator
from metricbus.adapter import Adapter, RunInfo, Status
from metricbus.delivery import Delivery, check_queue_options
from metricbus.errors import ClosedError, DistributedError, MetricBusWarning, MetricTypeError, SpecError, StepError
from metricbus.partial import Partial
from metricbus.ranks import LocalRanks, RankTransport
from metricbus.reduce import Window, output_name, reduce_ranks
from metricbus.rules import Rules
from metricbus.spec import NanPolicy, Spec, SpecLike, check_nan, parse_spec
from metricbus.values import check_finite, is_tensor, to_values, to_weights

CLOSE_TIMEOUT_S = 30.0  # how long close() (and the close at interpreter exit) gives the adapters to drain


class MetricBus:
    """Collects per-micro-batch records and emits exact hierarchical reductions at each commit."""

    def __init__(
        self,
        *,
        adapters: Sequence[Adapter | str | Mapping[str, Any]] = (),
        rules: Mapping[str, SpecLike] | None = None,
        log_every: int = 1,
        nan: NanPolicy = "propagate",
        strict: bool = False,
        run: RunInfo | None = None,
        dist: str | None = "auto",
        group: Any = None,
        writer_rank: int = 0,
        journal: str | None = None,
        fsync: str = "interval",
        queue_size: int = 1024,
        queue_policy: str = "block",
        queue_timeout_s: float = 10.0,
    ) -> None:
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every must be an int >= 1, got {log_every!r}")
        check_queue_options(queue_size=queue_size, queue_policy=queue_policy, queue_timeout_s=queue_timeout_s)
        self._nan: NanPolicy = check_nan(nan, metric="MetricBus(nan=)")
        self._rules = Rules(rules)
        self._log_every = log_every
        self._strict = strict
        self.run = run or RunInfo()
        self._accs: dict[str, Accumulator] = {}
        self._fast: dict[str, list[float]] = {}  # names whose records take the plain-append path
        self._outputs: dict[str, str] = {}  # emitted name -> metric it comes from (collision check)
        self._ingested: list[Partial] = []
        self._window = Window(log_every=log_every)
        self._last_step: int | None = None
        self._closed = False
        self._ranks: RankTransport = _make_transport(dist=dist, group=group, writer_rank=writer_rank)
        self._journal = _make_journal(path=journal, fsync=fsync, bus=self)
        resolved = [_resolve_adapter(a) for a in adapters] if self._ranks.is_writer else []
        self._delivery = Delivery(
            resolved,
            strict=strict,
            queue_size=queue_size,
            queue_policy=queue_policy,
            queue_timeout_s=queue_timeout_s,
            on_delivered=None if self._journal is None else self._journal.delivered,
        )
        self._delivery.open(run=self.run)
        if resolved or self._journal is not None or self._ranks.collective:
            shutdown.track(id(self), self._close_at_exit)

    @classmethod
    def from_config(cls, source: Any = None, **overrides: Any) -> MetricBus:
        """Build a bus from a config file path, a mapping (dict or OmegaConf), or ``$METRICBUS_CONFIG``."""
        from metricbus.config import bus_from_config

        return bus_from_config(cls, source, overrides)

    # -- declaring ---------------------------------------------------------------------------------------------

    def define(self, pattern: str, spec: SpecLike, *, nan: NanPolicy | None = None) -> None:
        """Add a rule: metrics matching ``pattern`` (fnmatchcase) get ``spec``; the first matching rule wins."""
        parsed = parse_spec(spec, metric=pattern)
        if nan is not None:
            parsed = Spec(parsed.chains, check_nan(nan, metric=pattern))
        self._rules.add(pattern, parsed)

    def spec_of(self, name: str) -> Spec:
        """The spec ``name`` has (or would get if logged now without ``agg=``)."""
        acc = self._accs.get(name)
        return acc.spec if acc is not None else self._rules.match(name)

    def _accumulator(self, name: str, agg: SpecLike | None) -> Accumulator:
        acc = self._accs.get(name)
        if acc is not None:
            if agg is not None:
                explicit = parse_spec(agg, metric=name)
                if explicit != acc.spec:
                    raise SpecError(
                        f"{name!r} was logged with spec {acc.spec} and now with {explicit}; a name's spec is fixed "
                        "the first time it is seen"
                    )
            return acc
        if not isinstance(name, str) or not name:
            raise MetricTypeError(f"metric names must be non-empty strings, got {name!r}")
        spec = parse_spec(agg, metric=name) if agg is not None else self._rules.match(name)
        self._claim_outputs(name, spec)
        acc = Accumulator(name=name, spec=spec, nan=spec.nan or self._nan)
        self._accs[name] = acc
        return acc

    def _claim_outputs(self, name: str, spec: Spec) -> None:
        keys = [output_name(name, chain) for chain in spec.chains]
        for key in keys:
            owner = self._outputs.get(key)
            if owner is not None and owner != name:
                raise SpecError(f"{name!r} with spec {spec} would emit {key!r}, which {owner!r} already emits")
        for key in keys:
            self._outputs[key] = name

    def _forget_since(self, known: int) -> None:
        """Drop the accumulators (all still empty) created after the first ``known`` ones."""
        for name in list(self._accs)[known:]:
            del self._accs[name]
            self._outputs = {key: owner for key, owner in self._outputs.items() if owner != name}

    # -- logging -----------------------------------------------------------------------------------------------

    def log(
        self,
        name: str | Mapping[str, Any],
        value: Any = None,
        *,
        weight: Any = None,
        agg: SpecLike | None = None,
    ) -> None:
        """Record ``value`` (a number, array or tensor: each element one record) for ``name``, or a dict of them."""
        if weight is None and agg is None and type(value) is float:
            buffer = self._fast.get(name)  # type: ignore[arg-type]
            if buffer is not None:
                buffer.append(value)
                if len(buffer) >= FOLD_AT:
                    self._accs[name].fold()  # type: ignore[index]
                return
        self._log_slow(name, value, weight=weight, agg=agg)

    def _log_slow(self, name: Any, value: Any, *, weight: Any, agg: SpecLike | None) -> None:
        if self._closed:
            raise ClosedError(f"cannot log {name!r}: the bus is closed")
        if isinstance(name, Mapping):
            if value is not None:
                raise MetricTypeError("log(dict) takes the values in the dict; do not pass value= as well")
            items = list(name.items())
        else:
            items = [(name, value)]
        staged = []
        known = len(self._accs)
        try:
            for metric, raw in items:  # validate everything before recording anything
                acc = self._accumulator(metric, agg)
                device_ok = weight is None or is_tensor(weight) or type(weight) in (int, float)
                if is_tensor(raw) and not raw.is_complex() and device_ok:
                    to_weights(metric, None if is_tensor(weight) else weight, 1, 0.0)  # scalar weights: checked now
                    staged.append((acc, raw, weight))  # device tensors: accumulated on device, no host sync
                    continue
                values = to_values(metric, raw)
                weights = to_weights(metric, weight, len(values), raw)
                if acc.nan == "error":
                    check_finite(metric, values)
                staged.append((acc, values, weights))
        except Exception:
            self._forget_since(known)  # a rejected call must not fix the spec of a name it introduced
            raise
        for acc, values, weights in staged:
            if is_tensor(values):
                self._device_states().add(acc.name, values, weights, nan=acc.nan)
                self._fast.pop(acc.name, None)
                continue
            acc.add(values, weights)
            if acc.weights is None and acc.nan == "propagate":
                self._fast.setdefault(acc.name, acc.values)
            else:
                self._fast.pop(acc.name, None)

    # -- exporting and ingesting (single-controller rank level) -----------------------------------------------

    def _device_states(self) -> Any:
        states = self.__dict__.get("_device")
        if states is None:
            from metricbus.tensors import DeviceStates

            states = self.__dict__["_device"] = DeviceStates()
        return states

    def _take(self) -> Partial:
        entries = []
        device = self.__dict__.get("_device")
        on_device = device.take_all({n: a.nan for n, a in self._accs.items()}) if device is not None else {}
        for name, acc in self._accs.items():
            summary = acc.take()
            held = on_device.get(name)
            if held is not None:  # host records first, then device records
                summary = summary.merge(held)
            if summary.count:
                entries.append((name, acc.spec, summary))
        return Partial(tuple(entries))

    def export(self) -> Partial:
        """This worker's uncommitted records as a picklable Partial; the buffer is left empty."""
        self._check_open("export")
        return self._take()

    def ingest(self, partials: Iterable[Partial]) -> None:
        """Add workers' partials; they rank in ingest order (before this bus's own records) at the next commit."""
        self._check_open("ingest")
        batch = list(partials)
        for part in batch:  # check all before taking any, so a bad partial loses nothing
            if not isinstance(part, Partial):
                raise MetricTypeError(f"ingest() takes Partial objects from export(), got {type(part).__name__}")
            for name, spec, _ in part:
                mine = self.spec_of(name)
                if mine != spec:
                    raise SpecError(f"an ingested partial has {name!r} with spec {spec}, but this bus uses {mine}")
        for part in batch:
            for name, spec, _ in part:
                self._accumulator(name, spec)
        self._ingested.extend(batch)

    # -- committing --------------------------------------------------------------------------------------------

    @property
    def last_step(self) -> int | None:
        """The step of the last commit (None before the first)."""
        return self._last_step

    def commit(self, step: int | None = None) -> dict[str, float]:
        """End a step: reduce and (every ``log_every``-th commit) emit; returns what was emitted, else ``{}``."""
        self._check_open("commit")
        self._delivery.check()
        step = self._next_step(step)
        if self._ranks.collective and not self._ranks.usable():
            raise DistributedError(
                f"commit(step={step}) on rank {self._ranks.rank}: the torch.distributed process group was destroyed "
                "(or never initialized); the records stay buffered. Commit and close() on every rank before "
                "torch.distributed.destroy_process_group()"
            )
        own = self._take()
        partials = self._ranks.gather(own=own, ingested=self._ingested)
        self._ingested = []
        if self._journal is not None:  # local: every worker of this commit; torch.distributed: this rank's own
            local = isinstance(self._ranks, LocalRanks)
            entries = list(enumerate(partials)) if local else [(self._ranks.rank, own)]
            self._journal.append(step=step, entries=entries)
        specs = {name: acc.spec for name, acc in self._accs.items()}
        for part in partials:
            for name, spec, _ in part:
                specs.setdefault(name, spec)
        reduced = reduce_ranks(specs, [p.summaries() for p in partials])
        self._last_step = step
        if not self._window.add(reduced):
            return {}
        return self._emit(step)

    def _emit(self, step: int) -> dict[str, float]:
        out = self._window.emit()
        if out and self._ranks.is_writer:
            self._delivery.submit(step=step, metrics=out)
        return out

    def _next_step(self, step: int | None) -> int:
        if step is None:
            return 0 if self._last_step is None else self._last_step + 1
        if isinstance(step, bool) or not isinstance(step, int):
            raise StepError(f"commit step must be an int, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise StepError(f"commit step {step} is not greater than the last step {self._last_step}")
        return step

    # -- closing -----------------------------------------------------------------------------------------------

    def _check_open(self, verb: str) -> None:
        if self._closed:
            raise ClosedError(f"cannot {verb}: the bus is closed")

    @property
    def closed(self) -> bool:
        """True after close()."""
        return self._closed

    def close(self, *, status: Status = "finished", timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Commit records logged since the last commit, emit a partial window, and close the adapters.

        With torch.distributed, ``close()`` is a collective like ``commit()``: call it on every rank, before
        ``destroy_process_group()``. ``close(status="failed")`` (and leaving a ``with`` block on an exception), a
        process group that was already destroyed, and interpreter exit close this rank alone: no collective runs,
        so nothing hangs while the other ranks are elsewhere, and records logged since the last commit are not
        committed (a :class:`~metricbus.errors.MetricBusWarning` says which). Committed steps are never lost.
        """
        if self._closed:
            return
        alone = None
        if self._ranks.collective and status == "failed":
            alone = "close(status='failed') (or an exception leaving a `with` block) runs no collective"
        elif self._ranks.collective and not self._ranks.usable():
            alone = "the process group was destroyed before bus.close()"
        self._close(status=status, timeout_s=timeout_s, alone=alone)

    def _close_at_exit(self, status: Status) -> None:
        """The interpreter is exiting with this bus open (see :mod:`metricbus.shutdown`): no collective."""
        alone = "the bus was still open at interpreter exit" if self._ranks.collective else None
        self._close(status=status, timeout_s=CLOSE_TIMEOUT_S, alone=alone)

    def _pending_names(self) -> set[str]:
        """The metrics with records logged since the last commit (host or device)."""
        names = {name for name, acc in self._accs.items() if acc.pending}
        device = self.__dict__.get("_device")
        if device is not None:
            names.update(device.names())
        return names

    def _pending(self) -> bool:
        return bool(self._ingested) or bool(self._pending_names())

    def _close(self, *, status: Status, timeout_s: float, alone: str | None) -> None:
        """Close; ``alone`` (why) set: without collectives, leaving this rank's pending records uncommitted."""
        if self._closed:
            return
        try:
            if alone is not None:
                self._warn_uncommitted(alone)
            elif self._ranks.any_pending(pending=self._pending()):
                self.commit()
            if self._window.pending and self._last_step is not None:
                self._emit(self._last_step)  # the window holds rank-level results, the same on every rank
        finally:
            self._closed = True
            shutdown.untrack(id(self))
            self._fast = {}
            self._ranks.settle()
            if self._journal is not None:
                self._journal.close()
            self._delivery.close(status=status, timeout_s=timeout_s)

    def _warn_uncommitted(self, why: str) -> None:
        listed = sorted(self._pending_names())
        if not listed:
            return
        shown = ", ".join(repr(n) for n in listed[:5]) + (f" and {len(listed) - 5} more" if len(listed) > 5 else "")
        since = "the bus was built" if self._last_step is None else f"the last commit (step {self._last_step})"
        warnings.warn(
            f"rank {self._ranks.rank}: records of {shown} logged since {since} were not committed: {why}. "
            "Call bus.commit() or bus.close() on every rank before torch.distributed.destroy_process_group()",
            MetricBusWarning,
            stacklevel=4,
        )

    def __enter__(self) -> MetricBus:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(status="failed" if exc_type is not None else "finished")


def _make_transport(*, dist: str | None, group: Any, writer_rank: int) -> RankTransport:
    if dist not in ("auto", "torch", None):
        raise ValueError(f"dist must be 'auto', 'torch' or None, got {dist!r}")
    if dist is None:
        return LocalRanks()
    try:
        from metricbus.dist import make_torch_transport
    except ImportError:
        if dist == "torch":
            raise
        return LocalRanks()
    transport = make_torch_transport(required=dist == "torch", group=group, writer_rank=writer_rank)
    return transport if transport is not None else LocalRanks()


def _make_journal(*, path: str | None, fsync: str, bus: MetricBus) -> Any:
    if path is None:
        return None
    from metricbus.journal import open_journal

    return open_journal(path=path, fsync=fsync, bus=bus)


def _resolve_adapter(adapter: Adapter | str | Mapping[str, Any]) -> Adapter:
    if isinstance(adapter, (str, Mapping)):
        from metricbus.registry import make_adapter

        return make_adapter(adapter)  # type: ignore[no-any-return]
    for verb in ("open", "write", "flush", "close"):
        if not callable(getattr(adapter, verb, None)):
            raise MetricTypeError(f"adapter {adapter!r} has no {verb}(); adapters implement open, write, flush, close")
    return adapter


