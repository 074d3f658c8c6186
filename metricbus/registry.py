"""Find adapters by name through the ``metricbus.adapters`` entry-point group, and build them from specs.

The group is scanned on the first lookup (never at import) and cached; a loaded object must be a class with
``open``, ``write``, ``flush`` and ``close``. :func:`make_adapter` accepts

* a name: ``"console"``;
* a URI-like string ``"<name>:<value>"`` whose value fills the adapter's main option:
  ``"tensorboard:runs/exp"`` (log_dir), ``"mlflow:sqlite:///x.db"`` (tracking_uri), ``"jsonl:out.jsonl"`` (path),
  ``"wandb:my-project"`` (project);
* a mapping ``{"type": "tensorboard", "log_dir": "runs/exp"}`` whose other keys are constructor keywords.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from metricbus.errors import AdapterNotFoundError, ConfigError

GROUP = "metricbus.adapters"
_VERBS = ("open", "write", "flush", "close")
# The option a "name:value" spec fills, per adapter; other adapters take the first keyword parameter.
URI_OPTION = {"tensorboard": "log_dir", "mlflow": "tracking_uri", "jsonl": "path", "wandb": "project"}

_entry_points: dict[str, EntryPoint] | None = None
_classes: dict[str, type] = {}


def _scan() -> dict[str, EntryPoint]:
    global _entry_points
    if _entry_points is None:
        _entry_points = {ep.name: ep for ep in entry_points(group=GROUP)}
    return _entry_points


def refresh() -> None:
    """Forget the scan and the loaded classes; the next lookup rescans (after a plugin is installed at runtime)."""
    global _entry_points
    _entry_points = None
    _classes.clear()


def adapter_names() -> list[str]:
    """Sorted names of every registered adapter."""
    return sorted(_scan())


def get_adapter_class(name: str) -> type:
    """The adapter class registered as ``name`` (loaded once, then cached)."""
    cached = _classes.get(name)
    if cached is not None:
        return cached
    point = _scan().get(name)
    if point is None:
        raise AdapterNotFoundError(f"no adapter named {name!r}; known adapters: {', '.join(adapter_names())}")
    try:
        loaded = point.load()
    except ImportError as exc:
        raise AdapterNotFoundError(f"adapter {name!r} ({point.value}) cannot be imported: {exc}") from exc
    missing = [verb for verb in _VERBS if not callable(getattr(loaded, verb, None))]
    if not isinstance(loaded, type) or missing:
        raise AdapterNotFoundError(
            f"entry point {name!r} ({point.value}) is not an adapter class"
            + (f": it lacks {', '.join(missing)}" if missing else "")
        )
    _classes[name] = loaded
    return loaded


def adapter_options(cls: type) -> list[str]:
    """The keyword parameters ``cls``'s constructor accepts, in order."""
    params = inspect.signature(cls).parameters.values()
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds]


def _build(name: str, options: Mapping[str, Any]) -> Any:
    cls = get_adapter_class(name)
    valid = adapter_options(cls)
    for key in options:
        if key not in valid:
            raise ConfigError(
                f"unknown option {key!r} for adapter {name!r}; valid options: {', '.join(valid) or '(none)'}"
            )
    return cls(**options)


def make_adapter(spec: str | Mapping[str, Any]) -> Any:
    """Build an adapter from a name, a ``"name:value"`` string or a ``{"type": name, ...}`` mapping."""
    if isinstance(spec, Mapping):
        if "type" not in spec:
            raise ConfigError(f"adapter mapping {dict(spec)!r} lacks 'type'; use one of {', '.join(adapter_names())}")
        options = {key: value for key, value in spec.items() if key != "type"}
        return _build(str(spec["type"]), options)
    if not isinstance(spec, str):
        raise ConfigError(f"adapter spec must be a name, 'name:value' or a mapping, not {type(spec).__name__}")
    name, sep, value = spec.partition(":")
    if not sep:
        return _build(name, {})
    option = URI_OPTION.get(name)
    if option is None:
        valid = adapter_options(get_adapter_class(name))
        if not valid:
            raise ConfigError(f"adapter {name!r} takes no options, so {spec!r} cannot set one")
        option = valid[0]
    return _build(name, {option: value})


def resolve_adapter(adapter: Any) -> Any:
    """An adapter object as given, or built from a name, ``"name:value"`` string or mapping."""
    if isinstance(adapter, (str, Mapping)):
        return make_adapter(adapter)
    return adapter  # an adapter object: BusOptions checked its verbs
