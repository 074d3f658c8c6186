"""The adapter registry: entry points, spec forms, and the errors for unknown names and options."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from metricbus.adapters.jsonl import JsonlAdapter
from metricbus.adapters.mlflow import MlflowAdapter
from metricbus.adapters.tensorboard import TensorBoardAdapter
from metricbus.adapters.wandb import WandbAdapter

from metricbus import registry
from metricbus.errors import AdapterNotFoundError, ConfigError

DECLARED = {"console", "jsonl", "tensorboard", "mlflow", "wandb"}


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """A registry that rescans entry points now and again after the test."""
    registry.refresh()
    yield
    registry.refresh()


@pytest.fixture
def plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None) -> Path:
    """An installed-looking distribution declaring one good and two broken adapters."""
    (tmp_path / "fake_plugin.py").write_text(
        textwrap.dedent(
            """
            class Good:
                name = "good"
                def __init__(self, *, level: int = 1) -> None:
                    self.level = level
                def open(self, *, run): pass
                def write(self, *, step, metrics): pass
                def flush(self): pass
                def close(self, *, status): pass

            class NoClose:
                def open(self, *, run): pass
                def write(self, *, step, metrics): pass
                def flush(self): pass

            def not_a_class(): pass
            """
        )
    )
    dist = tmp_path / "fake_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[metricbus.adapters]\ngood = fake_plugin:Good\nnoclose = fake_plugin:NoClose\n"
        "func = fake_plugin:not_a_class\nmissing = fake_plugin_absent:X\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("fake_plugin", None)


def test_every_declared_entry_point_loads(fresh_registry: None) -> None:
    """Each entry point in the group loads to an adapter class whose ``name`` is its entry-point name."""
    declared = {ep.name for ep in entry_points(group=registry.GROUP)}
    assert declared >= DECLARED
    for name in sorted(declared):
        cls = registry.get_adapter_class(name)
        assert isinstance(cls, type)
        assert cls.name == name  # type: ignore[attr-defined]
    assert set(registry.adapter_names()) == declared


def test_lookups_are_cached(fresh_registry: None) -> None:
    """The same class object comes back on every lookup."""
    assert registry.get_adapter_class("jsonl") is registry.get_adapter_class("jsonl") is JsonlAdapter


def test_name_spec_builds_default_adapter() -> None:
    """A bare name builds the adapter with its defaults."""
    adapter = registry.make_adapter("tensorboard")
    assert isinstance(adapter, TensorBoardAdapter)
    assert adapter.log_dir is None  # decided at open: runs/<project>/<run id>/tensorboard
    assert type(registry.make_adapter("console")).__name__ == "ConsoleAdapter"


@pytest.mark.parametrize(
    ("spec", "cls", "attr", "value"),
    [
        ("tensorboard:runs/exp", TensorBoardAdapter, "log_dir", "runs/exp"),
        ("mlflow:sqlite:///x.db", MlflowAdapter, "tracking_uri", "sqlite:///x.db"),
        ("mlflow:http://127.0.0.1:5000", MlflowAdapter, "tracking_uri", "http://127.0.0.1:5000"),
        ("jsonl:out.jsonl", JsonlAdapter, "path", Path("out.jsonl")),
        ("wandb:proj", WandbAdapter, "project", "proj"),
    ],
)
def test_uri_spec_fills_main_option(spec: str, cls: type, attr: str, value: object) -> None:
    """``name:value`` puts everything after the first colon into the adapter's main option."""
    adapter = registry.make_adapter(spec)
    assert isinstance(adapter, cls)
    assert getattr(adapter, attr) == value


def test_mapping_spec_passes_options(tmp_path: Path) -> None:
    """``{"type": ..., **options}`` passes the options as constructor keywords."""
    adapter = registry.make_adapter({"type": "mlflow", "tracking_uri": "sqlite:///y.db", "experiment": "e"})
    assert isinstance(adapter, MlflowAdapter)
    assert adapter.tracking_uri == "sqlite:///y.db"
    jsonl = registry.make_adapter({"type": "jsonl", "path": str(tmp_path / "a.jsonl")})
    assert isinstance(jsonl, JsonlAdapter)


def test_unknown_name_lists_known_ones() -> None:
    """An unknown adapter name raises AdapterNotFoundError listing the registered names."""
    with pytest.raises(AdapterNotFoundError, match=r"'tensorbord'.*console.*jsonl.*mlflow.*tensorboard.*wandb"):
        registry.make_adapter("tensorbord")


def test_unknown_option_names_key_and_valid_ones() -> None:
    """An unknown keyword raises ConfigError naming it and the constructor's keywords."""
    with pytest.raises(ConfigError, match=r"'logdir'.*'tensorboard'.*log_dir"):
        registry.make_adapter({"type": "tensorboard", "logdir": "x"})
    with pytest.raises(ConfigError, match=r"'uri'.*tracking_uri, experiment, run_name"):
        registry.make_adapter({"type": "mlflow", "uri": "x"})


def test_mapping_without_type_is_config_error() -> None:
    """A mapping spec must say which adapter it is."""
    with pytest.raises(ConfigError, match="lacks 'type'"):
        registry.make_adapter({"log_dir": "x"})


def test_plugin_adapter_is_found_and_built(plugin_path: Path) -> None:
    """A third-party entry point is found, built from a mapping, and its first keyword takes the URI value."""
    assert "good" in registry.adapter_names()
    adapter = registry.make_adapter({"type": "good", "level": 3})
    assert adapter.level == 3
    assert registry.make_adapter("good:5").level == "5"


@pytest.mark.parametrize(("name", "message"), [("noclose", "lacks close"), ("func", "not an adapter class")])
def test_loaded_objects_are_type_checked(plugin_path: Path, name: str, message: str) -> None:
    """An entry point that is not a class with open/write/flush/close is refused."""
    with pytest.raises(AdapterNotFoundError, match=message):
        registry.get_adapter_class(name)


def test_unimportable_entry_point_says_so(plugin_path: Path) -> None:
    """An entry point whose module is missing raises AdapterNotFoundError, not ImportError."""
    with pytest.raises(AdapterNotFoundError, match="cannot be imported"):
        registry.get_adapter_class("missing")


@pytest.mark.parametrize(
    ("cls", "blocked", "extra"),
    [
        (TensorBoardAdapter, "tensorboard.compat.proto", "tensorboard"),
        (MlflowAdapter, "mlflow.entities", "mlflow"),
        (WandbAdapter, "wandb", "wandb"),
    ],
)
def test_missing_backend_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cls: type, blocked: str, extra: str
) -> None:
    """With the backend unimportable, open() raises AdapterNotFoundError naming the pip extra."""
    from metricbus.adapter import RunInfo

    monkeypatch.setitem(sys.modules, blocked, None)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(AdapterNotFoundError, match=rf"pip install 'metricbus\[{extra}\]'"):
        cls().open(run=RunInfo())


def test_importing_adapters_imports_no_backend() -> None:
    """Importing the adapter modules and the registry leaves every backend unimported."""
    import subprocess

    code = (
        "import sys, metricbus.registry, metricbus.adapters.tensorboard, metricbus.adapters.mlflow, "
        "metricbus.adapters.wandb, metricbus.adapters.jsonl; "
        "print(sorted(m for m in ('tensorboard', 'mlflow', 'wandb', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
