"""PPO with gradient accumulation, data-parallel over gloo processes, logged through metricbus.

A small float64 policy (embedding + MLP over a 32-token vocabulary) is trained with a PPO clipped loss on
synthetic sequences of random lengths. Each step's global batch depends only on the step's seed; it is split
over R ranks (processes spawned here, gloo on 127.0.0.1) x M gradient-accumulation micro-batches per rank.

The loss is verl's ``agg_loss`` token-mean: each micro-batch's loss is ``sum(token losses) / global_tokens *
dp_size``, gradients are averaged over ranks, so the update is d(global per-token mean)/d(params) for every
layout. What gets *logged* is where trainers go wrong (verl PR "fix: Engine Metric Aggregation"):

* ``actor/pg_loss``      -- Agg(micro="sum", rank="mean"): the true global per-token loss, for every layout;
* ``naive_mean/pg_loss`` -- the plain mean over all micro-batch values (verl before its fixes): true / M;
* ``naive_sum/pg_loss``  -- the sum over micro-batches and ranks (after the first fix): true * R;
* ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/entropy`` -- local token means logged with weight=n_tokens:
  the global token-weighted value; ``naive/pg_clipfrac`` is the unweighted mean of micro-batch means.

``--compare`` trains the same batches under several layouts and prints how each metric agrees with 1x1.

    python examples/ppo_grad_accum.py --compare              # the demo (make demo)
    python examples/ppo_grad_accum.py --ranks 2 --micro 4    # one layout, every adapter of the config
"""

from __future__ import annotations

import argparse
import importlib.util
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

for _key, _value in (("MLFLOW_DISABLE_TELEMETRY", "true"), ("DO_NOT_TRACK", "true"), ("WANDB_MODE", "offline"),
                     ("WANDB_SILENT", "true")):  # before any backend is imported, here or in the workers
    os.environ.setdefault(_key, _value)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402
import torch.multiprocessing as tmp  # noqa: E402
from _ppo_data import DTYPE, Batch, Policy, Shape, global_batch  # noqa: E402

from metricbus import Agg, MetricBus  # noqa: E402
from metricbus.adapter import Status  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_CONFIG = HERE / "demo.yaml"
LAYOUTS = ((1, 1), (2, 2), (2, 4), (4, 2))
CLIP = 0.2
PG_LOSS = Agg(micro="sum", rank="mean")
COMPARED = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "response_length/mean", "batch/tokens")
AGREE_REL = 1e-9
MARKER = ".ppo_grad_accum"


@dataclass(frozen=True)
class Job:
    """One training run: a layout and where its output goes."""

    ranks: int
    micro: int
    steps: int
    seed: int
    lr: float
    out: str  # the layout's folder: values.json goes here
    config: dict[str, Any] | None  # a resolved config mapping (None: only the layout's own jsonl)
    port: int
    shape: Shape

    @property
    def layout(self) -> str:
        """``RxM``."""
        return f"{self.ranks}x{self.micro}"


# -- config --------------------------------------------------------------------------------------------------------


def _substitute(value: Any, out: str) -> Any:
    if isinstance(value, str):
        return value.replace("{out}", out)
    if isinstance(value, list):
        return [_substitute(v, out) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, out) for k, v in value.items()}
    return value


def has_torch_dist() -> bool:
    """True if this metricbus has ``dist="torch"`` (metricbus.dist)."""
    return importlib.util.find_spec("metricbus.dist") is not None


def has_journal() -> bool:
    """True if this metricbus has the journal (metricbus.journal)."""
    return importlib.util.find_spec("metricbus.journal") is not None


def load_config(path: Path, out: Path) -> dict[str, Any]:
    """Read the YAML/TOML/JSON config and replace ``{out}`` with the run folder."""
    from metricbus.config import read_file

    data = _substitute(read_file(path), str(out))
    if data.get("journal") and not has_journal():
        data.pop("journal")
    return data


# -- one rank ------------------------------------------------------------------------------------------------------


def lr_at(step: int, *, steps: int, base: float) -> float:
    """Linear warm-up over 10% of the steps, then cosine decay to 10% of ``base``."""
    warm = max(1, steps // 10)
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def micro_step(policy: Policy, batch: Batch, *, global_tokens: int, dp_size: int) -> dict[str, float]:
    """Forward and backward of one micro-batch; returns its local statistics."""
    logp_all = policy(batch.context)
    logp = logp_all.gather(1, batch.target[:, None]).squeeze(1)
    old_logp = logp.detach() + batch.old_logp_noise  # the behaviour policy that generated the rollout
    ratio = torch.exp(logp - old_logp)
    adv = batch.advantage
    token_loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP))
    loss = token_loss.sum() / global_tokens * dp_size  # verl agg_loss "token-mean" with the global normalizer
    loss.backward()
    with torch.no_grad():
        clipped = (-adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP) > -adv * ratio).to(DTYPE)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return {
            "pg_loss": float(loss),
            "pg_clipfrac": float(clipped.mean()),
            "ppo_kl": float((old_logp - logp).mean()),
            "entropy": float(entropy.mean()),
        }


class _GatherBus:
    """Without metricbus.dist: every rank exports its partial, rank 0 ingests them in rank order and commits."""

    def __init__(self, bus: MetricBus, *, rank: int) -> None:
        self.bus = bus
        self.rank = rank

    def log(self, *args: Any, **kwargs: Any) -> None:
        self.bus.log(*args, **kwargs)

    def commit(self, step: int) -> dict[str, float]:
        parts: list[Any] = [None] * tdist.get_world_size()
        tdist.all_gather_object(parts, self.bus.export())
        if self.rank != 0:
            return {}
        self.bus.ingest(parts)
        return self.bus.commit(step=step)

    def close(self, *, status: Status = "finished") -> None:
        self.bus.close(status=status)


def make_bus(job: Job, *, rank: int) -> Any:
    """The rank's bus: dist="torch" if available (adapters on rank 0 only), else export/gather/ingest."""
    out = Path(job.out)
    overrides: dict[str, Any] = {}
    if job.config is None:  # a compare layout other than the first: its own jsonl only
        config: dict[str, Any] = {"adapters": [f"jsonl:{out / 'metrics.jsonl'}"], "strict": True}
        overrides["adapters"] = [f"jsonl:{out / 'metrics.jsonl'}"]  # not replaced by $METRICBUS_ADAPTERS
    else:
        config = dict(job.config)
    run = dict(config.get("run") or {})
    run["name"] = f"{run.get('name', 'ppo_grad_accum')}-{job.layout}"
    run["config"] = {**run.get("config", {}), "ranks": job.ranks, "micro": job.micro, "steps": job.steps,
                     "seed": job.seed, "lr": job.lr, **asdict(job.shape)}
    overrides["run"] = run
    if has_torch_dist():  # commit() is a collective; adapters live on rank 0, every rank journals its own records
        if rank != 0:
            overrides["adapters"] = []
        return MetricBus.from_config(config, dist="torch", writer_rank=0, **overrides)
    if rank != 0:
        return _GatherBus(MetricBus(dist=None), rank=rank)
    return _GatherBus(MetricBus.from_config(config, dist=None, **overrides), rank=rank)


def worker(rank: int, job: Job) -> None:
    """One data-parallel rank: train ``job.steps`` steps, log everything, rank 0 saves what was emitted."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{job.port}", rank=rank, world_size=job.ranks)
    try:
        policy = Policy(job.shape, seed=job.seed)
        opt = torch.optim.Adam(policy.parameters(), lr=job.lr)
        bus = make_bus(job, rank=rank)
        emitted: list[tuple[int, dict[str, float]]] = []
        try:
            for step in range(job.steps):
                start = time.perf_counter()
                lr = lr_at(step, steps=job.steps, base=job.lr)
                for group in opt.param_groups:
                    group["lr"] = lr
                data = global_batch(step=step, seed=job.seed, shape=job.shape)
                opt.zero_grad(set_to_none=False)
                for m in range(job.micro):
                    batch = data.shard(rank=rank, ranks=job.ranks, micro=m, micros=job.micro)
                    stats = micro_step(policy, batch, global_tokens=data.n_tokens, dp_size=job.ranks)
                    n = batch.n_tokens
                    bus.log("actor/pg_loss", stats["pg_loss"], agg=PG_LOSS)
                    bus.log("actor/pg_clipfrac", stats["pg_clipfrac"], weight=n, agg="mean")
                    bus.log("actor/ppo_kl", stats["ppo_kl"], weight=n, agg="mean")
                    bus.log("actor/entropy", stats["entropy"], weight=n, agg="mean")
                    bus.log("response_length", batch.lengths.to(DTYPE), agg=["mean", "max", "min"])
                    bus.log("batch/tokens", float(n), agg="sum")
                    bus.log("naive_mean/pg_loss", stats["pg_loss"], agg="mean")  # verl before its fixes
                    bus.log("naive_sum/pg_loss", stats["pg_loss"], agg="sum")  # verl after the first fix
                    bus.log("naive/pg_clipfrac", stats["pg_clipfrac"], agg="mean")  # mean of micro-batch means
                if job.ranks > 1:  # DDP's gradient mean, by hand: one flat all_reduce
                    grads = [p.grad for p in policy.parameters() if p.grad is not None]
                    flat = torch.cat([g.reshape(-1) for g in grads])
                    tdist.all_reduce(flat)
                    flat /= job.ranks
                    offset = 0
                    for g in grads:
                        g.copy_(flat[offset : offset + g.numel()].view_as(g))
                        offset += g.numel()
                opt.step()
                bus.log("actor/lr", lr, agg="mean")
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
            (Path(job.out) / "values.json").write_text(json.dumps({"layout": job.layout, "rows": emitted}))
    finally:
        tdist.destroy_process_group()


# -- driving layouts -----------------------------------------------------------------------------------------------


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_layout(job: Job) -> list[tuple[int, dict[str, float]]]:
    """Spawn ``job.ranks`` processes, wait, and return rank 0's emitted rows."""
    tmp.spawn(worker, args=(job,), nprocs=job.ranks, join=True)
    data = json.loads((Path(job.out) / "values.json").read_text())
    return [(int(step), metrics) for step, metrics in data["rows"]]


def _series(rows: list[tuple[int, dict[str, float]]], name: str) -> list[float]:
    return [metrics[name] for _, metrics in rows]


def _max_rel(a: list[float], b: list[float]) -> float:
    scale = max([abs(x) for x in b] + [1e-300])
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) / scale


def _factor(a: list[float], b: list[float]) -> float:
    ratios = sorted(x / y for x, y in zip(a, b, strict=True) if abs(y) > 1e-12)
    return ratios[len(ratios) // 2] if ratios else float("nan")


def compare_table(results: dict[str, list[tuple[int, dict[str, float]]]]) -> tuple[str, bool]:
    """The comparison table against the first layout, and whether metricbus agreed everywhere."""
    ref_name = next(iter(results))
    ref = results[ref_name]
    lines = []
    head = (f"{'layout':>6} | {'pg_loss last':>13} {'max rel dev':>11} | {'clipfrac last':>13} {'max rel dev':>11}"
            f" | {'naive_mean/pg_loss':>18} {'factor':>8} {'1/M':>6} | {'naive_sum/pg_loss':>17} {'factor':>7}"
            f" {'R':>3} | {'naive clipfrac':>14} {'max rel dev':>11}")
    lines += [head, "-" * len(head)]
    ok = True
    for name, rows in results.items():
        ranks, micro = (int(x) for x in name.split("x"))
        if [s for s, _ in rows] != [s for s, _ in ref]:
            raise AssertionError(f"layout {name} emitted other steps than {ref_name}")
        loss, ref_loss = _series(rows, "actor/pg_loss"), _series(ref, "actor/pg_loss")
        clip, ref_clip = _series(rows, "actor/pg_clipfrac"), _series(ref, "actor/pg_clipfrac")
        naive_mean, naive_sum = _series(rows, "naive_mean/pg_loss"), _series(rows, "naive_sum/pg_loss")
        naive_clip = _series(rows, "naive/pg_clipfrac")
        dev_loss, dev_clip = _max_rel(loss, ref_loss), _max_rel(clip, ref_clip)
        for metric in COMPARED:
            dev = _max_rel(_series(rows, metric), _series(ref, metric))
            ok = ok and dev <= AGREE_REL
        lines.append(
            f"{name:>6} | {loss[-1]:>13.9f} {dev_loss:>11.1e} | {clip[-1]:>13.9f} {dev_clip:>11.1e}"
            f" | {naive_mean[-1]:>18.9f} {_factor(naive_mean, loss):>8.4f} {1 / micro:>6.3f}"
            f" | {naive_sum[-1]:>17.9f} {_factor(naive_sum, loss):>7.3f} {ranks:>3}"
            f" | {naive_clip[-1]:>14.9f} {_max_rel(naive_clip, clip):>11.1e}"
        )
    return "\n".join(lines), ok


def plot(results: dict[str, list[tuple[int, dict[str, float]]]], path: Path) -> None:
    """Curves of pg_loss and pg_clipfrac, metricbus vs naive, per layout (PNG, matplotlib Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8), sharex=True)
    ref = next(iter(results))
    for name, rows in results.items():
        steps = [s for s, _ in rows]
        loss, clip = _series(rows, "actor/pg_loss"), _series(rows, "actor/pg_clipfrac")
        axes[0, 0].plot(steps, loss, label=name, lw=1.2)
        for metric, style in (("naive_mean/pg_loss", "-"), ("naive_sum/pg_loss", "--")):
            ratio = [n / t if abs(t) > 1e-12 else math.nan for n, t in zip(_series(rows, metric), loss, strict=True)]
            axes[0, 1].plot(steps, ratio, ls=style, lw=1.2, label=f"{name} {metric.split('/')[0]}")
        axes[1, 0].plot(steps, clip, label=name, lw=1.2)
        gap = [n - c for n, c in zip(_series(rows, "naive/pg_clipfrac"), clip, strict=True)]
        axes[1, 1].plot(steps, gap, label=f"{name}", lw=1)
    axes[0, 1].set_yscale("log", base=2)
    titles = [f"metricbus actor/pg_loss (all layouts overlap; max rel dev vs {ref} in the table)",
              "naive pg_loss / true pg_loss: mean gives 1/M, sum gives R",
              "metricbus actor/pg_clipfrac (token-weighted)",
              "naive pg_clipfrac (mean of micro-batch means) minus the token-weighted one"]
    for ax, title in zip(axes.flat, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle("Same global batches, layouts R ranks x M micro-batches")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def how_to_look(out: Path, config: dict[str, Any]) -> list[str]:
    """The commands that open what the run wrote."""
    lines = [f"Run folder: {out}"]
    adapters = [a if isinstance(a, str) else a.get("type", "") for a in config.get("adapters", [])]
    env = os.environ.get("METRICBUS_ADAPTERS", "").strip()
    if env:
        lines.append(f"  (adapters from $METRICBUS_ADAPTERS={env}, not the config)")
        adapters = [] if env.lower() == "none" else [a.strip() for a in env.split(",") if a.strip()]
    for spec in adapters:
        if spec.startswith("tensorboard"):
            lines.append(f"  tensorboard --logdir {spec.partition(':')[2] or out}")
        elif spec.startswith("mlflow"):
            lines.append(f"  mlflow ui --backend-store-uri {spec.partition(':')[2]}")
        elif spec == "wandb":
            lines.append(f"  wandb offline run: {out}/wandb/offline-run-*  (wandb sync <that folder> to upload)")
        elif spec.startswith("jsonl"):
            lines.append(f"  jsonl: {spec.partition(':')[2]}")
    journal = config.get("journal")
    if journal:
        lines.append(f"  metricbus show {journal}")
        lines.append(f"  metricbus replay {journal} --to console")
    else:
        lines.append("  (no journal: the config has none, or this metricbus lacks metricbus.journal)")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, train one layout or compare several, print the results."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel gloo processes (R)")
    parser.add_argument("--micro", type=int, default=2, help="gradient-accumulation micro-batches per rank (M)")
    parser.add_argument("--compare", action="store_true", help="train under several layouts and compare")
    parser.add_argument("--layouts", default=",".join(f"{r}x{m}" for r, m in LAYOUTS), help="for --compare")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="metricbus config (adapters)")
    parser.add_argument("--out", type=Path, default=Path("runs/ppo_grad_accum"), help="run folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch", type=int, default=16, help="sequences per global batch")
    parser.add_argument("--max-len", type=int, default=48)
    args = parser.parse_args(argv)

    out: Path = args.out
    if (out / MARKER).exists():  # a folder this script made before: start clean (backends append otherwise)
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by examples/ppo_grad_accum.py; rerunning into this folder replaces it\n")
    config = load_config(args.config, out)
    shape = Shape(batch=args.batch, max_len=args.max_len)
    if args.compare:
        layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
    else:
        layouts = [(args.ranks, args.micro)]
    for ranks, micro in layouts:
        if shape.batch % (ranks * micro):
            parser.error(f"--batch {shape.batch} does not split into layout {ranks}x{micro}")

    mode = "metricbus.dist (dist='torch')" if has_torch_dist() else "export() -> all_gather_object -> ingest()"
    print(f"PPO, {args.steps} steps, global batch {shape.batch} sequences of 1..{shape.max_len} response tokens, "
          f"float64; rank exchange: {mode}")
    results: dict[str, list[tuple[int, dict[str, float]]]] = {}
    started = time.perf_counter()
    for i, (ranks, micro) in enumerate(layouts):
        name = f"{ranks}x{micro}"
        first = i == 0
        folder = out / "layouts" / name
        where = "the config's adapters" if first else f"{folder / 'metrics.jsonl'} only"
        print(f"\n== layout {name}: {ranks} rank(s) x {micro} micro-batch(es); writing to {where}", flush=True)
        job = Job(ranks=ranks, micro=micro, steps=args.steps, seed=args.seed, lr=args.lr, out=str(folder),
                  config=config if first else None, port=free_port(), shape=shape)
        t0 = time.perf_counter()
        results[name] = run_layout(job)
        print(f"== layout {name} done in {time.perf_counter() - t0:.1f} s", flush=True)

    if not results[next(iter(results))]:
        print("nothing was emitted", file=sys.stderr)
        return 1
    ok = True
    if args.compare:
        table, ok = compare_table(results)
        ref = next(iter(results))
        print(f"\nCompared with layout {ref} over {args.steps} steps (last-step values; max rel dev over all steps):")
        print(table)
        print(f"metricbus actor/pg_loss, pg_clipfrac, ppo_kl, response_length, batch/tokens agree with {ref} to "
              f"rel {AGREE_REL:g}: {'YES' if ok else 'NO'}")
        print(f"max rel dev = max over steps |x - x_{ref}| / max over steps |x_{ref}|; factor = median of naive / "
              "metricbus pg_loss over steps.")
        print("naive_mean/pg_loss = true/M (mean over M*R pre-scaled values); naive_sum/pg_loss = true*R "
              "(each value already carries dp_size); naive/pg_clipfrac ignores token counts.")
        png = out / "compare.png"
        plot(results, png)
        print(f"Plot: {png}")
        print(f"Values per layout: {out}/layouts/<RxM>/values.json; only layout {ref} wrote to the config's "
              "adapters, the others to their own metrics.jsonl.")
    else:
        step, last = results[next(iter(results))][-1]
        print(f"\nLast step {step}:")
        for key, value in last.items():
            print(f"  {key:<24} {value:.10g}")
    print(f"\nTotal {time.perf_counter() - started:.1f} s.")
    print("\n".join(how_to_look(out, config)))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
