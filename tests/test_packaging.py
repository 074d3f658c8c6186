"""The wheel ships ``metricbus`` and ``metricbus.adapters``, never a top-level ``adapters`` package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def run(*args: str | Path, cwd: Path | None = None) -> str:
    """Run a command, failing the test with its output if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the fresh venv sees only what it installed
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, timeout=600, check=False,
                          env=env)  # fmt: skip
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the source tree (so the build leaves nothing in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in ("metricbus", "adapters"):  # without the checkout's own build of the C loops
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q", "-w", out, cwd=src)
    (built,) = out.glob("metricbus-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a new plain venv (no system site-packages) with the wheel and numpy installed."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    python = env_dir / "bin" / "python"
    numpy = f"numpy=={metadata.version('numpy')}"
    run(python, "-m", "pip", "install", "-q", "--no-deps", wheel, numpy)
    return python


def test_wheel_holds_no_top_level_adapters(wheel: Path) -> None:
    """Every file in the wheel is under metricbus/ or the dist-info."""
    names = zipfile.ZipFile(wheel).namelist()
    assert "metricbus/adapters/console.py" in names
    assert "metricbus/py.typed" in names
    assert "metricbus/_speedups.pyi" in names
    assert [n for n in names if n.startswith("metricbus/_speedups.") and n.endswith(".so")]  # built from the C
    assert not [n for n in names if not n.startswith(("metricbus/", "metricbus-"))]


def test_installed_wheel_imports_the_console_adapter(fresh_python: Path) -> None:
    """In a fresh venv, metricbus.adapters.console imports and a bus writes through it."""
    code = (
        "from metricbus import MetricBus\n"
        "from metricbus.adapters.console import ConsoleAdapter\n"
        "bus = MetricBus(adapters=[ConsoleAdapter()], dist=None, strict=True)\n"
        "bus.log('loss', 0.5)\n"
        "bus.commit(step=3)\n"
        "bus.close()\n"
    )
    assert "step      3 | loss 0.5000" in run(fresh_python, "-c", code, cwd=fresh_python.parent)


def test_installed_wheel_has_no_top_level_adapters_package(fresh_python: Path) -> None:
    """importlib finds no top-level `adapters` in the fresh venv."""
    code = "import importlib.util; print(importlib.util.find_spec('adapters') is None)"
    assert run(fresh_python, "-c", code, cwd=fresh_python.parent).strip() == "True"


def test_installed_wheel_runs_the_compiled_loops(fresh_python: Path) -> None:
    """The wheel's C loops load in the fresh venv, and its numpy code is there without them."""
    code = "from metricbus import native; print(native.speedups is not None)"
    assert run(fresh_python, "-c", code, cwd=fresh_python.parent).strip() == "True"
