"""Rules: an ordered list of ``(fnmatchcase pattern, Spec)``; the first match wins, validated when declared."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase

from metricbus.errors import SpecError
from metricbus.spec import DEFAULT_SPEC, Spec, SpecLike, parse_spec


class Rules:
    """Ordered pattern rules. ``match(name)`` is called once per new name; the bus caches the result."""

    __slots__ = ("_rules",)

    def __init__(self, rules: Mapping[str, SpecLike] | Iterable[tuple[str, SpecLike]] | None = None) -> None:
        self._rules: list[tuple[str, Spec]] = []
        items = rules.items() if isinstance(rules, Mapping) else (rules or ())
        for pattern, spec in items:
            self.add(pattern, spec)

    def add(self, pattern: str, spec: SpecLike) -> Spec:
        """Append a rule (after the existing ones) and return its parsed spec."""
        check_pattern(pattern)
        parsed = parse_spec(spec, metric=pattern)
        self._rules.append((pattern, parsed))
        return parsed

    def match(self, name: str) -> Spec:
        """The spec of the first rule whose pattern matches ``name``, else the default (``mean``)."""
        return self.find(name)[1]

    def find(self, name: str) -> tuple[str | None, Spec]:
        """``(pattern, spec)`` of the first rule matching ``name``, else ``(None, the default spec)``."""
        for pattern, spec in self._rules:
            if fnmatchcase(name, pattern):
                return pattern, spec
        return None, DEFAULT_SPEC

    def items(self) -> list[tuple[str, Spec]]:
        """The rules in order."""
        return list(self._rules)


def check_pattern(pattern: object) -> None:
    """Raise SpecError unless ``pattern`` is a non-empty string (an fnmatchcase pattern)."""
    if not isinstance(pattern, str) or not pattern:
        raise SpecError(f"rule pattern must be a non-empty string, got {pattern!r}")
