"""The spec table: the one place that decides a metric's spec, detects conflicts and claims output names.

``log()``, ``ingest()`` and the torch.distributed agreement all go through one :class:`SpecTable`, so the three
paths cannot decide differently. Precedence, highest first:

1. an explicit ``agg=`` given to ``log()`` on this bus;
2. this bus's rules (``rules=``, ``define()``), first matching pattern;
3. a spec a worker (an ingested partial, or another rank) *declared* (by ``agg=`` or a rule of its own);
4. the default (``mean``), which is no declaration: a worker that only had the default gives way to any of the above.

A name's spec is fixed the first time it is logged with a declared spec, or committed; until its first commit a
default spec still gives way to a declaration. A later, different declaration is a
:class:`~metricbus.errors.SpecError` naming the metric, both specs and where each came from. Two specs that would
emit the same output name (``x`` as ``["mean", "max"]`` and a plain ``x/mean``) are an error too, never a merge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from metricbus.errors import MetricTypeError, SpecError
from metricbus.partial import Partial
from metricbus.rules import Rules
from metricbus.spec import Spec, SpecLike, parse_spec

# Origins, by precedence (lower number wins).
EXPLICIT, RULE, DECLARED, DEFAULT = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class Claim:
    """A spec for a name and where it came from (``origin`` one of EXPLICIT..DEFAULT; ``where`` for messages)."""

    spec: Spec
    origin: int
    where: str

    @property
    def declared(self) -> bool:
        """True unless the spec is only the default."""
        return self.origin != DEFAULT


def output_keys(name: str, spec: Spec) -> list[str]:
    """The names ``name`` is emitted under with ``spec``: ``name`` for a single chain, ``name/<kind>`` for a list."""
    return [f"{name}/{chain.suffix}" if chain.suffix else name for chain in spec.chains]


def conflict(name: str, held: Claim, new: Claim) -> str:
    """The message for two different specs of one name."""
    return (
        f"{name!r} has spec {held.spec} from {held.where}, but {new.where} gives {new.spec}; "
        "a metric has one spec: declare it the same everywhere, or only in one place"
    )


def check_name(name: object) -> None:
    """MetricTypeError unless ``name`` is a metric name: a non-empty string that UTF-8 can encode."""
    if not isinstance(name, str) or not name:
        raise MetricTypeError(f"metric names must be non-empty strings, got {name!r}")
    if not name.isascii():  # the journal, packing and backends keep names as UTF-8
        try:
            name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise MetricTypeError(
                f"metric name {name!r} cannot be encoded as UTF-8 ({exc.reason} at {exc.start}); names must be "
                "valid Unicode text (no lone surrogates, as os.fsdecode or 'surrogateescape' leave)"
            ) from None


class SpecTable:
    """Name -> Claim, plus the output names each name claims."""

    __slots__ = ("_claims", "_outputs", "_sealed", "_unsealed", "rules", "specs", "version")

    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self._claims: dict[str, Claim] = {}
        self._outputs: dict[str, str] = {}  # emitted name -> metric it comes from
        self._sealed: set[str] = set()  # names committed at least once: their spec can no longer change
        self._unsealed: set[str] = set()
        self.specs: dict[str, Spec] = {}  # name -> its spec, for every claimed name (read by the hot paths)
        self.version = 0  # changes whenever ``specs`` does: a reader may keep what it derived from a version

    def spec(self, name: str) -> Spec:
        """The spec ``name`` has, or would get if logged now without ``agg=``."""
        held = self._claims.get(name)
        return held.spec if held is not None else self.rules.match(name)

    def claim(self, name: str) -> Claim | None:
        """The claim fixed for ``name`` (None if the name is new)."""
        return self._claims.get(name)

    def own(self, name: str, agg: SpecLike | None) -> Claim:
        """The claim for ``name`` logged on this bus with ``agg`` (None: rules, then the default); not recorded."""
        check_name(name)
        if agg is not None:
            return Claim(parse_spec(agg, metric=name), EXPLICIT, "agg= in log() on this bus")
        pattern, spec = self.rules.find(name)
        if pattern is None:
            return Claim(spec, DEFAULT, "the default (no rule matched)")
        return Claim(spec, RULE, f"this bus's rule {pattern!r}")

    def resolve(self, name: str, agg: SpecLike | None) -> Spec:
        """The spec of ``name`` (already claimed) logged here with ``agg``; SpecError if ``agg`` differs."""
        held = self._claims[name]
        if agg is not None:
            new = self.own(name, agg)
            if new.spec != held.spec:
                raise SpecError(conflict(name, held, new))
        return held.spec

    def offer(self, name: str, offers: Iterable[Claim]) -> Claim:
        """The winning claim for ``name`` among this bus's (fixed, or its rules) and ``offers`` (workers')."""
        held = self._claims.get(name)
        if held is not None:
            return decide(name, held, offers, fixed=name in self._sealed)
        return decide(name, self.own(name, None), offers, fixed=False)

    def adopt(
        self,
        partials: Sequence[Partial],
        *,
        first_worker: int,
        check: Callable[[dict[str, Claim]], None] | None = None,
    ) -> None:
        """Settle the spec of every name in ingested ``partials`` (workers ``first_worker``, ``first_worker + 1``,
        ...), or raise SpecError and change nothing; ``check`` sees every name's settled claim before anything
        changes, and may raise too."""
        offers: dict[str, list[Claim]] = {}
        seen: set[bytes] = set()  # partials of one layout offer the same claims: the first one speaks for all
        for i, part in enumerate(partials):
            packed = part.packed
            if packed.layout in seen:
                continue
            seen.add(packed.layout)
            for name, spec in dict(zip(packed.names, packed.specs, strict=True)).items():
                origin = DEFAULT if name in part.undeclared else DECLARED
                what = "default" if origin == DEFAULT else "declared spec"
                offers.setdefault(name, []).append(Claim(spec, origin, f"ingested worker {first_worker + i}'s {what}"))
        decided = {name: self.offer(name, claims) for name, claims in offers.items()}
        outputs: dict[str, str] = {}
        for name, claim in decided.items():
            self.check_outputs(name, claim.spec, outputs)
        if check is not None:
            check(decided)
        for name, claim in decided.items():
            self.fix(name, claim)

    def claims(self) -> list[tuple[str, Claim]]:
        """Every claimed name and its claim."""
        return list(self._claims.items())

    def sealed(self, name: str) -> bool:
        """True once ``name`` was committed (its spec can no longer change)."""
        return name in self._sealed

    def seal(self, names: Iterable[str] | None = None) -> None:
        """These names (None: every claimed name) were committed: a default spec among them can no longer give
        way to a declaration."""
        if names is None:
            if self._unsealed:
                self._sealed.update(self._unsealed)
                self._unsealed.clear()
            return
        for name in names:
            self._sealed.add(name)
            self._unsealed.discard(name)

    def check_outputs(self, name: str, spec: Spec, pending: dict[str, str] | None = None) -> None:
        """Raise SpecError if ``name`` with ``spec`` would emit a name another metric emits."""
        for key in output_keys(name, spec):
            owner = self._outputs.get(key)
            if owner is None and pending is not None:
                owner = pending.get(key)
            if owner is not None and owner != name:
                raise SpecError(
                    f"{name!r} with spec {spec} would emit {key!r}, which {owner!r} already emits; "
                    "rename one of them or change its spec"
                )
            if pending is not None:
                pending[key] = name

    def fix(self, name: str, claim: Claim) -> None:
        """Record ``claim`` for ``name`` (after :meth:`check_outputs`); an existing claim is replaced."""
        old = self._claims.get(name)
        if old is not None:
            for key in output_keys(name, old.spec):
                self._outputs.pop(key, None)
        self._claims[name] = claim
        self.specs[name] = claim.spec
        self.version += 1
        if name not in self._sealed:
            self._unsealed.add(name)
        for key in output_keys(name, claim.spec):
            self._outputs[key] = name

    def forget(self, names: Iterable[str]) -> None:
        """Drop names whose claims were recorded by a call that then failed (so it fixes nothing)."""
        for name in names:
            self._sealed.discard(name)
            self._unsealed.discard(name)
            self.specs.pop(name, None)
            self.version += 1
            old = self._claims.pop(name, None)
            if old is not None:
                for key in output_keys(name, old.spec):
                    self._outputs.pop(key, None)


def decide(name: str, held: Claim | None, offers: Iterable[Claim], *, fixed: bool) -> Claim:
    """The winning claim for ``name``: ``held`` (``fixed``: already committed) against ``offers``, in order.

    Equal specs agree (the higher-precedence origin is kept); a declared spec beats the default unless the
    default is already ``fixed``; two different declared specs raise SpecError naming both and their origins.
    """
    best = held
    for offer in offers:
        if best is None:
            best = offer
        elif offer.spec == best.spec:
            if offer.origin < best.origin:
                best = offer
        elif offer.declared and best.declared:
            raise SpecError(conflict(name, best, offer))
        elif offer.declared and not (fixed and best is held):
            best = offer
        elif offer.declared:  # the default was fixed by a commit already: a declaration now is too late
            raise SpecError(conflict(name, best, offer))
    if best is None:
        raise SpecError(f"no spec offered for {name!r}")
    return best
