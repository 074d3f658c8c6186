"""A tiny GPT-2 Trainer for tests/test_hf.py; run under torch.distributed.run it is one DDP rank (gloo, CPU).

The trainer records the independent truth: each training micro-batch's float32 per-token losses of counted label
tokens, computed here from the logits with an explicit shift (``logits[:, :-1]`` against ``labels[:, 1:]``).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.nn import functional
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from metricbus import MetricBus
from metricbus.integrations.hf import MetricBusCallback, MetricBusTrainerMixin
from metricbus.testing import MemoryAdapter

VOCAB = 64
SEED = 1234


def tiny_model() -> Any:
    """GPT-2 from a config: nothing downloaded."""
    torch.manual_seed(SEED)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=64))


def dataset(n: int = 64) -> list[dict[str, list[int]]]:
    """Random token ids, lengths 2..40 (uneven on purpose)."""
    rng = random.Random(SEED)
    return [{"input_ids": [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 40))]} for _ in range(n)]


def collate(items: Sequence[Any]) -> dict[str, Any]:
    """Right-pad with 0; labels are the ids with -100 on padding."""
    seqs = [list(it["input_ids"]) if isinstance(it, dict) else list(it) for it in items]
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        labels[row, : len(seq)] = torch.tensor(seq)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class TruthTrainer(MetricBusTrainerMixin, Trainer):  # type: ignore[misc]
    """The mixin's Trainer, recording each training micro-batch's counted per-token losses in ``truth``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.truth: list[list[float]] = []
        self.label_counts: list[int] = []  # labels != -100 before the shift: what HF 5.23 counts for GPT-2

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        labels = inputs["labels"]
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if model.training:
            with torch.no_grad():
                logits = outputs.logits[:, :-1, :].float()
                target = labels[:, 1:]
                per_token = functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="none"
                )
                keep = target.reshape(-1) != -100
            self.truth.append([float(v) for v in per_token[keep].tolist()])
            self.label_counts.append(int((labels != -100).sum()))
        return (loss, outputs) if return_outputs else loss


def build_trainer(tmp: Path, callback: MetricBusCallback | None, *, logging_steps: int) -> TruthTrainer:
    """4 optimizer steps, 2 accumulation steps, 2 sequences per micro-batch."""
    args = TrainingArguments(
        output_dir=str(tmp / "out"), use_cpu=True, max_steps=4, gradient_accumulation_steps=2,
        per_device_train_batch_size=2, logging_steps=logging_steps, report_to="none", save_strategy="no",
        seed=SEED, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    return TruthTrainer(
        model=tiny_model(), args=args, train_dataset=dataset(), data_collator=collate,
        callbacks=[callback] if callback is not None else None,
    )  # fmt: skip


def windows(truth: list[list[float]], *, per_step: int, logging_steps: int) -> list[list[list[float]]]:
    """The micro-batches of each logging window, in order."""
    size = per_step * logging_steps
    return [truth[i : i + size] for i in range(0, len(truth), size)]


def exact_mean(micro: Sequence[Sequence[float]]) -> float:
    """fsum of every per-token loss over the number of tokens."""
    values = [v for m in micro for v in m]
    return math.fsum(values) / len(values)


def hf_expected(micro: Sequence[Sequence[float]], counts: Sequence[int]) -> float:
    """What the Trainer logs for one update: the token-loss sum over its (unshifted) label count."""
    return math.fsum(v for m in micro for v in m) / sum(counts)


Rows = dict[int, dict[str, float]]


def read_ddp(out: Path) -> tuple[Rows, dict[int, dict[int, list[list[float]]]], dict[int, float], dict[int, list[int]]]:
    """What main() wrote: rank 0's emitted rows and HF losses, each rank's micro-batches and label counts."""
    rows = {int(k): v for k, v in json.loads((out / "rows.json").read_text()).items()}
    hf = {int(k): v for k, v in json.loads((out / "hf.json").read_text()).items()}
    truth = {}
    for rank in (0, 1):
        micro = json.loads((out / f"truth{rank}.json").read_text())
        truth[rank] = {step: micro[2 * (step - 1) : 2 * step] for step in range(1, 5)}
    counts = {rank: json.loads((out / f"counts{rank}.json").read_text()) for rank in (0, 1)}
    return rows, truth, hf, counts


def main() -> None:
    """One DDP rank: train with a collective bus, write what test_hf checks."""
    out = Path(os.environ["HF_WORKERS_OUT"])
    memory = MemoryAdapter()
    rank = int(os.environ["RANK"])
    trainer = build_trainer(out / f"r{rank}", None, logging_steps=1)
    bus = MetricBus(adapters=[memory] if rank == 0 else [], strict=True, dist="auto")  # after the group exists
    callback = MetricBusCallback(bus)
    trainer.add_callback(callback)
    trainer.train()
    (out / f"truth{rank}.json").write_text(json.dumps(trainer.truth))
    (out / f"counts{rank}.json").write_text(json.dumps(trainer.label_counts))
    if rank == 0:
        rows: dict[int, dict[str, float]] = {}
        for step, metrics in memory.rows:  # the Trainer's final summary is a second commit at the last step
            rows.setdefault(step, {}).update(metrics)
        (out / "rows.json").write_text(json.dumps(rows))
        hf = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
        (out / "hf.json").write_text(json.dumps(hf))
    bus.close()  # the caller's bus: train() flushed it; closing is a collective (before destroy_process_group)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
