"""verl plugin: adds the ``metricbus`` logger to ``verl.utils.tracking.Tracking`` when imported.

metricbus registers this module in the ``verl.plugins`` entry-point group, which ``verl/__init__.py`` loads on every
``import verl``, in every process (the Ray ``TaskRunner`` actor where ``fit()`` builds ``Tracking`` included), so
``trainer.logger='[console,metricbus]'`` works without patching the launcher. verl logs a plugin's load error at
debug level only, so this module never raises: when it cannot install the backend (another verl version, a broken
install) it says so at WARNING level, through ``logging`` and ``warnings``.
"""

from __future__ import annotations

import contextlib
import logging
import warnings


def _install() -> None:
    try:
        from metricbus.integrations.verl import install_tracking_backend

        install_tracking_backend()
    except Exception as exc:  # an import-time hook must never break `import verl`
        message = (
            f"metricbus could not add its 'metricbus' logger to verl's Tracking ({type(exc).__name__}: {exc}); "
            "trainer.logger entries naming 'metricbus' will fail verl's 'is not supported' check"
        )
        logging.getLogger(__name__).warning(message)
        with contextlib.suppress(Exception):  # `-W error` must not turn the warning into an import failure
            from metricbus.errors import MetricBusWarning

            warnings.warn(message, MetricBusWarning, stacklevel=2)


_install()
