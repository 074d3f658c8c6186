"""A tiny token model for tests/test_lightning.py, and the DDP worker it launches (``python THIS rank port out``).

The model is float64 so that a micro-batch's mean token loss times its token count gives back its token-loss sum
to ~1e-16: the test's reference (sum of token losses / tokens over a step's micro-batches) is then comparable with
metricbus's weighted mean to 1e-12.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers.logger import Logger
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `metricbus` importable

from metricbus.integrations.lightning import MetricBusCallback, metricbus_log
from metricbus.testing import MemoryAdapter

# Lightning's advice for real runs, not about what the tests check (filterwarnings of test_lightning and
# test_review_lightning_accel_3)
QUIET = [
    "ignore:.*does not have many workers.*",
    "ignore:.*smaller than the logging interval.*",
    "ignore:.*GPU available but not used.*",
    "ignore:.*litlogger.*",
    "ignore:.*no `val_dataloader`.*",
]
VOCAB = 32
BATCH = 4
TRAINER_ARGS: dict[str, Any] = {
    "accelerator": "cpu", "max_steps": 6, "accumulate_grad_batches": 2, "log_every_n_steps": 1,
    "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
}  # fmt: skip


def sequences(count: int = 96, seed: int = 7) -> list[list[int]]:
    """``count`` token sequences of lengths 1..20 (uneven token counts per micro-batch)."""
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(count)]


def collate(batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to the longest sequence; return tokens and the padding mask."""
    width = max(len(s) for s in batch)
    tokens = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.float64)
    for i, seq in enumerate(batch):
        tokens[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1.0
    return tokens, mask


def loader() -> DataLoader[list[int]]:
    """The training data, in order (Lightning adds a DistributedSampler under DDP)."""
    return DataLoader(sequences(), batch_size=BATCH, shuffle=False, collate_fn=collate)  # type: ignore[arg-type]


class TinyLM(pl.LightningModule):
    """Embedding + linear over tokens; loss = mean token cross-entropy of the micro-batch."""

    def __init__(self, lr: float = 0.1, dim: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Embedding(VOCAB, dim), nn.Linear(dim, VOCAB)).double()
        self.records: list[tuple[int, float, float]] = []  # (global_step, sum of token losses, tokens)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Log the micro-batch's token mean: to Lightning, and to metricbus weighted by its tokens."""
        tokens, mask = batch
        logits = self.net(tokens)
        targets = (tokens * 7 + 3) % VOCAB
        token_loss = nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none") * mask
        total, n_tokens = token_loss.sum(), mask.sum()
        loss = total / n_tokens
        self.records.append((self.trainer.global_step, total.item(), n_tokens.item()))
        self.log("train_loss", loss, on_step=True, on_epoch=False, batch_size=tokens.shape[0])
        if any(isinstance(c, MetricBusCallback) for c in self.trainer.callbacks):  # type: ignore[attr-defined]
            metricbus_log(self, "train/loss", loss.detach(), weight=n_tokens)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Lightning's own validation mean (logged at the step of the training log before it)."""
        tokens, mask = batch
        token_loss = nn.functional.cross_entropy(
            self.net(tokens).transpose(1, 2), (tokens * 7 + 3) % VOCAB, reduction="none"
        )
        self.log("val_loss", (token_loss * mask).sum() / mask.sum(), batch_size=tokens.shape[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams["lr"])


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call Lightning makes: ``calls`` is ``[(step, {name: value})]``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def last_values(calls: list[tuple[int | None, dict[str, float]]], name: str) -> dict[int, float]:
    """The last value of ``name`` Lightning passed at each step (what its loggers end up showing)."""
    out: dict[int, float] = {}
    for step, metrics in calls:
        if name in metrics and step is not None:
            out[step] = metrics[name]
    return out


def ddp_worker(out: Path) -> None:
    """One DDP rank (env from the test: LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT); write what it saw as JSON."""
    from pytorch_lightning.strategies import DDPStrategy

    memory = MemoryAdapter()
    logger = MemoryLogger()
    module = TinyLM()
    trainer = pl.Trainer(
        **TRAINER_ARGS, devices=2, strategy=DDPStrategy(process_group_backend="gloo"), logger=logger,
        callbacks=[MetricBusCallback(adapters=[memory])],
    )  # fmt: skip
    trainer.fit(module, loader())
    rank = trainer.global_rank
    result = {"rank": rank, "records": module.records, "rows": memory.rows, "lightning": logger.calls}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    ddp_worker(Path(sys.argv[1]))
