"""The rank level over torch.distributed: one or two collectives of O(K) values per commit, whatever the number of
ranks.

All ranks keep an identical *agreed table* of metric names and spec claims, hence the same *columns* (each agreed
metric's rank-level inputs, :func:`metricbus.reduce.columns_of`). Each rank reduces its own records to its
update-level states (:meth:`metricbus.reduce.StepReducer.worker`) and lifts them to its columns; then

1. one ``all_reduce(MAX)`` of float64 :func:`metricbus.rank_level.maxima` (``NM`` per column), led by one slot
   holding the byte length of this rank's pickled ``(new claims, partial, dropped names)`` when it has names the
   table lacks or dropped a metric, else 0, and the step's slots (:mod:`metricbus.step_check`: ranks that commit
   different steps raise ``DistributedError`` on every rank, keeping their records);
2. one ``all_reduce(SUM)`` of int64 :func:`metricbus.rank_level.sums` (``NS`` per column plus the fixed-point limbs
   of its exact sums), laid out by the agreed maxima.

In a steady run the second pass does not wait for the first: it is laid out by a guess made from the last agreed
maxima (:mod:`metricbus.speculate`). Where no agreed chain reads a merged ``min``/``max`` at the rank level and no
column is sketched, the first pass is skipped: the sums pass carries the guess's checks and is the commit's one
collective (:mod:`metricbus.one_pass`; both passes again every ``REFRESH`` commits, to narrow the guess). Otherwise
both all_reduces are issued together. When the checks or the agreed maxima show the guess missed, every rank runs
the sums pass again under the agreed maxima. Either way
:func:`metricbus.rank_level.finish` gives every rank the same merged states, bit for bit what a single process,
the driver's ``ingest()`` and journal replay compute from the same records. Nothing of size R is sent or received.

When the length slot is set, one ``all_gather`` of bytes (padded to the longest, each prefixed with its length)
carries those ranks' claims and partials, and every rank decides the new specs with the same
:func:`metricbus.spec_table.decide` the single-process and ``ingest()`` paths use; the new metrics of this commit
are merged from the gathered partials by the same :func:`metricbus.rank_level.merge`. So a changed key set costs
exactly one extra collective. Conflicting declared specs, and two metrics that would emit the same output name,
raise :class:`~metricbus.errors.DistributedError` on every rank (all ranks see the same gathered claims, so all
raise; nothing hangs).

Exit safety. A backend's worker thread (Gloo's ``runLoop``, NCCL's watchdog) drops its reference to a collective's
tensors *after* the collective returns, and for a tensor that has a Python object that last drop takes the GIL
(``TensorImpl::decref_pyobject``). If the interpreter is finalizing by then, ``take_gil`` ends the thread with
``pthread_exit``, whose forced unwind runs into a ``noexcept`` frame: ``terminate called without an active
exception``, SIGABRT, no Python frame. So every collective here is *settled*: the tensors handed to it are kept
until the backend has let go of them (their use count is back to what it was before the call), waiting with the
GIL released. On the CPU (Gloo) that happens right after each collective (the worker lets go within microseconds
once it can take the GIL); on CUDA (NCCL, whose watchdog polls) the tensors are kept and settled at ``close()``
and at interpreter exit, so the hot path never waits for the watchdog.

Cost per commit with K agreed columns: 8·(9 + NM·K) bytes all-reduced by MAX (none in a one-pass commit) and
8·(NS·K + limbs) by SUM per rank (limbs: (E - Q)//32 + 3 per exact sum, 3-4 for typical data, about one more in a
guessed window; see :mod:`metricbus.fixed`), plus 8·(9 + LENGTH_BITS + weighted columns) of checks (the step's
eight slots among them) in a one-pass commit, independent of R.
"""

from __future__ import annotations

import pickle
import struct
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from metricbus import one_pass, rank_level, sketch_level, speculate, step_check
from metricbus.column_states import ColumnStates
from metricbus.errors import DistributedError, MetricBusWarning, SpecError
from metricbus.partial import Partial
from metricbus.rank_finish import Merged
from metricbus.ranked_columns import RankedColumns
from metricbus.ranks import Commit, Exchange, with_specs
from metricbus.reduce import Column, Ranked, RankedStates, StepReducer, WorkerStates, lift_columns
from metricbus.spec import Spec
from metricbus.spec_table import Claim, SpecTable, decide, output_keys
from metricbus.summary import EMPTY, N_FIELDS, Summary

SETTLE_S = 2.0  # the longest close() waits for a backend thread to let go of a collective's tensors
_SETTLE_MAX_SLEEP_S = 1e-3
_EMPTY = np.array(EMPTY.as_tuple(), dtype=np.float64)[:, None]  # an absent column's fields, as a column
_LENGTH = struct.Struct("<Q")  # the prefix of each rank's bytes in the byte gather


def make_torch_transport(*, required: bool, group: Any, writer_rank: int) -> TorchRanks | None:
    """A transport over the initialized default (or given) process group; None if unavailable and not required."""
    try:
        import torch.distributed as tdist
    except ImportError as exc:
        if required:
            raise DistributedError("dist='torch' needs torch with torch.distributed; install torch") from exc
        return None
    if not tdist.is_available() or not tdist.is_initialized():
        if required:
            raise DistributedError(
                "dist='torch' but torch.distributed is not initialized; call "
                "torch.distributed.init_process_group(...) before building the MetricBus, or use dist=None"
            )
        return None
    # (a writer_rank beyond the group is refused by the bus after its first exchange, on every rank alike: raised
    # here on the ranks that passed it, the others would wait in that exchange for them)
    return TorchRanks(group=group, writer_rank=writer_rank)

_AT = 1 + step_check.N_MAX  # where the maxima start in the MAX pass's vector (after the length and the step)

class TorchRanks:
    """Every rank's Partial per commit, in rank order, through one packed all_gather in the steady state."""

    collective = True

    def __init__(self, *, group: Any, writer_rank: int) -> None:
        import torch
        import torch.distributed as tdist

        self._torch = torch
        self._dist = tdist
        self._group = group
        self.rank: int = tdist.get_rank(group)
        self._rank_row = np.array([self.rank], dtype=np.int64)  # a block's ranks (read-only: shared by the blocks)
        self._rank_row.flags.writeable = False
        self._size: int = tdist.get_world_size(group)
        self.world = self._size
        self.is_writer: bool = self.rank == writer_rank
        self._agreed: dict[str, Claim] = {}  # the agreed table, identical on every rank
        self._specs: dict[str, Spec] = {}
        self._names: list[str] = []  # sorted
        self._names_tuple: tuple[str, ...] = ()  # the same
        self._version = 0  # counts the layouts (each _layout() call)
        self._lifts: dict[str, tuple[Column, ...]] = {}  # each name's columns (rank-level inputs)
        self._columns: list[tuple[int, int]] = []  # each name's (first column, number of columns)
        self._width = 0  # the number of columns
        self._direct: dict[tuple[str, ...], Any] = {}  # names of an update in columns -> their columns (see _block)
        self._moments: list[bool] = []  # per column: whether its merged m2 is read
        self._moment_mask = np.zeros(0, dtype=bool)  # the same, as a read-only array (shared by the blocks)
        self._sketched: list[int] = []  # the columns whose states carry a sketch
        self._held: list[tuple[Any, int]] = []  # (tensor, its use count before the collective): not yet let go
        self._guess: Any = None  # the next commit's guessed maxima (see metricbus.speculate); None: no guess
        self._one_pass = False  # whether a steady commit may take one collective (see metricbus.one_pass)
        self._hits = 0  # one-pass commits since the maxima were last agreed
        self._settled_names: tuple[Any, ...] = ()  # (names, table version) whose claims the agreed table holds
        backend = str(tdist.get_backend(group)).lower()
        self._device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        self._eager = self._device.type == "cpu"  # settle after every collective (off after one timeout)
        self.ended: str | None = None  # why no collective can run any more though the group is up (see exchange)

    # -- the protocol ------------------------------------------------------------------------------------------

    def exchange(self, commit: Commit) -> Exchange:
        """The rank-level results of this commit, identical on every rank; a collective every rank calls."""
        own, table, reducer, rejected = commit.own, commit.table, commit.reducer, commit.rejected
        if commit.ingested:
            # Ingested partials are workers of their own at the rank level; folding them into one rank's
            # contribution would change rank-level kinds (e.g. rank="mean"), so the combination is refused.
            raise DistributedError(
                "ingest() cannot be combined with torch.distributed; use export()/ingest() with dist=None, "
                "or log on every rank and let commit() gather"
            )
        claims = self._claims(own.names(), table)
        if claims or rejected:  # new names or dropped metrics: the partial itself travels in the byte gather
            payload = pickle.dumps((claims, own, list(rejected)), protocol=pickle.HIGHEST_PROTOCOL)
        else:
            payload = b""
        specs = self._specs
        known = [
            update if all(map(specs.__contains__, update)) else {name: s for name, s in update.items() if name in specs}
            for update in commit.own_updates
        ]
        block = self._block(reducer.worker(known, specs), reducer)
        prep = rank_level.prepare(block)
        sketched = self._sketched  # the layout of this commit (the agreement may extend it)
        # this rank's sketches of the agreed sketched columns (one of a column its own rule alone sketches is not sent)
        mine = rank_level.sketch_rows(block, sketched).get(0, [None] * len(sketched)) if sketched else []
        guess = None if sketched else self._guess
        one = guess is not None and self._one_pass and self._hits < one_pass.REFRESH
        maxima = rank_level.maxima(prep, extrema=not one)  # (a one-pass commit reads no extrema unless it misses)
        step, doing = commit.step, commit.doing
        head: Any = None if one else _max_vector(len(payload), step, doing, maxima, mine)
        hit, paired, agree = False, False, True
        if one:  # the sums laid out by the guess, checked in the same all_reduce (see metricbus.one_pass)
            hit, longest, summed, agree, ending = self._one_pass_sums(
                prep, maxima, guess, len(payload), step=step, doing=doing
            )
        elif guess is not None:  # the sums laid out by the guess travel with the maxima (see metricbus.speculate)
            mine_fit = one_pass.own_fit(
                maxima=maxima, present=prep.present[0], weighted=prep.weighted[0], rank=self.rank, guess=guess
            )  # (weights in a column guessed unweighted have no slots in the guess's layout)
            early = rank_level.sums(prep, guess) if mine_fit else speculate.blank(guess)
            head, summed = self._all_reduce_pair(head, early)
            longest, paired = int(head[0]), True
        else:
            head = self._all_reduce(head, "max")
            longest = int(head[0])
        if not one:
            ending = step_check.ending_of_max(head[1:_AT])
        columns, names = self._columns, self._names
        dropped: dict[str, str] = {}
        fresh: Ranked = {}
        if longest:
            # a commit every rank aborts (steps that differ, or every rank's step invalid) agrees on no spec: its
            # records come back, and a refused commit changes nothing (the gather still runs on every rank)
            aborted = (
                commit.invalid
                or doing != step_check.COMMIT
                or ending[0]
                or (not agree if one else step_check.steps_of_max(head[1:_AT]) is not None)
            )
            try:
                fresh, dropped = self._agree(payload, longest, table, reducer, apply=not aborted)
            except DistributedError:
                if not ending[0]:
                    raise
                # a rank closed while the others commit: that error, on every rank (every rank sees both)
        if hit:  # the guess's layout; its extrema are NaN (no chain reads them)
            merged = rank_level.finish(guess, summed, prep.block.moments)
            self._hits += 0 if longest else 1  # (an agreement changed the columns and dropped the guess)
        else:
            if one:  # the guess missed: the maxima pass after all (the length is known: the gather is done)
                rank_level.set_extrema(prep, maxima)
                head = self._all_reduce(_max_vector(0, step, doing, maxima, mine), "max")
            bounds = head[_AT + maxima.size :].reshape(-1, sketch_level.NB)
            agreed = head[_AT : _AT + maxima.size].reshape(-1, rank_level.NM)
            if paired and speculate.fits(agreed, guess):
                merged = rank_level.finish(speculate.within(agreed, guess), summed, prep.block.moments)
            else:  # the sums pass under the agreed maxima (again, if the guess missed: every rank sees the same)
                sums = rank_level.sums(prep, agreed)
                summed = self._all_reduce(np.concatenate((sums, sketch_level.counts(mine, bounds))), "sum")
                merged = rank_level.finish(agreed, summed[: sums.size], prep.block.moments)
                if sketched:
                    rank_level.attach(merged, sketched, sketch_level.finish(bounds, summed[sums.size :]))
            if not longest:  # (an agreement changed the columns and dropped the guess)
                self._guess = speculate.guess_of(agreed, guess, commits=self._hits + 1)
                self._guess.flags.writeable = False  # (frozen: its layout is then found by identity, rank_finish.plan)
                self._hits = 0
        if hit:  # the step's slots travelled in the sums (no MAX pass): a second look only where they disagree
            slots = None if agree else self._all_reduce(step_check.max_slots(step, doing), "max")
            steps = None if slots is None else step_check.steps_of_max(slots)
        else:
            steps = step_check.steps_of_max(head[1:_AT])
        mixed, pending = ending
        if mixed:  # some ranks closed the bus while the others commit: no rank will meet this group's others again
            self.ended = (
                "another rank called close() while this rank called commit() (close() and commit() are collectives: "
                "every rank calls them in the same order)"
            )
        ranked: RankedStates | None = None if longest or sketched else self._ranked_columns(merged)
        if ranked is None:
            ranked = _ranked(merged, names, columns, fresh, dropped)
        journal = [(self.rank, with_specs(own, self._specs, dropped))] if commit.journaled else []
        others = {name: where for name, where in dropped.items() if name not in rejected}
        return Exchange([], self._specs, journal, others, ranked, steps=steps, mixed=mixed, pending=pending)

    def _ranked_columns(self, merged: Merged) -> RankedColumns | None:
        """``merged`` kept in columns (see :mod:`metricbus.ranked_columns`) where every metric has one column and
        every column a worker has took the fast path; else None."""
        fields = merged.fields
        if fields is None or self._width != len(self._names):  # (every name has at least one column)
            return None
        names = self._names_tuple
        if merged.picks is not None:  # a metric no rank logged this commit is left out
            names = tuple(map(names.__getitem__, merged.picks.tolist()))
        return RankedColumns(names=names, fields=fields, version=self._version)

    def gather(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order, on every rank (two collectives; used once, when a bus is built)."""
        payload = text.encode()
        longest = int(self._all_reduce(np.array([float(len(payload))]), "max")[0])
        return [data.decode() for data in self._gather_bytes(payload, longest)]

    def any_pending(self, check: Commit) -> bool:
        """True if any rank has uncommitted records. ``check`` is a commit of nothing whose ``doing`` says whether
        this rank has some: it runs a commit's collectives (the same shapes as a commit another rank may be in), so
        a rank in ``commit()`` meanwhile is found, and both raise ``DistributedError``."""
        try:
            exchange = self.exchange(check)
        except DistributedError:
            if self.ended is None:
                raise
            raise DistributedError(f"close() on rank {self.rank}: {self.ended}; this rank closes alone") from None
        if exchange.mixed:
            raise DistributedError(
                f"close() on rank {self.rank}: another rank called commit() meanwhile (close() and commit() are "
                "collectives: every rank calls them in the same order); this rank closes alone"
            )
        return exchange.pending

    def usable(self) -> bool:
        """True while the process group can still run collectives (not destroyed), and no rank closed the bus while
        this one committed (see ``ended``)."""
        if self.ended is not None:
            return False
        try:
            return bool(self._dist.is_initialized()) and int(self._dist.get_rank(self._group)) >= 0
        except (RuntimeError, ValueError):
            return False

    def settle(self, *, timeout_s: float = SETTLE_S) -> bool:
        """Wait (GIL released) until the backend let go of every collective's tensors; False if it did not in time."""
        deadline = time.monotonic() + timeout_s
        delay = 0.0
        while True:
            self._prune()
            if not self._held:
                return True
            if time.monotonic() >= deadline:
                self._eager = False  # a backend that keeps tensors this long: settle at close only, never per commit
                warnings.warn(
                    f"rank {self.rank}: the torch.distributed backend still holds {len(self._held)} tensors of "
                    f"metricbus's last collective after {timeout_s:g} s; if the process exits now it may abort. "
                    "Call bus.close() on every rank before torch.distributed.destroy_process_group()",
                    MetricBusWarning,
                    stacklevel=2,
                )
                return False
            time.sleep(delay)  # releases the GIL, which the backend's thread needs to let go
            delay = min(_SETTLE_MAX_SLEEP_S, max(1e-6, delay * 2))

    # -- internals ---------------------------------------------------------------------------------------------

    def _collective(self, fn: Any, *tensors: Any, **kwargs: Any) -> None:
        """Run ``fn(*tensors)`` on the group and hold the tensors until the backend lets go of them."""
        before = [t._use_count() for t in tensors]
        try:
            fn(*tensors, group=self._group, **kwargs)
        except RuntimeError as exc:  # gloo's "Connection closed by peer", a timeout, NCCL's DistBackendError
            raise self._failed(exc) from None
        self._hold(list(tensors), before)

    def _failed(self, exc: RuntimeError) -> DistributedError:
        """A collective the backend failed (another rank's process ended or crashed, or the group timed out): no
        collective can run any more (``ended``, so commit() raises and close() closes this rank alone)."""
        lines = str(exc).strip().splitlines()
        said = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        self.ended = (
            f"a torch.distributed collective failed ({said}); another rank's process ended without calling "
            "bus.close() (close() is a collective: every rank calls it), crashed, or the group timed out"
        )
        return DistributedError(f"rank {self.rank}: {self.ended}")

    def _hold(self, tensors: list[Any], before: list[int]) -> None:
        """Keep ``tensors`` until the backend lets go of them (their use counts back to ``before``)."""
        self._held.extend(zip(tensors, before, strict=True))
        if self._eager:
            self.settle()
        else:  # NCCL's watchdog lets go later: keep only what it still holds (settled at close and at exit)
            self._prune()

    def _prune(self) -> None:
        """Forget the tensors the backend has let go of (use count back to what it was before the collective)."""
        self._held = [(t, before) for t, before in self._held if t._use_count() > before]

    def _all_gather(self, out: Any, local: Any) -> None:
        # torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (same semantics); looked up
        # at call time so wrappers installed on torch.distributed (call counters, profilers) see it.
        all_gather = getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor
        self._collective(all_gather, out, local)

    def _claims(self, names: tuple[str, ...], table: SpecTable) -> dict[str, Claim]:
        """This rank's claims the agreed table lacks (or holds with another spec), among ``names``."""
        if self._settled_names == (names, table.version):  # the same names under the same specs: none
            return {}
        claims = {}
        for name in names:
            claim = table.claim(name)
            held = self._agreed.get(name)
            if claim is not None and (held is None or held.spec != claim.spec):
                claims[name] = claim
        self._settled_names = () if claims else (names, table.version)
        return claims

    def _one_pass_sums(
        self, prep: rank_level.Prepared, maxima: Any, guess: Any, length: int, *, step: int, doing: int
    ) -> tuple[bool, int, Any, bool, tuple[bool, bool]]:
        """One all_reduce(SUM) of this rank's sums laid out by ``guess``, the checks of it (:mod:`metricbus.one_pass`)
        and the step's slots (:mod:`metricbus.step_check`): ``(hit, a bound on the longest claims payload, the
        reduced sums, whether every rank sent this step and does the same, step_check.ending_of_sums)``."""
        sent = one_pass.vector(prep, maxima=maxima, rank=self.rank, guess=guess, length=length)
        summed = self._all_reduce(np.concatenate((sent, step_check.sum_slots(step, doing))), "sum")
        slots = summed[-step_check.N_SUM :]
        agree = step_check.sums_agree(slots, self._size)
        return (*one_pass.read(summed[: -step_check.N_SUM], guess), agree, step_check.ending_of_sums(slots, self._size))

    def _all_reduce_pair(self, maxima: Any, sums: Any) -> tuple[Any, Any]:
        """An all_reduce(MAX) of float64 ``maxima`` and an all_reduce(SUM) of int64 ``sums``, issued together; both
        live in one buffer (one host-to-device and one device-to-host copy on a GPU)."""
        torch, dist = self._torch, self._dist
        both = np.concatenate((maxima.view(np.int64), sums))
        buffer = torch.from_numpy(both).to(self._device)
        first, second = buffer[: maxima.size].view(torch.float64), buffer[maxima.size :]
        before = [first._use_count(), second._use_count()]
        try:
            held = dist.all_reduce(first, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
            dist.all_reduce(second, op=dist.ReduceOp.SUM, group=self._group, async_op=True).wait()
            held.wait()
        except RuntimeError as exc:  # (see _collective)
            raise self._failed(exc) from None
        del held  # a Work keeps its tensors: drop it before waiting for the backend to let go of them
        self._hold([first, second], before)
        out = _host(buffer)
        return out[: maxima.size].view(np.float64), out[maxima.size :]

    def _all_reduce(self, values: Any, op: str) -> Any:
        """One all_reduce of a float64 (``op="max"``) or int64 (``"sum"``) numpy vector; the result as numpy."""
        torch = self._torch
        tensor = torch.from_numpy(values)
        if self._device.type != "cpu":  # (to() of a CPU tensor to the CPU is the tensor itself: a dispatch saved)
            tensor = tensor.to(self._device)
        reduce_op = self._dist.ReduceOp.MAX if op == "max" else self._dist.ReduceOp.SUM
        self._collective(self._dist.all_reduce, tensor, op=reduce_op)
        return _host(tensor)

    def _block(self, states: WorkerStates, reducer: StepReducer) -> rank_level.Block:
        """This rank's row over the agreed columns."""
        if type(states) is ColumnStates and not states.update.others:
            update = states.update
            direct = self._direct.get(update.names)
            if direct is None:
                direct = self._direct[update.names] = self._direct_columns(update.names, reducer)
            index, whole = direct
            if len(index):  # every metric's micro summary is its one column: copy the update's fields over
                fields = np.empty((N_FIELDS, 1, self._width))
                if whole:  # (the usual commit: every agreed metric, in column order)
                    fields[:, 0, :] = update.fields
                else:
                    fields[:, 0, :] = _EMPTY
                    fields[:, 0, index] = update.fields
                return rank_level.Block(fields, self._rank_row, self._moment_mask)
        row: list[Summary | None] = [None] * self._width
        for name, (base, width) in zip(self._names, self._columns, strict=True):
            held = states.get(name)
            if held is not None:
                row[base : base + width] = lift_columns(held, self._lifts[name])
        return rank_level.block_of([row], [self.rank], self._moments)

    def _direct_columns(self, names: tuple[str, ...], reducer: StepReducer) -> tuple[Any, bool]:
        """The column of each of ``names`` where every one's micro summary is its one rank-level input as it is
        (no lift, no sketch: :meth:`StepReducer.plain`), else an empty array (the row is built state by state); and
        whether those are every column, in order."""
        at = {name: base for name, (base, _) in zip(self._names, self._columns, strict=True)}
        out = []
        for name in names:
            spec = self._specs.get(name)
            if spec is None or not reducer.plain(name, spec) or self._lifts[name][0][3]:
                return np.empty(0, dtype=np.intp), False
            out.append(at[name])
        return np.array(out, dtype=np.intp), out == list(range(self._width))

    def _gather_bytes(self, payload: bytes, longest: int) -> list[bytes]:
        """One all_gather of every rank's ``payload``, each prefixed with its length and padded to the longest."""
        torch = self._torch
        width = _LENGTH.size + longest
        local = torch.zeros(width, dtype=torch.uint8)
        local[: _LENGTH.size + len(payload)] = torch.frombuffer(
            bytearray(_LENGTH.pack(len(payload)) + payload), dtype=torch.uint8
        )
        local = local.to(self._device)
        out = torch.empty(width * self._size, dtype=torch.uint8, device=self._device)
        self._all_gather(out, local)
        data = out.cpu().numpy().tobytes()
        blocks = [data[r * width : (r + 1) * width] for r in range(self._size)]
        return [block[_LENGTH.size : _LENGTH.size + _LENGTH.unpack_from(block)[0]] for block in blocks]

    def _agree(
        self, payload: bytes, longest: int, table: SpecTable, reducer: StepReducer, *, apply: bool = True
    ) -> tuple[Ranked, dict[str, str]]:
        """Gather the new claims and partials of the ranks that have them; extend the agreed table identically on
        every rank (or raise on every rank: all ranks see the same claims); return the rank-level results of the
        metrics new to the table, merged from the gathered partials, and the metrics some rank dropped."""
        gathered: list[tuple[int, tuple[dict[str, Claim], Partial, list[str]]]] = [
            (rank, pickle.loads(data))  # pickled by the group's own ranks
            for rank, data in enumerate(self._gather_bytes(payload, longest))
            if data
        ]
        dropped = {name: f"rank {rank}" for rank, (_, _, names) in gathered for name in names}
        offers: dict[str, list[Claim]] = {}
        for rank, (claims, _, _) in gathered:
            for name, claim in sorted(claims.items()):
                offers.setdefault(name, []).append(Claim(claim.spec, claim.origin, f"rank {rank} ({claim.where})"))
        decided: dict[str, Claim] = {}
        outputs = {key: name for name, claim in self._agreed.items() for key in output_keys(name, claim.spec)}
        refused: dict[str, str] = {}  # the metrics whose specs the ranks disagree on, and why
        for name in sorted(offers):
            held = self._agreed.get(name)
            try:
                decided[name] = decide(name, held, offers[name], fixed=held is not None)
            except SpecError as exc:
                refused[name] = str(exc)
        for name, claim in decided.items():
            for key in output_keys(name, claim.spec):
                owner = outputs.setdefault(key, name)
                if owner != name and name not in refused:
                    refused[name] = (
                        f"{name!r} with spec {claim.spec} would emit {key!r}, which {owner!r} also emits "
                        "(on another rank, or earlier); rename one of them or change its spec"
                    )
        if refused:  # seen alike on every rank: each keeps its records but those of the refused metrics and of
            # the metrics some rank dropped (dropped on every rank, as a commit would)
            first = next(iter(refused.values()))
            more = f" (and {len(refused) - 1} more metrics)" if len(refused) > 1 else ""
            reasons = {name: f"{where} rejected the records of {name!r}" for name, where in dropped.items()}
            raise DistributedError(
                f"rank {self.rank}: the ranks disagree: {first}{more}", refused={**reasons, **refused}
            ) from None
        if not apply:
            return {}, dropped
        new = {name for name in decided if name not in self._agreed}
        for name, claim in decided.items():
            self._agreed[name] = claim
            if claim.declared or table.claim(name) is not None:
                # A rank with its own rule for a name agreed as the default keeps that rule: when it logs the name,
                # its declaration reaches the agreement and is refused there, as ingest() refuses it.
                table.fix(name, claim)
        table.seal(decided)
        self._layout(reducer)
        specs = self._specs
        workers = []  # the ranks that sent a partial, in rank order: every rank that has a new metric did
        for _, (_, partial, _) in gathered:
            updates = [{name: s for name, s in update.items() if name in new} for update in partial.updates()]
            workers.append(reducer.worker(updates, specs))
        fresh = reducer.rank_level(workers, specs) if new and workers else {}
        return {name: merged for name, merged in fresh.items() if name in new}, dropped

    def _layout(self, reducer: StepReducer) -> None:
        """The columns of the agreed table, in name order (identical on every rank)."""
        self._specs = {name: claim.spec for name, claim in self._agreed.items()}
        self._names = sorted(self._agreed)
        self._names_tuple = tuple(self._names)
        self._version += 1
        self._lifts = {name: reducer.columns(name, self._specs[name]) for name in self._names}
        self._columns = []
        self._moments = []
        self._sketched = []
        width = 0
        for name in self._names:
            self._columns.append((width, len(self._lifts[name])))
            self._moments.extend(moment for _, _, moment, _ in self._lifts[name])
            self._sketched.extend(width + j for j, column in enumerate(self._lifts[name]) if column[3])
            width += len(self._lifts[name])
        self._width = width
        self._moment_mask = np.array(self._moments, dtype=bool)
        self._moment_mask.flags.writeable = False
        self._direct = {}
        self._guess = None
        self._hits = 0
        self._one_pass = not one_pass.reads_extrema(self._specs)
        self._settled_names = ()


def _ranked(
    merged: Sequence[Summary | None],
    names: list[str],
    columns: list[tuple[int, int]],
    fresh: Ranked,
    dropped: Mapping[str, str],
) -> Ranked:
    """Each metric's merged columns (``merged``, laid out by ``names`` and their ``columns``), then the metrics an
    agreement brought (``fresh``), less those a rank dropped."""
    ranked: Ranked = {}
    for name, (base, width) in zip(names, columns, strict=True):
        if width == 1:
            held = merged[base]
            if held is not None:
                ranked[name] = (held,)
        elif any(m is not None for m in merged[base : base + width]):
            ranked[name] = tuple(merged[base : base + width])
    ranked.update(fresh)
    for name in dropped:  # a metric one rank had to drop is dropped on every rank, never half-reduced
        ranked.pop(name, None)
    return ranked


def _max_vector(length: int, step: int, doing: int, maxima: Any, mine: Sequence[Any]) -> Any:
    """What this rank all-reduces (MAX) in the maxima pass: the claims payload's ``length``, the step's slots, its
    ``maxima`` and the bounds of its sketches ``mine``."""
    return np.concatenate(
        ([float(length)], step_check.max_slots(step, doing), maxima.ravel(), sketch_level.bounds(mine).ravel())
    )


def _host(tensor: Any) -> Any:
    """A collective's result tensor as a numpy array (one device-to-host copy for a CUDA tensor)."""
    return tensor.cpu().numpy() if tensor.device.type != "cpu" else tensor.numpy()
