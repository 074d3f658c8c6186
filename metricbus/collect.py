"""The collector: one worker's uncommitted records, per metric and optimizer update, safe across threads.

``log()`` validates a whole call before recording anything (a rejected call records nothing and fixes no spec),
then buffers host records in :class:`~metricbus.accumulate.Accumulator` s and tensors in device states. Update
boundaries (``end_update()``) close the current update's micro level. ``take()`` ends the last update and returns
every update's summaries. All mutation happens under one lock except the lock-free ``log(name, float)`` append
(see :mod:`metricbus.accumulate`).
"""

from __future__ import annotations

import collections
import contextlib
import math
import operator
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase
from itertools import chain
from typing import Any

import numpy as np

from metricbus import shutdown
from metricbus.accumulate import FOLD_AT, Accumulator, PlainBuffers
from metricbus.errors import ClosedError, MetricTypeError, MetricValueError, SpecError
from metricbus.micro_columns import COLUMNS_FROM, MicroUpdate, Segments, packed_update, summarize_joined
from metricbus.native import speedups
from metricbus.partial import Packed, Partial, Updates, from_packed, with_fields
from metricbus.sketch import unknown
from metricbus.spec import NanPolicy, Spec, SpecLike, micro_sketch
from metricbus.spec_table import DEFAULT, EXPLICIT, RULE, Claim, SpecTable, decide
from metricbus.summary import EMPTY, Summary, with_sketch
from metricbus.values import check_finite, check_tensor, is_tensor, to_values, to_weights

_NONE: frozenset[str] = frozenset()
_MAX_SHAPES = 256  # dict shapes the log(dict) fast path keeps; others take the validated path
_append = list.append
_consume: Callable[[Iterable[Any]], None] = collections.deque(maxlen=0).extend  # runs an iterator in C, keeping nothing
_REAL_KINDS = frozenset("fiub")  # numpy dtype kinds logged as float64 records (as values.to_values accepts)


class Collector:
    """Accumulators, the fast-path buffers and device states of one bus."""

    def __init__(self, *, table: SpecTable, nan: NanPolicy) -> None:
        self.table = table
        self._nan: NanPolicy = nan
        self.lock = shutdown.BusLock()  # a SIGTERM arriving while it is held waits for its release
        self.accs: dict[str, Accumulator] = {}
        self.fast: dict[str, list[float]] = {}  # name -> its accumulator's plain buffer (nan="propagate" only)
        self._done: Updates = []  # finished updates of this commit
        self._failed: dict[str, MetricValueError] = {}  # metrics whose records could not be reduced, since take()
        self._device: Any = None
        self._shapes: dict[tuple[str, ...], Any] = {}  # log(dict)'s Python fast path: keys -> their buffers' getter
        self._packed: dict[frozenset[str], tuple[Packed, int]] = {}  # per ``undeclared``: the last packed partial
        # and the spec table's version it was built under (see partial())
        # _end_update's common case: every accumulator that may hold records other than plain ones since the last
        # update is in ``_touched`` (a caller of Accumulator.add/add_array/fold, or a new spec, puts it there);
        # when none is, the plain buffers are taken together (``_plain``, rebuilt when accumulators come or change
        # nan policy or sketch), and the accumulators that never go to columns (``_apart``) one at a time.
        self._touched: set[str] = set()
        self._plain: PlainBuffers | None = None
        self._apart: list[tuple[str, Accumulator]] = []
        self._segments: Segments | None = None  # the last update's, reused while the counts repeat
        self._open_taken = False  # the last take() returned, last, the update it ended (see restore())
        self.closed = False  # close() began: log() raises ClosedError (checked under the lock, see stop())
        self._drained = threading.Event()  # close() is past its last commit (see late())

    # -- logging (the caller's fast path appends to ``fast`` itself) ------------------------------------------

    def log_floats(self, metrics: dict[str, Any]) -> bool:
        """The fast path of ``log(dict)``: if the dict has two keys or more, every name has a fast buffer and every
        value is a plain float, append them all (no lock, as ``log(name, float)``) and return True; else record
        nothing and return False. A buffer that reaches ``FOLD_AT`` is folded, as ``log(name, float)`` folds it.

        In one C call where the compiled module is built (``metricbus._speedups.append_dict``: the same rule and
        the same records, appended with no other thread in between); else the buffers of each dict shape (its keys)
        are found by an ``itemgetter`` decided once.
        """
        if speedups is not None:
            return self._append_floats(metrics, speedups.append_dict)
        keys = tuple(metrics)
        getter = self._shapes.get(keys)
        if getter is None:
            if len(keys) < 2 or len(self._shapes) >= _MAX_SHAPES:  # one key: the caller's single fast path
                return False
            getter = self._shapes[keys] = operator.itemgetter(*keys)
        fast = self.fast
        try:
            buffers = getter(fast)
        except KeyError:  # a new name, or one whose nan policy keeps it off the fast path
            return False
        values = [*metrics.values()]  # one snapshot: what is checked is what is appended
        if [*map(type, values)].count(float) != len(values):
            return False
        _consume(map(_append, buffers, values))
        if self.fast is not fast:  # close() began on another thread since the buffers were read
            self.late(metrics, zip(buffers, values, strict=True))
        elif max(map(len, buffers)) >= FOLD_AT:
            for name, buffer in zip(keys, buffers, strict=True):
                if len(buffer) >= FOLD_AT:
                    self.fold(name)
        return True

    def _append_floats(self, metrics: dict[str, Any], append_dict: Callable[[dict[Any, Any], Any], int]) -> bool:
        """:meth:`log_floats` in one C call: every name's buffer found and every value checked first, then all
        appended. The buffers are the accumulators' own (``fast`` maps each name to them), read from ``accs`` after
        the call: another thread may take a name off ``fast`` meanwhile (a nan policy adopted by ``ingest()``)."""
        fast = self.fast
        longest = append_dict(metrics, fast)
        if longest < 0:
            return False
        accs = self.accs
        if self.fast is not fast:  # close() began on another thread since the buffers were read
            self.late(metrics, [(accs[name].plain, value) for name, value in metrics.items()])
        elif longest >= FOLD_AT:
            for name in [name for name in metrics if len(accs[name].plain) >= FOLD_AT]:
                self.fold(name)
        return True

    def log(self, name: Any, value: Any, *, weight: Any, agg: SpecLike | None) -> None:
        """Validate every record of the call, then buffer them all (or raise and record nothing)."""
        if type(value) is np.ndarray and type(name) is str and weight is None and agg is None:  # a known name's
            acc = self.accs.get(name)  # array: no staging
            dtype = value.dtype  # (a longdouble may hold a value beyond the double range: to_values checks it)
            real = dtype.kind in _REAL_KINDS and dtype.itemsize <= 8
            if acc is not None and real and (acc.nan != "error" or value.size == 0):
                flat = np.array(value, dtype=np.float64, order="C").reshape(-1)
                if flat.size:
                    with self.lock:
                        if self.closed:
                            raise ClosedError(f"cannot log {name!r}: the bus is closed")
                        self._touched.add(name)
                        acc.add_array(flat)
                return
        if isinstance(name, Mapping):
            if value is not None:
                raise MetricTypeError("log(dict) takes the values in the dict; do not pass value= as well")
            items = list(name.items())
        else:
            items = [(name, value)]
        with self.lock:
            if self.closed:  # close() began on another thread: its last commit would not hold these records
                raise ClosedError(f"cannot log {name!r}: the bus is closed")
            introduced: list[str] = []
            replaced: list[tuple[str, Claim]] = []
            staged = []
            try:
                for metric, raw in items:  # validate everything before recording anything
                    acc = self._accumulator(metric, agg, introduced, replaced)
                    staged.append((acc, *self._records(acc, raw, weight)))
            except Exception:
                # a rejected call changes no spec: names it introduced are forgotten, defaults it replaced put back
                for metric, held in reversed(replaced):
                    self.table.fix(metric, held)
                    self._respec(self.accs[metric])
                self._forget(introduced)
                raise
            for new in introduced:  # only now may the lock-free fast path see the new buffers
                fresh = self.accs[new]
                if fresh.nan == "propagate":
                    self.fast[new] = fresh.plain
            for acc, values, weights in staged:
                self._touched.add(acc.name)
                if type(values) is list:
                    acc.add(values, weights)
                elif type(values) is np.ndarray:
                    if values.size:
                        acc.add_array(values)
                else:  # how many host records of this update came before it (first and last follow log order)
                    if acc.pending:
                        acc.fold()
                    self._device_states().add(acc.name, values, weights, nan=acc.nan, host=acc.state.count)

    def _accumulator(
        self, name: Any, agg: SpecLike | None, introduced: list[str], replaced: list[tuple[str, Claim]]
    ) -> Accumulator:
        """The accumulator of ``name`` logged with ``agg``; a name this call adds is put in ``introduced``, and a
        default this call's ``agg=`` replaced in ``replaced`` (with the claim replaced), for the caller to undo."""
        table = self.table
        if not isinstance(name, str):
            table.own(name, agg)  # raises: names are strings
        acc = self.accs.get(name)
        if acc is not None and agg is None:
            return acc
        held = table.claim(name)
        if held is None:
            claim = table.own(name, agg)
            table.check_outputs(name, claim.spec)
            table.fix(name, claim)
            introduced.append(name)
            spec = claim.spec
        elif agg is not None and not held.declared and not table.sealed(name):
            claim = table.own(name, agg)  # the default gives way to a declaration until the first commit
            if claim.spec != held.spec:
                if acc is not None:
                    self._check_distribution(acc, claim.spec)
                    self._check_nan(acc, claim.spec, "agg= in this log()")
                table.check_outputs(name, claim.spec)
                table.fix(name, claim)
                replaced.append((name, held))
                if acc is not None:
                    self._respec(acc)
            spec = claim.spec
        else:
            spec = table.resolve(name, agg)  # raises for a different explicit spec
        if acc is None:
            acc = Accumulator(name=name, spec=spec, nan=self.nan_of(spec))
            self.accs[name] = acc
            self._plain = None
            if name not in introduced and acc.nan == "propagate":
                self.fast[name] = acc.plain
        return acc

    def define(self, pattern: str, spec: Spec) -> None:
        """Add the rule ``pattern`` -> ``spec`` to the table's rules, and give it to the names already logged whose
        first matching rule it is: a default not committed yet gives way (the records so far take the new spec; a
        nan= policy other than the one they were logged under is refused); a name logged with ``agg=`` keeps it
        (``agg=`` comes before rules). A committed default or a worker's declaration that differs is a SpecError
        naming the metric, and nothing changes (the rule is not added)."""
        with self.lock:
            table = self.table
            rule = Claim(spec, RULE, f"this bus's rule {pattern!r}")
            won: dict[str, Claim] = {}
            outputs: dict[str, str] = {}
            for name, held in table.claims():
                if not fnmatchcase(name, pattern) or table.rules.find(name)[0] is not None or held.origin == EXPLICIT:
                    continue  # another rule, or agg=, comes first for it (or the rule does not match)
                claim = decide(name, held, [rule], fixed=table.sealed(name))
                if claim is held:
                    continue
                if claim.spec != held.spec:
                    acc = self.accs.get(name)
                    if acc is not None:
                        self._check_distribution(acc, claim.spec)
                        self._check_nan(acc, claim.spec, f"the rule {pattern!r}")
                    table.check_outputs(name, claim.spec, outputs)
                won[name] = claim
            table.rules.add(pattern, spec)
            for name, claim in won.items():
                respec = claim.spec != table.specs[name]
                table.fix(name, claim)
                acc = self.accs.get(name)
                if respec and acc is not None:
                    self._respec(acc)

    def check_adopted_nan(self, name: str, spec: Spec, what: str) -> None:
        """Before ``spec`` (from ``what``, a worker's declaration ingest() adopts) replaces ``name``'s spec here:
        its records buffered here are reduced under the new nan= policy when they are folded (so a worker's
        nan='ignore' drops this bus's NaN records too). Those already reduced (folded at 256 buffered records, in an
        ended update, or put back by a refused commit) are summaries: they fit the new policy where they hold no
        NaN or infinite record and were reduced under a policy that dropped none (else a SpecError, as for
        define(); so are tensor records, not read back to check). Under nan='error' a non-finite record of this
        bus's is a MetricValueError now, where log() would have raised."""
        acc = self.accs.get(name)
        nan = self.nan_of(spec)
        if acc is None or nan == acc.nan:
            return
        with self.lock:
            reduced = [s for s in (acc.state, *(u[name] for u in self._done if name in u)) if s.count]
            held_nan = not all(math.isfinite(s.min) and math.isfinite(s.max) for s in reduced)
            on_device = self._device is not None and name in self._device.names()
            if on_device or (reduced and (acc.nan == "ignore" or (held_nan and nan == "ignore"))):
                raise SpecError(
                    f"{what} gives {name!r} nan={nan!r}, but records of it were already reduced here under "
                    f"nan={acc.nan!r}; declare the same nan= policy on this bus (a rule or agg=) before logging "
                    f"{name!r}. Nothing of this ingest() was taken"
                )
            finite = not held_nan and all(map(math.isfinite, (*acc.plain, *acc.values))) and all(
                bool(np.isfinite(chunk).all()) for chunk in acc.chunks
            )
            if nan == "error" and not finite:
                raise MetricValueError(
                    f"{what} gives {name!r} nan='error', but this bus's own records of it hold a NaN or infinite "
                    f"value (logged under nan={acc.nan!r}). Nothing of this ingest() was taken"
                )

    def nan_of(self, spec: Spec) -> NanPolicy:
        """The nan= policy ``spec`` has on this bus (its own, else the bus's)."""
        return spec.nan or self._nan

    def _check_nan(self, acc: Accumulator, spec: Spec, what: str) -> None:
        """Refuse a spec (from ``what``) whose nan= policy differs from the one ``acc``'s records not yet committed
        were logged under (they were checked or dropped at log() by it, and reduced by it): buffered, in an update
        already ended, or on the device."""
        nan = self.nan_of(spec)
        if nan == acc.nan:
            return
        name = acc.name
        logged = acc.pending or self._in_updates(name)
        if logged:
            raise SpecError(
                f"{what} gives {name!r} nan={nan!r}, but its records were already logged under nan={acc.nan!r}; "
                f"declare its spec before logging {name!r}, or give it the same nan= policy"
            )

    def _in_updates(self, name: str) -> bool:
        """True if ``name`` has records in an update already ended, or on the device (caller holds the lock)."""
        return any(name in update for update in self._done) or (
            self._device is not None and name in self._device.names()
        )

    def _respec(self, acc: Accumulator) -> None:
        """``acc``'s name got another spec (adopted, or a declaration replaced the default): use its nan policy."""
        self._touched.add(acc.name)
        self._plain = None
        spec = self.table.specs[acc.name]
        if micro_sketch(spec) and not acc.sketched:
            acc.fold()
            if acc.state.count:  # adopted from another worker: the records reduced so far count as unknown (NaN)
                acc.state = with_sketch(acc.state, unknown(acc.state.count))
        acc.sketched = micro_sketch(spec)
        acc.spec = spec
        nan = self.nan_of(acc.spec)
        acc.nan = nan  # buffered records are folded under it too (a fold of >= FOLD_AT records already happened)
        if nan == "propagate" and not self.closed:
            self.fast[acc.name] = acc.plain
        else:
            self.fast.pop(acc.name, None)

    def respec(self) -> None:
        """Bring every accumulator to its name's spec in the table (after ingest() or a rank agreement)."""
        specs = self.table.specs
        with self.lock:
            for name, acc in self.accs.items():
                if specs.get(name, acc.spec) is not acc.spec:
                    self._respec(acc)

    def _records(self, acc: Accumulator, raw: Any, weight: Any) -> tuple[Any, Any]:
        """The validated records of one value: a list of floats (and weights), a float64 array (unit weights,
        copied: the caller may reuse its array), or a device tensor (and weight)."""
        metric = acc.name
        if type(raw) is np.ndarray and weight is None and raw.dtype.kind in _REAL_KINDS and raw.dtype.itemsize <= 8:
            flat = np.array(raw, dtype=np.float64, order="C").reshape(-1)
            if acc.nan == "error" and not np.isfinite(flat).all():
                check_finite(metric, flat.tolist())  # raises, naming the first non-finite value
            return flat, None
        if is_tensor(raw) and not raw.is_complex():
            from metricbus.tensors import check_device, check_weight

            check_tensor(metric, raw)
            check_device(metric, raw)
            if acc.sketched:  # a distribution: its values are bucketed on the host (one copy)
                if weight is None:
                    flat = np.array(raw.detach().reshape(-1).double().cpu().numpy(), dtype=np.float64)  # our own copy
                    if acc.nan == "error" and not np.isfinite(flat).all():
                        check_finite(metric, flat.tolist())
                    return flat, None
                # with weights: the host records path below
            elif is_tensor(weight):
                check_device(metric, weight, "weight")
                if not weight.is_complex():  # (check_weight says what a complex weight should be)
                    check_tensor(metric, weight, "weight")
                check_weight(metric, raw, weight)  # (shapes and dtypes only: no sync) before anything is recorded
                return raw, weight  # device tensors: accumulated on device, no host sync
            elif weight is None or type(weight) in (int, float):
                to_weights(metric, weight, 1, 0.0)  # a scalar weight: checked now
                return raw, weight
        values = to_values(metric, raw)
        weights = to_weights(metric, weight, len(values), raw)
        if acc.nan == "error":
            check_finite(metric, values)
        return values, weights

    def _check_distribution(self, acc: Accumulator, spec: Any) -> None:
        """Refuse a declaration whose distribution kinds would miss records already reduced without a sketch (in
        the current update, an update already ended, or on the device)."""
        if not micro_sketch(spec) or acc.sketched:
            return
        self._touched.add(acc.name)
        acc.fold()
        reduced = acc.state.count + sum(update[acc.name].count for update in self._done if acc.name in update)
        on_device = self._device is not None and acc.name in self._device.names()
        if reduced or on_device:
            held = f"{reduced} of its records were" if reduced else "its tensor records were"
            raise SpecError(
                f"{acc.name!r} is declared {spec}, which reads the distribution of its records, after {held} logged "
                f"under {acc.spec}, which keeps no sketch of them (a quantile of part of them would be wrong); declare "
                "its spec (define(), rules= or agg= on its first log()) before logging it"
            )

    def _forget(self, names: list[str]) -> None:
        self._plain = None
        for name in names:
            self.accs.pop(name, None)  # a new name: no records, and the fast path never saw it
        self.table.forget(names)

    def _device_states(self) -> Any:
        if self._device is None:
            from metricbus.tensors import DeviceStates

            self._device = DeviceStates()
        return self._device

    def fold(self, name: str) -> None:
        """The fast path filled ``name``'s buffer: fold it."""
        with self.lock:
            if self.closed:  # records appended now are late ones (see late()): they stay where late() finds them
                return
            self._touched.add(name)
            self.accs[name].fold()

    # -- updates and taking ------------------------------------------------------------------------------------

    def _end_update(self) -> None:
        """Close the current update (caller holds the lock): the metrics holding only plain records, as most do,
        are summarised together in columns (:mod:`metricbus.micro_columns`), the others one at a time."""
        others: dict[str, Summary] = {}
        plain = self._plain
        if plain is None or self._touched:
            names, counts, records = self._take_each(others)
        else:
            for name, acc in self._apart:  # sketched or nan="ignore": never in columns
                if acc.pending:
                    self._take(name, acc, others)
            names, counts, records = plain.take()
        update: Mapping[str, Summary] = others
        if len(names) >= COLUMNS_FROM:
            segments = self._segments
            if segments is None or segments.counts != counts:
                segments = self._segments = Segments(counts)
            with contextlib.suppress(Exception):  # never expected: then one at a time below, losing only a metric
                update = summarize_joined(names, segments, np.frombuffer(records, dtype=np.float64), others)
        if update is others:
            values, start = struct.unpack(f"{len(records) // 8}d", records), 0
            for name, count in zip(names, counts, strict=True):
                try:
                    others[name] = Summary.of_batch(list(values[start : start + count]), None)
                except Exception as exc:
                    self._lose(name, exc)
                start += count
        if self._device is not None:
            self._device.end_update(len(self._done))
        self._done.append(update)

    def _take_each(self, others: dict[str, Summary]) -> tuple[tuple[str, ...], list[int], bytes]:
        """Some accumulator may hold more than plain records: look at each (as PlainBuffers.take, those with plain
        records only; the others into ``others``), then remember which can be taken together from now on."""
        names: list[str] = []
        chunks: list[list[float]] = []
        for name, acc in self.accs.items():
            plain = acc.plain
            if plain or acc.values or acc.chunks or acc.state.count:  # acc.pending, inlined
                simple = plain and not acc.values and not acc.chunks and not acc.sketched
                if simple and acc.nan != "ignore" and not acc.state.count:
                    n = len(plain)  # Accumulator.take's common case, inlined: once per metric per commit
                    chunk = plain[:n]
                    del plain[:n]  # records appended since the slice stay for the next update
                    names.append(name)
                    chunks.append(chunk)
                else:
                    self._take(name, acc, others)
        self._touched.clear()  # every accumulator now holds plain records at most
        if self._plain is None:
            columnar = [(n, a) for n, a in self.accs.items() if not a.sketched and a.nan != "ignore"]
            self._plain = PlainBuffers(tuple(n for n, _ in columnar), [a.plain for _, a in columnar])
            self._apart = [(n, a) for n, a in self.accs.items() if a.sketched or a.nan == "ignore"]
        counts = [*map(len, chunks)]
        return tuple(names), counts, struct.pack(f"{sum(counts)}d", *chain.from_iterable(chunks))

    def _take(self, name: str, acc: Accumulator, others: dict[str, Summary]) -> None:
        try:
            others[name] = acc.take()
        except Exception as exc:  # never expected (every finite double is valid): lose this metric only
            self._lose(name, exc)

    def _lose(self, name: str, exc: Exception) -> None:
        """``name``'s records could not be reduced: drop them, and say so at the commit."""
        acc = self.accs[name]
        acc.plain.clear()
        acc.values, acc.weights, acc.state = [], [], EMPTY
        acc.chunks, acc.chunked = [], 0
        self._failed[name] = MetricValueError(f"reducing the records of {name!r} failed: {exc!r}")

    def end_update(self) -> None:
        """The records logged since the previous boundary form one optimizer update."""
        with self.lock:
            if self.closed:  # it would take the records a late log() looks for (see late())
                raise ClosedError("cannot end_update: the bus is closed")
            self._end_update()

    def take(self) -> tuple[Updates, dict[str, MetricValueError]]:
        """Every update's summaries since the last take (the current update ends), and per metric the error that
        rejected its device records (those metrics are left out); the buffers are left empty."""
        with self.lock:
            opened = len(self._done)  # the update take() ends: the last one it returns, when it holds records
            self._end_update()
            updates, self._done = self._done, []
            errors, self._failed = self._failed, {}
            if self._device is not None and self._device.pending():
                accs = self.accs
                device, bad = self._device.take_all(nan_of=lambda name: accs[name].nan)
                errors.update(bad)
                for index, (names, fields, hosts) in device.items():
                    updates[index] = _with_device(updates[index], names, fields, hosts)
                for index, update in enumerate(updates):
                    if any(name in update for name in errors):
                        updates[index] = {n: s for n, s in update.items() if n not in errors}
            self._open_taken = bool(updates[opened])
        return [u for u in updates if u], errors

    def restore(self, updates: Updates) -> None:
        """Put taken updates back (a commit or export that failed before anything left this process)."""
        with self.lock:
            opened, self._open_taken = self._open_taken, False
            kept = [u for u in updates if u]
            # the update take() ended was open (no end_update() closed it): it is open again, so the records logged
            # from now on join it, as if the commit had not been tried (else a refused commit would split an update
            # in two: Agg(micro="sum", update="mean") 0.5 where it is 1.0). Not where an update ended meanwhile.
            if opened and updates and updates[-1] and not self._done and self._reopen(updates[-1]):
                kept = [u for u in updates[:-1] if u]
            if self._device is not None:
                self._device.shift(len(kept))
            self._done = kept + self._done

    def _reopen(self, update: Mapping[str, Summary]) -> bool:
        """Put ``update``'s summaries back into their accumulators, ahead of what they took since; False (nothing
        changed) where a metric of it has no accumulator any more."""
        accs = self.accs
        if any(name not in accs for name in update):
            return False
        for name in update:
            acc = accs[name]
            acc.state = update[name].merge(acc.state)
            self._touched.add(name)
        return True

    def steady(self, updates: Updates) -> tuple[Packed, Any] | None:
        """``(the last commit's own packed partial, the update's fields)`` when ``updates`` are one update in columns
        of its metrics under the same spec table (a commit's usual case): this commit's own partial is then that
        partial with these fields. Else None. Where the names are equal but not the same object, the kept partial is
        rekeyed to the update's names (so the next commits compare them by identity)."""
        if len(updates) == 1:
            update = updates[0]
            if type(update) is MicroUpdate and not update.others:
                last, version = self._packed.get(_NONE, (None, -1))
                if last is not None and version == self.table.version:
                    names = update.names
                    if last.names is names:
                        return last, update.fields
                    if last.names == names:
                        plain = self._plain  # read once: a log() of a new name on another thread may drop it
                        if plain is not None and names is plain.names:  # the next commits' names too:
                            last = Packed(  # kept with them, they compare by identity
                                names, last.specs, last.fields, last.rests, last.layout, last.single, last.sketches
                            )
                            self._packed[_NONE] = (last, version)
                        return last, update.fields
        return None

    def partial(self, updates: Updates, *, undeclared: bool = True) -> Partial:
        """``updates`` as a Partial, each entry with the table's spec of its name (``undeclared``: also say which
        names have only the default spec, for a receiving bus; a commit here does not need it). One update held in
        columns becomes a packed Partial without a Summary per metric."""
        specs = self.table.specs
        table = self.table
        if len(updates) == 1 and type(updates[0]) is MicroUpdate:
            update = updates[0]
            if not undeclared:  # a commit's own partial: usually the metrics and specs of the last one
                steady = self.steady(updates)
                if steady is not None:
                    return from_packed(with_fields(*steady), _NONE)  # packed_update's usual case
            claims = table.claim
            unclaimed = (
                frozenset(n for n in update if (c := claims(n)) is None or c.origin == DEFAULT)
                if undeclared
                else frozenset()
            )
            last, version = self._packed.get(unclaimed, (None, -1))
            packed = packed_update(update, specs, unclaimed, last=last, same=version == table.version)
            if len(self._packed) >= _MAX_SHAPES:
                self._packed.clear()
            self._packed[unclaimed] = (packed, table.version)
            return from_packed(packed, unclaimed)
        entries = tuple((name, specs[name], s) for update in updates for name, s in update.items())
        if not undeclared:
            return Partial(entries)
        names = {name for name, _, _ in entries}
        return Partial(entries, frozenset(n for n in names if (c := table.claim(n)) is None or c.origin == DEFAULT))

    def pending_names(self) -> set[str]:
        """The metrics with records logged since the last take (host or device, any update)."""
        with self.lock:
            names = {name for name, acc in self.accs.items() if acc.pending}
            names.update(name for update in self._done for name in update)
            if self._device is not None:
                names.update(self._device.names())
        return names

    def stop(self) -> None:
        """close() began: from now on log() raises ClosedError (the fast paths find no buffer, and the validated path
        checks ``closed`` under the lock), so no record lands after close()'s last commit took the buffers."""
        with self.lock:
            self.closed = True
            self.fast = {}
            self._shapes.clear()

    def drained(self) -> None:
        """close() is past its last commit: a record still in a buffer now came after it (see late())."""
        self._drained.set()

    def late(self, name: Any, appended: Iterable[tuple[list[float], float]]) -> None:
        """A lock-free ``log()`` appended ``appended`` (buffer, value) after reading the buffers from before close()
        began: wait until close() is past its last commit; the records that commit took were committed, and those
        still in their buffer (appended after it took them) came too late: removed, and ClosedError, as for a
        ``log()`` that began after close(). One call's records are appended without a thread switch between them,
        so they are all taken or all late. A value object is looked for by identity (the same object appended by
        two late calls: either call's record is the same value)."""
        self._drained.wait()
        with self.lock:
            found = False
            for buffer, value in appended:
                for i in range(len(buffer) - 1, -1, -1):
                    if buffer[i] is value:
                        del buffer[i]
                        found = True
                        break
        if found:
            raise ClosedError(f"cannot log {name!r}: the bus is closed")


def _with_device(host: Mapping[str, Summary], names: tuple[str, ...], fields: Any, hosts: Any) -> Mapping[str, Summary]:
    """One update's host summaries and its device summaries (``names``, ``fields`` in columns): in columns when
    the host update is in columns (or empty) and shares no name; else merged per name, the host's state first, with
    ``first`` and ``last`` the records logged first and last (``hosts[:, i]``: how many host records of name ``i``
    came before its first and before its last tensor record)."""
    columns = MicroUpdate(names=names, fields=fields, others={})
    if not host:
        return columns
    if type(host) is MicroUpdate and not host.others and not any(map(host.__contains__, names)):
        return MicroUpdate(names=host.names + names, fields=np.concatenate((host.fields, fields), axis=1), others={})
    merged = dict(host)
    for i, name in enumerate(names):
        held = columns[name]
        mine = merged.get(name)
        if mine is None:
            merged[name] = held
            continue
        both = mine.merge(held)  # first: the host's; last: the tensors'
        if hosts[0, i] == 0:  # no host record before the first tensor record
            both = both._replace(first=held.first)
        if mine.count > hosts[1, i]:  # host records after the last tensor record
            both = both._replace(last=mine.last)
        merged[name] = both
    return merged
