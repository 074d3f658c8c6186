"""PPO with K mini-batch updates per step and gradient accumulation, data-parallel over gloo, logged by metricbus.

A small float64 policy (embedding + MLP over a 32-token vocabulary) is trained with a PPO clipped loss plus a KL
loss to the initial (reference) policy on synthetic sequences of random lengths. As in verl with
``ppo_mini_batch_size < train_batch_size``, one training step runs K optimizer updates; each update's mini-batch
is split over R ranks (processes spawned here, gloo on 127.0.0.1) x M gradient-accumulation micro-batches per rank.
A layout is ``RxMxK``.

The loss is verl's ``agg_loss`` "token-mean" with global batch info: each micro-batch's loss is
``sum(token losses) / mini_batch_tokens * dp_size``, where ``mini_batch_tokens`` counts the tokens of ITS
mini-batch over all ranks. Gradients are averaged over ranks, so every update follows d(mini-batch per-token
mean)/d(params) whatever R and M. What gets *logged* is where trainers go wrong (verl PR "fix: Engine Metric
Aggregation"). With S_rmk the token-loss sum of micro-batch m of rank r in update k, N_k the tokens of update k and
L_k = sum_rm S_rmk / N_k the true per-token loss of update k, verl logs x_rmk = R * S_rmk / N_k and:

* ``actor/pg_loss``, ``actor/kl_loss`` -- ``Agg(micro="sum", update="mean", rank="mean")``: the micro sum of rank r
  in update k is R * S_rk / N_k; the mean over the R*K (rank, update) values is (1/K) sum_k L_k, the mean over
  the step's updates of each update's true per-token loss (what one GPU logs, and verl's driver means over
  mini-batches). Exact for every R, M, K, with unequal token counts.
* ``naive_mean/pg_loss`` -- "mean" of every micro-batch value (verl before its fixes): true / M;
* ``naive_sum/pg_loss`` -- sum over micro-batches and ranks (verl after its first fix): true * R;
* ``naive_step_sum/pg_loss`` -- sum over all micro-batches of the step, as ``Agg(micro="sum", rank="mean")`` does
  in a trainer that never calls ``bus.end_update()``: true * K;
* ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/entropy`` -- local token means logged with weight=n_tokens:
  the token-weighted value over the step; ``naive/pg_clipfrac`` is the unweighted mean of micro-batch means.

Which quantity is layout-invariant when K changes: a step's value is the mean over ITS updates, so a step of K=2
and a step of K=1 cover different data. Here every optimizer update's mini-batch depends only on (seed, update
number) and the behaviour policy never depends on the layout, so the sequence of updates (and the parameters) is
the same for every layout. ``--compare`` lines the layouts up on rows of U = lcm(K) updates: layout RxMxK runs
U/K times as many steps as the layout with K = U and logs with ``log_every=U/K``, so each emitted row is the
step-level merge over the same U updates -- (1/U) sum_k L_k for every layout, to ~1e-15. The naive columns show
the factors 1/M, R and K.

    python examples/ppo_grad_accum.py --compare                  # the demo (make demo)
    python examples/ppo_grad_accum.py --ranks 2 --micro 4 --updates 2   # one layout, every adapter of the config
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

for _key, _value in (
    ("MLFLOW_DISABLE_TELEMETRY", "true"),
    ("DO_NOT_TRACK", "true"),
    ("WANDB_MODE", "offline"),
    ("WANDB_SILENT", "true"),
    ("MLFLOW_LOGGING_LEVEL", "WARNING"),
):  # before any backend import
    os.environ.setdefault(_key, _value)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402
from _ppo_console import with_console_view  # noqa: E402
from _ppo_data import DTYPE, Batch, Policy, Shape, mini_batch  # noqa: E402
from _ppo_report import AGREE_REL, NAIVE, Layout, Rows, compare_table, plot, series  # noqa: E402

from metricbus import Agg, MetricBus  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "demo.yaml"
LAYOUTS = "1x1x1,2x2x2,2x4x2,4x2x2"
CLIP = 0.2
KL_COEF = 0.3  # verl's use_kl_loss / kl_loss_coef with kl_loss_type=low_var_kl: keeps the policy from collapsing
PRE_SCALED = Agg(micro="sum", update="mean", rank="mean")  # sum an update's micro-batches, mean updates and ranks
MARKER = ".ppo_grad_accum"


@dataclass(frozen=True)
class Job:
    """One training run: a layout and where its output goes."""

    layout: Layout
    steps: int
    log_every: int | None  # None: the config's
    seed: int
    lr: float
    out: str  # the layout's folder: values.json goes here
    config: dict[str, Any] | None  # a resolved config mapping (None: only the layout's own jsonl)
    console_every: int
    port: int
    shape: Shape


# -- config and the console view -----------------------------------------------------------------------------------


def _substitute(value: Any, out: str) -> Any:
    if isinstance(value, str):
        return value.replace("{out}", out)
    if isinstance(value, list):
        return [_substitute(v, out) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, out) for k, v in value.items()}
    return value


def load_config(path: Path, out: Path) -> dict[str, Any]:
    """Read the YAML/TOML/JSON config and replace ``{out}`` with the run folder."""
    from metricbus.config import read_file

    return dict(_substitute(read_file(path), str(out)))


def make_bus(job: Job, *, rank: int) -> MetricBus:
    """The rank's bus: ``dist="torch"``, adapters on rank 0 only."""
    out = Path(job.out)
    overrides: dict[str, Any] = {}
    if job.config is None:  # a compare layout other than the first: its own jsonl only
        config: dict[str, Any] = {"adapters": [f"jsonl:{out / 'metrics.jsonl'}"], "strict": True}
        overrides["adapters"] = config["adapters"]  # not replaced by $METRICBUS_ADAPTERS
    else:
        config = with_console_view(job.config, every=job.console_every) if rank == 0 else job.config
    if rank != 0:
        overrides["adapters"] = []
    if job.log_every is not None:
        overrides["log_every"] = job.log_every
    run = dict(config.get("run") or {})
    run["name"] = f"{run.get('name', 'ppo_grad_accum')}-{job.layout}"
    run["config"] = {
        **run.get("config", {}),
        **asdict(job.layout),
        "steps": job.steps,
        "seed": job.seed,
        "lr": job.lr,
        "kl_coef": KL_COEF,
        **asdict(job.shape),
    }
    overrides["run"] = run
    # commit() is a collective; adapters live on rank 0, every rank journals its own records
    return MetricBus.from_config(config, dist="torch", writer_rank=0, **overrides)


# -- one rank ------------------------------------------------------------------------------------------------------


def lr_at(update: int, *, updates: int, base: float) -> float:
    """Linear warm-up over 10% of the run's updates, then cosine decay to 10% of ``base``."""
    warm = max(1, updates // 10)
    if update < warm:
        return base * (update + 1) / warm
    progress = (update - warm) / max(1, updates - warm)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def micro_step(policy: Policy, ref: Policy, batch: Batch, *, mini_batch_tokens: int, dp_size: int) -> dict[str, float]:
    """Forward and backward of one micro-batch; returns the values verl logs for it."""
    logp_all = policy(batch.context)
    logp = logp_all.gather(1, batch.target[:, None]).squeeze(1)
    old_logp = logp.detach() + batch.old_logp_noise  # the behaviour policy that generated the rollout
    ratio = torch.exp(logp - old_logp)
    adv = batch.advantage
    token_pg = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP))
    with torch.no_grad():
        ref_logp = ref(batch.context).gather(1, batch.target[:, None]).squeeze(1)
    log_ratio = torch.clamp(ref_logp - logp, -20, 20)  # verl's kl_penalty "low_var_kl" (k3), clamped like verl's
    token_kl = torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10, 10)
    scale = dp_size / mini_batch_tokens  # verl agg_loss "token-mean" with the mini-batch's global token count
    pg_loss, kl_loss = token_pg.sum() * scale, token_kl.sum() * scale
    (pg_loss + KL_COEF * kl_loss).backward()
    with torch.no_grad():
        clipped = (-adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP) > -adv * ratio).to(DTYPE)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return {
            "pg_loss": float(pg_loss),
            "kl_loss": float(kl_loss),
            "pg_clipfrac": float(clipped.mean()),
            "ppo_kl": float((old_logp - logp).mean()),
            "entropy": float(entropy.mean()),
        }


def log_micro_batch(bus: MetricBus, batch: Batch, stats: dict[str, float]) -> None:
    """What the trainer logs for one micro-batch: verl's values, the spec declared where they are logged."""
    n = batch.n_tokens
    bus.log("actor/pg_loss", stats["pg_loss"], agg=PRE_SCALED)
    bus.log("actor/kl_loss", stats["kl_loss"], agg=PRE_SCALED)
    for name in ("pg_clipfrac", "ppo_kl", "entropy"):  # local token means: token-weighted
        bus.log(f"actor/{name}", stats[name], weight=n, agg="mean")
    # distributions over the whole data-parallel batch: quantiles within 1% and a histogram (TensorBoard, wandb)
    bus.log("response_length", batch.lengths.to(DTYPE), agg=["mean", "max", "min", "p50", "p90", "p99", "hist"])
    bus.log("actor/advantages", batch.advantage, agg=["mean", "p50", "p90", "p99", "hist"])
    bus.log("batch/tokens", float(n), agg="sum")
    for name, (spec, _, _) in NAIVE.items():
        bus.log(name, stats["pg_loss"], agg=spec)
    bus.log("naive/pg_clipfrac", stats["pg_clipfrac"], agg="mean")  # mean of micro-batch means


def all_reduce_mean(policy: Policy, ranks: int) -> None:
    """DDP's gradient mean, by hand: one flat all_reduce."""
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    tdist.all_reduce(flat)
    flat /= ranks
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def train_update(
    policy: Policy, ref: Policy, opt: torch.optim.Optimizer, bus: MetricBus, *, update: int, rank: int, job: Job
) -> None:
    """One optimizer update (verl: one mini-batch): M micro-batches, the gradient mean over ranks, the step."""
    layout = job.layout
    lr = lr_at(update, updates=job.steps * layout.updates, base=job.lr)
    for group in opt.param_groups:
        group["lr"] = lr
    data = mini_batch(update=update, seed=job.seed, shape=job.shape)
    opt.zero_grad(set_to_none=False)
    for m in range(layout.micro):
        batch = data.shard(rank=rank, ranks=layout.ranks, micro=m, micros=layout.micro)
        stats = micro_step(policy, ref, batch, mini_batch_tokens=data.n_tokens, dp_size=layout.ranks)
        log_micro_batch(bus, batch, stats)
    if layout.ranks > 1:
        all_reduce_mean(policy, layout.ranks)
    opt.step()
    bus.log("actor/lr", lr, agg="mean")
    bus.end_update()  # the records since the last boundary are this update's micro level


def worker(rank: int, job: Job) -> None:
    """One data-parallel rank: train ``job.steps`` steps of K updates, log everything, rank 0 saves the rows."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    updates = job.layout.updates
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job.port}", rank=rank, world_size=job.layout.ranks)
    try:
        policy, ref = Policy(job.shape, seed=job.seed), Policy(job.shape, seed=job.seed).requires_grad_(False)
        opt = torch.optim.Adam(policy.parameters(), lr=job.lr)
        bus = make_bus(job, rank=rank)
        emitted: Rows = []
        try:
            for step in range(job.steps):
                start = time.perf_counter()
                for k in range(updates):
                    train_update(policy, ref, opt, bus, update=step * updates + k, rank=rank, job=job)
                bus.log("timing/step_s", time.perf_counter() - start, agg="mean")
                out = bus.commit(step=step)
                if rank == 0 and out:
                    emitted.append((step, dict(out)))
        except BaseException:
            bus.close(status="failed")  # this rank alone, no collective: the other ranks may be anywhere
            raise
        bus.close()  # a collective, on every rank, before destroy_process_group()
        if rank == 0:
            Path(job.out).mkdir(parents=True, exist_ok=True)
            (Path(job.out) / "values.json").write_text(json.dumps({"layout": str(job.layout), "rows": emitted}))
    finally:
        tdist.destroy_process_group()


# -- driving layouts -----------------------------------------------------------------------------------------------


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_layout(job: Job) -> Rows:
    """Spawn ``job.layout.ranks`` processes, wait, and return rank 0's emitted rows."""
    tmp.spawn(worker, args=(job,), nprocs=job.layout.ranks, join=True)
    data = json.loads((Path(job.out) / "values.json").read_text())
    return [(int(step), metrics) for step, metrics in data["rows"]]


def how_to_look(out: Path, config: dict[str, Any]) -> list[str]:
    """The commands that open what the run wrote (an adapter given by its bare name: its default place)."""
    lines = [f"Run folder: {out}"]
    options = {"tensorboard": "log_dir", "mlflow": "tracking_uri", "jsonl": "path"}  # a mapping's place
    adapters = [
        a if isinstance(a, str) else f"{a.get('type', '')}:{a.get(options.get(a.get('type', '')), '')}".rstrip(":")
        for a in config.get("adapters", [])
    ]
    env = os.environ.get("METRICBUS_ADAPTERS", "").strip()
    if env:
        lines.append(f"  (adapters from $METRICBUS_ADAPTERS={env}, not the config)")
        adapters = [] if env.lower() == "none" else [a.strip() for a in env.split(",") if a.strip()]
    project = (config.get("run") or {}).get("project") or "metricbus"
    for spec in adapters:
        name, _, value = spec.partition(":")
        if name == "tensorboard":  # float64 scalar tensors: TensorBoard's default fast loader shows none of them
            lines.append(f"  tensorboard --logdir {value or f'runs/{project}'} --load_fast=false")
        elif name == "mlflow":
            uri = value or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///runs/metricbus/mlflow.db"
            lines.append(f"  mlflow ui --backend-store-uri {uri}")
        elif name == "wandb":
            lines.append(f"  wandb offline run: {out}/wandb/offline-run-*  (wandb sync <that folder> to upload)")
        elif name == "jsonl":
            lines.append(f"  jsonl: {value or f'runs/{project}/<run id>/metrics.jsonl'}")
    journal = config.get("journal")
    if journal:
        lines.append(f"  metricbus show {journal}   |   metricbus replay {journal} --to console")
    return lines


def train_layouts(layouts: list[Layout], args: argparse.Namespace, config: dict[str, Any]) -> dict[Layout, Rows]:
    """Train every layout in turn (the first with the config's adapters); with ``--compare`` each emitted row covers
    the same lcm(K) updates: ``log_every = lcm(K) / K``."""
    per_row = math.lcm(*(layout.updates for layout in layouts)) if args.compare else None
    results: dict[Layout, Rows] = {}
    for i, layout in enumerate(layouts):
        window = None if per_row is None else per_row // layout.updates
        steps = args.steps * (window or 1)
        folder = args.out / "layouts" / str(layout)
        where = "the config's adapters" if i == 0 else f"{folder / 'metrics.jsonl'}"
        print(
            f"== {layout}: R={layout.ranks} x M={layout.micro} x K={layout.updates} updates/step, {steps} steps"
            f"{f', log_every {window}' if window and window > 1 else ''} -> {where}",
            end="\n" if i == 0 else "",
            flush=True,
        )
        job = Job(
            layout=layout,
            steps=steps,
            log_every=window,
            seed=args.seed,
            lr=args.lr,
            out=str(folder),
            config=config if i == 0 else None,
            console_every=args.console_every,
            port=free_port(),
            shape=Shape(batch=args.batch, max_len=args.max_len),
        )
        t0 = time.perf_counter()
        results[layout] = run_layout(job)
        print(f"{'== ' + str(layout) + ' done in' if i == 0 else ':'} {time.perf_counter() - t0:.1f} s", flush=True)
    return results


def report_compare(results: dict[Layout, Rows], out: Path) -> bool:
    """Print the table, write the plot; True if metricbus agreed across layouts."""
    table, ok = compare_table(results)
    ref, rows = next(iter(results.items()))
    per_row = math.lcm(*(layout.updates for layout in results))
    print(
        f"\nAll layouts trained on the same {per_row * len(rows)} mini-batches; one row = {per_row} updates. "
        f"Against {ref}, over {len(rows)} rows:"
    )
    print(table)
    print(
        f"metricbus agrees with {ref} to rel {AGREE_REL:g} on all 9 metrics (losses, clipfrac, ppo_kl, entropy, "
        f"lengths, tokens): {'YES' if ok else 'NO'}"
    )
    print("naive_*: median over rows of naive / metricbus pg_loss, then the predicted factor; clipfrac: max rel dev")
    png = out / "compare.png"
    plot(results, png, updates_per_row=per_row)
    print(f"Plot: {png}   Rows: {out}/layouts/<RxMxK>/values.json")
    return ok


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, train one layout or compare several, print the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="steps (--compare: of the layouts with the largest K)")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel gloo processes (R)")
    parser.add_argument("--micro", type=int, default=2, help="gradient-accumulation micro-batches per rank (M)")
    parser.add_argument("--updates", type=int, default=2, help="optimizer updates (mini-batches) per step (K)")
    parser.add_argument("--compare", action="store_true", help="train under several layouts and compare")
    parser.add_argument("--layouts", default=LAYOUTS, help="for --compare: RxMxK,... (RxM: K from --updates)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="metricbus config (adapters)")
    parser.add_argument("--out", type=Path, default=Path("runs/ppo_grad_accum"), help="run folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=16, help="sequences per mini-batch (ppo_mini_batch_size)")
    parser.add_argument("--max-len", type=int, default=48)
    parser.add_argument("--console-every", type=int, default=25, help="console: every N-th row (1: all)")
    args = parser.parse_args(argv)
    try:
        items = args.layouts.split(",") if args.compare else [f"{args.ranks}x{args.micro}x{args.updates}"]
        layouts = [Layout.parse(item, updates=args.updates) for item in items]
    except ValueError as exc:
        parser.error(str(exc))
    for layout in layouts:
        if args.batch % (layout.ranks * layout.micro):
            parser.error(f"--batch {args.batch} does not split into layout {layout} (R*M must divide it)")

    out: Path = args.out
    if (out / MARKER).exists():  # a folder this script made before: start clean (backends append otherwise)
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by examples/ppo_grad_accum.py; rerunning into this folder replaces it\n")
    config = load_config(args.config, out)
    print(
        f"PPO + KL loss to a reference policy, float64; mini-batches of {args.batch} sequences, 4..{args.max_len} "
        "tokens each"
    )
    started = time.perf_counter()
    results = train_layouts(layouts, args, config)
    rows = results[layouts[0]]
    if not rows:
        print("nothing was emitted", file=sys.stderr)
        return 1
    ok = report_compare(results, out) if args.compare else True
    if not args.compare:
        print(f"\nLast step {rows[-1][0]}:")
        for key, value in rows[-1][1].items():
            print(f"  {key:<24} {value:.10g}")
    entropy = series(rows, "actor/entropy")
    print(
        f"Policy entropy {entropy[0]:.3f} -> {entropy[-1]:.3f} nats/token (uniform {math.log(Shape.vocab):.3f}), "
        f"KL loss to the reference {rows[-1][1]['actor/kl_loss']:.3f}. Total {time.perf_counter() - started:.1f} s."
    )
    print("\n".join(how_to_look(out, config)))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
