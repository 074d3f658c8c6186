"""Run a function on real gloo ranks (spawned processes) for the review tests: each rank's result, every exit 0."""

from __future__ import annotations

import os
import queue
import socket
from typing import Any

import pytest

TIMEOUT_S = 120  # a rank that gives no result within this is taken for a hang


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(fn: Any, size: int, *args: Any) -> dict[int, Any]:
    """Run ``fn(rank, size, *args)`` (a module-level function) on ``size`` gloo ranks; each rank's result, and every
    process's exit code 0 (gloo aborts a process on a collective of another size)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_entry, args=(fn, r, size, port, args, out)) for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(size):
            rank, value = out.get(timeout=TIMEOUT_S)
            results[rank] = value
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(size)) - set(results))} gave no result (a hang)")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * size
    return results


def _entry(  # noqa: PLR0917  (mp.Process passes arguments positionally)
    fn: Any, rank: int, size: int, port: int, args: tuple[Any, ...], out: Any
) -> None:
    import torch.distributed as tdist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        out.put((rank, fn(rank, size, *args)))
    finally:
        tdist.destroy_process_group()
