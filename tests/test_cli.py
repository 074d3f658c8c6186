"""The ``metricbus`` command: replay, show, inspect, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from metricbus.adapters.jsonl import read_jsonl

from metricbus.cli import main
from metricbus.journal import MAGIC
from metricbus.testing import MemoryAdapter
from tests.test_replay import bits, single_controller_run


@pytest.fixture
def journal(tmp_path: Path) -> tuple[Path, MemoryAdapter]:
    """A single-controller journal (11 commits, log_every 3) and what it delivered live."""
    live = single_controller_run(tmp_path / "journal")
    return tmp_path / "journal", live


def test_replay_to_a_uri_writes_the_live_values(journal: tuple[Path, MemoryAdapter], tmp_path: Path) -> None:
    """replay --to jsonl:FILE writes what live delivered, bit for bit."""
    path, live = journal
    out = tmp_path / "out.jsonl"
    assert main(["replay", str(path), "--to", f"jsonl:{out}"]) == 0
    assert bits(read_jsonl(out)) == bits(live.rows)


def test_replay_with_a_rule_and_steps(journal: tuple[Path, MemoryAdapter], tmp_path: Path) -> None:
    """--rule re-aggregates and --steps selects commits."""
    path, _ = journal
    out = tmp_path / "out.jsonl"
    argv = ["replay", str(path), "--to", f"jsonl:{out}", "--rule", "pg_loss=micro:sum,rank:mean", "--steps", "0:6"]
    assert main(argv) == 0
    rows = read_jsonl(out)
    assert [s for s, _ in rows] == [2, 5]


def test_replay_is_quiet_when_stderr_is_not_a_terminal(
    journal: tuple[Path, MemoryAdapter], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No progress bar and no output at all off a terminal."""
    assert main(["replay", str(journal[0]), "--to", f"jsonl:{tmp_path / 'o.jsonl'}"]) == 0
    assert capsys.readouterr() == ("", "")


def test_show_prints_an_aligned_table(journal: tuple[Path, MemoryAdapter], capsys: pytest.CaptureFixture[str]) -> None:
    """show --metric --last prints a header and N rows of equal width."""
    assert main(["show", str(journal[0]), "--metric", "loss", "--metric", "tokens", "--last", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "loss", "tokens"]
    assert [line.split()[0] for line in lines[1:]] == ["8", "10"]
    assert len({len(line) for line in lines}) == 1


def test_inspect_lists_ranks_steps_and_specs(
    journal: tuple[Path, MemoryAdapter], capsys: pytest.CaptureFixture[str]
) -> None:
    """inspect names the ranks, the commits, log_every and each metric's spec."""
    assert main(["inspect", str(journal[0])]) == 0
    out = capsys.readouterr().out
    assert "ranks       4 (0, 1, 2, 3)" in out
    assert "commits     11 (steps 0..10)" in out
    assert "log_every   3" in out
    assert "tokens" in out
    assert "[mean, max, std]" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "{tmp}/missing"], "no journal at"),
        (["inspect", "{tmp}/foreign"], "not a metricbus journal"),
        (["inspect", "{tmp}/newer"], "newer than this metricbus reads"),
        (["replay", "{journal}", "--to", "memory", "--rule", "loss=avg"], "unknown aggregation 'avg'"),
        (["replay", "{journal}", "--to", "memory", "--rule", "loss"], "use PATTERN=SPEC"),
        (["replay", "{journal}", "--to", "nosuch"], "no adapter named 'nosuch'"),
        (["replay", "{journal}", "--to", "memory", "--steps", "a:b"], "bad --steps"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_errors_are_one_line_with_exit_code_2(
    journal: tuple[Path, MemoryAdapter], tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
    message: str,
) -> None:
    """Each mistake prints one line on stderr naming it, and exits 2."""
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "rank-00000.mbj").write_text("not a journal")
    (tmp_path / "newer").mkdir()
    payload = b"H" + json.dumps({"format": 7}).encode()
    (tmp_path / "newer" / "rank-00000.mbj").write_bytes(
        MAGIC + struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    )
    args = [a.format(tmp=tmp_path, journal=journal[0]) for a in argv]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert message in captured.err


def test_python_dash_m_metricbus(journal: tuple[Path, MemoryAdapter]) -> None:
    """python -m metricbus runs the same command line."""
    done = subprocess.run([sys.executable, "-m", "metricbus", "inspect", str(journal[0])],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "commits     11" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "metricbus", "inspect", "/nonexistent/journal"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2
    assert bad.stderr.startswith("metricbus: error:")
    assert "Traceback" not in bad.stderr


def test_a_torn_journal_warns_in_one_line_and_still_works(
    journal: tuple[Path, MemoryAdapter], capsys: pytest.CaptureFixture[str]
) -> None:
    """A torn last record is reported as one warning line; the rest is inspected."""
    path = journal[0] / "rank-00000.mbj"
    path.write_bytes(path.read_bytes()[:-5])
    assert main(["inspect", str(journal[0])]) == 0
    captured = capsys.readouterr()
    assert "commits     10 (steps 0..9)" in captured.out
    assert captured.err.startswith("metricbus: warning:")
    assert len(captured.err.splitlines()) == 1


def test_a_failing_backend_during_sync_exits_1_in_one_line(
    journal: tuple[Path, MemoryAdapter], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """sync to a backend that cannot be written reports it in one line and exits 1."""
    blocked = tmp_path / "blocked"
    blocked.write_text("a file, not a folder")
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"adapters": [f"jsonl:{blocked}/out.jsonl"]}))
    assert main(["sync", str(journal[0]), "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("metricbus: error:")
    assert len(err.splitlines()) == 1


def test_progress_bar_only_on_a_terminal() -> None:
    """The progress callback exists for a TTY stream and draws a bar; none for a pipe."""
    import io

    from metricbus.cli import _progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert _progress(io.StringIO()) is None
    tty = Tty()
    show = _progress(tty)
    assert show is not None
    show(10, 10)
    assert "10/10 commits" in tty.getvalue()


def _sync_config(tmp_path: Path) -> tuple[Path, Path]:
    out = tmp_path / "synced.jsonl"
    config = tmp_path / "sync.json"
    config.write_text(json.dumps({"adapters": [f"jsonl:{out}"]}))
    return config, out


def test_sync_is_quiet_off_a_terminal_but_for_its_summary(
    journal: tuple[Path, MemoryAdapter], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """sync to a pipe prints no progress: only the per-adapter summary on stdout."""
    config, out = _sync_config(tmp_path)
    assert main(["sync", str(journal[0]), "--config", str(config)]) == 0
    assert capsys.readouterr() == ("jsonl: sent 4 steps\n", "")
    assert bits(read_jsonl(out)) == bits(journal[1].rows)


def test_sync_progress_shows_steps_rate_and_eta_on_a_terminal() -> None:
    """The sync progress line names the steps sent, the rate and the ETA; none for a pipe."""
    import io

    from metricbus.cli import _sync_progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert _sync_progress(io.StringIO()) is None
    tty = Tty()
    show = _sync_progress(tty)
    assert show is not None
    show(5, 10, 3)
    show(10, 10, 7)
    last = tty.getvalue().split("\r")[-1]
    assert "7 steps sent" in last
    assert "steps/s" in last
    assert "10/10 commits" in last
    assert "ETA 0 s" in last
    assert tty.getvalue().endswith("\n")


def test_ctrl_c_during_sync_prints_one_line_and_exits_130(
    journal: tuple[Path, MemoryAdapter], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KeyboardInterrupt at the third step: the two written are kept, one summary line, exit 130; resync ends it."""
    from metricbus.adapters.jsonl import JsonlAdapter

    config, out = _sync_config(tmp_path)
    write = JsonlAdapter.write

    def interrupted_write(self: JsonlAdapter, *, step: int, metrics: dict[str, float]) -> None:
        if step == journal[1].rows[2][0]:
            raise KeyboardInterrupt
        write(self, step=step, metrics=metrics)

    monkeypatch.setattr(JsonlAdapter, "write", interrupted_write)
    assert main(["sync", str(journal[0]), "--config", str(config)]) == 130
    assert capsys.readouterr() == ("", "interrupted: sent 2 steps to jsonl; run sync again to resume\n")
    assert bits(read_jsonl(out)) == bits(journal[1].rows[:2])
    monkeypatch.setattr(JsonlAdapter, "write", write)
    assert main(["sync", str(journal[0]), "--config", str(config)]) == 0
    assert capsys.readouterr().out == "jsonl: sent 2 steps\n"
    assert bits(read_jsonl(out)) == bits(journal[1].rows)
