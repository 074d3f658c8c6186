"""Delivery of emitted steps to adapters (synchronous; failures isolated per adapter).

A backend's exception never reaches the training loop: it is reported through ``logging`` (adapter name, step,
exception; once per adapter per minute) and the other adapters go on. A strict bus re-raises it as
:class:`~metricbus.errors.AdapterError` at the next ``commit()`` or ``close()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from metricbus.adapter import Adapter, RunInfo, Status
from metricbus.errors import AdapterError

logger = logging.getLogger("metricbus.delivery")
REPORT_EVERY_S = 60.0


class Delivery:
    """Calls each adapter in turn and keeps its failures to itself."""

    def __init__(
        self,
        adapters: Sequence[Adapter],
        *,
        strict: bool,
        queue_size: int = 1024,
        queue_policy: str = "block",
        queue_timeout_s: float = 10.0,
        on_delivered: Callable[[int, Adapter, int], None] | None = None,
    ) -> None:
        self._on_delivered = on_delivered
        del queue_size, queue_policy, queue_timeout_s  # used by background delivery
        self._adapters = list(adapters)
        self._strict = strict
        self._errors: list[AdapterError] = []
        self._last_report: dict[str, float] = {}
        self.failures: dict[str, int] = {}

    def _fail(self, adapter: Adapter, verb: str, step: int | None, exc: BaseException) -> None:
        name = getattr(adapter, "name", type(adapter).__name__)
        self.failures[name] = self.failures.get(name, 0) + 1
        now = time.monotonic()
        if now - self._last_report.get(name, -REPORT_EVERY_S) >= REPORT_EVERY_S:
            self._last_report[name] = now
            logger.error("adapter %r failed in %s at step %s: %r", name, verb, step, exc)
        if self._strict:
            err = AdapterError(f"adapter {name!r} failed in {verb} at step {step}: {exc!r}")
            err.__cause__ = exc
            self._errors.append(err)

    def open(self, *, run: RunInfo) -> None:
        """Open every adapter."""
        for adapter in self._adapters:
            try:
                adapter.open(run=run)
            except Exception as exc:
                self._fail(adapter, "open", None, exc)
        self.check()

    def submit(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Hand one emitted step to every adapter."""
        for index, adapter in enumerate(self._adapters):
            try:
                adapter.write(step=step, metrics=metrics)
            except Exception as exc:
                self._fail(adapter, "write", step, exc)
            else:
                if self._on_delivered is not None:
                    self._on_delivered(index, adapter, step)

    def check(self) -> None:
        """Raise the first pending adapter failure (strict buses only)."""
        if self._errors:
            err = self._errors[0]
            self._errors.clear()
            raise err

    def close(self, *, status: Status, timeout_s: float) -> None:
        """Flush and close every adapter. ``timeout_s`` bounds background delivery (none here)."""
        del timeout_s
        for adapter in self._adapters:
            for verb in ("flush", "close"):
                try:
                    if verb == "flush":
                        adapter.flush()
                    else:
                        adapter.close(status=status)
                except Exception as exc:
                    self._fail(adapter, verb, None, exc)
        self.check()
