"""Review of today's change: regressions found between the commits made in parallel (the journal's ones are in
tests/test_journal_short.py)."""

from __future__ import annotations

import pytest

from metricbus.errors import ConfigError


def test_lightning_logger_resume_without_a_journal_fails_at_construction() -> None:
    """MetricBusLogger(resume=True) without a journal is refused when built, not at its first log mid-fit."""
    pytest.importorskip("pytorch_lightning")
    from metricbus.integrations.lightning import MetricBusLogger

    with pytest.raises(ConfigError, match="resume: needs a journal"):
        MetricBusLogger(adapters=[], resume=True)
