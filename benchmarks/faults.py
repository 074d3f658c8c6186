"""The fault table: every fault scenario of issue 11, run for real, and what was committed, delivered and recovered.

    .venv/bin/python benchmarks/faults.py

Each scenario runs its trainer in a child process (this file, started with ``--child``) against real jsonl files,
a real MLflow sqlite store and a real journal under a temporary directory (removed at the end), then runs the real
``python -m metricbus sync JOURNAL --config FILE``. One table is printed:

* **steps committed**: the ``commit()`` calls that returned (the child prints each step after its ``commit()``);
  a commit that raised is counted where the notes say so;
* **delivered live**: the steps in the live backend once the trainer is gone, read back (``read_jsonl``, the
  MemoryAdapter's rows, MLflow's metric history) — never assumed;
* **recovered by sync**: the steps in the backend after ``metricbus sync``. After a crash (exit, kill, a hung or
  dead adapter, MLflow) that is the *same* backend the trainer used, resumed from its cursor. Where the damage is
  in the journal after a complete live run (two writers, disk full, flipped bytes, an empty rank file, 2**63) it is
  a *fresh* jsonl, so every step shown there comes from the journal (``read_journal`` + ``emitted``).

Every count is checked against a reference run (a MemoryAdapter bus, no journal): steps in order, once each,
values bit for bit. Anything else is flagged in the notes in capitals (LOSS, DUP, VALUES, ORDER, ERROR). Every
child and wait is bounded; the whole run takes well under 3 minutes.
"""

from __future__ import annotations

import inspect
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SELF = Path(__file__).resolve()
ROOT = SELF.parent.parent
CHILD_TIMEOUT_S = 90.0
BIG_STEPS = 5000  # the journal a sync is killed in the middle of
KILL_AT_LINES = 1500  # past sync's first flush (every 1,000 steps), so the re-sync must cut what was not acknowledged
HUNG_STEPS = 400
Rows = list[tuple[int, dict[str, float]]]


# -- what every trainer logs -------------------------------------------------------------------------------------


def values(step: int) -> list[tuple[str, float]]:
    """Step ``step``'s records: "loss" twice, and "acc" from step 5 on (a new metric there: a new name table row)."""
    out = [("loss", step * 0.5), ("loss", step * 0.5 + 1.25)]
    if step >= 5:
        out.append(("acc", step / 8))
    return out


def log_step(bus: Any, step: int) -> None:
    """Log :func:`values` of ``step``."""
    for name, value in values(step):
        bus.log(name, value)


# -- the children ------------------------------------------------------------------------------------------------


def _jsonl_adapters(*paths: str) -> list[Any]:
    from metricbus.adapters.jsonl import JsonlAdapter

    return [JsonlAdapter(path=p) for p in paths if p != "-"]


def child_train(journal: str, jsonl: str, steps: str, ending: str) -> None:
    """Commit ``steps`` steps (``ending`` "forever": until killed), printing each, then end as ``ending`` says."""
    from metricbus import MetricBus

    bus = MetricBus(dist=None, journal=journal, adapters=_jsonl_adapters(jsonl))
    step = 0
    while ending == "forever" or step < int(steps):
        log_step(bus, step)
        bus.commit(step)
        print(step, flush=True)
        step += 1
    if ending == "raise":
        raise RuntimeError("the training loop failed (outside any `with`)")
    if ending == "os_exit":
        os._exit(0)
    if ending == "close":
        bus.close()
    # "end": the script just ends, no close()


def child_hold(journal: str, jsonl: str) -> None:
    """Commit 10 steps, say ``ready``, wait for a line on stdin, commit 10 more, close."""
    from metricbus import MetricBus

    bus = MetricBus(dist=None, journal=journal, adapters=_jsonl_adapters(jsonl))
    for step in range(20):
        if step == 10:
            print("ready", flush=True)
            sys.stdin.readline()
        log_step(bus, step)
        bus.commit(step)
        print(step, flush=True)
    bus.close()


def child_second(journal: str) -> None:
    """Try to open a second writer on ``journal``; print the error (JSON)."""
    from metricbus import MetricBus

    try:
        bus = MetricBus(dist=None, journal=journal, resume=True)  # resume: the journal holds the first one's run
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return
    bus.close()
    print(json.dumps({"error": None}))


def child_efbig(journal: str) -> None:
    """15 steps to a MemoryAdapter; step 5's journal write hits RLIMIT_FSIZE 20 bytes in (EFBIG, SIGXFSZ ignored)."""
    import resource

    from metricbus import MetricBus
    from metricbus.journal import rank_file
    from metricbus.testing import MemoryAdapter

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    memory = MemoryAdapter()
    bus = MetricBus(dist=None, journal=journal, adapters=[memory])
    errors: dict[int, str] = {}
    returned = []
    for step in range(15):
        if step == 5:
            resource.setrlimit(resource.RLIMIT_FSIZE, (rank_file(journal, 0).stat().st_size + 20, hard))
        log_step(bus, step)
        try:
            bus.commit(step)
            returned.append(step)
        except Exception as exc:
            errors[step] = f"{type(exc).__name__}: {exc}"
        if step == 5:
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    bus.close()
    print(json.dumps({"errors": errors, "returned": returned, "rows": memory.rows}))


def child_stuck(kind: str, journal: str, stuck: str, other: str) -> None:
    """Two jsonl adapters; the first one's write() of step 2 never returns ("hung") or raises SystemExit ("exit")."""
    from metricbus.adapters.jsonl import JsonlAdapter

    from metricbus import MetricBus

    class Stuck(JsonlAdapter):
        def write(self, *, step: int, metrics: Mapping[str, float]) -> None:
            if step == 2:
                if kind == "hung":
                    threading.Event().wait()  # never returns
                raise SystemExit(3)
            super().write(step=step, metrics=metrics)

    opts: dict[str, Any] = {"queue_size": 4, "queue_policy": "block", "queue_timeout_s": 3600.0}
    if kind == "hung":
        opts["write_timeout_s"] = 0.5
    bus = MetricBus(dist=None, journal=journal, adapters=[Stuck(path=stuck), JsonlAdapter(path=other)], **opts)
    started = time.monotonic()
    for step in range(HUNG_STEPS):
        log_step(bus, step)
        bus.commit(step)
        print(step, flush=True)
    loop_s = time.monotonic() - started
    bus.close(timeout_s=20)
    print(json.dumps({"loop_s": loop_s, "close_s": time.monotonic() - started - loop_s}), flush=True)


def child_mlflow(journal: str, uri: str) -> None:
    """10 steps to MLflow; step 3 also logs "a//b" and "a/b", which map to one MLflow key: rejected for good."""
    from metricbus.adapters.mlflow import MlflowAdapter

    from metricbus import MetricBus

    bus = MetricBus(dist=None, journal=journal, adapters=[MlflowAdapter(tracking_uri=uri, experiment="faults")])
    for step in range(10):
        bus.log("loss", float(step))
        if step == 3:
            bus.log({"a//b": 1.0, "a/b": 2.0})
        bus.commit(step)
        print(step, flush=True)
    bus.close()


def child_step63(journal: str, jsonl: str) -> None:
    """x=1 each step; before step 5, x=100 is logged and commit(step=2**63) is tried: it must keep the record."""
    from metricbus import MetricBus

    bus = MetricBus(dist=None, journal=journal, adapters=_jsonl_adapters(jsonl))
    error = None
    for step in range(10):
        if step == 5:
            bus.log("x", 100.0)
            try:
                bus.commit(step=2**63)
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        bus.log("x", 1.0)
        bus.commit(step=step)
        print(step, flush=True)
    bus.close()
    print(json.dumps({"error": error}), flush=True)


def child_slow_sync(journal: str, config: str) -> int:
    """``metricbus sync`` with each jsonl write slowed by 0.5 ms (a remote backend's latency), so it can be killed."""
    from metricbus.adapters.jsonl import JsonlAdapter

    from metricbus.cli import main

    write = JsonlAdapter.write

    def slow_write(self: JsonlAdapter, *, step: int, metrics: Mapping[str, float]) -> None:
        time.sleep(0.0005)
        write(self, step=step, metrics=metrics)

    JsonlAdapter.write = slow_write  # type: ignore[method-assign]
    return main(["sync", journal, "--config", config])


CHILDREN: dict[str, Callable[..., Any]] = {
    "train": child_train, "hold": child_hold, "second": child_second, "efbig": child_efbig,
    "stuck": child_stuck, "mlflow": child_mlflow, "step63": child_step63, "slow-sync": child_slow_sync,
}


# -- the parent's helpers ----------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table."""

    scenario: str
    committed: int | str = "-"
    live: int | str = "-"
    recovered: int | str = "-"
    notes: list[str] = field(default_factory=list)


class Lab:
    """A temporary directory, the environment children run in, and the reference rows."""

    def __init__(self, root: Path) -> None:
        self.root = root
        home = root / "home"
        (home / ".config").mkdir(parents=True)
        self.env = {
            **os.environ,
            "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
            "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONWARNINGS": "ignore",
        }
        self.reference = reference(BIG_STEPS)
        self._count = 0

    def dir(self, name: str) -> Path:
        """A fresh folder for one scenario."""
        self._count += 1
        path = self.root / f"{self._count:02d}-{name}"
        path.mkdir()
        return path

    def popen(self, *args: str, stdin: int | None = None) -> subprocess.Popen[str]:
        """Start this file as a child."""
        return subprocess.Popen([sys.executable, str(SELF), "--child", *args], stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.env, cwd=self.root)

    def run(self, *args: str) -> tuple[int, str, str]:
        """Run this file as a child to its end (bounded); ``(returncode, stdout, stderr)``."""
        return finish(self.popen(*args))

    def sync(self, journal: Path, config: Path) -> tuple[int, str, str]:
        """``python -m metricbus sync JOURNAL --config CONFIG``; ``(returncode, stdout, stderr)``."""
        proc = subprocess.Popen([sys.executable, "-m", "metricbus", "sync", str(journal), "--config", str(config)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
                                cwd=self.root)
        return finish(proc)

    def check(self, row: Row, what: str, rows: Rows, want: Iterable[int]) -> None:
        """Flag in ``row`` anything in ``rows`` (steps in a backend) other than ``want``, once each, in order, exact."""
        steps = [s for s, _ in rows]
        wanted = set(want)
        dups = sorted({s for s in steps if steps.count(s) > 1})
        if dups:
            row.notes.append(f"{what} DUP {span(dups)}")
        missing = sorted(wanted - set(steps))
        if missing:
            row.notes.append(f"{what} LOSS {span(missing)}")
        extra = sorted(set(steps) - wanted)
        if extra:
            row.notes.append(f"{what} EXTRA {span(extra)}")
        if steps != sorted(steps):
            row.notes.append(f"{what} ORDER")
        ref = self.reference
        bad = [s for s, m in rows if s in wanted and 0 <= s < len(ref) and bits(m) != bits(ref[s][1])]
        if bad:
            row.notes.append(f"{what} VALUES differ at {span(bad)}")


def finish(proc: subprocess.Popen[str], timeout_s: float = CHILD_TIMEOUT_S) -> tuple[int, str, str]:
    """Wait for ``proc`` (killed after ``timeout_s``); ``(returncode, stdout, stderr)``."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n(killed after {timeout_s:.0f} s)"
    return proc.returncode, out, err


def reference(steps: int) -> Rows:
    """What a bus without a journal delivers for :func:`values`, steps 0..steps-1."""
    from metricbus import MetricBus
    from metricbus.testing import MemoryAdapter

    memory = MemoryAdapter()
    with MetricBus(dist=None, adapters=[memory], strict=True) as bus:
        for step in range(steps):
            log_step(bus, step)
            bus.commit(step)
    return list(memory.rows)


def bits(metrics: Mapping[str, float]) -> dict[str, str]:
    """Values as hex floats (exact comparison, NaN included)."""
    return {k: float(v).hex() for k, v in metrics.items()}


def span(steps: list[int]) -> str:
    """``[3]``, ``[3..7]`` or ``[3, 9, ...] (n)``."""
    if len(steps) == 1:
        return f"[{steps[0]}]"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"[{steps[0]}..{steps[-1]}]"
    head = ", ".join(map(str, steps[:3]))
    return f"[{head}, ...] ({len(steps)})"


def jsonl_rows(path: Path) -> Rows:
    """The steps in a jsonl file (none when it does not exist)."""
    from metricbus.adapters.jsonl import read_jsonl

    return read_jsonl(path) if path.exists() else []


def journal_rows(journal: Path) -> tuple[Rows, list[str]]:
    """What replay recovers from ``journal``, and the JournalWarnings it gave."""
    from metricbus.journal import read_journal
    from metricbus.replay import emitted

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = list(emitted(read_journal(journal)))
    return rows, [str(w.message) for w in caught]


def cursor(journal: Path, adapter: Any) -> int | None:
    """The delivery cursor of ``adapter`` in ``journal``."""
    from metricbus.journal import CursorStore

    return CursorStore(journal).get(adapter)


def jsonl_cursor(journal: Path, path: Path) -> int | None:
    """The cursor of the jsonl adapter writing ``path``."""
    from metricbus.adapters.jsonl import JsonlAdapter

    return cursor(journal, JsonlAdapter(path=path))


def config(folder: Path, adapters: list[Any], name: str = "metricbus.json") -> Path:
    """A config file naming ``adapters``."""
    path = folder / name
    path.write_text(json.dumps({"adapters": adapters}))
    return path


def sent(out: str) -> str:
    """``N`` from sync's ``jsonl: sent N steps`` (the whole output when it does not look like that)."""
    parts = out.split()
    return parts[2] if len(parts) == 4 and parts[1] == "sent" else out.strip().replace("\n", " / ")


def printed_steps(out: str) -> list[int]:
    """The step numbers a child printed (one a line)."""
    return [int(line) for line in out.splitlines() if line.strip().isdigit()]


def read_line(proc: subprocess.Popen[str], timeout_s: float = CHILD_TIMEOUT_S) -> str:
    """One line of ``proc``'s stdout, read byte by byte from the pipe (nothing is left in a Python buffer, so a
    later ``communicate()`` gets the rest); "" at EOF or after ``timeout_s``."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        byte = os.read(fd, 1) if ready else b""
        if not byte:
            break
        line += byte
    return line.decode()


def short(text: str, lab: Lab, width: int = 60) -> str:
    """``text`` without the temporary directory, cut to ``width``."""
    text = text.replace(str(lab.root) + "/", "").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def sync_step(lab: Lab, row: Row, journal: Path, conf: Path) -> str:
    """Run sync, flag a failure in ``row``; returns how many steps it reported sent."""
    rc, out, err = lab.sync(journal, conf)
    if rc != 0:
        row.notes.append(f"sync ERROR rc={rc}: {short(err.strip().splitlines()[-1] if err.strip() else '', lab)}")
    return sent(out)


# -- the scenarios -----------------------------------------------------------------------------------------------


def exit_scenario(lab: Lab, title: str, ending: str, steps: int) -> Row:
    """A trainer that commits ``steps`` steps to jsonl + journal and ends as ``ending`` says; then sync."""
    row = Row(title)
    folder = lab.dir(ending)
    journal, jsonl = folder / "journal", folder / "live.jsonl"
    rc, out, err = lab.run("train", str(journal), str(jsonl), str(steps), ending)
    committed = printed_steps(out)
    row.committed = len(committed)
    live = jsonl_rows(jsonl)
    row.live = len(live)
    ack = jsonl_cursor(journal, jsonl)
    sent_n = sync_step(lab, row, journal, config(folder, [f"jsonl:{jsonl}"]))
    final = jsonl_rows(jsonl)
    row.recovered = len(final)
    want = range(steps)
    row.notes.insert(0, f"exit {rc}; cursor {ack}; sync sent {sent_n}")
    if ending == "raise" and "RuntimeError" not in err:
        row.notes.append("ERROR: no traceback")
    lab.check(row, "live", live, want if ending in {"end", "raise"} else range(len(live)))
    lab.check(row, "sync", final, want)
    return row


def sigkill_scenario(lab: Lab) -> Row:
    """A trainer committing forever, SIGKILLed once it reported 50 commits; then sync, twice."""
    row = Row("SIGKILL + sync")
    folder = lab.dir("sigkill")
    journal, jsonl = folder / "journal", folder / "live.jsonl"
    proc = lab.popen("train", str(journal), str(jsonl), "0", "forever")
    try:
        first = [read_line(proc) for _ in range(50)]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        rc, rest, _ = finish(proc)
    committed = printed_steps("".join(first) + rest)
    row.committed = len(committed)
    journaled, _ = journal_rows(journal)
    live = jsonl_rows(jsonl)
    row.live = len(live)
    ack = jsonl_cursor(journal, jsonl)
    conf = config(folder, [f"jsonl:{jsonl}"])
    sent_n = sync_step(lab, row, journal, conf)
    final = jsonl_rows(jsonl)
    again = sync_step(lab, row, journal, conf)
    row.recovered = len(final)
    flight = len(journaled) - len(committed)
    journal_note = f"journal {len(journaled)}" + (f" (+{flight} in flight at the kill)" if flight > 0 else "")
    row.notes.insert(0, f"rc {rc}; {journal_note}; cursor {ack}; sync sent {sent_n}, again {again}")
    if committed != list(range(len(committed))):
        row.notes.append("ERROR: printed steps out of order")
    if not len(committed) <= len(journaled) <= len(committed) + 1:
        row.notes.append(f"journal LOSS: {len(journaled)} journaled of {len(committed)} returned")
    lab.check(row, "live", live, range(len(live)))
    lab.check(row, "sync", final, range(max(len(journaled), len(committed))))
    if jsonl_rows(jsonl) != final or again != "0":
        row.notes.append("second sync DUP")
    return row


def sync_kill_scenario(lab: Lab) -> Row:
    """A 5,000-step journal; a (slowed) sync of it SIGKILLed after 1,500 lines; then sync again, twice."""
    row = Row("SIGKILL during sync + re-sync")
    folder = lab.dir("sync-kill")
    journal, jsonl = folder / "journal", folder / "out.jsonl"
    rc, out, err = lab.run("train", str(journal), "-", str(BIG_STEPS), "close")
    row.committed = len(printed_steps(out))
    if rc != 0:
        row.notes.append(f"trainer ERROR rc={rc}: {short(err, lab)}")
    conf = config(folder, [f"jsonl:{jsonl}"])
    proc = lab.popen("slow-sync", str(journal), str(conf))
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if jsonl.exists() and jsonl.read_bytes().count(b"\n") >= KILL_AT_LINES:
                break
            time.sleep(0.005)
        killed = proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        finish(proc)
    first = jsonl_rows(jsonl)
    row.live = len(first)
    ack = jsonl_cursor(journal, jsonl)
    sent_n = sync_step(lab, row, journal, conf)
    final = jsonl_rows(jsonl)
    again = sync_step(lab, row, journal, conf)
    row.recovered = len(final)
    row.notes.insert(0, f"live = 1st sync, killed at {len(first)}; cursor {ack}; re-sync sent {sent_n}, again {again}")
    if not killed:
        row.notes.append("ERROR: the first sync ended before it was killed")
    lab.check(row, "1st sync", first, range(len(first)))
    lab.check(row, "re-sync", final, range(BIG_STEPS))
    if jsonl_rows(jsonl) != final or again != "0":
        row.notes.append("third sync DUP")
    return row


def two_writers_scenario(lab: Lab) -> Row:
    """A trainer holds the journal (10 steps); a second process opens a bus on it; the first goes on to 20."""
    from metricbus.journal import rank_file

    row = Row("two writers, one journal")
    folder = lab.dir("two-writers")
    journal, jsonl, fresh = folder / "journal", folder / "live.jsonl", folder / "synced.jsonl"
    proc = lab.popen("hold", str(journal), str(jsonl), stdin=subprocess.PIPE)
    try:
        assert proc.stdin is not None
        head = []
        while (line := read_line(proc)) not in {"ready\n", ""}:
            head.append(line)
        _, second, second_err = lab.run("second", str(journal))
        proc.stdin.write("go\n")
        proc.stdin.flush()
    finally:
        rc, rest, err = finish(proc)
    committed = printed_steps("".join(head) + rest)
    row.committed = len(committed)
    live = jsonl_rows(jsonl)
    row.live = len(live)
    try:
        error = json.loads(second)["error"]
    except ValueError:
        error = f"no answer: {second_err.strip()[-200:]}"
    named = error is not None and str(rank_file(journal, 0)) in error and f"PID {proc.pid}" in error
    kind = (error or "no error").split(":")[0]
    row.notes.append(f"2nd: {kind}{' naming file + PID' if named else ''}; fresh sync sent "
                     + sync_step(lab, row, journal, config(folder, [f"jsonl:{fresh}"])))
    if not named:
        row.notes.append(f"ERROR: 2nd writer got {short(error or 'no error', lab)}")
    if rc != 0:
        row.notes.append(f"first writer ERROR rc={rc}: {short(err, lab)}")
    final = jsonl_rows(fresh)
    row.recovered = len(final)
    lab.check(row, "live", live, range(20))
    lab.check(row, "sync", final, range(20))
    if [(s, bits(m)) for s, m in final] != [(s, bits(m)) for s, m in live]:
        row.notes.append("sync VALUES differ from live")
    return row


def enospc_scenario(lab: Lab) -> Row:
    """RLIMIT_FSIZE makes step 5's journal write fail part-way (EFBIG); 15 steps to a MemoryAdapter."""
    row = Row("disk full (RLIMIT_FSIZE) at step 5")
    folder = lab.dir("efbig")
    journal, fresh = folder / "journal", folder / "synced.jsonl"
    rc, out, err = lab.run("efbig", str(journal))
    try:
        report = json.loads(out)
    except ValueError:
        row.notes.append(f"ERROR rc={rc}: {short(err.strip()[-300:], lab)}")
        return row
    errors = {int(k): v for k, v in report["errors"].items()}
    row.committed = len(report["returned"]) + len(errors)
    live = [(int(s), m) for s, m in report["rows"]]
    row.live = len(live)
    sent_n = sync_step(lab, row, journal, config(folder, [f"jsonl:{fresh}"]))
    final = jsonl_rows(fresh)
    row.recovered = len(final)
    ok = list(errors) == [5] and errors[5].startswith("JournalError") and "EFBIG" in errors[5]
    raised = "JournalError (EFBIG)" if ok else "ERROR"
    row.notes.append(f"step 5 raised {raised}, journal gap; fresh sync sent {sent_n}")
    if not ok:
        row.notes.append(f"ERROR: commit errors {short(json.dumps(errors), lab)}")
    lab.check(row, "live", live, range(15))
    lab.check(row, "sync", final, [s for s in range(15) if s != 5])
    return row


def frames(data: bytes) -> list[tuple[int, bytes, int]]:
    """``(offset, kind, size)`` of each frame of an undamaged journal file (magic, then ``<I len><I crc>`` payload)."""
    from metricbus.journal import MAGIC

    out, pos = [], len(MAGIC)
    while pos + 8 <= len(data):
        length, _ = struct.unpack_from("<II", data, pos)
        out.append((pos, data[pos + 8 : pos + 9], 8 + length))
        pos += 8 + length
    return out


def damage_scenario(lab: Lab, title: str, damage: str, steps: int) -> Row:
    """A complete run (jsonl + journal), then the journal damaged as ``damage`` says; sync to a fresh jsonl."""
    from metricbus.journal import rank_file

    row = Row(title)
    folder = lab.dir(damage)
    journal, jsonl, fresh = folder / "journal", folder / "live.jsonl", folder / "synced.jsonl"
    rc, out, err = lab.run("train", str(journal), str(jsonl), str(steps), "close")
    row.committed = len(printed_steps(out))
    if rc != 0:
        row.notes.append(f"trainer ERROR rc={rc}: {short(err, lab)}")
    live = jsonl_rows(jsonl)
    row.live = len(live)
    path = rank_file(journal, 0)
    data = bytearray(path.read_bytes())
    if damage == "empty-rank":
        rank_file(journal, 1).write_bytes(b"")
    else:
        kind = b"H" if damage == "header" else b"N"
        pos, _, size = next(f for f in frames(bytes(data)) if f[1] == kind)
        data[pos + size // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    recovered, caught = journal_rows(journal)
    sent_n = sync_step(lab, row, journal, config(folder, [f"jsonl:{fresh}"]))
    final = jsonl_rows(fresh)
    row.recovered = len(final)
    count = sum(len(m) for _, m in final)
    want_values = sum(len(m) for _, m in lab.reference[:steps])
    note = f"values {count}/{want_values}; {len(caught)} warning(s); fresh sync sent {sent_n}"
    if damage == "empty-rank":
        done = subprocess.run([sys.executable, "-m", "metricbus", "inspect", str(journal)], capture_output=True,
                              text=True, env=lab.env, timeout=CHILD_TIMEOUT_S, check=False)
        note += f"; inspect rc {done.returncode}"
    row.notes.append(note)
    if len(recovered) != len(final):
        row.notes.append(f"ERROR: replay has {len(recovered)} steps, sync sent {len(final)}")
    lab.check(row, "live", live, range(steps))
    lab.check(row, "sync", final, range(steps))
    return row


def stuck_scenario(lab: Lab, kind: str) -> Row:
    """One of two jsonl adapters hangs in write() (or its thread dies of SystemExit) at step 2; 400 commits."""
    title = "hung adapter (write never returns)" if kind == "hung" else "adapter thread dies of SystemExit"
    row = Row(title)
    if kind == "hung":
        from metricbus import MetricBus

        if "write_timeout_s" not in inspect.signature(MetricBus).parameters:
            row.committed = row.live = row.recovered = "n/a"
            row.notes.append("n/a (write_timeout_s not available)")
            return row
    folder = lab.dir(kind)
    journal, stuck, other = folder / "journal", folder / "stuck.jsonl", folder / "other.jsonl"
    rc, out, err = lab.run("stuck", kind, str(journal), str(stuck), str(other))
    row.committed = len(printed_steps(out))
    live = jsonl_rows(stuck)
    row.live = len(live)
    others = jsonl_rows(other)
    ack = jsonl_cursor(journal, stuck)
    sent_n = sync_step(lab, row, journal, config(folder, [f"jsonl:{stuck}"]))
    final = jsonl_rows(stuck)
    row.recovered = len(final)
    timing = ""
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if last.startswith("{"):
        times = json.loads(last)
        timing = f"; loop {times['loop_s']:.1f} s, close {times['close_s']:.1f} s"
    else:
        row.notes.append(f"ERROR rc={rc}: {short(err.strip()[-300:], lab)}")
    row.notes.insert(0, f"other adapter {len(others)} live{timing}; cursor {ack}; sync sent {sent_n}")
    lab.check(row, "live", live, range(2))
    lab.check(row, "other", others, range(HUNG_STEPS))
    lab.check(row, "sync", final, range(HUNG_STEPS))
    return row


def mlflow_history(uri: str) -> list[tuple[str, str, list[int]]]:
    """``(run id, status, steps of "loss")`` of each run in the "faults" experiment."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("faults")
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id])
    return [(r.info.run_id, r.info.status, sorted(m.step for m in client.get_metric_history(r.info.run_id, "loss")))
            for r in runs]


def mlflow_scenario(lab: Lab) -> Row:
    """MLflow (sqlite) rejects step 3 of 10 ("a//b" and "a/b" map to one key); then sync to the same store."""
    row = Row("MLflow rejects step 3 for good")
    folder = lab.dir("mlflow")
    journal = folder / "journal"
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    rc, out, err = lab.run("mlflow", str(journal), uri)
    row.committed = len(printed_steps(out))
    if rc != 0:
        row.notes.append(f"trainer ERROR rc={rc}: {short(err.strip()[-300:], lab)}")
    old_env = {k: os.environ.get(k) for k in ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK")}
    os.environ.update({"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"})
    try:
        from metricbus.adapters.mlflow import MlflowAdapter

        from metricbus.journal import CursorStore

        before = mlflow_history(uri)
        probe = MlflowAdapter(tracking_uri=uri, experiment="faults")
        store = CursorStore(journal)
        gaps = sorted(getattr(store, "gaps", lambda _: set())(probe))
        adapter = {"type": "mlflow", "tracking_uri": uri, "experiment": "faults"}
        sync_rc, sync_out, sync_err = lab.sync(journal, config(folder, [adapter]))
        after = mlflow_history(uri)
        gaps_after = sorted(getattr(store, "gaps", lambda _: set())(probe))
    finally:
        for key, value in old_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    live = sorted({s for _, _, steps in before for s in steps})
    row.live = len(live)
    final = sorted({s for _, _, steps in after for s in steps})
    row.recovered = len(final)
    live_ids = {run_id for run_id, _, _ in before}
    runs = ", ".join(f"{'live' if run_id in live_ids else 'sync'} {status} {len(steps)} steps"
                     for run_id, status, steps in sorted(after, key=lambda r: r[0] not in live_ids))
    row.notes.append(f"runs: {runs}; gap {gaps} recorded, cursor {store.get(probe)}")
    if sync_rc == 0:
        row.notes.append(f"sync sent {sent(sync_out)}")
    else:
        again = ", rejected again" if "MlflowException" in sync_err else f" ({short(sync_err.strip(), lab)})"
        row.notes.append(f"sync retried it: rc {sync_rc}{again}; gap {gaps_after} kept")
    if not before or before[0][1] == "RUNNING":
        row.notes.append("ERROR: the live run was left RUNNING (or is missing)")
    missing = sorted(set(range(10)) - {3} - set(live))
    if missing:
        row.notes.append(f"live LOSS {span(missing)}")
    missing = sorted(set(range(10)) - {3} - set(final))
    if missing:
        row.notes.append(f"sync LOSS {span(missing)}")
    dups = [s for _, _, steps in after for s in steps]
    if len(dups) != len(set(dups)):
        row.notes.append("DUP across runs")
    return row


def step63_scenario(lab: Lab) -> Row:
    """commit(step=2**63) between steps 4 and 5: a StepError, and step 5 still holds the record logged before it."""
    row = Row("commit(step=2**63)")
    folder = lab.dir("step63")
    journal, jsonl, fresh = folder / "journal", folder / "live.jsonl", folder / "synced.jsonl"
    rc, out, err = lab.run("step63", str(journal), str(jsonl))
    row.committed = len(printed_steps(out))
    last = out.strip().splitlines()[-1] if out.strip() else ""
    error = json.loads(last)["error"] if last.startswith("{") else f"ERROR rc={rc}: {short(err[-300:], lab)}"
    live = jsonl_rows(jsonl)
    row.live = len(live)
    sent_n = sync_step(lab, row, journal, config(folder, [f"jsonl:{fresh}"]))
    final = jsonl_rows(fresh)
    row.recovered = len(final)
    kept = [dict(rows).get(5, {}).get("x") for rows in (live, final)]
    row.notes.append(f"{(error or 'no error').split(':')[0]}; step 5 x live/sync {kept[0]}/{kept[1]} (want 50.5); "
                     f"fresh sync sent {sent_n}")
    if not (error or "").startswith("StepError") or kept != [50.5, 50.5]:
        row.notes.append("ERROR: not a StepError with the records kept")
    for what, rows in (("live", live), ("sync", final)):
        steps = [s for s, _ in rows]
        if steps != list(range(10)):
            row.notes.append(f"{what} steps {steps}: LOSS/DUP")
    return row


# -- the table ---------------------------------------------------------------------------------------------------


def scenarios() -> list[tuple[str, Callable[[Lab], Row]]]:
    """Every scenario of issue 11, in the order of its "Must show" list."""
    return [
        ("exit without close (jsonl)", lambda lab: exit_scenario(lab, "exit without close (jsonl)", "end", 50)),
        ("exception outside `with`", lambda lab: exit_scenario(lab, "exception outside `with`", "raise", 30)),
        ("os._exit + sync", lambda lab: exit_scenario(lab, "os._exit + sync", "os_exit", 50)),
        ("SIGKILL + sync", sigkill_scenario),
        ("SIGKILL during sync + re-sync", sync_kill_scenario),
        ("two writers, one journal", two_writers_scenario),
        ("disk full (RLIMIT_FSIZE)", enospc_scenario),
        ("flipped header byte", lambda lab: damage_scenario(lab, "flipped header byte", "header", 20)),
        ("flipped name-table byte", lambda lab: damage_scenario(lab, "flipped name-table byte", "names", 50)),
        ("empty rank-00001.mbj", lambda lab: damage_scenario(lab, "empty rank-00001.mbj", "empty-rank", 20)),
        ("hung adapter", lambda lab: stuck_scenario(lab, "hung")),
        ("adapter SystemExit", lambda lab: stuck_scenario(lab, "exit")),
        ("MLflow rejection", mlflow_scenario),
        ("commit(step=2**63)", step63_scenario),
    ]


def render(rows: list[Row]) -> str:
    """The table, columns padded."""
    head = ["scenario", "steps committed", "delivered live", "recovered by sync", "notes"]
    body = [[r.scenario, str(r.committed), str(r.live), str(r.recovered), "; ".join(r.notes)] for r in rows]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(4)]

    def fmt(line: list[str]) -> str:
        cells = [line[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(line[1:4], widths[1:4], strict=True)), line[4]]
        return " | ".join(cells).rstrip()

    rule = "-+-".join("-" * w for w in widths) + "-+-" + "-" * 5
    return "\n".join([fmt(head), rule, *(fmt(line) for line in body)])


def main() -> int:
    """Run every scenario, print the table."""
    started = time.monotonic()
    rows = []
    root = Path(tempfile.mkdtemp(prefix="metricbus-faults-"))
    try:
        lab = Lab(root)
        for title, scenario in scenarios():
            try:
                rows.append(scenario(lab))
            except Exception as exc:
                rows.append(Row(title, notes=[f"ERROR {type(exc).__name__}: {exc}"]))
                traceback.print_exc()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(render(rows))
    print(f"\n{len(rows)} scenarios in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.path.insert(0, str(ROOT))
        result = CHILDREN[sys.argv[2]](*sys.argv[3:])
        raise SystemExit(result if isinstance(result, int) else 0)
    raise SystemExit(main())
