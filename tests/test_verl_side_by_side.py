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
from fractions import Fraction
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


def test_a_verl_worker_groups_merged_result_gives_each_ranks_partial(bench: ModuleType) -> None:
    """verl 0.9.1's own DataProto.concat (how its worker groups merge the ranks' results): a Partial directly under
    meta_info["metrics"] fails in it (AttributeError: 'Partial' object has no attribute 'keys'), so each rank
    returns meta_info={"metrics": {"metricbus": bus.export()}}, which concat makes a list; gather_partials takes
    each as one worker, in rank order (before: 'returned no Partial'), bit for bit one bus logging everything."""
    from metricbus import Agg, MetricBus
    from metricbus.integrations.ray import VERL_KEY, gather_partials

    data_proto = bench.load_verl().DataProto
    rules = {"actor/pg_loss": Agg(micro="sum", update="mean", rank="mean"), "actor/tokens": "sum"}
    whole = MetricBus(dist=None, rules=rules)
    protos = []
    for rank in range(3):
        worker = MetricBus(dist=None, rules=rules)
        for micro in range(2):
            for b in (worker, whole):
                b.log("actor/pg_loss", 0.1 * rank + 0.01 * micro)
                b.log("actor/tokens", float(10 * rank + micro))
        protos.append(data_proto(meta_info={"metrics": {VERL_KEY: worker.export()}}))
        worker.close()
    with pytest.raises(AttributeError, match="'Partial' object has no attribute 'keys'"):
        data_proto.concat([data_proto(meta_info={"metrics": part.meta_info["metrics"][VERL_KEY]}) for part in protos])
    merged = data_proto.concat(protos)
    driver = MetricBus(dist=None)
    driver.ingest(gather_partials([merged]))
    out = driver.commit(0)
    assert out["actor/tokens"] == whole.commit(0)["actor/tokens"] == 63.0
    direct = MetricBus(dist=None)  # the ranks' results as each returned it: three workers
    direct.ingest(gather_partials(protos))
    assert out == direct.commit(0)
    sums = [float(Fraction(0.1 * r) + Fraction(0.1 * r + 0.01)) for r in range(3)]  # each rank's sum, rounded
    assert out["actor/pg_loss"] == float(sum(map(Fraction, sums)) / 3)  # their exact mean, rounded once
    direct.close()
    repeated = data_proto.concat([protos[0], protos[0]])
    with pytest.raises(ValueError, match=r"worker 0, rank 0 and worker 0, rank 1 hold the same result"):
        gather_partials([repeated])
    driver.close()
    whole.close()
