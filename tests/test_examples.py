"""The examples at a tiny size, as a user runs them: exit 0, metricbus agrees across layouts, the backends agree.

``ppo_grad_accum.py --compare`` runs two layouts that differ in R, M and K (1x1x1 with every adapter of
examples/demo.yaml, 2x4x3 with a jsonl only) over the same 3 x 3 optimizer updates; the test reads each layout's
emitted rows and every backend the first layout wrote, back through the backend's own reader.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from backend_env import isolate_env, read_wandb_history

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ROWS = 3  # emitted rows per layout; each covers K_OTHER optimizer updates
R, M, K_OTHER = 2, 4, 3  # the second layout: the naive factors 1/M, R and K all differ
LAYOUTS = ("1x1x1", f"{R}x{M}x{K_OTHER}")
REL = 1e-9
EXACT = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "response_length/mean",
    "response_length/max",
    "response_length/min",
    "batch/tokens",
)
Rows = list[tuple[int, dict[str, float]]]


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME/WANDB_DIR/XDG_CONFIG_HOME in tmp_path, wandb offline, MLflow telemetry off, no metricbus env config."""
    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    return isolate_env(monkeypatch, tmp_path)


def _run(args: list[str], *, cwd: Path, timeout: float = 240) -> str:
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def _rows(path: Path) -> Rows:
    data = json.loads(path.read_text())
    return [(int(step), metrics) for step, metrics in data["rows"]]


def _series(rows: Rows, name: str) -> np.ndarray:
    return np.array([metrics[name] for _, metrics in rows])


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One tiny ``--compare`` run shared by the tests below."""
    root = tmp_path_factory.mktemp("ppo")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
        monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
        isolate_env(monkeypatch, root)
        out = root / "run"
        stdout = _run(
            [str(EXAMPLES / "ppo_grad_accum.py"), "--compare", "--layouts", ",".join(LAYOUTS), "--steps", str(ROWS),
             "--max-len", "12", "--out", str(out)],
            cwd=root,
        )  # fmt: skip
    return out, stdout


def test_metricbus_agrees_across_layouts_and_naive_does_not(compare_run: tuple[Path, str]) -> None:
    """The exact metrics agree to 1e-9 across layouts differing in R, M and K; naive rules are off by 1/M, R, K."""
    out, stdout = compare_run
    ref, other = (_rows(out / f"layouts/{name}/values.json") for name in LAYOUTS)
    assert [s for s, _ in ref] == [K_OTHER * i + K_OTHER - 1 for i in range(ROWS)]  # K=1: log_every=K_OTHER steps
    assert [s for s, _ in other] == list(range(ROWS))
    for name in EXACT:
        np.testing.assert_allclose(_series(other, name), _series(ref, name), rtol=REL, atol=0, err_msg=name)
    loss = _series(ref, "actor/pg_loss")
    for naive in ("naive_mean/pg_loss", "naive_sum/pg_loss", "naive_step_sum/pg_loss"):  # 1x1x1: every rule is right
        np.testing.assert_allclose(_series(ref, naive), loss, rtol=1e-12, err_msg=naive)
    np.testing.assert_allclose(_series(other, "naive_mean/pg_loss"), loss / M, rtol=REL)
    np.testing.assert_allclose(_series(other, "naive_sum/pg_loss"), loss * R, rtol=REL)
    np.testing.assert_allclose(_series(other, "naive_step_sum/pg_loss"), loss * K_OTHER, rtol=REL)
    naive_clip, clip = _series(other, "naive/pg_clipfrac"), _series(ref, "actor/pg_clipfrac")
    assert np.max(np.abs(naive_clip - clip) / clip) > 1e-3  # unequal token counts: the unweighted mean is off
    assert re.search(r"metricbus agrees with 1x1x1 to rel 1e-09 on all 9 metrics .*: YES", stdout)
    for hint in ("tensorboard --logdir", "mlflow ui --backend-store-uri", "metricbus show"):
        assert hint in stdout


def test_the_demo_output_fits_a_screen(compare_run: tuple[Path, str]) -> None:
    """The console shows the first and the last row only (every 25th row), the whole output is short."""
    out, stdout = compare_run
    steps = [int(m.group(1)) for m in re.finditer(r"^step\s+(\d+) \|", stdout, flags=re.MULTILINE)]
    assert steps == [K_OTHER - 1, K_OTHER * ROWS - 1]
    assert len(stdout.splitlines()) <= 40
    assert max(len(line) for line in stdout.splitlines() if str(out) not in line) <= 132


def test_plot_is_a_readable_png(compare_run: tuple[Path, str]) -> None:
    """compare.png exists and decodes."""
    import matplotlib.image

    out, _ = compare_run
    png = out / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.ndim == 3
    assert image.shape[0] > 200
    assert image.shape[1] > 200


def test_backends_hold_the_emitted_values(compare_run: tuple[Path, str]) -> None:
    """jsonl, TensorBoard (float32), MLflow sqlite and wandb offline hold layout 1x1x1's rows; the console the last;
    the histograms are TensorBoard histograms, wandb histograms, jsonl edges and counts and MLflow quantiles."""
    from metricbus.adapters.console import format_value
    from metricbus.adapters.jsonl import read_jsonl
    from mlflow.tracking import MlflowClient

    from metricbus.histogram import Histogram
    from tests.tb_reader import histogram_points, legacy_accumulator, tensor_points

    out, stdout = compare_run
    ref = _rows(out / f"layouts/{LAYOUTS[0]}/values.json")
    names = sorted(ref[0][1])
    hists = [name for name in names if name.endswith("/hist")]
    assert hists == ["actor/advantages/hist", "response_length/hist"]
    scalars = [name for name in names if name not in hists]
    expected = {name: [(s, m[name]) for s, m in ref] for name in scalars}

    rows = read_jsonl(out / "metrics.jsonl")
    assert rows == ref
    assert read_jsonl(out / f"layouts/{LAYOUTS[1]}/metrics.jsonl") == _rows(out / f"layouts/{LAYOUTS[1]}/values.json")
    drawn = {name: [(s, m[name]) for s, m in rows] for name in hists}  # jsonl keeps edges and counts
    for name in hists:
        for _, h in drawn[name]:
            assert isinstance(h, Histogram)
            assert sum(h.counts) == float(h)
            assert len(h.edges) == len(h.counts) + 1

    acc = legacy_accumulator(out / "tensorboard")
    tags = sorted(t for t in acc.Tags()["tensors"] if acc.SummaryMetadata(t).plugin_data.plugin_name == "scalars")
    assert {tag: tensor_points(acc, tag) for tag in tags} == expected  # float64, exact
    assert sorted(acc.Tags()["histograms"]) == hists
    for name in hists:
        points = histogram_points(acc, name)
        assert [(step, counts) for step, _, counts in points] == [(s, list(h.counts)) for s, h in drawn[name]]

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("metricbus-demo")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    history = {n: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, n)) for n in scalars}
    assert history == expected
    for name in hists:  # MLflow has no histograms: their quantiles
        for suffix in ("p50", "p90", "p99"):
            got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"{name}/{suffix}"))
            assert got == [(s, dict(h.quantiles)[suffix]) for s, h in drawn[name]]

    (run_dir,) = (out / "wandb").glob("offline-run-*")
    wb: dict[str, list[tuple[int, Any]]] = {}
    for row in read_wandb_history(run_dir):
        for key, value in row.items():
            if not key.startswith("_"):
                wb.setdefault(key, []).append((row["_step"], value))
    for name in hists:  # wandb keeps a histogram as its bins and values
        assert wb.pop(f"{name}/_type") == [(s, "histogram") for s, _ in drawn[name]]
        assert wb.pop(f"{name}/values") == [(s, list(h.counts)) for s, h in drawn[name]]
        bins = wb.pop(f"{name}/bins")
        assert [len(b) for _, b in bins] == [len(h.edges) for _, h in drawn[name]]
    assert {k: [(s, float(v)) for s, v in pts] for k, pts in sorted(wb.items())} == expected

    last_step, last = ref[-1]
    line = next(ln for ln in stdout.splitlines() if re.match(rf"step\s+{last_step} \|", ln))
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/entropy"):
        assert f"{name} {format_value(last[name]).strip()}" in line


def test_journal_shows_the_same_values(compare_run: tuple[Path, str]) -> None:
    """``metricbus show`` on the run's journal replays layout 1x1x1's rows (its log_every windows)."""
    out, _ = compare_run
    shown = _run(["-m", "metricbus", "show", str(out / "journal")], cwd=out)
    assert "actor/pg_loss" in shown
    ref = _rows(out / f"layouts/{LAYOUTS[0]}/values.json")
    assert [int(ln.split()[0]) for ln in shown.splitlines() if re.match(r"\d+\s", ln)] == [s for s, _ in ref]


SINGLE_CONTROLLER = ("--workers", "2", "--micro", "4", "--updates", "3", "--steps", "2", "--compare")


def _single_controller(env: Path, backend: str) -> tuple[dict[str, str], list[tuple[str, float, str]]]:
    """Run single_controller.py; its last step's exact values (as printed, repr) and its naive rows."""
    stdout = _run([str(EXAMPLES / "single_controller.py"), *SINGLE_CONTROLLER, "--backend", backend], cwd=env)
    match = re.search(r"max relative deviation from the directly computed global token means: (\S+)", stdout)
    assert match is not None, stdout
    assert float(match.group(1)) <= 1e-12
    exact = dict(re.findall(r"^  ((?:actor|perf|response_length)/\S+) +(\S+)$", stdout, flags=re.MULTILINE))
    naive = [(name, float(ratio), factor) for name, ratio, factor in
             re.findall(r"^  (\S+) +\S+ +(\d+\.\d{4}) +(\S+)  ", stdout, flags=re.MULTILINE)]  # fmt: skip
    return exact, naive


def test_single_controller_example(env: Path) -> None:
    """Without Ray (multiprocessing workers): the driver's values are the direct global token means; --compare
    shows verl's naive pg_loss reductions off by exactly 1/M, R and K."""
    exact, naive = _single_controller(env, "mp")
    assert set(exact) == {"actor/pg_loss", "actor/pg_clipfrac", "perf/tokens", "response_length/mean",
                          "response_length/max", "response_length/min"}  # fmt: skip
    factors = {factor: ratio for name, ratio, factor in naive if name == "actor/pg_loss"}
    assert factors == {"1/M": 0.25, "R": 2.0, "K": 3.0}
    ((_, clip_ratio, _),) = [row for row in naive if row[0] == "actor/pg_clipfrac"]
    assert clip_ratio != 1.0  # unequal token counts: the mean of micro-batch fractions is off


def test_single_controller_example_on_ray(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray actor workers (a local Ray): the same printed values, digit for digit, as the multiprocessing run."""
    import shutil
    import tempfile

    pytest.importorskip("ray")
    ray_tmp = Path(tempfile.mkdtemp(prefix="mbray-"))  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        on_ray = _single_controller(env, "ray")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert on_ray == _single_controller(env, "mp")


def test_one_layout_with_adapters_from_the_environment(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """METRICBUS_ADAPTERS replaces the config's adapters; a 2x1x2 run writes exactly what rank 0's commit returned."""
    from metricbus.adapters.jsonl import read_jsonl

    target = env / "swapped.jsonl"
    monkeypatch.setenv("METRICBUS_ADAPTERS", f"jsonl:{target}")
    out = env / "one"
    stdout = _run([str(EXAMPLES / "ppo_grad_accum.py"), "--ranks", "2", "--micro", "1", "--updates", "2",
                   "--steps", "2", "--max-len", "8", "--out", str(out)], cwd=env)  # fmt: skip
    assert read_jsonl(target) == _rows(out / "layouts/2x1x2/values.json")
    assert not (out / "tensorboard").exists()
    assert "$METRICBUS_ADAPTERS" in stdout


def test_the_policy_keeps_its_entropy(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the demo's 200 updates the policy learns (entropy falls) without collapsing (it stays above 1 nat)."""
    monkeypatch.setenv("METRICBUS_ADAPTERS", "none")
    out = env / "long"
    _run([str(EXAMPLES / "ppo_grad_accum.py"), "--ranks", "1", "--micro", "1", "--updates", "2", "--steps", "100",
          "--out", str(out)], cwd=env)  # fmt: skip
    entropy = _series(_rows(out / "layouts/1x1x2/values.json"), "actor/entropy")
    assert entropy[0] > 3.3  # near uniform over 32 tokens (3.47)
    assert 1.0 < entropy[-1] < 2.5
    assert entropy.min() > 1.0
