"""The options of a :class:`~metricbus.bus.MetricBus`, validated once, into a frozen :class:`BusOptions`.

:data:`VALIDATORS` holds one check per option. Each takes the value a caller gave and returns it normalized
(``run={"name": "x"}`` becomes a :class:`~metricbus.adapter.RunInfo`, ``rules`` the parsed ``(pattern, Spec)``
pairs), or raises a ``ValueError`` subclass whose message starts with the option's location and says what is
valid: ``log_every: must be an int >= 1, got 0``, ``run.tags: must be a list of strings, got 'a'``. Options that
another module owns are checked by that module's own function (nan and rules: :mod:`metricbus.spec` and
:mod:`metricbus.rules`, raising :class:`~metricbus.errors.SpecError`; queue options and timeouts:
:mod:`metricbus.delivery`; fsync: :mod:`metricbus.journal`); the rest raise :class:`~metricbus.errors.ConfigError`.
:mod:`metricbus.config` puts where a value came from in front (``c.yaml: log_every: ...``).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, TypeAlias

from metricbus.adapter import Adapter, RunInfo
from metricbus.delivery import WRITE_TIMEOUT_S, as_seconds, check_open_error, check_queue_options, check_seconds
from metricbus.errors import ConfigError, SpecError
from metricbus.rules import Rules
from metricbus.shutdown import EXIT_TIMEOUT_S
from metricbus.spec import NanPolicy, Spec, check_nan

AdapterLike: TypeAlias = Adapter | str | Mapping[str, Any]
RuleItems: TypeAlias = tuple[tuple[str, Spec], ...]
RUN_KEYS = ("project", "name", "tags", "config")
DIST_MODES = ("auto", "torch", None)
ADAPTER_VERBS = ("open", "write", "flush", "close")
_QUEUE_OK: Mapping[str, object] = MappingProxyType({"queue_size": 1, "queue_policy": "block", "queue_timeout_s": 0.0})


@dataclass(frozen=True, slots=True)
class BusOptions:
    """Every MetricBus option, checked; make one with :meth:`build` (the constructor trusts its arguments).

    ``rules`` is held parsed, as ``(pattern, Spec)`` pairs in declaration order (first match wins), so each spec
    is parsed once; ``build`` takes a ``{pattern: spec}`` mapping (or such pairs). ``run=None`` means "the
    default RunInfo", made by the bus (a RunInfo holds its start time, so it cannot be a constant default).
    """

    adapters: tuple[AdapterLike, ...] = ()
    rules: RuleItems = ()
    log_every: int = 1
    nan: NanPolicy = "propagate"
    strict: bool = False
    run: RunInfo | None = None
    dist: str | None = "auto"
    group: Any = None
    writer_rank: int = 0
    journal: str | None = None
    fsync: str = "interval"
    queue_size: int = 1024
    queue_policy: str = "block"
    queue_timeout_s: float = 10.0
    write_timeout_s: float = WRITE_TIMEOUT_S
    exit_timeout_s: float = EXIT_TIMEOUT_S
    resume: bool = False
    on_open_error: str = "raise"

    @classmethod
    def build(cls, **options: Any) -> BusOptions:
        """Check every option (given or default) with its validator; an unknown name is a TypeError."""
        for name in options:
            if name not in VALIDATORS:
                raise TypeError(f"unknown MetricBus option: {unknown_key(name, tuple(VALIDATORS))}")
        built = cls(**{name: check(options.get(name, _DEFAULTS[name])) for name, check in VALIDATORS.items()})
        check_request_timeouts(built.adapters, write_timeout_s=built.write_timeout_s)
        return built


def check_request_timeouts(adapters: Sequence[Any], *, write_timeout_s: float) -> None:
    """Refuse an adapter whose own ``request_timeout_s`` (how long one of its calls may wait for its backend, e.g.
    MLflow's) is not below the bus's ``write_timeout_s``: such a call would be taken for hung and the adapter stopped
    for the run, where a shorter request would have been retried. ``adapters``: adapter objects (their attribute)
    or, before they are built, specs (a mapping's ``request_timeout_s`` key), so :meth:`BusOptions.build` (which the
    Lightning callback and logger run at construction) refuses what the bus would refuse once the adapters are
    built. A number that is not below it (NaN, an int beyond the double range included) is refused; what is not a
    number is left to the adapter."""
    for i, adapter in enumerate(adapters):
        if isinstance(adapter, str):
            continue
        if isinstance(adapter, Mapping):
            limit, name = adapter.get("request_timeout_s"), adapter.get("type")
        else:
            limit, name = getattr(adapter, "request_timeout_s", None), getattr(adapter, "name", type(adapter).__name__)
        seconds = as_seconds(limit)
        if seconds is not None and not seconds < write_timeout_s:
            raise ConfigError(
                f"adapters[{i}] ({name}): request_timeout_s={seconds:g} s must be below the bus's "
                f"write_timeout_s={write_timeout_s:g} s (an adapter call running that long is taken for hung and the "
                f"adapter stopped for the run, where a request that timed out is retried); lower request_timeout_s "
                f"or raise write_timeout_s"
            )


def unknown_key(key: object, valid: Sequence[str]) -> str:
    """``unknown key 'x' (did you mean 'y'?); valid keys: ...``."""
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{hint}; valid keys: {', '.join(valid)}"


# -- checks owned here -------------------------------------------------------------------------------------------


def _int_at_least(option: str, least: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{option}: must be an int >= {least}, got {value!r}")
        return value

    return check


def _bool(option: str) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{option}: must be a bool (True or False), got {value!r}")
        return value

    return check


def _on_open_error(value: Any) -> str:
    return _located("on_open_error", ConfigError, lambda: check_open_error(value))  # type: ignore[no-any-return]


def _dist(value: Any) -> str | None:
    if value is not None and not (isinstance(value, str) and value in DIST_MODES):
        raise ConfigError(f"dist: must be 'auto', 'torch' or None, got {value!r}")
    return value


def _group(value: Any) -> Any:
    """A torch.distributed process group (or None: the default group); checked when the transport is made."""
    return value


def _journal(value: Any) -> str | None:
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if path is None:
        return None
    if not isinstance(path, str) or not path:
        raise ConfigError(f"journal: must be a path (a non-empty str or os.PathLike) or None, got {value!r}")
    return path


def _adapters(value: Any) -> tuple[AdapterLike, ...]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ConfigError(
            f"adapters: must be a list of adapters, names ('console', 'jsonl:out.jsonl') or {{'type': ...}} "
            f"mappings, got {value!r}"
        )
    return tuple(_adapter(i, item) for i, item in enumerate(value))


def _adapter(index: int, value: Any) -> AdapterLike:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return MappingProxyType(dict(value))  # the caller's mapping is copied on intake
    missing = [verb for verb in ADAPTER_VERBS if not callable(getattr(value, verb, None))]
    if missing:
        raise ConfigError(
            f"adapters[{index}]: {value!r} has no {', '.join(v + '()' for v in missing)}; an adapter implements "
            f"{', '.join(ADAPTER_VERBS)} (or give a name such as 'console', or a {{'type': ...}} mapping)"
        )
    return value  # type: ignore[no-any-return]


def _run(value: Any) -> RunInfo | None:
    if value is None or isinstance(value, RunInfo):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"run: must be a mapping with {', '.join(RUN_KEYS)} (or a RunInfo), got {value!r}")
    for key in value:
        if key not in RUN_KEYS:
            raise ConfigError(f"run.{key}: {unknown_key(key, RUN_KEYS)}")
    given: dict[str, Any] = {}
    if "project" in value:
        if not isinstance(value["project"], str):
            raise ConfigError(f"run.project: must be a string, got {value['project']!r}")
        given["project"] = value["project"]
    if "name" in value:
        if value["name"] is not None and not isinstance(value["name"], str):
            raise ConfigError(f"run.name: must be a string or None, got {value['name']!r}")
        given["name"] = value["name"]
    tags = value.get("tags", ())
    if isinstance(tags, str) or not isinstance(tags, Sequence) or not all(isinstance(t, str) for t in tags):
        raise ConfigError(f"run.tags: must be a list of strings, got {tags!r}")
    config = value.get("config", {})
    if not isinstance(config, Mapping):
        raise ConfigError(f"run.config: must be a mapping, got {config!r}")
    return RunInfo(**given, tags=tuple(tags), config=dict(config))


# -- checks owned elsewhere, reused --------------------------------------------------------------------------


def _located(option: str, error: type[ValueError], check: Callable[[], Any]) -> Any:
    """Run an owner's ``check``; its ValueError comes back as ``error`` with ``option: `` in front."""
    try:
        return check()
    except ValueError as exc:
        text = str(exc)
        text = text[len(option) + 1 :] if text.startswith(f"{option} ") else text  # "x must be": no "x: x must be"
        raise error(f"{option}: {text}") from exc


def _queue(option: str) -> Callable[[Any], Any]:
    """The check of one queue option: delivery's check of all three, the other two given valid values."""

    def check(value: Any) -> Any:
        _located(option, ConfigError, lambda: check_queue_options(**{**_QUEUE_OK, option: value}))
        return float(value) if option == "queue_timeout_s" else value

    return check


def _seconds(option: str) -> Callable[[Any], float]:
    """A timeout in seconds, > 0 (``write_timeout_s``: see :mod:`metricbus.delivery`; ``exit_timeout_s``:
    :mod:`metricbus.shutdown`)."""
    return lambda value: _located(option, ConfigError, lambda: check_seconds(option, value))


def _nan(value: Any) -> NanPolicy:
    return _located("nan", SpecError, lambda: check_nan(value, metric="MetricBus(nan=)"))  # type: ignore[no-any-return]


def _fsync(value: Any) -> str:
    from metricbus.journal import check_fsync  # lazily, like the bus opens its journal

    return _located("fsync", ConfigError, lambda: check_fsync(value))  # type: ignore[no-any-return]


def check_rule(pattern: Any, spec: Any) -> tuple[str, Spec]:
    """One rule, checked and parsed by :class:`~metricbus.rules.Rules` (raises its SpecError unchanged)."""
    return pattern, Rules().add(pattern, spec)


def _rules(value: Any) -> RuleItems:
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(i, tuple) and len(i) == 2 for i in value):
        items = list(value)
    else:
        raise SpecError(f"rules: must be a mapping of name pattern -> spec (or (pattern, spec) pairs), got {value!r}")
    parsed = []
    for pattern, spec in items:
        parsed.append(_located("rules", SpecError, lambda: check_rule(pattern, spec)))  # noqa: B023 - called at once
    return tuple(parsed)


VALIDATORS: Mapping[str, Callable[[Any], Any]] = MappingProxyType(
    {
        "adapters": _adapters,
        "rules": _rules,
        "log_every": _int_at_least("log_every", 1),
        "nan": _nan,
        "strict": _bool("strict"),
        "run": _run,
        "dist": _dist,
        "group": _group,
        "writer_rank": _int_at_least("writer_rank", 0),
        "journal": _journal,
        "fsync": _fsync,
        "queue_size": _queue("queue_size"),
        "queue_policy": _queue("queue_policy"),
        "queue_timeout_s": _queue("queue_timeout_s"),
        "write_timeout_s": _seconds("write_timeout_s"),
        "exit_timeout_s": _seconds("exit_timeout_s"),
        "resume": _bool("resume"),
        "on_open_error": _on_open_error,
    }
)
"""Option name -> its check, in MetricBus's signature order."""

_DEFAULTS: Mapping[str, Any] = MappingProxyType({f.name: f.default for f in fields(BusOptions)})
