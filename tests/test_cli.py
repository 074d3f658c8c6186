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

from metricbus import MetricBus
from metricbus._version import __version__
from metricbus.cli import main
from metricbus.journal import MAGIC, read_journal
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


def test_replay_prints_one_summary_line_and_no_progress_off_a_terminal(
    journal: tuple[Path, MemoryAdapter], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Off a terminal: no progress bar, only the summary naming the steps and where they went."""
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert main(["replay", str(journal[0]), "--to", f"jsonl:{one}", "--to", f"jsonl:{two}"]) == 0
    assert capsys.readouterr() == (f"replayed 4 steps (steps 2..10) to jsonl ({one}), jsonl ({two})\n", "")


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
        (["replay", "{journal}", "--to", "memory", "--steps", "a:b"], "bad --steps 'a:b'; use A:B"),
        (["replay", "{journal}", "--to", "memory", "--steps", "400:"],
         "no emitted steps in 400: (the journal has steps 0..10)"),
        (["replay", "{journal}", "--to", "jsonl:{tmp}/o.jsonl", "--steps", "3:5"],
         "no emitted steps in 3:5 (the journal has steps 0..10; a step is emitted every 3 commits)"),
        (["replay", "{journal}", "--to", "jsonl:"], "--to 'jsonl:': jsonl: the path is empty"),
        (["replay", "{journal}", "--to", "jsonl:{tmp}"], "is a directory"),
        (["replay", "{journal}", "--to", "console:x"], "--to 'console:x': console: stream must be"),
        (["show", "{journal}", "--last", "-3"], "argument --last: must be >= 1, got -3"),
        (["show", "{journal}", "--last", "0"], "argument --last: must be >= 1, got 0"),
        (["show", "{journal}", "--last", "x"], "argument --last: must be an integer >= 1, got 'x'"),
        (["show", "{journal}", "--metric", "nope*"], "--metric 'nope*' matches no metric; the journal has "),
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
    data, at, last = path.read_bytes(), 8, 0
    while at < len(data):  # the last commit frame (a "W" frame naming its window's steps follows it)
        last = at if data[at + 8 : at + 9] in (b"S", b"R", b"P") else last
        at += 8 + int.from_bytes(data[at : at + 4], "little")
    path.write_bytes(data[: last + 12])  # cut inside it
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


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """--version prints 'metricbus <version>' and exits 0."""
    assert main(["--version"]) == 0
    assert capsys.readouterr() == (f"metricbus {__version__}\n", "")


def test_top_level_help_lists_commands_and_examples(capsys: pytest.CaptureFixture[str]) -> None:
    """--help names each command with a one-line description, and ends with examples."""
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("replay", "sync", "show", "inspect"):
        assert any(line.split()[:1] == [command] and len(line.split()) > 2 for line in out.splitlines()), command
    assert "examples:" in out
    assert "metricbus show " in out.split("examples:")[1]


def test_replay_help_shows_the_rule_syntax(capsys: pytest.CaptureFixture[str]) -> None:
    """replay --help explains PATTERN=SPEC with an example, the spec forms, the kinds and the adapter forms."""
    assert main(["replay", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--rule 'actor/*=micro:sum,rank:mean'" in out
    for form in ("one kind", "sum", "mean,max", "micro:sum,rank:mean", "micro, update, rank, step", "std"):
        assert form in out
    assert "jsonl:out.jsonl" in out


def test_replay_to_jsonl_without_a_path_writes_the_per_run_file(
    journal: tuple[Path, MemoryAdapter], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--to jsonl writes the per-run file of a new run (runs/<project>/<run id>-replay-<new id>/metrics.jsonl, the
    live values) and says where; the live run's own file, written by the live bus, is left as it was (a replay
    never adds to the live run: that would hold each step twice)."""
    path, live = journal
    run = read_journal(path).run
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    own = work / "runs" / run.project / run.id / "metrics.jsonl"
    own.parent.mkdir(parents=True)
    own.write_text('{"step": 2, "x": 1.0}\n')  # as the live bus's jsonl adapter would have left it
    for _ in range(2):  # twice: each replay is a run of its own
        assert main(["replay", str(path), "--to", "jsonl"]) == 0
    targets = sorted((work / "runs" / run.project).glob(f"{run.id}-replay-*/metrics.jsonl"))
    assert len(targets) == 2
    for target in targets:
        assert bits(read_jsonl(target)) == bits(live.rows)
    assert own.read_text() == '{"step": 2, "x": 1.0}\n'
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == [f"replayed 4 steps (steps 2..10) to jsonl ({target})" for target in targets]


def test_an_empty_step_selection_creates_nothing(
    journal: tuple[Path, MemoryAdapter], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--steps past the end is refused before any adapter is built or opened."""
    out = tmp_path / "never" / "out.jsonl"
    assert main(["replay", str(journal[0]), "--to", f"jsonl:{out}", "--steps", "400:"]) == 2
    assert capsys.readouterr().err == "metricbus: error: no emitted steps in 400: (the journal has steps 0..10)\n"
    assert not out.parent.exists()


def test_sync_with_several_adapters_adds_a_total_line(
    journal: tuple[Path, MemoryAdapter], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One line per adapter, then one line with the total."""
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    config = tmp_path / "two.json"
    config.write_text(json.dumps({"adapters": [f"jsonl:{tmp_path / 'a.jsonl'}", f"jsonl:{tmp_path / 'b.jsonl'}"]}))
    assert main(["sync", str(journal[0]), "--config", str(config)]) == 0
    assert capsys.readouterr() == (
        "jsonl[0]: sent 4 steps\njsonl[1]: sent 4 steps\nsync: sent 8 steps to 2 adapters\n", ""
    )


def _numbered_journal(directory: Path, *, steps: int = 3, metrics: int = 12) -> Path:
    """A journal of ``m/1`` .. ``m/<metrics>`` (log_every 1), so names sort differently as text and as numbers."""
    with MetricBus(dist=None, journal=str(directory), log_every=1) as bus:
        for step in range(steps):
            bus.log({f"m/{i}": step + i / 8 for i in range(1, metrics + 1)})
            bus.commit(step)
    return directory


NATURAL = [f"m/{i}" for i in range(1, 13)]


def test_show_sorts_names_naturally(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """show puts m/2 before m/10."""
    assert main(["show", str(_numbered_journal(tmp_path / "j"))]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["step", *NATURAL]


def test_inspect_sorts_names_naturally(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """inspect lists m/2 before m/10."""
    assert main(["inspect", str(_numbered_journal(tmp_path / "j"))]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  m/")]
    assert names == NATURAL


def test_show_merges_two_writes_at_one_step_and_follows_a_rewind(
    journal: tuple[Path, MemoryAdapter], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Train then eval at one step is one row; a step lower than the last one replaces the rows from there on."""
    points = [(1, {"train": 1.0}), (1, {"eval": 2.0}), (2, {"train": 3.0}), (3, {"train": 4.0}), (2, {"train": 5.0})]
    monkeypatch.setattr("metricbus.cli_views.emitted", lambda _journal: iter(points))
    assert main(["show", str(journal[0])]) == 0
    assert [line.split() for line in capsys.readouterr().out.splitlines()] == [
        ["step", "eval", "train"], ["1", "2", "1"], ["2", "-", "5"]
    ]


def test_a_config_placeholder_is_an_error_before_anything_is_created(
    journal: tuple[Path, MemoryAdapter], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An adapter entry with an unfilled {out} names the config, the entry and the placeholder; no {out}/ folder."""
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"adapters": ["console", {"type": "jsonl", "path": "{out}/metrics.jsonl"}]}))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    before = sorted(journal[0].rglob("*"))
    for argv in (["sync", str(journal[0])], ["replay", str(journal[0])]):
        assert main([*argv, "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"metricbus: error: {config}: adapters[1]: ")
        assert "placeholder {out}" in err
        assert len(err.splitlines()) == 1
    assert list(work.iterdir()) == []
    assert sorted(journal[0].rglob("*")) == before


def test_a_journal_placeholder_in_the_config_is_an_error(
    journal: tuple[Path, MemoryAdapter], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The config's journal entry is checked too."""
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"adapters": ["console"], "journal": "{run_dir}/journal"}))
    assert main(["sync", str(journal[0]), "--config", str(config)]) == 2
    assert "journal: '{run_dir}/journal' holds the placeholder {run_dir}" in capsys.readouterr().err


def test_sync_with_the_demo_config_refuses_its_out_placeholder(
    journal: tuple[Path, MemoryAdapter], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """examples/demo.yaml (whose {out} only its example fills) is refused instead of making a literal {out}/."""
    pytest.importorskip("yaml")
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    demo = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"
    monkeypatch.chdir(tmp_path)
    assert main(["sync", str(journal[0]), "--config", str(demo)]) == 2
    err = capsys.readouterr().err
    assert "demo.yaml: adapters[" in err
    assert "{out}" in err
    assert not (tmp_path / "{out}").exists()


def test_a_broken_pipe_is_quiet(
    journal: tuple[Path, MemoryAdapter], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stdout whose reader went away ends the command with exit 0 and nothing on stderr."""

    class Closed:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def writelines(self, lines: object) -> None:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["show", str(journal[0])]) == 0
    assert capsys.readouterr().err == ""


def test_show_into_a_pipe_closed_after_one_line_exits_0_quietly(tmp_path: Path) -> None:
    """`metricbus show J | head -1`: a real pipe closed after the first line; no traceback, no message, exit 0."""
    big = _numbered_journal(tmp_path / "big", steps=1000, metrics=30)  # a table of ~300 KiB, beyond a pipe's buffer
    child = subprocess.Popen([sys.executable, "-m", "metricbus", "show", str(big)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert child.stdout is not None
    assert child.stderr is not None
    first = child.stdout.readline()
    child.stdout.close()
    err = child.stderr.read()
    child.stderr.close()
    assert child.wait(timeout=60) == 0
    assert first.split()[:3] == [b"step", b"m/1", b"m/2"]
    assert err == b""
