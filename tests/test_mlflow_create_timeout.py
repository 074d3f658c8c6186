"""A ``create_run`` that request_timeout_s gave up on and that lands later: the next open in the process neither
creates a second run beside it nor leaves it an empty RUNNING run. Real ``mlflow server`` behind a proxy that
holds the create request; read back with MlflowClient."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from backend_env import MlflowServer, isolate_env

from metricbus.adapter import RunInfo


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HOME and friends inside tmp_path, telemetry off, no MLflow settings from the caller's environment."""
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    return isolate_env(monkeypatch, tmp_path)


class CreateHoldingProxy:
    """An HTTP proxy to a real server that holds the first ``runs/create`` request until ``release`` is set."""

    def __init__(self, target: str) -> None:
        self.release, self.held, self.landed = threading.Event(), threading.Event(), threading.Event()
        host, port = target.removeprefix("http://").split(":")
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: object) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hold = self.path.endswith("/runs/create") and not proxy.held.is_set()
                if hold:
                    proxy.held.set()
                    proxy.release.wait()
                conn = http.client.HTTPConnection(host, int(port), timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                conn.close()
                if hold:
                    proxy.landed.set()  # the server created the run
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.getheader("Content-Type") or "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._forward()

            def do_POST(self) -> None:
                self._forward()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.mark.slow
def test_an_open_after_a_create_run_that_timed_out_waits_for_it_and_adopts_its_run(mlflow_server: MlflowServer) -> None:
    """Open 1's create_run times out; open 2 refuses while it is still held; once it landed, open 3 logs into it."""
    from metricbus.adapters.mlflow import RUN_ID_TAG, MlflowAdapter
    from mlflow.tracking import MlflowClient

    run = RunInfo(id="late-create")
    MlflowClient(tracking_uri=mlflow_server.uri).create_experiment(run.project)  # open's first POST is then its own
    proxy = CreateHoldingProxy(mlflow_server.uri)
    try:
        with pytest.raises(TimeoutError, match=r"create_run\(\)"):
            MlflowAdapter(tracking_uri=proxy.uri, request_timeout_s=10).open(run=run)
        assert proxy.held.is_set()
        with pytest.raises(TimeoutError, match=r"create_run\(\) that an earlier adapter sent"):
            MlflowAdapter(tracking_uri=proxy.uri, request_timeout_s=10).open(run=run)
        proxy.release.set()
        assert proxy.landed.wait(120)
        adapter = MlflowAdapter(tracking_uri=proxy.uri, request_timeout_s=30)
        adapter.open(run=run)
        adapter.write(step=0, metrics={"loss": 1.0})
        adapter.close(status="finished")
    finally:
        proxy.close()
    client = MlflowClient(tracking_uri=mlflow_server.uri)
    experiment = client.get_experiment_by_name(run.project)
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{run.id}'")
    assert [(r.info.run_id, r.info.status) for r in runs] == [(adapter.run_id, "FINISHED")]
    assert [(m.step, m.value) for m in client.get_metric_history(adapter.run_id, "loss")] == [(0, 1.0)]
