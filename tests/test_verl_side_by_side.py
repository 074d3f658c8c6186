"""benchmarks/verl_side_by_side.py on a tiny grid: verl 0.9.1's own loss and metric code next to metricbus.

metricbus agrees with the truth computed from the tokens to 1e-12. verl 0.9.1's engine path logs pg_loss at
exactly the truth (its ``Metric.aggregate_dp`` means over dp ranks: the fix of verl PR #5203); the seed PR's
``Metric.chain`` over ranks (transcribed in the benchmark) logs R x the truth at K=1. The clip fraction, a mean of
micro-batch means in both verl paths, is off once micro-batches hold unequal token counts.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import verl_source

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "verl_side_by_side.py"
EXACT = 1e-12

pytestmark = pytest.mark.skipif(not verl_source.available(), reason="verl 0.9.1 sources not installed (make install)")


@pytest.fixture
def bench() -> Iterator[ModuleType]:
    """The benchmark module; the verl modules and stand-ins it registers, and its sys.path entries, are removed
    afterwards, so no other test sees a stand-in ``tensordict`` or ``transformers``."""
    modules, path = set(sys.modules), list(sys.path)
    spec = importlib.util.spec_from_file_location("_verl_side_by_side", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        added = set(sys.modules) - modules
        ours = {spec.name, *module.STUBBED}
        for name in added:
            if name in ours or name == "verl" or name.startswith("verl."):
                del sys.modules[name]
        sys.path[:] = path


def test_tiny_grid(bench: ModuleType) -> None:
    """R in {1,2} x M in {1,4} x K in {1,2}, two steps each."""
    rows = bench.run(bench.grid(ranks=(1, 2), micros=(1, 4), updates=(1, 2)), steps=2)
    assert len(rows) == 8
    for row in rows:
        layout = row.layout
        for step in row.steps:
            assert abs(step.bus_pg / step.truth_pg - 1) <= EXACT, (layout, step)
            assert abs(step.bus_clip / step.truth_clip - 1) <= EXACT, (layout, step)
            assert abs(step.engine_pg / step.truth_pg - 1) <= EXACT, (layout, step)  # verl 0.9.1: exact
            if layout.updates == 1:  # the seed PR's engine path: R x the truth
                assert abs(step.engine_seed_pg / step.truth_pg - layout.ranks) <= EXACT * layout.ranks, (layout, step)
            assert step.engine_clip == pytest.approx(step.legacy_clip, rel=EXACT)  # both a mean of micro means
        if layout.ranks * layout.micros > 1:  # unequal micro-batches: the unweighted means are off
            assert max(abs(s.engine_clip / s.truth_clip - 1) for s in row.steps) > 1e-4, layout
            assert max(abs(s.legacy_pg / s.truth_pg - 1) for s in row.steps) > 1e-4, layout


def test_main_prints_the_table(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """The command, one line per layout of the full grid, and the summary line."""
    assert bench.main(["--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("$ .venv/bin/python benchmarks/verl_side_by_side.py --steps 1\n")
    assert sum(line.lstrip().startswith(("1x", "2x", "4x")) for line in out.splitlines()) == 24
    assert "Summary: metricbus max |rel err|" in out
