"""Helpers for the backend adapter tests: an isolated environment, free ports, server polling, a wandb reader."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import zlib
from pathlib import Path
from typing import Any

import pytest

WANDB_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK_BYTES = 32 * 1024
RECORD_HEADER = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def isolate_env(monkeypatch: pytest.MonkeyPatch, root: Path) -> Path:
    """Point HOME, WANDB_DIR and XDG_CONFIG_HOME at ``root`` and switch telemetry and network off."""
    home = root / "home"
    (home / ".config").mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("WANDB_DIR", str(root))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")
    return root


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, *, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Poll ``url`` until it answers 200; fail early if ``proc`` exits, fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, http.client.HTTPException):  # not up yet, or another process's answer on the port
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")


def get_json(url: str) -> Any:
    """GET ``url`` and decode its JSON body."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def start_server(args: list[str], *, log: Path) -> subprocess.Popen[bytes]:
    """Start a server in its own session, output to ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server's process group (it was started as a session leader, so its group id is its PID)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def _wandb_payloads(data: bytes, *, complete_only: bool = False) -> list[bytes]:
    """Split a LevelDB-log-framed wandb file into record payloads, checking every CRC.

    ``complete_only``: stop quietly at a record wandb-core has not finished writing (instead of failing).
    """
    if not data.startswith(WANDB_HEADER):
        raise AssertionError(f"not a wandb run file: header {data[:7]!r}")
    payloads: list[bytes] = []
    pending = b""
    pos = len(WANDB_HEADER)
    while pos + RECORD_HEADER.size <= len(data):
        room = BLOCK_BYTES - pos % BLOCK_BYTES
        if room < RECORD_HEADER.size:  # the rest of a block too small for a header is padding
            pos += room
            continue
        crc, length, kind = RECORD_HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding at the end of a block or file
            pos += room
            continue
        body = data[pos + RECORD_HEADER.size : pos + RECORD_HEADER.size + length]
        if len(body) < length or zlib.crc32(bytes([kind]) + body) & 0xFFFFFFFF != crc:
            if complete_only:
                break
            raise AssertionError(f"bad CRC at offset {pos}")
        pos += RECORD_HEADER.size + length
        if kind == FULL:
            payloads.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            payloads.append(pending + body)
            pending = b""
    return payloads


def read_wandb_records(run_dir: Path, *, timeout_s: float = 30.0) -> list[Any]:
    """Every ``wandb_internal_pb2.Record`` of the run's ``.wandb`` file, once the run's exit record is in it.

    wandb's service process writes the file asynchronously: ``run.finish()`` can return ~50 ms before the last
    records (and the exit record) are on disk (measured: 1 run in 15 under load), so this waits for them.
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_dir).glob("*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = []
            for payload in _wandb_payloads(path.read_bytes()):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(payload)
                records.append(record)
            if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
                return records
        except AssertionError:  # a record still being written (bad CRC or a torn tail)
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def read_wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows of a wandb run folder, each ``{key: decoded value_json}`` (``_step`` included)."""
    rows = []
    for record in read_wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


def poll_until(check: Any, *, timeout_s: float = 60.0, what: str = "condition") -> None:
    """Call ``check()`` until it is truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} not met within {timeout_s} s")


def read_wandb_records_now(run_dir: Path) -> list[Any]:
    """The records already complete in the run's ``.wandb`` file, read once, without waiting for the exit record."""
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(run_dir).glob("*.wandb")
    records = []
    for payload in _wandb_payloads(path.read_bytes(), complete_only=True):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        records.append(record)
    return records


def wandb_history_of(records: list[Any]) -> list[dict[str, Any]]:
    """The history rows among ``records``, each ``{key: decoded value_json}`` (``_step`` included)."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


class MlflowServer:
    """A real ``mlflow server`` (sqlite backend, one worker) on one port, which can be stopped and started again."""

    def __init__(self, root: Path) -> None:
        exe = shutil.which("mlflow", path=str(Path(sys.executable).parent))
        assert exe is not None
        self.root = root
        self.proc: subprocess.Popen[bytes] | None = None
        self._exe = exe
        self._started = False
        self._pick_port()

    def _pick_port(self) -> None:
        self.uri = f"http://127.0.0.1:{free_port()}"
        port = self.uri.rsplit(":", 1)[1]
        root = self.root
        self.args = [self._exe, "server", "--backend-store-uri", f"sqlite:///{root / 'server.db'}", "--host"]
        self.args += ["127.0.0.1", "--port", port, "--workers", "1", "--default-artifact-root", str(root / "artifacts")]

    def start(self) -> None:
        """Start the server; on its first start, where another process took the free port before the server bound
        it (the server exits), on another port (a restart keeps the port: tests reconnect to the same URI)."""
        for attempt in range(3):
            log = self.root / f"mlflow-server-{len(list(self.root.glob('*.log')))}.log"
            self.proc = start_server(self.args, log=log)
            try:
                wait_http(f"{self.uri}/health", proc=self.proc, timeout_s=90)
            except AssertionError:
                if self._started or self.proc.poll() is None or attempt == 2:
                    raise
                self._pick_port()
                continue
            self._started = True
            return

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)
            self.proc = None
