"""Child processes for tests/test_verl.py: each runs in a fresh interpreter, as a process that imports verl does.

``python tests/verl_workers.py plugin OUT``: runs verl's own plugin loader (the ``verl.plugins`` block of the
installed ``verl/__init__.py``, executed as written), then builds verl's ``Tracking`` with the console and metricbus
backends, logs two steps and finishes. ``mismatch OUT``: the same loader with a ``Tracking`` unlike verl 0.9's.
``imports OUT``: which frameworks importing metricbus and its verl integration pulls in. Each writes JSON to OUT.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import verl_source

PLUGIN_BLOCK_START = "# Auto-discover plugins via setuptools entry_points."
PLUGIN_BLOCK_END = 'if os.getenv("VERL_USE_MODELSCOPE"'


def load_plugins_as_verl_does() -> None:
    """Execute the entry-point block of the installed ``verl/__init__.py`` as ``verl/__init__`` would."""
    text = (verl_source.SOURCE / "verl" / "__init__.py").read_text(encoding="utf-8")
    start, end = text.index(PLUGIN_BLOCK_START), text.index(PLUGIN_BLOCK_END)
    exec(
        compile(text[start:end], "verl/__init__.py (plugin block)", "exec"),
        {"os": os, "logging": logging, "__name__": "verl"},
    )


def plugin(out: Path) -> None:
    verl_source.verl_modules()
    load_plugins_as_verl_does()
    from verl.utils.tracking import Tracking

    tracking = Tracking("proj", "exp", default_backend=["console", "metricbus"], config={"trainer": {"x": 1}})
    tracking.log({"actor/pg_loss": 0.25, "response_length/max": 7}, step=1)
    tracking.log({"actor/pg_loss": 0.125, "response_length/max": 9}, step=2)
    tracking.finish()
    result = {
        "supported": "metricbus" in Tracking.supported_backend,
        "backends": sorted(tracking.logger),
        "run": [tracking.logger["metricbus"].bus.run.project, tracking.logger["metricbus"].bus.run.name],
    }
    out.write_text(json.dumps(result), encoding="utf-8")


def mismatch(out: Path) -> None:
    verl_source.verl_modules()
    import verl.utils

    fake = types.ModuleType("verl.utils.tracking")

    class Tracking:  # a Tracking from another verl: no supported_backend, another constructor
        def __init__(self, project_name: str, backends: Any = None) -> None:
            self.backends = backends

    fake.Tracking = Tracking  # type: ignore[attr-defined]
    sys.modules["verl.utils.tracking"] = fake
    verl.utils.tracking = fake  # type: ignore[attr-defined]
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger().addHandler(Keep(level=logging.DEBUG))
    logging.getLogger().setLevel(logging.DEBUG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_plugins_as_verl_does()  # must not raise
    result = {
        "logged": [[r.levelname, r.getMessage()] for r in records if "metricbus" in r.getMessage()],
        "warned": [str(w.message) for w in caught],
        "loaded": "metricbus.integrations.verl_plugin" in sys.modules,
    }
    out.write_text(json.dumps(result), encoding="utf-8")


def imports(out: Path) -> None:
    import metricbus
    import metricbus.integrations.verl

    frameworks = ("verl", "torch", "ray", "omegaconf")
    result = {"version": metricbus.__version__, "imported": [m for m in frameworks if m in sys.modules]}
    out.write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    {"plugin": plugin, "mismatch": mismatch, "imports": imports}[sys.argv[1]](Path(sys.argv[2]))
