"""The examples at a tiny size, as a user runs them: exit 0, metricbus agrees across layouts, the backends agree.

``ppo_grad_accum.py --compare`` runs two layouts (1x1 with every adapter of examples/demo.yaml, 2x2 with a jsonl
only); the test reads each layout's emitted values and every backend the first layout wrote, back through the
backend's own reader.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from backend_env import isolate_env, read_wandb_history

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STEPS = 3
REL = 1e-9
EXACT = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "response_length/mean", "batch/tokens")
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
            [str(EXAMPLES / "ppo_grad_accum.py"), "--compare", "--layouts", "1x1,2x2", "--steps", str(STEPS),
             "--max-len", "12", "--out", str(out)],
            cwd=root,
        )  # fmt: skip
    return out, stdout


def test_metricbus_agrees_across_layouts_and_naive_does_not(compare_run: tuple[Path, str]) -> None:
    """pg_loss/pg_clipfrac (and the other exact metrics) agree to 1e-9; naive mean is /M, naive sum is *R."""
    out, stdout = compare_run
    ref, other = _rows(out / "layouts/1x1/values.json"), _rows(out / "layouts/2x2/values.json")
    assert [s for s, _ in ref] == [s for s, _ in other] == list(range(STEPS))
    for name in EXACT:
        np.testing.assert_allclose(_series(other, name), _series(ref, name), rtol=REL, atol=0, err_msg=name)
    loss = _series(ref, "actor/pg_loss")
    np.testing.assert_allclose(_series(ref, "naive_mean/pg_loss"), loss, rtol=1e-12)  # 1x1: naive is right
    np.testing.assert_allclose(_series(other, "naive_mean/pg_loss"), loss / 2, rtol=1e-9)  # M = 2
    np.testing.assert_allclose(_series(other, "naive_sum/pg_loss"), loss * 2, rtol=1e-9)  # R = 2
    naive_clip, clip = _series(other, "naive/pg_clipfrac"), _series(ref, "actor/pg_clipfrac")
    assert np.max(np.abs(naive_clip - clip) / clip) > 1e-3  # unequal token counts: the unweighted mean is off
    assert "agree with 1x1 to rel 1e-09: YES" in stdout
    for hint in ("tensorboard --logdir", "mlflow ui --backend-store-uri"):
        assert hint in stdout


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
    """jsonl, TensorBoard (float32), MLflow sqlite and wandb offline hold layout 1x1's values; console shows them."""
    from metricbus.adapters.console import format_value
    from metricbus.adapters.jsonl import read_jsonl
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, stdout = compare_run
    ref = _rows(out / "layouts/1x1/values.json")
    names = sorted(ref[0][1])
    expected = {name: [(s, m[name]) for s, m in ref] for name in names}

    assert read_jsonl(out / "metrics.jsonl") == ref
    assert read_jsonl(out / "layouts/2x2/metrics.jsonl") == _rows(out / "layouts/2x2/values.json")

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tb = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in sorted(acc.Tags()["scalars"])}
    assert tb == {name: [(s, float(np.float32(v))) for s, v in points] for name, points in expected.items()}

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("metricbus-demo")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    history = {n: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, n)) for n in names}
    assert history == expected

    (run_dir,) = (out / "wandb").glob("offline-run-*")
    wb: dict[str, list[tuple[int, float]]] = {}
    for row in read_wandb_history(run_dir):
        for key, value in row.items():
            if not key.startswith("_"):
                wb.setdefault(key, []).append((row["_step"], float(value)))
    assert dict(sorted(wb.items())) == expected

    last_step, last = ref[-1]
    line = next(ln for ln in stdout.splitlines() if re.match(rf"step\s+{last_step} \|", ln))
    for name in ("actor/pg_loss", "actor/pg_clipfrac"):
        assert f"{name} {format_value(last[name]).strip()}" in line


def test_journal_shows_the_same_values(compare_run: tuple[Path, str]) -> None:
    """``metricbus show`` on the run's journal prints layout 1x1's steps (when this metricbus has a journal)."""
    out, _ = compare_run
    journal = out / "journal"
    if not journal.exists():
        pytest.skip("this metricbus writes no journal")
    shown = _run(["-m", "metricbus", "show", str(journal)], cwd=out)
    assert "actor/pg_loss" in shown
    assert len([ln for ln in shown.splitlines() if re.match(r"\d+\s", ln)]) == STEPS


def test_single_controller_example(env: Path) -> None:
    """Workers' exported partials reduced by the driver equal the directly computed global token means."""
    stdout = _run([str(EXAMPLES / "single_controller.py"), "--workers", "2", "--micro", "2", "--steps", "2",
                   "--backend", "mp"], cwd=env)  # fmt: skip
    match = re.search(r"max relative deviation from the directly computed global token means: (\S+)", stdout)
    assert match is not None, stdout
    assert float(match.group(1)) <= 1e-12
    assert "actor/pg_loss" in stdout


def test_one_layout_with_adapters_from_the_environment(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """METRICBUS_ADAPTERS replaces the config's adapters; a 2x1 run writes exactly what rank 0's commit returned."""
    from metricbus.adapters.jsonl import read_jsonl

    target = env / "swapped.jsonl"
    monkeypatch.setenv("METRICBUS_ADAPTERS", f"jsonl:{target}")
    out = env / "one"
    stdout = _run([str(EXAMPLES / "ppo_grad_accum.py"), "--ranks", "2", "--micro", "1", "--steps", "2",
                   "--max-len", "8", "--out", str(out)], cwd=env)  # fmt: skip
    assert read_jsonl(target) == _rows(out / "layouts/2x1/values.json")
    assert not (out / "tensorboard").exists()
    assert "$METRICBUS_ADAPTERS" in stdout
