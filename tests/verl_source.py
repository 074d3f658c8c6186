"""verl 0.9.1's own sources, as `make install` puts them (``pip install --no-deps --target .venv/verl-src``).

``import verl`` would pull in ray, tensordict and transformers (its ``__init__`` also loads every ``verl.plugins``
entry point), so :func:`verl_modules` registers an empty ``verl`` package whose ``__path__`` is the installed
source folder: ``import verl.utils.metric.utils`` then runs that file alone, with only what it imports itself.
:func:`load_file` loads one file by path under a name of its own (verl's tests, ``tracking.py`` alone).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SOURCE = Path(os.environ.get("METRICBUS_VERL_SRC", ROOT / ".venv" / "verl-src"))
VERSION = "0.9.1"


def available() -> bool:
    """True when verl's sources are installed where the tests look for them."""
    return (SOURCE / "verl" / "utils" / "tracking.py").is_file()


def verl_modules() -> Path:
    """Make ``import verl.<module>`` load verl's source files without running ``verl/__init__.py``."""
    if "verl" not in sys.modules:
        package = types.ModuleType("verl")
        package.__path__ = [str(SOURCE / "verl")]
        package.__version__ = VERSION  # type: ignore[attr-defined]
        sys.modules["verl"] = package
    return SOURCE


def load_file(relative: str, *, name: str) -> Any:
    """Load ``SOURCE/relative`` as module ``name`` (registered in ``sys.modules``)."""
    path = SOURCE / relative
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
