"""The Weights & Biases adapter: ``wandb.init`` at open, ``run.log(metrics, step=step)`` per step.

``mode=None`` leaves the mode to wandb's own settings (``WANDB_MODE``, ``wandb offline``, ...); pass
``mode="offline"`` to never touch the network. System-stats sampling is off (``x_disable_stats=True``) so no
``wandb-symon`` process is spawned. wandb accepts any metric name; names are passed through.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from metricbus.adapter import RunInfo, Status
from metricbus.errors import AdapterNotFoundError

from ._names import NameMapper, passthrough_mapper


class WandbAdapter:
    """Logs one wandb history row per step."""

    name = "wandb"

    def __init__(
        self,
        *,
        project: str | None = None,
        mode: str | None = None,
        dir: str | os.PathLike[str] | None = None,  # named like wandb.init's own keyword
        entity: str | None = None,
    ) -> None:
        self._project = project
        self._mode = mode
        self._dir = None if dir is None else os.fspath(dir)
        self._entity = entity
        self._names: NameMapper = passthrough_mapper(backend="wandb")
        self._run: Any = None

    @property
    def project(self) -> str | None:
        """The wandb project given (None: the run's project)."""
        return self._project

    @property
    def run(self) -> Any:
        """The ``wandb.Run`` once open (its ``dir``, ``id``, ... are useful in tests)."""
        return self._run

    def open(self, *, run: RunInfo) -> None:
        """Start the wandb run with project, name, tags and config."""
        try:
            import wandb
        except ImportError as exc:
            raise AdapterNotFoundError(
                f"the wandb adapter needs wandb: pip install 'metricbus[wandb]' ({exc})"
            ) from exc
        if self._dir is not None:
            os.makedirs(self._dir, exist_ok=True)
        self._run = wandb.init(
            project=self._project or run.project,
            entity=self._entity,
            name=run.name,
            tags=list(run.tags),
            config=dict(run.config),
            mode=self._mode,  # type: ignore[arg-type]
            dir=self._dir,
            settings=wandb.Settings(x_disable_stats=True),
            reinit="create_new",
        )

    def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
        """Log one row at ``step``."""
        if self._run is None:
            raise RuntimeError("WandbAdapter.write() before open()")
        names = self._names
        self._run.log({names(key): value for key, value in metrics.items()}, step=int(step))

    def flush(self) -> None:
        """Nothing to do: wandb's service process writes the run file as rows arrive."""

    def close(self, *, status: Status) -> None:
        """Finish the run with exit code 0 (finished) or 1 (failed)."""
        if self._run is not None:
            self._run.finish(exit_code=0 if status == "finished" else 1)
            self._run = None
