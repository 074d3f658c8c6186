"""The installed distribution's version, read once from its metadata (the single source is ``pyproject.toml``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("metricbus")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
