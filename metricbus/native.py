"""The optional compiled loops (``metricbus/_speedups.c``), or None: the numpy code does the same, bit for bit.

Built by ``pip install`` where a C compiler is present; ``METRICBUS_PURE_PYTHON=1`` (read when metricbus is first
imported) turns it off, and a build of another version (a stale one in a source tree) is not used.
"""

from __future__ import annotations

import os
from types import ModuleType

ABI = 3  # the version of _speedups.c this code calls


def _load() -> ModuleType | None:
    if os.environ.get("METRICBUS_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from metricbus import _speedups
    except ImportError:
        return None
    return _speedups if getattr(_speedups, "ABI", None) == ABI else None


speedups = _load()
