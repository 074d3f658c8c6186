"""The rank level over torch.distributed: one packed ``all_gather`` of every metric's states per commit.

The reduction itself stays the local code in :mod:`metricbus.reduce` (so live equals journal replay bitwise);
this module only moves each rank's update-level states (:func:`metricbus.reduce.StepReducer.worker`, computed by
the rank itself). All ranks keep an identical *agreed table* of metric names and spec claims. Each commit packs,
for every agreed metric, the 12 Summary fields of each of its state keys into one float64 buffer, plus one leading
slot holding the byte length of this rank's pickled ``(new claims, partial)`` when it has names the table lacks
(or sums too wide for the 12 fields), else 0. One ``all_gather_single`` then gives every rank every rank's states.
When any length is set, one more ``all_gather_single`` of bytes carries those ranks' claims and partials (the other
ranks' states are complete in the first gather), and every rank decides the new specs with the same
:func:`metricbus.spec_table.decide` the single-process and ``ingest()`` paths use: a changed key set costs exactly
one extra collective; the steady state costs exactly one, whatever the number of metrics. Conflicting declared
specs, and two metrics that would emit the same output name, raise :class:`~metricbus.errors.DistributedError` on
every rank (all ranks see the same gathered claims, so all raise; nothing hangs).

Exit safety. A backend's worker thread (Gloo's ``runLoop``, NCCL's watchdog) drops its reference to a collective's
tensors *after* the collective returns, and for a tensor that has a Python object that last drop takes the GIL
(``TensorImpl::decref_pyobject``). If the interpreter is finalizing by then, ``take_gil`` ends the thread with
``pthread_exit``, whose forced unwind runs into a ``noexcept`` frame: ``terminate called without an active
exception``, SIGABRT, no Python frame. So every collective here is *settled*: the tensors handed to it are kept
until the backend has let go of them (their use count is back to what it was before the call), waiting with the
GIL released. On the CPU (Gloo) that happens right after each collective (the worker lets go within microseconds
once it can take the GIL); on CUDA (NCCL, whose watchdog polls) the tensors are kept and settled at ``close()``
and at interpreter exit, so the hot path never waits for the watchdog.

Cost per commit with R ranks and K agreed metric states: each rank receives R*K*12*8 bytes (the all_gather is O(R)).
"""

from __future__ import annotations

import pickle
import time
import warnings
from typing import Any

from metricbus.errors import DistributedError, MetricBusWarning, SpecError
from metricbus.partial import Partial
from metricbus.ranks import Commit, Exchange, with_specs
from metricbus.reduce import WorkerStates, state_keys
from metricbus.spec import Spec
from metricbus.spec_table import Claim, SpecTable, decide, output_keys
from metricbus.summary import N_FIELDS, Summary

_LENGTH = 0  # slot 0 of each rank's block: the byte length of its pickled (new specs, partial), 0 if none
SETTLE_S = 2.0  # the longest close() waits for a backend thread to let go of a collective's tensors
_SETTLE_MAX_SLEEP_S = 1e-3
_EMPTY = Summary().as_tuple()


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
    size = tdist.get_world_size(group)
    if not 0 <= writer_rank < size:
        raise DistributedError(f"writer_rank={writer_rank} is not a rank of the group (size {size})")
    return TorchRanks(group=group, writer_rank=writer_rank)


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
        self._size: int = tdist.get_world_size(group)
        self.is_writer: bool = self.rank == writer_rank
        self._agreed: dict[str, Claim] = {}  # the agreed table, identical on every rank
        self._specs: dict[str, Spec] = {}
        self._names: list[str] = []  # sorted
        self._keys: dict[str, tuple[str, ...]] = {}  # each name's worker-level state keys, in block order
        self._held: list[tuple[Any, int]] = []  # (tensor, its use count before the collective): not yet let go
        backend = str(tdist.get_backend(group)).lower()
        self._device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        self._eager = self._device.type == "cpu"  # settle after every collective (off after one timeout)

    # -- the protocol ------------------------------------------------------------------------------------------

    def exchange(self, commit: Commit) -> Exchange:
        """Every rank's update-level states of this commit, in rank order; a collective every rank calls."""
        own, table, reducer, rejected = commit.own, commit.table, commit.reducer, commit.rejected
        if commit.ingested:
            # Ingested partials are workers of their own at the rank level; folding them into one rank's
            # contribution would change rank-level kinds (e.g. rank="mean"), so the combination is refused.
            raise DistributedError(
                "ingest() cannot be combined with torch.distributed; use export()/ingest() with dist=None, "
                "or log on every rank and let commit() gather"
            )
        claims = {}
        for name, _, _ in own.entries:
            claim = table.claim(name)
            held = self._agreed.get(name)
            if claim is not None and (held is None or held.spec != claim.spec):
                claims[name] = claim
        mine = {} if claims else reducer.worker(commit.own_updates, self._specs)
        if claims or rejected or any(s.rest for states in mine.values() for s in states):
            # New names, dropped metrics, or sums too wide for the packed block: the partial itself travels in the
            # byte gather.
            payload = pickle.dumps((claims, own, list(rejected)), protocol=pickle.HIGHEST_PROTOCOL)
        else:
            payload = b""
        blocks = self._exchange(mine, length=len(payload))
        lengths = [int(block[_LENGTH]) for block in blocks]
        dropped: dict[str, str] = {}
        if any(lengths):
            # The key set changed: one byte gather carries the new claims and partials of the ranks that have
            # them, so the commit costs the data gather plus exactly one more collective.
            partials, dropped = self._agree(blocks, lengths, payload, table)
            workers = [
                reducer.worker(p.updates(), self._specs) if isinstance(p, Partial) else p for p in partials
            ]
            for states in workers:  # a metric one rank had to drop is dropped on every rank, never half-reduced
                for name in dropped:
                    states.pop(name, None)
        else:
            workers = [self._states(block) for block in blocks]
        journal = [(self.rank, with_specs(own, self._specs, dropped))] if commit.journaled else []
        others = {name: where for name, where in dropped.items() if name not in rejected}
        return Exchange(workers, self._specs, journal, others)

    def share(self, text: str) -> str:
        """The writer rank's ``text`` on every rank (two collectives; used once, when a bus is built)."""
        payload = text.encode() if self.is_writer else b""
        lengths = [int(block[_LENGTH]) for block in self._exchange({}, length=len(payload))]
        return max(self._gather_bytes(payload, lengths), key=len).decode()

    def any_pending(self, *, pending: bool) -> bool:
        """True if any rank has uncommitted records (one small all_reduce)."""
        torch = self._torch
        flag = torch.tensor([1.0 if pending else 0.0], dtype=torch.float64, device=self._device)
        self._collective(self._dist.all_reduce, flag, op=self._dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def usable(self) -> bool:
        """True while the process group can still run collectives (not destroyed)."""
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
        fn(*tensors, group=self._group, **kwargs)
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

    def _exchange(self, mine: WorkerStates, *, length: int) -> list[list[float]]:
        """One all_gather of ``[length, *fields of each agreed metric's states]``; per-rank blocks as floats."""
        torch = self._torch
        row = [float(length)]
        for name in self._names:
            held = mine.get(name)
            if held is None:
                row.extend(_EMPTY * len(self._keys[name]))
            else:
                for state in held:
                    row.extend(state.as_tuple())
        width = len(row)
        local = torch.tensor(row, dtype=torch.float64).to(self._device)
        out = torch.empty(width * self._size, dtype=torch.float64, device=self._device)
        self._all_gather(out, local)
        flat: list[float] = out.cpu().tolist()
        return [flat[r * width : (r + 1) * width] for r in range(self._size)]

    def _gather_bytes(self, payload: bytes, lengths: list[int]) -> list[bytes]:
        """One all_gather of every rank's ``payload``, padded to the longest (whose length every rank knows)."""
        torch = self._torch
        width = max(lengths)
        local = torch.zeros(width, dtype=torch.uint8)
        if payload:
            local[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        local = local.to(self._device)
        out = torch.empty(width * self._size, dtype=torch.uint8, device=self._device)
        self._all_gather(out, local)
        data = out.cpu().numpy().tobytes()
        return [data[r * width : r * width + lengths[r]] for r in range(self._size)]

    def _agree(
        self, blocks: list[list[float]], lengths: list[int], payload: bytes, table: SpecTable
    ) -> tuple[list[Partial | WorkerStates], dict[str, str]]:
        """Gather the new claims and partials of the ranks that have them; extend the agreed table identically on
        every rank (or raise on every rank: all ranks see the same claims) and return every rank's partial (or,
        for a rank that sent none, its states)."""
        payloads = self._gather_bytes(payload, lengths)
        gathered: list[tuple[dict[str, Claim], Partial | WorkerStates, list[str]]] = [
            pickle.loads(data) if length else ({}, self._states(block), [])  # pickled by the group's own ranks
            for data, length, block in zip(payloads, lengths, blocks, strict=True)
        ]
        dropped = {name: f"rank {rank}" for rank, (_, _, names) in enumerate(gathered) for name in names}
        offers: dict[str, list[Claim]] = {}
        for rank, (claims, _, _) in enumerate(gathered):
            for name, claim in sorted(claims.items()):
                offers.setdefault(name, []).append(Claim(claim.spec, claim.origin, f"rank {rank} ({claim.where})"))
        decided: dict[str, Claim] = {}
        outputs = {key: name for name, claim in self._agreed.items() for key in output_keys(name, claim.spec)}
        try:
            for name in sorted(offers):
                held = self._agreed.get(name)
                decided[name] = decide(name, held, offers[name], fixed=held is not None)
            for name, claim in decided.items():
                for key in output_keys(name, claim.spec):
                    owner = outputs.setdefault(key, name)
                    if owner != name:
                        raise SpecError(
                            f"{name!r} with spec {claim.spec} would emit {key!r}, which {owner!r} also emits "
                            "(on another rank, or earlier); rename one of them or change its spec"
                        )
        except SpecError as exc:
            raise DistributedError(f"rank {self.rank}: the ranks disagree: {exc}") from None
        for name, claim in decided.items():
            self._agreed[name] = claim
            if claim.declared or table.claim(name) is not None:
                # A rank with its own rule for a name agreed as the default keeps that rule: when it logs the name,
                # its declaration reaches the agreement and is refused there, as ingest() refuses it.
                table.fix(name, claim)
        table.seal(decided)
        self._specs = {name: claim.spec for name, claim in self._agreed.items()}
        self._names = sorted(self._agreed)
        self._keys = {name: tuple(state_keys(self._specs[name])) for name in self._names}
        return [part for _, part, _ in gathered], dropped

    def _states(self, block: list[float]) -> WorkerStates:
        out: WorkerStates = {}
        pos = 1
        for name in self._names:
            n = len(self._keys[name])
            if block[pos] > 0:  # a rank that has the metric has records in every one of its states
                out[name] = tuple(
                    Summary.from_tuple(block[pos + i * N_FIELDS : pos + (i + 1) * N_FIELDS]) for i in range(n)
                )
            pos += n * N_FIELDS
        return out
