"""Review of ``metricbus sync`` into MLflow against servers that hang or answer late: a listening socket that never
answers, and a real ``mlflow server`` behind a proxy that holds chosen requests."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from backend_env import MlflowServer, isolate_env

from metricbus import MetricBus
from metricbus.adapter import RunInfo
from metricbus.journal.cursors import CursorStore
from metricbus.replay import sync
from tests.test_review_backends_2 import _history


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path, telemetry off, no MLflow settings from the caller's environment."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return isolate_env(monkeypatch, tmp_path)


def _journal(tmp_path: Path, steps: int = 3) -> Path:
    journal = tmp_path / "journal"
    with MetricBus(dist=None, journal=journal, adapters=[]) as bus:
        for step in range(steps):
            bus.log("loss", float(step))
            bus.commit(step=step)
    return journal


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A socket on 127.0.0.1 that accepts every connection and never answers (nor closes it); its http:// URI."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)  # the thread sees ``stop`` (closing the socket does not wake a blocked accept())
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(10)
        listener.close()
        for conn in accepted:
            conn.close()


class HoldingProxy:
    """An HTTP proxy to a real server that keeps each request :meth:`holds` says to (by default each POST while
    ``hold`` is set) until ``release``; ``forwarded_held`` counts the held ones the server answered. Also used by
    tests/test_mlflow_create_timeout.py."""

    def __init__(self, target: str) -> None:
        self.hold, self.release = threading.Event(), threading.Event()
        self.held = 0
        self.forwarded_held = threading.Semaphore(0)
        host, port = target.removeprefix("http://").split(":")
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                held = proxy.holds(self.command, self.path)
                if held:
                    proxy.held += 1
                    proxy.release.wait()
                conn = http.client.HTTPConnection(host, int(port), timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                conn.close()
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.getheader("Content-Type") or "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                if held:
                    proxy.forwarded_held.release()

            def do_GET(self) -> None:
                self._forward()

            def do_POST(self) -> None:
                self._forward()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def holds(self, command: str, path: str) -> bool:
        """Whether the request ``command path`` waits for ``release``."""
        return command == "POST" and self.hold.is_set()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def held_once_open(proxy: HoldingProxy) -> Any:
    """An MlflowAdapter class whose writes and close wait in ``proxy`` once it opened (with time to spare on a busy
    machine): its request timeout is then 1 s for each held request."""
    from metricbus.adapters.mlflow import MlflowAdapter

    class HoldsOnceOpen(MlflowAdapter):
        def open(self, *, run: RunInfo) -> None:
            super().open(run=run)
            self._request_timeout_s = 1.0
            proxy.hold.set()  # sync 1's writes and its close now wait in the proxy

    return HoldsOnceOpen


@pytest.mark.slow
def test_cli_sync_against_a_server_that_never_answers_fails_with_the_request_timeout(
    silent_server: str, tmp_path: Path
) -> None:
    """`metricbus sync` to a server that accepts and never answers exits 1 naming request_timeout_s (no hang)."""
    journal = _journal(tmp_path)
    config = tmp_path / "metricbus.json"
    adapter = {"type": "mlflow", "tracking_uri": silent_server, "request_timeout_s": 1}
    config.write_text(json.dumps({"adapters": [adapter]}))
    cli = [sys.executable, "-m", "metricbus", "sync", str(journal), "--config", str(config)]
    done = subprocess.run(cli, check=False, capture_output=True, text=True, timeout=300)  # a hang guard only
    assert done.returncode == 1, done.stderr
    assert f"MLflow at {silent_server} did not answer" in done.stderr
    assert "request_timeout_s=1 s" in done.stderr
    from metricbus.adapters.mlflow import MlflowAdapter

    assert CursorStore(journal).get(MlflowAdapter(tracking_uri=silent_server)) is None  # nothing acknowledged


@pytest.mark.slow
def test_a_sync_after_one_whose_requests_answer_late_neither_logs_twice_nor_ends_failed(
    mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    """Sync 1's log_batch and FAILED close land late: sync 2 waits for them (refuses), sync 3 ends FINISHED, once."""
    from metricbus.adapters.mlflow import MlflowAdapter

    journal = _journal(tmp_path)
    proxy = HoldingProxy(mlflow_server.uri)

    holds_once_open = held_once_open(proxy)

    try:
        with pytest.raises(TimeoutError, match="log_batch of step 0"):
            sync(journal, [holds_once_open(tracking_uri=proxy.uri, request_timeout_s=30)])
        assert proxy.held == 2  # the log_batch of step 0 (each retry waited for it) and the set_terminated(FAILED)
        proxy.hold.clear()
        earlier = r"the log_batch of step 0, the set_terminated\(FAILED\) that an earlier adapter sent"
        with pytest.raises(TimeoutError, match=earlier):
            sync(journal, [MlflowAdapter(tracking_uri=proxy.uri, request_timeout_s=10)])
        assert _history(mlflow_server.uri, "loss") == ("RUNNING", [])  # sync 2 wrote nothing
        proxy.release.set()
        for _ in range(2):
            assert proxy.forwarded_held.acquire(timeout=120)
        sync(journal, [MlflowAdapter(tracking_uri=proxy.uri, request_timeout_s=30)])
    finally:
        proxy.close()
    assert _history(mlflow_server.uri, "loss") == ("FINISHED", [(s, float(s)) for s in range(3)])


def test_reopening_a_long_run_at_its_cursor_logs_each_point_after_it_once(tmp_path: Path) -> None:
    """A 700-step run reopened at cursor 100 (its later steps read in chunks): sent again, each point lands once."""
    from metricbus.adapters.mlflow import MlflowAdapter
    from mlflow.tracking import MlflowClient

    uri, run = f"sqlite:///{tmp_path / 'mlflow.db'}", RunInfo()
    first = MlflowAdapter(tracking_uri=uri)
    first.open(run=run)
    for step in range(700):
        first.write(step=step, metrics={"loss": float(step), "lr": 0.1})
    first.close(status="failed")  # the trainer died: steps after 100 were written, never acknowledged
    again = MlflowAdapter(tracking_uri=uri)
    again.resume(after_step=100, identity=first.identity)
    again.open(run=run)
    for step in range(101, 701):
        again.write(step=step, metrics={"loss": float(step), "lr": 0.1})
    again.close(status="finished")
    client = MlflowClient(tracking_uri=uri)
    for key, value in (("loss", float), ("lr", lambda _: 0.1)):
        history = sorted((m.step, m.value) for m in client.get_metric_history(again.run_id, key))
        assert history == [(s, value(s)) for s in range(701)]
    assert client.get_run(again.run_id).info.status == "FINISHED"
