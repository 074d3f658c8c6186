"""The GPU check of the scale issue: CUDA tensors, ``set_sync_debug_mode("error")`` around ``log()``, the copies
between host and device per commit, NCCL.

Needs one CUDA device and torch; nothing else beyond numpy. Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_gpu.py

Each check prints ``ok`` or ``FAIL`` with its figures; the last line is ``ALL OK`` or the failed checks. Checks:

1. ``log()`` of CUDA tensors (six dtypes, 0-d and n-d, tensor and float weights, ``nan="ignore"``, dicts, update
   boundaries) under ``debug_mode("error")``: no call raises; the commits equal the same tensors
   logged from the host (relative 1e-9: the device sums in its own order).
2. One process (``dist=None``): device-to-host and host-to-device copies per commit, read by the CUDA profiler, and
   the synchronizing calls ``set_sync_debug_mode("warn")`` reports.
3. NCCL, one rank: collectives per commit, copies per commit, the commits equal the one-process ones bit for bit,
   and the commit's time against one bare all_reduce of the same bytes (with their two copies) in the same run.
4. gloo, two ranks, each logging CUDA tensors: both ranks commit the same bits, equal (relative 1e-9) to one process
   that logged every record.
5. NCCL, two ranks on the one device: whether NCCL accepts it (it refuses duplicate devices in most versions); when
   it does, the two ranks agree bit for bit.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import struct
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from metricbus import Agg, MetricBus

K = 100  # metrics per step
STEPS = 24  # commits per run: past one refresh of the one-pass guess
UPDATES = 2  # optimizer updates per step
MICRO = 4  # micro-batches per update
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.float64)
RULES = {f"ign{i}": Agg(nan="ignore") for i in range(5)}

DEVICE = os.environ.get("BENCH_GPU_DEVICE", "cuda")  # "cpu": a dry run of checks 1 and 4 without a GPU
CUDA = DEVICE == "cuda"

failures: list[str] = []


def debug_mode(mode: str) -> None:
    """``torch.cuda.set_sync_debug_mode(mode)`` (nothing on a CPU dry run)."""
    if CUDA:
        torch.cuda.set_sync_debug_mode(mode)


def sync() -> None:
    """Wait for the device (nothing on a CPU dry run)."""
    if CUDA:
        torch.cuda.synchronize()


def check(label: str, ok: bool, detail: str = "") -> None:
    """Print one check's outcome; remember a failure."""
    print(("ok   " if ok else "FAIL ") + label + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        failures.append(label)


def batches(step: int, rank: int) -> list[list[tuple[Any, ...]]]:
    """This rank's log() calls of one step, per update and micro-batch: (name, value, weight) or (dict,)."""
    gen = torch.Generator(device=DEVICE).manual_seed(1000 * step + rank)
    out = []
    for _ in range(UPDATES * MICRO):
        calls: list[tuple[Any, ...]] = []
        for i in range(K):
            x = torch.randn(64, device=DEVICE, generator=gen) * (i + 1) + i
            dtype = DTYPES[i % len(DTYPES)]
            value = (x > i).to(dtype) if dtype is torch.bool else x.to(dtype)
            if i % 7 == 3:
                value = value[0]  # a 0-d tensor
            weight: Any = None
            if i % 5 == 1:
                weight = torch.rand(64, device=DEVICE, generator=gen) if value.dim() else 2.0
            calls.append((f"m{i}", value, weight))
        nan = torch.randn(8, device=DEVICE, generator=gen)
        nan[3] = float("nan")
        calls.extend((f"ign{i}", nan, None) for i in range(5))
        calls.append(({f"d{j}": torch.randn(16, device=DEVICE, generator=gen) for j in range(10)},))
        out.append(calls)
    return out


def log_step(bus: MetricBus, step_calls: list[list[tuple[Any, ...]]]) -> int:
    """Log one step's calls with update boundaries; the number of log() calls."""
    n = 0
    for u in range(UPDATES):
        with bus.update():
            for calls in step_calls[u * MICRO : (u + 1) * MICRO]:
                for call in calls:
                    if len(call) == 1:
                        bus.log(call[0])
                    else:
                        bus.log(call[0], call[1], weight=call[2])
                    n += 1
    return n


def to_host(step_calls: list[list[tuple[Any, ...]]]) -> list[list[tuple[Any, ...]]]:
    """The same calls with every tensor copied to the CPU."""

    def cpu(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: cpu(x) for k, x in v.items()}
        return v.cpu() if isinstance(v, torch.Tensor) else v

    return [[tuple(cpu(v) for v in call) for call in calls] for calls in step_calls]


def same(a: dict[str, float], b: dict[str, float], rel: float) -> list[str]:
    """The names whose values differ (beyond ``rel``; 0: bit for bit)."""
    bad = [n for n in a.keys() | b.keys() if n not in a or n not in b]
    for n in a.keys() & b.keys():
        x, y = float(a[n]), float(b[n])
        if rel == 0:  # the bits, NaN payloads and the sign of zero included
            if struct.pack("<d", x) != struct.pack("<d", y):
                bad.append(n)
        elif not (math.isnan(x) and math.isnan(y)) and not math.isclose(x, y, rel_tol=rel, abs_tol=1e-300):
            bad.append(n)
    return sorted(bad)


def copies(fn: Any) -> tuple[Any, int, int, int]:
    """``fn()``'s result, its device-to-host and host-to-device copies (CUDA profiler), and the synchronizing calls
    ``set_sync_debug_mode("warn")`` reports."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with profile(activities=[ProfilerActivity.CUDA] if CUDA else [ProfilerActivity.CPU]) as prof:
            debug_mode("warn")
            try:
                result = fn()
            finally:
                debug_mode("default")
            sync()
    names = [e.name for e in prof.events()]
    d2h = sum(n.startswith("Memcpy DtoH") for n in names)
    h2d = sum(n.startswith("Memcpy HtoD") for n in names)
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    return result, d2h, h2d, syncs


def port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_process(steps: list[Any]) -> list[dict[str, float]]:
    """Check 1 and 2: the commits of a dist=None bus fed the CUDA tensors under sync debug 'error'."""
    bus = MetricBus(dist=None, rules=RULES)
    host = MetricBus(dist=None, rules=RULES)
    results, errors, calls = [], [], 0
    per_commit, times = [], []
    for step, step_calls in enumerate(steps):
        sync()
        debug_mode("error")
        try:
            calls += log_step(bus, step_calls)
        except RuntimeError as exc:
            errors.append(f"step {step}: {exc}")
        finally:
            debug_mode("default")
        if step % 2:  # profile every other commit; time the rest
            got, d2h, h2d, syncs = copies(lambda s=step: bus.commit(step=s))
            per_commit.append((d2h, h2d, syncs))
        else:
            sync()
            t0 = time.perf_counter()
            got = bus.commit(step=step)
            times.append(time.perf_counter() - t0)
        results.append(got)
        log_step(host, to_host(step_calls))
        want = host.commit(step=step)
        bad = same(got, want, 1e-9)
        if bad:
            errors.append(f"step {step}: {bad[:5]} differ from the host-logged tensors")
    bus.close()
    host.close()
    check(
        "1. log() of CUDA tensors under set_sync_debug_mode('error')",
        not errors,
        f"{calls} log() calls over {len(steps)} steps ({K + 15} metrics, {UPDATES} updates x {MICRO} micro-batches), "
        f"{len(errors)} errors; values equal the host-logged tensors (rel 1e-9)"
        + (f"; {errors[:3]}" if errors else ""),
    )
    d2h = sorted({c[0] for c in per_commit})
    h2d = sorted({c[1] for c in per_commit})
    check(
        "2. one process: one device-to-host copy per commit",
        d2h == [1] or not CUDA,
        f"device-to-host copies per commit {d2h}, host-to-device {h2d}, synchronizing calls "
        f"{sorted({c[2] for c in per_commit})} (over {len(per_commit)} commits)",
    )
    print(f"     one process, K={K + 15}: commit median {statistics.median(times[1:]) * 1e3:.3f} ms", flush=True)
    return results


def counted_collectives() -> dict[str, int]:
    """Wrap torch.distributed's collectives to count their calls (metricbus looks them up at call time)."""
    calls: dict[str, int] = {}
    for n in ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "broadcast", "barrier"):
        real = getattr(tdist, n, None)
        if real is None:
            continue

        def wrap(*a: Any, _n: str = n, _fn: Any = real, **k: Any) -> Any:
            calls[_n] = calls.get(_n, 0) + 1
            return _fn(*a, **k)

        setattr(tdist, n, wrap)
    return calls


def nccl_one_rank(steps: list[Any], reference: list[dict[str, float]]) -> None:
    """Check 3."""
    torch.cuda.set_device(0)
    tdist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port()}", rank=0, world_size=1)
    calls = counted_collectives()
    try:
        bus = MetricBus(dist="torch", rules=RULES)
        pattern, per_commit, times, errors, bad = [], [], [], [], []
        sizes: list[int] = []
        real_all_reduce = tdist.all_reduce

        def sized(tensor: Any, *a: Any, **k: Any) -> Any:
            sizes.append(tensor.numel() * tensor.element_size())
            return real_all_reduce(tensor, *a, **k)

        tdist.all_reduce = sized
        for step, step_calls in enumerate(steps):
            sync()
            debug_mode("error")
            try:
                log_step(bus, step_calls)
            except RuntimeError as exc:
                errors.append(f"step {step}: {exc}")
            finally:
                debug_mode("default")
            calls.clear()
            sizes.clear()
            if step % 2:  # profile every other commit; time the rest
                got, d2h, h2d, syncs = copies(lambda s=step: bus.commit(step=s))
                per_commit.append((d2h, h2d, syncs, dict(calls)))
            else:
                sync()
                t0 = time.perf_counter()
                got = bus.commit(step=step)
                times.append((time.perf_counter() - t0, sum(sizes)))
            pattern.append(calls.get("all_reduce", 0))
            if same(got, reference[step], 0):
                bad.append(step)
        bus.close()
        tdist.all_reduce = real_all_reduce
        check("3a. NCCL 1 rank: log() under sync debug 'error'", not errors, "; ".join(errors[:3]))
        check(
            "3b. NCCL 1 rank: the commits equal the one-process commits bit for bit",
            not bad,
            f"{len(steps)} commits" + (f"; differing at steps {bad}" if bad else ""),
        )
        steady = pattern[2:]
        check(
            "3c. NCCL 1 rank: one all_reduce per steady commit",
            steady.count(1) >= len(steady) - 2,
            f"all_reduce calls per commit {pattern}",
        )
        syncs = sorted({c[2] for c in per_commit[1:]})
        check(
            "3d. NCCL 1 rank: copies per steady commit",
            all(c[0] <= 1 + c[3].get("all_reduce", 0) for c in per_commit[1:]),
            "device-to-host, host-to-device, synchronizing calls, collectives: "
            + ", ".join(f"({c[0]}, {c[1]}, {c[2]}, {c[3]})" for c in per_commit[1:])
            + f" (sync counts seen {syncs})",
        )
        # one bare all_reduce of the steady commit's bytes, with the copies metricbus makes around it
        nbytes = statistics.median(b for _, b in times[2:])
        host = torch.zeros(int(nbytes) // 8, dtype=torch.int64)
        bare = []
        for _ in range(len(times)):
            sync()
            t0 = time.perf_counter()
            dev = host.to("cuda")
            real_all_reduce(dev)
            dev.cpu()
            bare.append(time.perf_counter() - t0)
        ours = statistics.median(t for t, _ in times[2:])
        base = statistics.median(bare[2:])
        print(
            f"     NCCL 1 rank, K={K + 15}: commit median {ours * 1e3:.3f} ms, one bare all_reduce of the same "
            f"{int(nbytes)} bytes with its two copies {base * 1e3:.3f} ms: {ours / base:.2f}x",
            flush=True,
        )
    finally:
        tdist.destroy_process_group()


def rank_worker(rank: int, size: int, backend: str, addr: str, out: Any) -> None:
    """Checks 4 and 5: one rank logging CUDA tensors under sync debug 'error'; its commits to ``out``."""
    try:
        if CUDA:
            torch.cuda.set_device(0)
        tdist.init_process_group(backend, init_method=addr, rank=rank, world_size=size)
        bus = MetricBus(dist="torch", rules=RULES)
        got, errors = [], []
        for step in range(6):
            calls = batches(step, rank)
            sync()
            debug_mode("error")
            try:
                log_step(bus, calls)
            except RuntimeError as exc:
                errors.append(str(exc))
            finally:
                debug_mode("default")
            got.append(bus.commit(step=step))
        bus.close()
        out.put((rank, "ok", (got, errors)))
    except BaseException as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}"))
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


def ranks(backend: str, size: int, timeout: float) -> dict[int, Any]:
    """Run ``size`` rank_worker processes on ``backend``; their outcomes by rank (a missing rank: timed out)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"tcp://127.0.0.1:{port()}"
    procs = [ctx.Process(target=rank_worker, args=(r, size, backend, addr, out)) for r in range(size)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(got) < size and time.monotonic() < deadline:
        try:
            rank, status, value = out.get(timeout=1.0)
            got[rank] = (status, value)
        except Exception:
            if not any(p.is_alive() for p in procs) and out.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    return got


def reference_of_ranks(size: int) -> list[dict[str, float]]:
    """One process logging every rank's records (rank after rank, per update) of 6 steps."""
    bus = MetricBus(dist=None, rules=RULES)
    want = []
    for step in range(6):
        per_rank = [batches(step, r) for r in range(size)]
        for u in range(UPDATES):
            with bus.update():
                for r in range(size):
                    for calls in per_rank[r][u * MICRO : (u + 1) * MICRO]:
                        for call in calls:
                            if len(call) == 1:
                                bus.log(call[0])
                            else:
                                bus.log(call[0], call[1], weight=call[2])
        want.append(bus.commit(step=step))
    bus.close()
    return want


def two_ranks(backend: str, label: str, timeout: float, *, optional: bool) -> None:
    """Checks 4 and 5."""
    got = ranks(backend, 2, timeout)
    statuses = {r: got.get(r, ("timeout", None))[0] for r in range(2)}
    if any(s != "ok" for s in statuses.values()):
        detail = "; ".join(f"rank {r}: {got.get(r, ('timeout', f'no answer in {timeout:.0f} s'))[1]}" for r in range(2))
        if optional:
            print(f"     {label}: not run ({detail[:400]})", flush=True)
        else:
            check(label, False, detail[:800])
        return
    (a, errs_a), (b, errs_b) = got[0][1], got[1][1]
    differ = [s for s in range(len(a)) if same(a[s], b[s], 0)]
    want = reference_of_ranks(2)
    off = [s for s in range(len(a)) if same(a[s], want[s], 1e-9)]
    check(
        label,
        not errs_a and not errs_b and not differ and not off,
        f"{len(a)} commits; sync-debug errors {len(errs_a) + len(errs_b)}; ranks differ at {differ}; "
        f"against one process logging every record (rel 1e-9) off at {off}",
    )


def main() -> int:
    if CUDA:
        print(
            f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, NCCL {torch.cuda.nccl.version()}", flush=True
        )
    steps = [batches(step, 0) for step in range(STEPS)]
    gloo = "4. gloo 2 ranks logging CUDA tensors: equal bits on both ranks"
    sections = (
        (lambda: nccl_one_rank(steps, one_process(steps))) if CUDA else (lambda: one_process(steps)),
        lambda: two_ranks("gloo", gloo, 240, optional=False),
        *(
            (lambda: two_ranks("nccl", "5. NCCL 2 ranks on one device: equal bits on both ranks", 90, optional=True),)
            if CUDA
            else ()
        ),
    )
    for section in sections:
        try:
            section()
        except Exception:
            traceback.print_exc()
            failures.append(repr(section))
    print("ALL OK" if not failures else f"FAILED: {failures}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main())
