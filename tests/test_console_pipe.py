"""The console adapter on a stdout pipe whose reader left (``python train.py | head -2``): it stops printing without
taking the process's stdout from the trainer, and the trainer still exits 0."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the trainer: one step printed, then (once the test closed the pipe's reading end) more steps
TRAINER = """
import os, stat, sys
from metricbus import MetricBus
bus = MetricBus(adapters=["console"], strict=True)
bus.log("loss", 0.5)
bus.commit(step=0)
assert bus.flush(timeout_s=30)
sys.stdin.readline()  # the test closes the pipe's reading end meanwhile
for step in range(1, 5):
    bus.log("loss", step / 7)
    bus.commit(step=step)
"""
# ... then its own print, after the console gave the pipe up
OWN_PRINT = """
assert bus.flush(timeout_s=30)
bus.close()
print("stdout:", "a pipe" if stat.S_ISFIFO(os.fstat(1).st_mode) else "not a pipe", file=sys.stderr)
try:
    print("the trainer's own line", flush=True)
    print("print: nothing raised", file=sys.stderr)
except BrokenPipeError:
    print("print: BrokenPipeError", file=sys.stderr)
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's SIGPIPE advice, the trainer's call
"""


def run_piped(code: str) -> tuple[int, str]:
    """Run ``code`` with stdout a pipe closed after its first two lines (``| head -2``; ``code`` then reads a line
    from stdin, which the test writes once the pipe is closed); its exit code and stderr. Also used by
    tests/test_review_adapters_3.py."""
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": "/nonexistent"}
    command = [sys.executable, "-c", textwrap.dedent(code)]
    trainer = subprocess.Popen(
        command, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert trainer.stdin is not None
    assert trainer.stdout is not None
    assert trainer.stderr is not None
    try:
        assert trainer.stdout.readline() == "metricbus run metricbus\n"
        assert trainer.stdout.readline().startswith("step      0 | loss")
        trainer.stdout.close()
        trainer.stdin.write("go\n")
        trainer.stdin.close()
        err = trainer.stderr.read()  # until the trainer exits
        trainer.wait(timeout=60)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    return trainer.returncode, err


def test_the_trainers_own_print_to_the_gone_reader_still_raises() -> None:
    """After the console gave the pipe up, stdout is still the pipe: the trainer's print raises BrokenPipeError."""
    code, err = run_piped(TRAINER + OWN_PRINT)
    assert code == 0, err
    assert err.count("no one reads <stdout> any more (BrokenPipeError") == 1, err
    assert "stdout: a pipe\n" in err
    assert "print: BrokenPipeError\n" in err


def test_a_bus_closed_at_exit_after_the_reader_left_exits_0_quietly() -> None:
    """The bus closed by the exit hook, its lines still buffered for the gone reader: exit 0, no exit-time error."""
    code, err = run_piped(TRAINER)
    assert code == 0, err
    assert "no one reads <stdout> any more (BrokenPipeError" in err
    assert "Exception ignored" not in err, err
    assert "Traceback" not in err, err
