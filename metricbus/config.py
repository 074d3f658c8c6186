"""Build a bus from a config: a file (YAML, TOML, JSON), a mapping (dict or OmegaConf), or ``$METRICBUS_CONFIG``.

Precedence, lowest first: the source, then ``$METRICBUS_ADAPTERS`` (a comma-separated adapter list that replaces
the source's, like ``OTEL_METRICS_EXPORTER``; ``none`` means no adapters), then the keyword overrides given in code.
Everything is validated before any adapter is built or opened: each option by its validator in
:mod:`metricbus.options`, after this module converts what a file writes differently. A mistake raises
:class:`~metricbus.errors.ConfigError` naming where it is (``c.yaml: log_every``, ``adapters[1].log_dir``,
``metrics["actor/pg_loss"].micro``) and what is valid. Relative paths are relative to the working directory.
TOML has no null: write ``dist = "none"`` there for ``dist: null``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from metricbus.errors import AdapterNotFoundError, ConfigError
from metricbus.kinds import KIND_HELP
from metricbus.options import VALIDATORS, check_rule, unknown_key
from metricbus.spec import LEVELS, Agg, Spec, check_kind, check_nan

ENV_CONFIG = "METRICBUS_CONFIG"
ENV_ADAPTERS = "METRICBUS_ADAPTERS"
CODE_ONLY_KEYS = ("group",)  # a process group object cannot come from a file
# The options a config sets: MetricBus's, with ``rules`` written ``metrics`` (as in a file's own words).
KEYS = tuple("metrics" if name == "rules" else name for name in VALIDATORS if name not in CODE_ONLY_KEYS)
LEVEL_KEYS = (*LEVELS, "nan")
SUFFIXES = (".yaml", ".yml", ".toml", ".json")
B = TypeVar("B")


def _error(where: str, what: str, origin: str) -> ConfigError:
    return ConfigError(f"{origin}: {where}: {what}" if where else f"{origin}: {what}")


# -- reading sources ---------------------------------------------------------------------------------------------


def plain(value: Any) -> Any:
    """Convert OmegaConf containers (at any depth) to dicts and lists, resolving interpolations."""
    omegaconf = sys.modules.get("omegaconf")  # only present if the caller uses OmegaConf; never imported here
    if omegaconf is not None and isinstance(value, (omegaconf.DictConfig, omegaconf.ListConfig)):
        return omegaconf.OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain(item) for item in value]
    return value


def read_file(path: str | os.PathLike[str], *, origin: str | None = None) -> dict[str, Any]:
    """Parse a ``.yaml``/``.yml``, ``.toml`` or ``.json`` config file into a dict (``origin``: for messages)."""
    file = Path(path)
    origin = origin or str(file)
    suffix = file.suffix.lower()
    if suffix not in SUFFIXES:
        raise _error("", f"unknown config file type {suffix or '(none)'!r}; use one of {', '.join(SUFFIXES)}", origin)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise _error("", f"cannot read the config file: {exc}", origin) from exc
    try:
        data = _parse(text, suffix)
    except ImportError as exc:
        raise _error("", f"{exc}; pip install 'metricbus[config]'", origin) from exc
    except ValueError as exc:  # json, toml and yaml (below) parse errors
        raise _error("", f"cannot parse: {exc}", origin) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise _error("", f"the top level must be a mapping of options, not {type(data).__name__}", origin)
    return data


def _parse(text: str, suffix: str) -> Any:
    if suffix == ".json":
        return json.loads(text)
    if suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib
        return tomllib.loads(text)
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:  # its str() is several lines, with a drawing of where: one line here
        context = f" ({exc.context}{_at(exc.context_mark)})" if exc.context else ""
        raise ValueError(f"{exc.problem or 'invalid YAML'}{_at(exc.problem_mark)}{context}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(" ".join(str(exc).split())) from exc


def _at(mark: Any) -> str:
    """`` at line L, column C`` (1-based) of a PyYAML mark, or nothing."""
    return "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"


def load_source(source: Any) -> tuple[dict[str, Any], str]:
    """The config mapping of ``source`` and a description of where it came from (for messages)."""
    if source is None:
        path = os.environ.get(ENV_CONFIG)
        if not path:
            return {}, "config"
        origin = f"${ENV_CONFIG}={path}"
        return read_file(path, origin=origin), origin
    if isinstance(source, (str, os.PathLike)):
        return read_file(source), os.fspath(source)
    try:
        data = plain(source)
    except ValueError as exc:  # OmegaConf's resolution errors (an interpolation that names nothing) are ValueErrors
        where = getattr(exc, "full_key", None)
        reason = str(getattr(exc, "msg", exc)).splitlines()[0]
        raise _error(str(where or ""), f"cannot resolve the OmegaConf config: {reason}", "config") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"from_config() takes a file path, a mapping (dict or OmegaConf DictConfig) or None, "
            f"not {type(source).__name__}"
        )
    return dict(data), "config"


# -- converting file forms ---------------------------------------------------------------------------------------
# Values are checked by metricbus.options (one validator per option); here only the forms a file writes differently
# are converted (TOML's dist = "none", a spec mapping -> Agg), checking what the conversion itself needs.


def _located(where: str, origin: str, check: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``check(*args, **kwargs)``; a ValueError it raises comes back as ConfigError at ``where`` in ``origin``."""
    try:
        return check(*args, **kwargs)
    except ValueError as exc:
        raise _error(where, str(exc), origin) from exc


def _agg(value: Mapping[str, Any], *, pattern: str, where: str, origin: str) -> Agg:
    levels: dict[str, Any] = {}
    for key, item in value.items():
        if key == "nan":
            levels[key] = _located(f"{where}.nan", origin, check_nan, item, metric=pattern)
        elif key in LEVELS:
            levels[key] = _located(f"{where}.{key}", origin, check_kind, item, metric=pattern, level=key)
        else:
            raise _error(f"{where}.{key}", unknown_key(key, LEVEL_KEYS), origin)
    return Agg(**levels)


def _spec(value: Any, *, pattern: str, where: str, origin: str, nested: bool = False) -> Any:
    """The SpecLike a file's spec stands for: a kind, a mapping of levels (-> Agg) or a list of those; an ``Agg`` or
    ``Spec`` object (an override given in code) as it is."""
    if isinstance(value, (Agg, Spec)):
        return value
    if isinstance(value, str):
        return _located(where, origin, check_kind, value, metric=pattern, level="every")
    if isinstance(value, Mapping):
        return _agg(value, pattern=pattern, where=where, origin=origin)
    if isinstance(value, list) and not nested:
        return [
            _spec(item, pattern=pattern, where=f"{where}[{i}]", origin=origin, nested=True)
            for i, item in enumerate(value)
        ]
    raise _error(
        where,
        f"invalid spec {value!r}; use a kind ({', '.join(KIND_HELP)}), a list of kinds, or a mapping with "
        f"{', '.join(LEVEL_KEYS)}",
        origin,
    )


def _metrics(value: Any, *, origin: str) -> dict[str, Spec]:
    """``metrics:`` -> the ``rules`` option, each rule checked by the rules validator at its location."""
    if not isinstance(value, Mapping):
        raise _error("metrics", f"must be a mapping of name pattern -> spec, got {value!r}", origin)
    rules: dict[str, Spec] = {}
    for pattern, raw in value.items():
        where = f"metrics[{json.dumps(str(pattern))}]"
        spec = _spec(raw, pattern=str(pattern), where=where, origin=origin)
        rules[pattern] = _located(where, origin, check_rule, pattern, spec)[1]
    return rules


# -- adapters ----------------------------------------------------------------------------------------------------


def _adapter_list(value: Any, *, origin: str) -> list[Any]:
    if isinstance(value, (str, Mapping)):
        return [value]
    if isinstance(value, Sequence):
        return list(value)
    raise _error("adapters", f"must be a name, a list, a {{type: ...}} mapping or a 'name:value' string, "
                 f"got {value!r}", origin)


def _make(spec: Any, *, where: str, origin: str) -> Any:
    from metricbus import registry

    if not isinstance(spec, (str, Mapping)):  # an adapter object given in code
        return spec
    try:
        if isinstance(spec, Mapping):
            name = spec.get("type")
            if not isinstance(name, str):
                raise _error(where, f"an adapter mapping needs 'type': one of {', '.join(registry.adapter_names())}",
                             origin)
            valid = registry.adapter_options(registry.get_adapter_class(name))
            for key in spec:
                if key != "type" and key not in valid:
                    raise _error(f"{where}.{key}", f"unknown option {key!r} for adapter {name!r}; valid options: "
                                 f"{', '.join(valid) or '(none)'}", origin)
        return registry.make_adapter(spec)
    except ConfigError as exc:
        if str(exc).startswith(origin):
            raise
        raise _error(where, str(exc), origin) from exc
    except (AdapterNotFoundError, TypeError, ValueError) as exc:
        raise _error(where, str(exc), origin) from exc


def require_source(source: Any, *, how: str) -> None:
    """Raise ConfigError where ``source`` is None and neither ``$METRICBUS_CONFIG`` nor ``$METRICBUS_ADAPTERS`` is
    set: an integration's bus built from nothing has no adapters, so everything logged would go nowhere. ``how``:
    how that integration is given a config instead (for the message)."""
    if source is None and not os.environ.get(ENV_CONFIG) and not os.environ.get(ENV_ADAPTERS, "").strip():
        raise ConfigError(
            f"no metricbus config: set {ENV_CONFIG} to a config file, {ENV_ADAPTERS} (e.g. 'jsonl,tensorboard'; "
            f"'none' for no adapters), or {how}"
        )


def _env_adapters() -> list[str] | None:
    text = os.environ.get(ENV_ADAPTERS, "").strip()
    if not text:
        return None
    if text.lower() == "none":
        return []
    return [part.strip() for part in text.split(",") if part.strip()]


# -- the whole config --------------------------------------------------------------------------------------------

_FILE_FORMS: dict[str, tuple[Callable[[Any], Any], str]] = {
    # option -> (file form -> option value, how a file writes it: added to a mistake's message)
    "dist": (lambda v: None if v == "none" else v, 'in a file, null or "none" (TOML has no null) is None'),
}


def _option(key: str, value: Any, *, origin: str) -> Any:
    """``value`` converted from its file form and checked by the option's validator."""
    convert, form = _FILE_FORMS.get(key, (None, ""))
    if convert is not None:
        value = convert(value)
    try:
        return VALIDATORS[key](value)
    except ValueError as exc:
        raise _error("", f"{exc}; {form}" if form else str(exc), origin) from exc


def bus_options(source: Any = None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Validate ``source`` + ``$METRICBUS_ADAPTERS`` + ``overrides`` into MetricBus keyword arguments."""
    data, origin = load_source(source)
    origins = dict.fromkeys(data, origin)
    env = _env_adapters()
    if env is not None:
        data["adapters"] = env
        origins["adapters"] = f"${ENV_ADAPTERS}"
    for key, value in (overrides or {}).items():
        data[key] = value
        origins[key] = "from_config() override"
    for key in data:
        allowed = KEYS + CODE_ONLY_KEYS if origins[key] == "from_config() override" else KEYS
        if key not in allowed:
            raise _error(str(key), unknown_key(key, KEYS), origins[key])
    options: dict[str, Any] = {}
    for key, value in data.items():
        if key == "metrics":
            options["rules"] = _metrics(value, origin=origins[key])
        elif key != "adapters":  # built last, once everything else is known to be valid
            options[key] = _option(key, value, origin=origins[key])
    if "adapters" in data:
        where = origins["adapters"]
        name = "" if where.startswith("$") else "adapters"
        entries = _adapter_list(data["adapters"], origin=where)
        built = [_make(e, where=f"{name}[{i}]", origin=where) for i, e in enumerate(entries)]
        options["adapters"] = list(_option("adapters", built, origin=where))
    return options


def bus_from_config(cls: Callable[..., B], source: Any, overrides: Mapping[str, Any]) -> B:
    """``cls(**options)`` from ``source`` and ``overrides``; used by ``MetricBus.from_config``."""
    return cls(**bus_options(source, overrides))
