"""Aggregation specs: what a metric's records become at the micro, update, rank and step levels.

A spec is a kind (``"sum"``: used at every level), an :class:`Agg` (``Agg(micro="sum", rank="mean")``: a level
left out takes the kind of the level below; micro defaults to ``mean``), or a list of those, emitted as
``name/<kind>`` (verl's ``response_length/mean`` convention). Specs are parsed once, when declared.

The levels, lowest first: **micro** (the records of one optimizer update on one worker: its micro-batches),
**update** (the updates of one commit on one worker, marked by ``bus.end_update()``), **rank** (the workers of a
commit) and **step** (the commits of a ``log_every`` window).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

from metricbus.errors import SpecError
from metricbus.kinds import HIST, KIND_HELP, canonical, is_sketch

NanPolicy = Literal["propagate", "ignore", "error"]
NAN_POLICIES: tuple[str, ...] = ("propagate", "ignore", "error")
DEFAULT_KIND = "mean"
LEVELS: tuple[str, ...] = ("micro", "update", "rank", "step")


def check_kind(kind: object, *, metric: str, level: str) -> str:
    """Return ``kind``'s tag (``quantile(0.5)`` -> ``p50``) if it is a known kind, else raise SpecError naming the
    metric and the valid kinds."""
    tag = canonical(kind)
    if tag is None:
        raise SpecError(
            f"unknown aggregation {kind!r} for {metric!r} ({level} level); use one of {', '.join(KIND_HELP)} "
            "(pNN: a percentile such as p95 or p99.9; quantile(q): 0 <= q <= 1)"
        )
    return tag


def check_nan(policy: object, *, metric: str) -> NanPolicy:
    """Return ``policy`` if it is a valid nan policy."""
    if policy not in NAN_POLICIES:
        raise SpecError(f"unknown nan policy {policy!r} for {metric!r}; use one of {', '.join(NAN_POLICIES)}")
    return policy  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Agg:
    """A per-level spec; ``nan`` optionally overrides the bus's nan policy for the metrics it applies to."""

    micro: str | None = None
    update: str | None = None
    rank: str | None = None
    step: str | None = None
    nan: NanPolicy | None = None

    def __post_init__(self) -> None:
        for level in LEVELS:
            kind = getattr(self, level)
            if kind is not None:
                check_kind(kind, metric="Agg", level=level)
        if self.nan is not None:
            check_nan(self.nan, metric="Agg")


@dataclass(frozen=True, slots=True)
class Chain:
    """One fully resolved kind per level, and the name suffix it is emitted under ('' for a single chain)."""

    micro: str
    update: str
    rank: str
    step: str
    suffix: str = ""

    def __str__(self) -> str:
        if self.micro == self.update == self.rank == self.step:
            return self.micro
        update = "" if self.update == self.micro else f"update:{self.update},"
        return f"micro:{self.micro},{update}rank:{self.rank},step:{self.step}"


@dataclass(frozen=True, slots=True)
class Spec:
    """A resolved spec: its chains and nan policy (None: the bus's)."""

    chains: tuple[Chain, ...]
    nan: NanPolicy | None = None

    def __str__(self) -> str:
        if len(self.chains) == 1 and not self.chains[0].suffix:
            text = str(self.chains[0])
        else:
            text = "[" + ", ".join(str(c) for c in self.chains) + "]"
        return text if self.nan is None else f"{text} (nan={self.nan})"


SpecLike: TypeAlias = str | Agg | Sequence[str | Agg] | Spec


def _chain(item: str | Agg, *, metric: str, suffix: bool) -> tuple[Chain, NanPolicy | None]:
    if isinstance(item, str):
        kind = check_kind(item, metric=metric, level="every")
        return Chain(kind, kind, kind, kind, kind if suffix else ""), None
    if isinstance(item, Agg):
        micro = check_kind(item.micro or DEFAULT_KIND, metric=metric, level="micro")
        update = check_kind(item.update, metric=metric, level="update") if item.update else micro
        rank = check_kind(item.rank, metric=metric, level="rank") if item.rank else update
        step = check_kind(item.step, metric=metric, level="step") if item.step else rank
        levels = (micro, update, rank, step)
        written = (True, bool(item.update), bool(item.rank), bool(item.step))  # else taken from the level below
        for at, (kind, above) in enumerate(itertools.pairwise(levels)):
            if kind == HIST and above != HIST:
                origin = max(i for i in range(at + 1) if written[i])
                kept = f" (kept by the {LEVELS[at]} level)" if origin < at else ""
                raise SpecError(
                    f"'hist' at the {LEVELS[origin]} level of {metric!r}{kept} is followed by {above!r} at the "
                    f"{LEVELS[at + 1]} level; a histogram is not a number a higher level can reduce, so 'hist' may "
                    "only be followed by 'hist' (use a quantile below)"
                )
        return Chain(micro, update, rank, step, step if suffix else ""), item.nan
    raise SpecError(
        f"invalid spec {item!r} for {metric!r}; use a kind ({', '.join(KIND_HELP)}), "
        "an Agg(micro=, update=, rank=, step=), or a list of those"
    )


def parse_spec(spec: SpecLike, *, metric: str) -> Spec:
    """Resolve ``spec`` for ``metric`` (a name or pattern, used in error messages)."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, (str, Agg)):
        chain, nan = _chain(spec, metric=metric, suffix=False)
        return Spec((chain,), nan)
    if isinstance(spec, Sequence) and not isinstance(spec, (bytes, bytearray)):
        if not spec:
            raise SpecError(f"empty spec list for {metric!r}; give at least one kind")
        parsed = [_chain(item, metric=metric, suffix=True) for item in spec]
        chains = tuple(c for c, _ in parsed)
        suffixes = [c.suffix for c in chains]
        duplicates = sorted({s for s in suffixes if suffixes.count(s) > 1})
        if duplicates:
            raise SpecError(f"spec list for {metric!r} emits {metric}/{duplicates[0]} twice; list each kind once")
        nans = {n for _, n in parsed if n is not None}
        if len(nans) > 1:
            raise SpecError(f"spec list for {metric!r} mixes nan policies {sorted(nans)}; use one")
        return Spec(chains, nans.pop() if nans else None)
    raise SpecError(
        f"invalid spec {spec!r} for {metric!r}; use a kind ({', '.join(KIND_HELP)}), "
        "an Agg(micro=, update=, rank=, step=), or a list of those"
    )


def parse_spec_text(text: str, *, metric: str) -> Spec:
    """Parse the command-line form: ``sum``, ``mean,max`` (a list) or ``micro:sum,rank:mean`` (levels)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise SpecError(f"empty spec for {metric!r}; use e.g. 'sum', 'mean,max' or 'micro:sum,rank:mean'")
    if all(":" in p for p in parts):
        kinds: dict[str, str] = {}
        nan: NanPolicy | None = None
        given: set[str] = set()
        for part in parts:
            level, _, kind = (piece.strip() for piece in part.partition(":"))
            if level not in (*LEVELS, "nan"):
                raise SpecError(f"unknown level {level!r} in spec for {metric!r}; use micro, update, rank, step or nan")
            if level in given:
                raise SpecError(f"the {level} level is given twice in spec for {metric!r} ({text!r}); give it once")
            if not kind:
                raise SpecError(f"no kind for the {level} level in spec for {metric!r}; use e.g. 'micro:sum'")
            given.add(level)
            # checked here, naming the metric (Agg() can only name itself)
            if level == "nan":
                nan = check_nan(kind, metric=metric)
            else:
                kinds[level] = check_kind(kind, metric=metric, level=level)
        return parse_spec(Agg(nan=nan, **kinds), metric=metric)
    if any(":" in p for p in parts):
        raise SpecError(f"spec {text!r} for {metric!r} mixes level pairs and kinds; use one form")
    return parse_spec(parts[0] if len(parts) == 1 else parts, metric=metric)


DEFAULT_SPEC = parse_spec(DEFAULT_KIND, metric="default")


def micro_sketch(spec: Spec) -> bool:
    """True when a chain of ``spec`` reads the records' distribution (its micro kind is a quantile or ``hist``)."""
    return any(is_sketch(chain.micro) for chain in spec.chains)
