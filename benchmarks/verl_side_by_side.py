"""verl 0.9.1's own PPO loss and metric code next to metricbus, on the same synthetic data, for R x M x K layouts.

Run: .venv/bin/python benchmarks/verl_side_by_side.py     (about 3 s on 2 cores; --steps N, --seed S, --shift A)

For every layout R ranks x M gradient-accumulation micro-batches per rank x K mini-batch updates per step
(R in {1,2,4}, M in {1,2,4,8}, K in {1,2}), over 4 steps each, it prints for ``actor/pg_loss`` and
``actor/pg_clipfrac`` the truth and the relative error (value / truth - 1, the worst over the steps) of what verl's
engine path, verl's legacy path and metricbus log, and the engine path's pg_loss / truth.

Data (float64; ``examples/_ppo_data.py``, the data of ``examples/ppo_grad_accum.py``): update u's mini-batch of
32 sequences (one prompt token, 4..48 response tokens, so micro-batches hold unequal token counts) depends only on
(seed, u); log-probs come from the example's fixed ``Policy`` (no optimizer step: only the metrics are at stake),
old log-probs = log-probs + the example's per-token noise, advantages = the example's group-normalized rewards
plus 1 (``--shift``, a baseline one standard deviation below the group mean): with zero-mean advantages the true
token-mean loss is ~0.01 and a relative error of it says little (``--shift 0`` shows it).
Step s covers updates s*K .. s*K+K-1; update k's mini-batch is split over ranks and micro-batches in contiguous
equal slices of sequences (as ``MiniBatch.shard``). Loss: verl's default ``loss_agg_mode="token-mean"``,
``policy_loss.loss_mode="vanilla"`` (dual-clip PPO, clip 0.2, clip_ratio_c 3), no entropy or KL term.

Truth, computed directly from the token arrays with numpy (its own formula, not verl's code):
  * pg_loss: per update, the token mean of the PPO token losses over the update's whole mini-batch (all ranks and
    micro-batches); then the mean over the step's K updates (K=1: the global token mean of the step). This is what
    a single GPU without accumulation logs, what verl's driver reports (it means over mini-batches), and what
    metricbus's ``Agg(micro="sum", update="mean", rank="mean")`` defines.
  * pg_clipfrac: clipped tokens / tokens over the whole step (all ranks, micro-batches and updates).

verl engine path (``verl.workers.engine_workers``, the only worker implementation 0.9.1 ships). verl code that is
CALLED:
  * ``verl.workers.utils.losses.ppo_loss(config, model_output, data)`` once per micro-batch, with an
    ``ActorConfig`` (``verl.workers.config``) and the global batch info the FSDP engine puts into ``data``
    (``FSDPEngine.forward_backward_batch``: ``dp_size`` = R, ``batch_num_tokens`` = the update's response tokens
    summed over all ranks -- its all_reduce, here a sum --, ``global_batch_size`` = the mini-batch's sequences).
    Inside it verl runs ``no_padding_2_padding``, ``core_algos.get_policy_loss_fn("vanilla")`` =
    ``compute_policy_loss_vanilla`` -> ``agg_loss(..., **config.global_batch_info)`` (pg_loss pre-scaled:
    sum(token losses) / batch_num_tokens * dp_size), and wraps the values in ``verl.utils.metric.Metric``
    (pg_loss ``AggregationType.SUM``, pg_clipfrac/ppo_kl ``MEAN``).
  * ``verl.workers.engine.utils.postprocess_batch_func`` over a rank's M micro-batch outputs (``append_to_dict``
    turns them into one ``Metric`` per key with M values).
  * ``Metric.aggregate_dp`` and ``verl.utils.py_functional.append_to_dict`` per mini-batch, as
    ``TrainingWorker.train_mini_batch`` does; ``rename_dict`` and ``verl.utils.metric.reduce_metrics`` on the
    driver, as ``RayPPOTrainer._update_actor`` / ``fit`` do.
  SIMULATED (ranks run in this process, one after another):
  * the all_reduce of ``batch_num_tokens`` (a sum over the simulated ranks);
  * ``allgather_dict_into_dict`` in ``TrainingWorker._postprocess_output`` (every rank's metric dict gathered into
    {key: [rank 0's value, ..., rank R-1's]}, which is what that function returns after ``all_gather_object``);
  * the loop of ``TrainingWorker.train_mini_batch`` that applies ``Metric.aggregate_dp`` (transcribed, 5 lines);
  * the driver's collect (``concat_tensordict_with_none_bsz`` keeps the first dp rank's metrics; all ranks hold
    the same after the allgather);
  * the micro-batch TensorDict: ``_MicroBatch`` below is a dict with the two TensorDict methods ``ppo_loss`` uses
    (``select``, ``to_padded_tensor``); its tensors are already padded. ``model_output["log_probs"]`` is the
    flat (total_nnz,) tensor the model would return, log-prob of token t+1 at position t.
Column "seedPR": the engine path as the seed PR left it, before verl PR #5203 (TRANSCRIBED from the PR
discussion: ``train_mini_batch`` applied ``Metric.chain(val)`` -- all ranks' micro-batch values in one SUM Metric
-- instead of ``Metric.aggregate_dp``; the same ``append_to_dict`` and ``reduce_metrics`` follow). Its pg_loss /
truth is shown.

verl legacy path (``verl/workers/actor/dp_actor.py`` + ``fsdp_workers.py``). verl 0.9.1 no longer ships
dp_actor.py, so its metric bookkeeping is TRANSCRIBED from the last upstream version (after verl PR #4711, "RM
extra scaling in KL/PG losses"): ``metrics = {"actor/pg_loss": 0.0}`` once per ``update_policy`` call (one
PPO epoch here); per micro-batch ``metrics["actor/pg_loss"] += pg_loss * loss_scale_factor``
(``1 / gradient_accumulation`` = 1/M) and ``append_to_dict(metrics, pg_metrics)``. CALLED from verl 0.9.1:
``compute_policy_loss_vanilla`` with an ``ActorConfig`` whose ``global_batch_info`` is empty (legacy never fills
it: a micro-batch-local token mean), ``append_to_dict``, ``DataProto.concat`` (the DP_COMPUTE_PROTO collect:
per-rank metric dicts become {key: [per-rank values]}) and ``reduce_metrics``. The column "legacy/M" is the
version before PR #4711 (``micro_batch_metrics["actor/pg_loss"] = pg_loss * loss_scale_factor``, reduced by a
plain mean): the seed PR's "mean over micro-batches divided by M".

metricbus: one bus per simulated rank logs, per micro-batch, the pg_loss value verl's ``ppo_loss`` returned, with
``Agg(micro="sum", update="mean", rank="mean")``, and the micro-batch clip fraction with ``weight=n_tokens``,
``agg="mean"`` (the rules of ``examples/ppo_grad_accum.py``), ``end_update()`` after each mini-batch; the
driver bus ingests the ranks' ``export()`` and commits. The clip fraction it gets is the micro-batch's clipped
count / tokens in float64: verl's ``pg_clipfrac`` is the same ratio rounded to float32 (``torch.gt(...).float()``;
checked to agree to 1e-7), which would cap any reduction of it at ~1e-8 relative.

verl modules that import packages not installed here (nothing is installed): ``_stub_missing`` registers empty
stand-ins for ``tensordict`` (+ ``.tensorclass``), ``transformers`` (+ ``.modeling_outputs``), ``codetiming`` and
``datasets`` -- module-level imports of ``verl.utils.torch_functional``, ``tensordict_utils``,
``transferqueue_utils``, ``utils.model``, ``utils.profiler`` and ``utils.dataset`` that the functions called here
never use (``unwrap_non_tensor_data``'s ``isinstance(x, NonTensorData)`` is False on a stand-in class, so plain
values pass through). ``verl.workers.engine`` is registered as a bare package so its ``__init__`` (the FSDP and
Megatron engines: peft, megatron) does not run; ``verl/__init__.py`` is skipped by ``tests/verl_source.py``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _folder in ("tests", "examples"):  # tests/verl_source.py; examples/_ppo_data.py
    if str(ROOT / _folder) not in sys.path:
        sys.path.insert(0, str(ROOT / _folder))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _ppo_data import DTYPE, Policy, Shape, mini_batch  # noqa: E402
from verl_source import SOURCE, VERSION, available, verl_modules  # noqa: E402

from metricbus import Agg, MetricBus  # noqa: E402

RANKS = (1, 2, 4)
MICROS = (1, 2, 4, 8)
UPDATES = (1, 2)
BATCH = 32  # sequences per mini-batch: R*M divides it for every layout of the grid
CLIP = 0.2
CLIP_C = 3.0
STEPS = 4  # steps per layout
SHIFT = 1.0  # added to the example's group-normalized advantages (see the module docstring)
PRE_SCALED = Agg(micro="sum", update="mean", rank="mean")
COMMAND = ".venv/bin/python benchmarks/verl_side_by_side.py"

# Imported by verl modules at module level, never used by the functions called here (see the docstring).
STUBBED = ("tensordict", "tensordict.tensorclass", "transformers", "transformers.modeling_outputs", "codetiming",
           "datasets")


class _StandIn(types.ModuleType):
    """An empty module: any attribute is a fresh empty class (``from tensordict import TensorDict`` works)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


def _stub_missing() -> list[str]:
    """Register stand-ins for the STUBBED modules that are not installed; returns their names."""
    stubbed = []
    for name in STUBBED:
        if name in sys.modules:
            continue
        top = name.partition(".")[0]
        if not isinstance(sys.modules.get(top), _StandIn) and importlib.util.find_spec(top) is not None:
            continue  # installed: the real package (and its submodule) imports normally
        module = _StandIn(name)
        module.__path__ = []
        sys.modules[name] = module
        stubbed.append(name)
    return stubbed


@dataclass
class Verl:
    """The verl 0.9.1 functions this benchmark calls."""

    ActorConfig: Any
    ppo_loss: Any
    compute_policy_loss_vanilla: Any
    postprocess_batch_func: Any
    Metric: Any
    AggregationType: Any
    reduce_metrics: Any
    append_to_dict: Any
    rename_dict: Any
    DataProto: Any
    stubbed: list[str] = field(default_factory=list)


_VERL: Verl | None = None


def load_verl() -> Verl:
    """Import verl's sources (``tests/verl_source.py``), with stand-ins for the packages they import but do not use
    here."""
    global _VERL
    if _VERL is not None:
        return _VERL
    if not available():
        raise RuntimeError(f"verl {VERSION} sources not found under {SOURCE} (make install puts them there)")
    verl_modules()
    stubbed = _stub_missing()
    if "verl.workers.engine" not in sys.modules:  # its __init__ imports the FSDP/Megatron engines (peft, megatron)
        engine = types.ModuleType("verl.workers.engine")
        engine.__path__ = [str(SOURCE / "verl" / "workers" / "engine")]
        sys.modules["verl.workers.engine"] = engine
    core_algos = importlib.import_module("verl.trainer.ppo.core_algos")
    losses = importlib.import_module("verl.workers.utils.losses")
    engine_utils = importlib.import_module("verl.workers.engine.utils")
    metric = importlib.import_module("verl.utils.metric")
    py_functional = importlib.import_module("verl.utils.py_functional")
    protocol = importlib.import_module("verl.protocol")
    config = importlib.import_module("verl.workers.config")
    _VERL = Verl(
        ActorConfig=config.ActorConfig, ppo_loss=losses.ppo_loss,
        compute_policy_loss_vanilla=core_algos.compute_policy_loss_vanilla,
        postprocess_batch_func=engine_utils.postprocess_batch_func, Metric=metric.Metric,
        AggregationType=metric.AggregationType, reduce_metrics=metric.reduce_metrics,
        append_to_dict=py_functional.append_to_dict, rename_dict=py_functional.rename_dict,
        DataProto=protocol.DataProto, stubbed=stubbed,
    )  # fmt: skip
    return _VERL


# -- data -----------------------------------------------------------------------------------------------------------


@dataclass
class Update:
    """One mini-batch (all ranks), per sequence: response log-probs, old log-probs, advantage."""

    logp: list[torch.Tensor]  # each (length,) float64
    old: list[torch.Tensor]
    adv: list[float]

    @property
    def n_tokens(self) -> int:
        return sum(len(x) for x in self.logp)


def make_update(policy: Policy, *, update: int, seed: int, shape: Shape, shift: float) -> Update:
    """Update ``update``'s mini-batch from examples/_ppo_data.py, with the fixed policy's log-probs and the
    example's advantages plus ``shift``."""
    data = mini_batch(update=update, seed=seed, shape=shape)
    context = torch.cat([s[:-1] for s in data.sequences])
    target = torch.cat([s[1:] for s in data.sequences])
    with torch.no_grad():
        logp = policy(context).gather(1, target[:, None]).squeeze(1)
    lengths = [len(s) - 1 for s in data.sequences]
    logps = list(torch.split(logp, lengths))
    olds = [lp + noise for lp, noise in zip(logps, data.noise, strict=True)]
    return Update(logp=logps, old=olds, adv=[float(a) + shift for a in data.advantages])


def token_terms(logp: np.ndarray, old: np.ndarray, adv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dual-clip PPO token losses and clipped flags, numpy float64 (the truth's own formula)."""
    ratio = np.exp(np.clip(logp - old, -20.0, 20.0))
    loss1 = -adv * ratio
    loss2 = -adv * np.clip(ratio, 1 - CLIP, 1 + CLIP)
    clipped_loss = np.maximum(loss1, loss2)
    loss = np.where(adv < 0, np.minimum(-adv * CLIP_C, clipped_loss), clipped_loss)
    return loss, loss2 > loss1


def truth(updates: list[Update]) -> tuple[float, float]:
    """(pg_loss, pg_clipfrac) of a step computed directly from its tokens (see the module docstring)."""
    per_update, clipped, tokens = [], 0, 0
    for u in updates:
        adv = np.concatenate([np.full(len(lp), a) for lp, a in zip(u.logp, u.adv, strict=True)])
        loss, flags = token_terms(torch.cat(u.logp).numpy(), torch.cat(u.old).numpy(), adv)
        per_update.append(math.fsum(loss.tolist()) / loss.size)
        clipped += int(flags.sum())
        tokens += flags.size
    return math.fsum(per_update) / len(per_update), clipped / tokens


# -- one micro-batch, in the form verl's loss functions take ----------------------------------------------------------


class _MicroBatch(dict):  # type: ignore[type-arg]
    """A micro-batch TensorDict as ``ppo_loss`` uses it: item access, ``in``, ``get``, ``select``,
    ``to_padded_tensor`` (the tensors here are padded already)."""

    def select(self, *keys: str) -> _MicroBatch:
        return _MicroBatch({key: self[key] for key in keys})

    def to_padded_tensor(self) -> _MicroBatch:
        return self


@dataclass
class Micro:
    """A micro-batch's padded tensors, the model's flat log-prob output, and its float64 clip fraction."""

    prompts: torch.Tensor
    responses: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor  # padded (B, L)
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    flat_log_probs: torch.Tensor  # (total_nnz,): what the model returns under use_remove_padding
    n_tokens: int
    clipfrac64: float

    def engine_data(self, *, dp_size: int, batch_num_tokens: int, global_batch_size: int) -> _MicroBatch:
        return _MicroBatch(
            prompts=self.prompts, responses=self.responses, attention_mask=self.attention_mask,
            response_mask=self.response_mask, old_log_probs=self.old_log_probs, advantages=self.advantages,
            dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
        )  # fmt: skip


def make_micro(update: Update, seqs: range) -> Micro:
    """The sequences ``seqs`` of ``update`` as one micro-batch (1 prompt token each, right-padded responses)."""
    lengths = [len(update.logp[i]) for i in seqs]
    b, width = len(lengths), max(lengths)
    response_mask = torch.zeros(b, width, dtype=torch.bool)
    logp = torch.zeros(b, width, dtype=DTYPE)
    old = torch.zeros(b, width, dtype=DTYPE)
    adv = torch.zeros(b, width, dtype=DTYPE)
    flat = []
    for row, (i, n) in enumerate(zip(seqs, lengths, strict=True)):
        response_mask[row, :n] = True
        logp[row, :n], old[row, :n], adv[row, :n] = update.logp[i], update.old[i], update.adv[i]
        flat.append(torch.cat([update.logp[i], torch.zeros(1, dtype=DTYPE)]))  # prompt + n tokens: n+1 positions
    attention_mask = torch.cat([torch.ones(b, 1, dtype=torch.long), response_mask.long()], dim=1)
    _, flags = token_terms(logp.numpy(), old.numpy(), adv.numpy())
    n_tokens = int(response_mask.sum())
    return Micro(
        prompts=torch.zeros(b, 1, dtype=torch.long), responses=torch.zeros(b, width, dtype=torch.long),
        attention_mask=attention_mask, response_mask=response_mask, log_probs=logp, old_log_probs=old,
        advantages=adv, flat_log_probs=torch.cat(flat), n_tokens=n_tokens,
        clipfrac64=int((flags & response_mask.numpy()).sum()) / n_tokens,
    )  # fmt: skip


def shards(update: Update, *, ranks: int, micros: int) -> Iterator[tuple[int, int, Micro]]:
    """(rank, micro, micro-batch) in contiguous equal slices of sequences, as ``MiniBatch.shard``."""
    per = len(update.logp) // (ranks * micros)
    for r in range(ranks):
        for m in range(micros):
            lo = (r * micros + m) * per
            yield r, m, make_micro(update, range(lo, lo + per))


# -- the three reductions -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    ranks: int
    micros: int
    updates: int

    def __str__(self) -> str:
        return f"{self.ranks}x{self.micros}x{self.updates}"


@dataclass
class StepValues:
    """What each path logs for one step."""

    truth_pg: float
    truth_clip: float
    engine_pg: float
    engine_seed_pg: float
    engine_clip: float
    legacy_pg: float
    legacy_old_pg: float
    legacy_clip: float
    bus_pg: float
    bus_clip: float


def _chain(metrics: list[Any]) -> Any:
    """``Metric.chain`` of the seed PR (verl 0.9.1 no longer has it): one Metric with every list's values."""
    chained = metrics[0].init_list()
    for metric in metrics:
        chained.extend(metric)
    return chained


def actor_config(verl: Verl, layout: Layout) -> Any:
    """verl's ActorConfig with its defaults (token-mean, vanilla, clip 0.2, clip_ratio_c 3)."""
    return verl.ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=BATCH,
                            ppo_micro_batch_size_per_gpu=BATCH // (layout.ranks * layout.micros))


def run_step(verl: Verl, updates: list[Update], layout: Layout, *, step: int) -> StepValues:
    """One training step of K = len(updates) mini-batches under ``layout``, through all three paths."""
    R, M = layout.ranks, layout.micros  # noqa: N806
    engine_config, legacy_config = actor_config(verl, layout), actor_config(verl, layout)
    engine_per_update: dict[str, Any] = {}  # TrainingWorker.train_mini_batch's `metrics`
    seed_per_update: dict[str, Any] = {}  # the same in the seed PR's version (Metric.chain over ranks)
    legacy_rank: list[dict[str, Any]] = [{"actor/pg_loss": 0.0} for _ in range(R)]  # dp_actor's `metrics`
    legacy_old: list[dict[str, Any]] = [{} for _ in range(R)]  # before PR #4711
    rank_buses = [MetricBus(dist=None) for _ in range(R)]
    try:
        for update in updates:
            batch_num_tokens = update.n_tokens  # FSDPEngine: all_reduce(SUM) of loss_mask.sum() over dp ranks
            per_rank_outputs: list[list[dict[str, Any]]] = [[] for _ in range(R)]
            for r, _m, micro in shards(update, ranks=R, micros=M):
                # engine path: verl.workers.utils.losses.ppo_loss, as FSDPEngineWithLMHead.forward_step calls it
                data = micro.engine_data(dp_size=R, batch_num_tokens=batch_num_tokens,
                                         global_batch_size=len(update.logp))
                loss, metrics = verl.ppo_loss(engine_config, {"log_probs": micro.flat_log_probs}, data)
                per_rank_outputs[r].append({"loss": loss.detach().item(), "metrics": metrics})
                pg_scaled = metrics["actor/pg_loss"].values[0]
                clip32 = metrics["actor/pg_clipfrac"].values[0]
                if abs(clip32 - micro.clipfrac64) > 1e-7 * max(micro.clipfrac64, 1e-300):
                    raise AssertionError(f"verl pg_clipfrac {clip32} != clipped/tokens {micro.clipfrac64}")
                # legacy path: dp_actor.update_policy's bookkeeping around verl's own policy loss function
                pg_local, pg_metrics = verl.compute_policy_loss_vanilla(
                    old_log_prob=micro.old_log_probs, log_prob=micro.log_probs, advantages=micro.advantages,
                    response_mask=micro.response_mask, loss_agg_mode=legacy_config.loss_agg_mode,
                    config=legacy_config,
                )  # fmt: skip
                loss_scale_factor = 1 / M  # 1 / self.gradient_accumulation
                legacy_rank[r]["actor/pg_loss"] += pg_local.detach().item() * loss_scale_factor
                verl.append_to_dict(legacy_rank[r], dict(pg_metrics))
                verl.append_to_dict(legacy_old[r], {"actor/pg_loss": pg_local.detach().item() * loss_scale_factor,
                                                    **pg_metrics})
                # metricbus: the value verl's ppo_loss returned, and the token-weighted clip fraction
                rank_buses[r].log("actor/pg_loss", pg_scaled, agg=PRE_SCALED)
                rank_buses[r].log("actor/pg_clipfrac", micro.clipfrac64, weight=micro.n_tokens, agg="mean")
            for bus in rank_buses:
                bus.end_update()  # after the optimizer step of this mini-batch
            # engine path, per rank: FSDPEngine.forward_backward_batch -> postprocess_batch_func
            rank_metrics = [verl.postprocess_batch_func(output_lst=outs, indices=None,
                                                        data={"use_dynamic_bsz": False})["metrics"]
                            for outs in per_rank_outputs]
            # TrainingWorker._postprocess_output: allgather_dict_into_dict over the dp group (simulated)
            gathered: dict[str, list[Any]] = {}
            for metrics in rank_metrics:
                for key, val in metrics.items():
                    gathered.setdefault(key, []).append(val)
            # TrainingWorker.train_mini_batch, its loop over mini-batch outputs (transcribed)
            output = dict(gathered)
            for key, val in output.items():
                if isinstance(val, list):
                    output[key] = (verl.Metric.aggregate_dp(val) if isinstance(val[0], verl.Metric)
                                   else list(chain.from_iterable(val)))
            verl.append_to_dict(engine_per_update, output)
            # the seed PR's train_mini_batch (before verl PR #5203): Metric.chain(val) -- every rank's micro-batch
            # values in one Metric of the same aggregation (SUM for pg_loss) -- then the same append_to_dict
            verl.append_to_dict(seed_per_update, {key: _chain(val) for key, val in gathered.items()})
        # driver: first dp rank's metrics, rename_dict(.., "actor/"), reduce_metrics (RayPPOTrainer)
        engine = verl.reduce_metrics(verl.rename_dict(engine_per_update, "actor/"))
        engine_seed = verl.reduce_metrics(verl.rename_dict(seed_per_update, "actor/"))
        legacy = verl.reduce_metrics(verl.DataProto.concat(
            [verl.DataProto(meta_info={"metrics": m}) for m in legacy_rank]).meta_info["metrics"])
        legacy_old_red = verl.reduce_metrics(verl.DataProto.concat(
            [verl.DataProto(meta_info={"metrics": m}) for m in legacy_old]).meta_info["metrics"])
        driver = MetricBus(dist=None)
        try:
            driver.ingest([bus.export() for bus in rank_buses])
            got = driver.commit(step=step)
        finally:
            driver.close()
    finally:
        for bus in rank_buses:
            bus.close()
    pg, clip = truth(updates)
    return StepValues(
        truth_pg=pg, truth_clip=clip, engine_pg=float(engine["actor/pg_loss"]),
        engine_seed_pg=float(engine_seed["actor/pg_loss"]),
        engine_clip=float(engine["actor/pg_clipfrac"]), legacy_pg=float(legacy["actor/pg_loss"]),
        legacy_old_pg=float(legacy_old_red["actor/pg_loss"]), legacy_clip=float(legacy["actor/pg_clipfrac"]),
        bus_pg=got["actor/pg_loss"], bus_clip=got["actor/pg_clipfrac"],
    )  # fmt: skip


@dataclass
class Row:
    """One layout: its steps' values."""

    layout: Layout
    steps: list[StepValues]

    def rel(self, name: str, truth_name: str) -> float:
        """The signed relative error of largest magnitude over the steps."""
        errs: list[float] = [getattr(s, name) / getattr(s, truth_name) - 1 for s in self.steps]
        return max(errs, key=abs)

    def ratios(self, name: str, truth_name: str) -> tuple[float, float]:
        """The smallest and largest value / truth over the steps."""
        values: list[float] = [getattr(s, name) / getattr(s, truth_name) for s in self.steps]
        return min(values), max(values)


def run(layouts: list[Layout], *, steps: int = STEPS, seed: int = 0, shift: float = SHIFT) -> list[Row]:
    """Every layout over ``steps`` steps; step s of a layout with K updates covers updates s*K .. s*K+K-1."""
    verl = load_verl()
    torch.set_num_threads(1)
    shape = Shape(batch=BATCH)
    policy = Policy(shape, seed=seed)
    cache: dict[int, Update] = {}

    def update(u: int) -> Update:
        if u not in cache:
            cache[u] = make_update(policy, update=u, seed=seed, shape=shape, shift=shift)
        return cache[u]

    rows = []
    for layout in layouts:
        k = layout.updates
        values = [run_step(verl, [update(s * k + i) for i in range(k)], layout, step=s) for s in range(steps)]
        rows.append(Row(layout, values))
    return rows


def grid(ranks: tuple[int, ...] = RANKS, micros: tuple[int, ...] = MICROS, updates: tuple[int, ...] = UPDATES
         ) -> list[Layout]:
    return [Layout(r, m, k) for k in updates for r in ranks for m in micros]


# -- report ---------------------------------------------------------------------------------------------------------


def _ratio(row: Row, name: str) -> str:
    lo, hi = row.ratios(name, "truth_pg")
    return f"{lo:.6f}" if hi - lo < 5e-7 else f"{lo:.2f}..{hi:.2f}"


def table(rows: list[Row]) -> str:
    """One line per layout: truths of step 0, then ratios / relative errors (worst over the steps)."""
    pg = (f"{'truth':>9} {'engine/tr':>9} {'engine':>9} {'seedPR/tr':>9} {'legacy':>9} {'legacy/M':>9} "
          f"{'metricbus':>9}")
    clip = f"{'truth':>7} {'engine':>9} {'legacy':>9} {'metricbus':>9}"
    head = f"{'RxMxK':>6} | {pg} | {clip}"
    top = f"{'':>6} | {'actor/pg_loss':^{len(pg)}} | {'actor/pg_clipfrac':^{len(clip)}}"
    lines = [top, head, "-" * len(head)]
    for row in rows:
        s0 = row.steps[0]
        lines.append(
            f"{row.layout!s:>6} | {s0.truth_pg:>9.6f} {_ratio(row, 'engine_pg'):>9} "
            f"{row.rel('engine_pg', 'truth_pg'):>+9.1e} {_ratio(row, 'engine_seed_pg'):>9} "
            f"{row.rel('legacy_pg', 'truth_pg'):>+9.2%} {row.rel('legacy_old_pg', 'truth_pg'):>+9.2%} "
            f"{row.rel('bus_pg', 'truth_pg'):>+9.1e} | {s0.truth_clip:>7.5f} "
            f"{row.rel('engine_clip', 'truth_clip'):>+9.2%} {row.rel('legacy_clip', 'truth_clip'):>+9.2%} "
            f"{row.rel('bus_clip', 'truth_clip'):>+9.1e}"
        )
    return "\n".join(lines)


def summary(rows: list[Row]) -> dict[str, float]:
    """The numbers of the summary line: worst |relative error| over layouts and steps, engine ratio range."""

    def worst(name: str, truth_name: str) -> float:
        return max(abs(row.rel(name, truth_name)) for row in rows)

    ratios = [r for row in rows for r in row.ratios("engine_pg", "truth_pg")]
    return {
        "bus_pg": worst("bus_pg", "truth_pg"), "bus_clip": worst("bus_clip", "truth_clip"),
        "engine_ratio_min": min(ratios), "engine_ratio_max": max(ratios),
        "engine_clip": worst("engine_clip", "truth_clip"), "legacy_pg": worst("legacy_pg", "truth_pg"),
        "legacy_clip": worst("legacy_clip", "truth_clip"),
    }  # fmt: skip


LEGEND = """\
Columns: truth = computed directly from the tokens (pg_loss: per-update global token mean, averaged over the K
updates; clipfrac: clipped / tokens over the step), step 0. X/tr = X / truth (range over the steps); the others
are X / truth - 1, the worst over the steps.
  engine    verl 0.9.1: losses.ppo_loss per micro-batch -> postprocess_batch_func -> Metric.aggregate_dp ->
            append_to_dict -> reduce_metrics (ranks simulated in-process)
  seedPR    the same with the seed PR's Metric.chain over ranks (transcribed; before verl PR #5203)
  legacy    dp_actor.update_policy's metric lines, last upstream version (transcribed; not in 0.9.1), around
            0.9.1's compute_policy_loss_vanilla, append_to_dict, DataProto.concat, reduce_metrics
  legacy/M  the same before verl PR #4711: pg_loss / M per micro-batch, plain mean
  metricbus per-rank buses (pg_loss: Agg(micro="sum", update="mean", rank="mean"); clipfrac: weight=n_tokens),
            export() -> driver ingest() -> commit()"""


def main(argv: list[str] | None = None) -> int:
    """Run the grid and print the command, the table and the summary line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=STEPS, help="steps per layout (errors: the worst over them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shift", type=float, default=SHIFT, help="added to the example's advantages")
    args = parser.parse_args(argv)
    print(f"$ {' '.join([COMMAND, *(sys.argv[1:] if argv is None else argv)])}")
    started = time.perf_counter()
    verl = load_verl()
    layouts = grid()
    rows = run(layouts, steps=args.steps, seed=args.seed, shift=args.shift)
    stand_ins = f"; stand-ins for {', '.join(verl.stubbed)}" if verl.stubbed else ""
    print(f"verl {VERSION} sources: {SOURCE.relative_to(ROOT) if SOURCE.is_relative_to(ROOT) else SOURCE}"
          f"{stand_ins}")
    print(f"Data: examples/_ppo_data.py, mini-batches of {BATCH} sequences of 1 prompt + 4..48 response tokens, "
          f"float64, advantages + {args.shift:g}; {args.steps} step(s) per layout, seed {args.seed}.")
    print(LEGEND + "\n")
    print(table(rows))
    s = summary(rows)
    print(f"\nSummary: metricbus max |rel err| {max(s['bus_pg'], s['bus_clip']):.1e} (pg_loss {s['bus_pg']:.1e}, "
          f"clipfrac {s['bus_clip']:.1e}); verl engine pg_loss / truth in [{s['engine_ratio_min']:.15f}, "
          f"{s['engine_ratio_max']:.15f}]; engine clipfrac max |rel err| {s['engine_clip']:.2%}; legacy max |rel "
          f"err| pg_loss {s['legacy_pg']:.2%}, clipfrac {s['legacy_clip']:.2%}. {len(layouts)} layouts x "
          f"{args.steps} steps in {time.perf_counter() - started:.1f} s.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
