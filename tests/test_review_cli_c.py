"""Review of the ``metricbus`` command with hostile inputs: each test a contract break found by running the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.cli import main


def _journal(path: Path) -> Path:
    """One rank, metrics loss (mean), lr (last) and tok (sum), steps 0..3."""
    with MetricBus(journal=str(path), rules={"loss": "mean", "lr": "last", "tok": "sum"}, dist=None) as bus:
        for step in range(4):
            bus.log("loss", float(step))
            bus.log("lr", 0.1 * step)
            bus.log("tok", 3.0)
            bus.commit(step=step)
    return path


@pytest.mark.parametrize("rules", [["loss=sum", "loss=max"], ["l*=sum", "loss=max"], ["loss=sum", "loss=sum"]])
def test_replay_rule_shadowed_by_an_earlier_one_is_an_error(
    tmp_path: Path, rules: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A --rule every metric of which takes an earlier rule (it re-aggregates nothing) is exit 2, naming both."""
    journal = _journal(tmp_path / "j")
    out = tmp_path / "out.jsonl"
    argv = ["replay", str(journal), "--to", f"jsonl:{out}"]
    for rule in rules:
        argv += ["--rule", rule]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "re-aggregates nothing" in err
    assert rules[1] in err
    assert rules[0] in err
    assert not out.exists() or out.read_text() == ""


def test_replay_rule_that_wins_for_some_metric_is_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A specific rule before a broader one is fine: each re-aggregates some metric."""
    journal = _journal(tmp_path / "j")
    out = tmp_path / "out.jsonl"
    argv = ["replay", str(journal), "--to", f"jsonl:{out}", "--rule", "loss=max", "--rule", "l*=sum"]
    assert main(argv) == 0, capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 4


@pytest.mark.parametrize("steps", ["", "  "])
def test_replay_empty_steps_is_an_error(tmp_path: Path, steps: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty --steps (an unset shell variable) is exit 2, not a replay of every step."""
    journal = _journal(tmp_path / "j")
    out = tmp_path / "out.jsonl"
    assert main(["replay", str(journal), "--to", f"jsonl:{out}", "--steps", steps]) == 2
    assert "bad --steps" in capsys.readouterr().err
    assert not out.exists()


def test_replay_of_no_emitted_step_creates_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--steps holding commits but no emitted step (log_every 3) is exit 2 with no file created, so the corrected
    replay into the same TensorBoard folder and jsonl file is not refused."""
    journal = tmp_path / "j"
    with MetricBus(journal=str(journal), dist=None, log_every=3) as bus:
        for step in range(9):
            bus.log("loss", float(step))
            bus.commit(step=step)
    tb, jsonl = tmp_path / "tb", tmp_path / "out.jsonl"
    argv = ["replay", str(journal), "--to", f"tensorboard:{tb}", "--to", f"jsonl:{jsonl}"]
    assert main([*argv, "--steps", "3:5"]) == 2
    assert "no emitted steps in 3:5" in capsys.readouterr().err
    assert not tb.exists()
    assert not jsonl.exists()
    assert main([*argv, "--steps", "5:6"]) == 0, capsys.readouterr().err
    assert len(jsonl.read_text().splitlines()) == 1
    assert list(tb.iterdir())
