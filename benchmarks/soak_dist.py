"""Soak: distributed runs end cleanly, every time. A benchmark script (it takes minutes), not a test.

Run: .venv/bin/python benchmarks/soak_dist.py [--runs 50] [--loop-runs 50]

1. ``examples/ppo_grad_accum.py --compare --layouts 1x1,2x2,2x4 --steps 20`` ``--runs`` times, each in a fresh
   folder with its own HOME (as a new user runs it);
2. a 4-rank commit/close loop: ``tests/exit_workers.py`` on 4 gloo ranks ``--loop-runs`` times, cycling through the
   ways a trainer ends (close then destroy, destroy without close, destroy then close, neither).

Prints failures out of runs for each, with the first lines of every failure (exit codes, ``terminate called``,
the last lines of stderr). Exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ppo_grad_accum.py"
WORKER = ROOT / "tests" / "exit_workers.py"
LOOP_ORDERS = ("close-destroy", "destroy", "destroy-close", "neither")
LOOP_RANKS = 4
TIMEOUT_S = 600


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), WANDB_DIR=str(home), WANDB_MODE="offline",
               WANDB_SILENT="true", MLFLOW_DISABLE_TELEMETRY="true", DO_NOT_TRACK="true")
    env.pop("METRICBUS_CONFIG", None)
    env.pop("METRICBUS_ADAPTERS", None)
    return env


def _first_lines(text: str, *, lines: int = 6) -> str:
    keep = [line for line in text.splitlines() if "terminate called" in line or "signal" in line.lower()]
    tail = text.splitlines()[-lines:]
    return "\n".join(f"    {line}" for line in [*keep[:3], *tail])


def example_run(folder: Path, *, steps: int, layouts: str) -> str | None:
    """One ``--compare`` run; None when it exited 0, else what went wrong."""
    home = folder / "home"
    (home / ".config").mkdir(parents=True)
    args = [sys.executable, str(EXAMPLE), "--compare", "--layouts", layouts, "--steps", str(steps),
            "--out", str(folder / "run")]
    try:
        done = subprocess.run(args, cwd=folder, env=_env(home), capture_output=True, text=True,
                              timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"  timed out after {TIMEOUT_S} s"
    if done.returncode == 0 and "terminate called" not in done.stderr:
        return None
    return f"  exit {done.returncode}\n{_first_lines(done.stderr)}"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def loop_run(folder: Path, *, order: str) -> str | None:
    """One 4-rank run of tests/exit_workers.py ending in ``order``; None when every rank exited 0 cleanly."""
    port = _port()
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), order, str(rank), str(LOOP_RANKS), str(port), str(folder)],
                         cwd=ROOT, env=_env(folder), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(LOOP_RANKS)
    ]
    problems = []
    for rank, proc in enumerate(procs):
        try:
            _, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
            problems.append(f"  rank {rank} timed out")
            continue
        if proc.returncode != 0 or "terminate called" in stderr:
            problems.append(f"  rank {rank} exit {proc.returncode}\n{_first_lines(stderr)}")
    return "\n".join(problems) or None


def _folder(tmp: str, name: str) -> Path:
    folder = Path(tmp) / name
    folder.mkdir()
    return folder


def soak(label: str, runs: int, one: Callable[[int], str | None]) -> int:
    """Run ``one(i)`` for i < runs (None: clean, else what went wrong); print failures out of runs; return them."""
    start = time.perf_counter()
    failures = [f"run {i}:\n{problem}" for i in range(runs) if (problem := one(i)) is not None]
    print(f"{label}: {len(failures)} failures in {runs} runs ({time.perf_counter() - start:.0f} s)", flush=True)
    if failures:
        print("\n".join(failures), flush=True)
    return len(failures)


def main(argv: list[str] | None = None) -> int:
    """Run both soaks and print failures out of runs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50, help="runs of the 2-rank example")
    parser.add_argument("--loop-runs", type=int, default=50, help="runs of the 4-rank commit/close loop")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layouts", default="1x1,2x2,2x4")
    args = parser.parse_args(argv)
    example = f"example --compare --layouts {args.layouts} --steps {args.steps}"
    loop = f"{LOOP_RANKS}-rank commit/close loop ({', '.join(LOOP_ORDERS)})"
    with tempfile.TemporaryDirectory(prefix="soak_dist-") as tmp:
        failed = soak(example, args.runs, lambda i: example_run(_folder(tmp, f"example-{i}"), steps=args.steps,
                                                                 layouts=args.layouts))
        failed += soak(loop, args.loop_runs, lambda i: loop_run(_folder(tmp, f"loop-{i}"),
                                                               order=LOOP_ORDERS[i % len(LOOP_ORDERS)]))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
