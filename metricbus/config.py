"""Build a bus from a config: a file (YAML, TOML, JSON), a mapping (dict or OmegaConf), or ``$METRICBUS_CONFIG``.

Precedence, lowest first: the source, then ``$METRICBUS_ADAPTERS`` (a comma-separated adapter list that replaces
the source's, like ``OTEL_METRICS_EXPORTER``; ``none`` means no adapters), then the keyword overrides given in code.
Everything is validated before any adapter is built or opened; a mistake raises
:class:`~metricbus.errors.ConfigError` naming where it is (``adapters[1].log_dir``,
``metrics["actor/pg_loss"].micro``) and what is valid. Relative paths are relative to the working directory.
TOML has no null: write ``dist = "none"`` there for ``dist: null``.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from metricbus.adapter import RunInfo
from metricbus.delivery import QUEUE_POLICIES
from metricbus.errors import AdapterNotFoundError, ConfigError, MetricBusError
from metricbus.kinds import KIND_NAMES
from metricbus.spec import NAN_POLICIES, Agg, Spec, parse_spec

ENV_CONFIG = "METRICBUS_CONFIG"
ENV_ADAPTERS = "METRICBUS_ADAPTERS"
KEYS = (
    "adapters", "metrics", "log_every", "nan", "strict", "dist", "writer_rank", "journal", "fsync",
    "queue_size", "queue_policy", "queue_timeout_s", "run",
)  # fmt: skip
CODE_ONLY_KEYS = ("group",)  # a process group object cannot come from a file
RUN_KEYS = ("project", "name", "tags", "config")
LEVEL_KEYS = ("micro", "rank", "step", "nan")
DIST_VALUES = ("auto", "torch", "none", None)
SUFFIXES = (".yaml", ".yml", ".toml", ".json")
B = TypeVar("B")


def _error(where: str, what: str, origin: str) -> ConfigError:
    return ConfigError(f"{origin}: {where}: {what}" if where else f"{origin}: {what}")


def _unknown(key: object, valid: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(key), valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{hint}; valid keys: {', '.join(valid)}"


# -- reading sources ---------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """Convert OmegaConf containers (at any depth) to dicts and lists, resolving interpolations."""
    omegaconf = sys.modules.get("omegaconf")  # only present if the caller uses OmegaConf; never imported here
    if omegaconf is not None and isinstance(value, (omegaconf.DictConfig, omegaconf.ListConfig)):
        return omegaconf.OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
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
    except yaml.YAMLError as exc:
        raise ValueError(str(exc)) from exc


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
    plain = _plain(source)
    if not isinstance(plain, Mapping):
        raise ConfigError(
            f"from_config() takes a file path, a mapping (dict or OmegaConf DictConfig) or None, "
            f"not {type(source).__name__}"
        )
    return dict(plain), "config"


# -- checking values ---------------------------------------------------------------------------------------------


def _int(value: Any, *, where: str, origin: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise _error(where, f"must be an int >= {least}, got {value!r}", origin)
    return value


def _number(value: Any, *, where: str, origin: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise _error(where, f"must be a number >= 0, got {value!r}", origin)
    return float(value)


def _choice(value: Any, valid: Sequence[Any], *, where: str, origin: str) -> Any:
    if value not in valid:
        shown = ", ".join("null" if v is None else str(v) for v in valid)
        raise _error(where, f"unknown value {value!r}; use one of {shown}", origin)
    return value


def _bool(value: Any, *, where: str, origin: str) -> bool:
    if not isinstance(value, bool):
        raise _error(where, f"must be true or false, got {value!r}", origin)
    return value


def _text(value: Any, *, where: str, origin: str, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise _error(where, f"must be a string, got {value!r}", origin)
    return os.fspath(value)


def _kind(value: Any, *, where: str, origin: str) -> str:
    if not isinstance(value, str) or value not in KIND_NAMES:
        raise _error(where, f"unknown aggregation {value!r}; use one of {', '.join(KIND_NAMES)}", origin)
    return value


def _agg(value: Mapping[str, Any], *, where: str, origin: str) -> Agg:
    levels: dict[str, Any] = {}
    for key, item in value.items():
        if key not in LEVEL_KEYS:
            raise _error(f"{where}.{key}", _unknown(key, LEVEL_KEYS), origin)
        if key == "nan":
            levels[key] = _choice(item, NAN_POLICIES, where=f"{where}.nan", origin=origin)
        else:
            levels[key] = _kind(item, where=f"{where}.{key}", origin=origin)
    return Agg(**levels)


def _spec(value: Any, *, where: str, origin: str, nested: bool = False) -> Any:
    if isinstance(value, str):
        return _kind(value, where=where, origin=origin)
    if isinstance(value, Mapping):
        return _agg(value, where=where, origin=origin)
    if isinstance(value, list) and not nested:
        if not value:
            raise _error(where, "empty list of kinds; give at least one", origin)
        return [_spec(item, where=f"{where}[{i}]", origin=origin, nested=True) for i, item in enumerate(value)]
    raise _error(
        where,
        f"invalid spec {value!r}; use a kind ({', '.join(KIND_NAMES)}), a list of kinds, or a mapping with "
        f"{', '.join(LEVEL_KEYS)}",
        origin,
    )


def _metrics(value: Any, *, origin: str) -> dict[str, Spec]:
    if not isinstance(value, Mapping):
        raise _error("metrics", f"must be a mapping of name pattern -> spec, got {value!r}", origin)
    rules: dict[str, Spec] = {}
    for pattern, raw in value.items():
        where = f"metrics[{json.dumps(str(pattern))}]"
        if not isinstance(pattern, str) or not pattern:
            raise _error(where, "a pattern must be a non-empty string", origin)
        try:
            rules[pattern] = parse_spec(_spec(raw, where=where, origin=origin), metric=pattern)
        except ConfigError:
            raise
        except MetricBusError as exc:  # e.g. a list that names one kind twice
            raise _error(where, str(exc), origin) from exc
    return rules


def _run(value: Any, *, origin: str) -> RunInfo:
    if isinstance(value, RunInfo):
        return value
    if not isinstance(value, Mapping):
        raise _error("run", f"must be a mapping with {', '.join(RUN_KEYS)}, got {value!r}", origin)
    for key in value:
        if key not in RUN_KEYS:
            raise _error(f"run.{key}", _unknown(key, RUN_KEYS), origin)
    options: dict[str, Any] = {}
    if "project" in value:
        options["project"] = _text(value["project"], where="run.project", origin=origin)
    if "name" in value:
        options["name"] = _text(value["name"], where="run.name", origin=origin, optional=True)
    tags = value.get("tags", [])
    if isinstance(tags, str) or not isinstance(tags, Sequence) or not all(isinstance(t, str) for t in tags):
        raise _error("run.tags", f"must be a list of strings, got {tags!r}", origin)
    options["tags"] = tuple(tags)
    config = value.get("config", {})
    if not isinstance(config, Mapping):
        raise _error("run.config", f"must be a mapping, got {config!r}", origin)
    options["config"] = dict(config)
    return RunInfo(**options)


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


def _env_adapters() -> list[str] | None:
    text = os.environ.get(ENV_ADAPTERS, "").strip()
    if not text:
        return None
    if text.lower() == "none":
        return []
    return [part.strip() for part in text.split(",") if part.strip()]


# -- the whole config --------------------------------------------------------------------------------------------

_SCALARS: dict[str, Callable[..., Any]] = {
    "log_every": lambda v, **kw: _int(v, least=1, **kw),
    "writer_rank": lambda v, **kw: _int(v, least=0, **kw),
    "queue_size": lambda v, **kw: _int(v, least=1, **kw),
    "queue_timeout_s": _number,
    "strict": _bool,
    "nan": lambda v, **kw: _choice(v, NAN_POLICIES, **kw),
    "queue_policy": lambda v, **kw: _choice(v, QUEUE_POLICIES, **kw),
    "dist": lambda v, **kw: None if _choice(v, DIST_VALUES, **kw) == "none" else v,
    "journal": lambda v, **kw: _text(v, optional=True, **kw),
    "fsync": lambda v, **kw: _choice(v, _fsync_modes(), **kw),
}


def _fsync_modes() -> tuple[str, ...]:
    from metricbus.journal import FSYNC_MODES

    return tuple(FSYNC_MODES)


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
            raise _error(str(key), _unknown(key, KEYS), origins[key])
    options: dict[str, Any] = {}
    for key, check in _SCALARS.items():
        if key in data:
            options[key] = check(data[key], where=key, origin=origins[key])
    if "metrics" in data:
        options["rules"] = _metrics(data["metrics"], origin=origins["metrics"])
    if "run" in data:
        options["run"] = _run(data["run"], origin=origins["run"])
    if "group" in data:
        options["group"] = data["group"]
    if "adapters" in data:
        where = origins["adapters"]
        name = "" if where.startswith("$") else "adapters"
        entries = _adapter_list(data["adapters"], origin=where)
        options["adapters"] = [_make(e, where=f"{name}[{i}]", origin=where) for i, e in enumerate(entries)]
    return options


def bus_from_config(cls: Callable[..., B], source: Any, overrides: Mapping[str, Any]) -> B:
    """``cls(**options)`` from ``source`` and ``overrides``; used by ``MetricBus.from_config``."""
    return cls(**bus_options(source, overrides))
