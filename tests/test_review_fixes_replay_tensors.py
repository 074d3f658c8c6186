"""Review fixes: a replay rule that would merge two metrics into one series is a SpecError before anything is
emitted (as live); a tensor weight the value cannot take is a MetricValueError at log(), naming the metric."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from metricbus import MetricBus
from metricbus.errors import MetricValueError, SpecError
from metricbus.journal import read_journal
from metricbus.journal.reader import stream_journal
from metricbus.replay import emitted, parse_rule, replay
from metricbus.testing import MemoryAdapter

LATE = 20_000  # > replay_levels._COLUMN_ENTRIES one-row commits
CLASH = r"'x' with spec \[mean, max\] would emit 'x/max', which 'x/max' already emits"


@pytest.fixture(scope="module")
def clashing_journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A journal of metric ``x`` (mean) and a plain metric ``x/max``, the latter first logged at step LATE: after
    more commits than replay holds at once (a batch, a columnar run), so it meets ``x/max`` after it yielded steps."""
    path = tmp_path_factory.mktemp("clash") / "journal"
    with MetricBus(dist=None, journal=str(path)) as bus:
        for step in range(LATE + 2):
            bus.log("x", 1.0)
            if step >= LATE:
                bus.log("x/max", 100.0)
            bus.commit(step)
    return path


def test_live_bus_refuses_the_clash() -> None:
    """The reference: the live bus refuses ``x`` as [mean, max] next to a plain ``x/max``."""
    with MetricBus(dist=None, rules={"x": ["mean", "max"]}) as bus:
        bus.log("x", 1.0)
        with pytest.raises(SpecError, match="'x/max'"):
            bus.log("x/max", 100.0)


def test_stream_replay_rule_clash_raises_before_the_first_emission(clashing_journal: Path) -> None:
    """A streamed replay raises naming both metrics before yielding a step (the clash is first met at step LATE)."""
    stream = emitted(stream_journal(clashing_journal), rules=[parse_rule("x=mean,max")])
    with pytest.raises(SpecError, match=rf"replay rule 'x'.*{CLASH}"):
        next(stream)


def test_read_journal_replay_rule_clash_raises(clashing_journal: Path) -> None:
    """The in-memory Journal path raises the same error."""
    with pytest.raises(SpecError, match=CLASH):
        list(emitted(read_journal(clashing_journal), rules=[parse_rule("x=mean,max")]))


def test_replay_api_rule_clash_opens_no_adapter(clashing_journal: Path) -> None:
    """replay() raises before any adapter is opened or written."""
    mem = MemoryAdapter()
    with pytest.raises(SpecError, match=CLASH):
        replay(clashing_journal, [mem], rules={"x": parse_rule("x=mean,max")[1]})
    assert mem.rows == []
    assert mem.run is None


def test_two_overridden_metrics_that_clash_raise(clashing_journal: Path) -> None:
    """Both names overridden, one rule emitting the other's name: still an error naming both."""
    rules = [parse_rule("x/max=sum"), parse_rule("x=mean,max")]
    with pytest.raises(SpecError, match=r"'x/max'.*'x'|'x'.*'x/max'"):
        list(emitted(stream_journal(clashing_journal), rules=rules))


def test_a_clash_across_rank_files_raises(tmp_path: Path) -> None:
    """Rank 0's file holds ``x``, rank 1's the plain ``x/max``: the streamed replay (one name table per file) raises."""
    from metricbus.adapter import RunInfo
    from metricbus.journal import open_journal

    run = RunInfo()  # one run, as torch.distributed ranks share
    for rank, name in enumerate(("x", "x/max")):
        writer = open_journal(path=str(tmp_path / "ranks"), fsync="never", rank=rank, run=run, rules=[],
                              log_every=1)
        worker = MetricBus(dist=None)
        for step in range(3):
            worker.log(name, 1.0)
            writer.append(step=step, entries=[(rank, worker.export())])
        writer.close()
    with pytest.raises(SpecError, match=CLASH):
        list(emitted(stream_journal(tmp_path / "ranks"), rules=[parse_rule("x=mean,max")]))


def test_a_rule_that_does_not_clash_still_replays(clashing_journal: Path) -> None:
    """``x`` as [mean, min] emits x/mean and x/min next to the plain x/max."""
    rows = list(emitted(stream_journal(clashing_journal), rules=[parse_rule("x=mean,min")]))
    assert rows[0] == (0, {"x/mean": 1.0, "x/min": 1.0})
    assert rows[-1] == (LATE + 1, {"x/mean": 1.0, "x/min": 1.0, "x/max": 100.0})


def test_a_rule_needing_a_sketch_fails_before_the_first_emission(clashing_journal: Path) -> None:
    """A rule reading a sketch the journal lacks, on a name first met at step LATE, fails before step 0 is yielded."""
    stream = emitted(stream_journal(clashing_journal), rules=[parse_rule("x/max=p90")])
    with pytest.raises(SpecError, match="no sketch of 'x/max'"):
        next(stream)


def test_cli_replay_rule_clash_exits_nonzero_and_writes_nothing(clashing_journal: Path, tmp_path: Path) -> None:
    """``metricbus replay --rule`` with a clash: non-zero exit, the error on stderr, no output file."""
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "metricbus", "replay", str(clashing_journal), "--to", f"jsonl:{out}",
            "--rule", "x=mean,max"]
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode != 0
    assert "'x/max', which 'x/max' already emits" in done.stderr
    assert done.stdout == ""
    assert not out.exists()


torch = pytest.importorskip("torch")


@pytest.mark.parametrize(
    ("value_shape", "weight_shape"), [((2,), (3,)), ((2, 3), (2,)), ((), (1,)), ((0,), (3,)), ((4,), (2, 4))]
)
def test_tensor_weight_that_does_not_broadcast_raises_naming_the_metric(
    no_host_sync: None, monkeypatch: pytest.MonkeyPatch, value_shape: tuple[int, ...], weight_shape: tuple[int, ...]
) -> None:
    """A weight whose shape does not broadcast to the value's: MetricValueError at log() naming the metric and both
    shapes, with no host sync; what was logged before (host and device records) still commits."""
    bus = MetricBus(dist=None)
    bus.log("loss", 1.0)
    bus.log("t", torch.ones(value_shape))
    shapes = f"weight of shape {weight_shape!r} for 't' does not broadcast to the value's shape {value_shape!r}"
    with pytest.raises(MetricValueError, match=rf"{re.escape(shapes)}.*or a scalar"):
        bus.log("t", torch.ones(value_shape), weight=torch.ones(weight_shape))
    monkeypatch.undo()  # commit copies the device states to the host, once
    logged = {"t": 1.0} if torch.ones(value_shape).numel() else {}
    assert bus.commit(0) == {"loss": 1.0, **logged}


def test_complex_tensor_weight_is_refused(no_host_sync: None) -> None:
    """A complex tensor weight is a MetricValueError naming the metric (as a complex value is refused), no sync."""
    bus = MetricBus(dist=None)
    bus.log("loss", 1.0)
    with pytest.raises(MetricValueError, match=r"weight of dtype torch.complex64 for 't' is complex.*must be real"):
        bus.log("t", torch.ones(2), weight=torch.ones(2, dtype=torch.complex64))
    assert bus.commit(0) == {"loss": 1.0}


BROADCASTING = [  # (value, weight): a column, a row, 0-d, one element, bool (list weights allow bools too)
    (torch.arange(6.0).reshape(2, 3), torch.tensor([[1.0], [3.0]])),
    (torch.arange(6.0).reshape(2, 3), torch.tensor([1.0, 2.0, 0.5])),
    (torch.arange(3.0), torch.tensor(2.0)),
    (torch.arange(3.0), torch.tensor([2.0])),
    (torch.arange(3.0), torch.tensor([True, False, True])),
]


def test_broadcasting_tensor_weights_are_accepted_without_a_sync(
    no_host_sync: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights that broadcast to the value's shape pass the check with no host sync, and weigh as the same weights
    given as lists."""
    dev = MetricBus(dist=None)
    for i, (value, weight) in enumerate(BROADCASTING):
        dev.log(f"m{i}", value, weight=weight)
    monkeypatch.undo()
    host = MetricBus(dist=None)
    for i, (value, weight) in enumerate(BROADCASTING):
        host.log(f"m{i}", value.tolist(), weight=weight.tolist())
    assert dev.commit(0) == host.commit(0)


def test_log_dict_with_a_bad_tensor_weight_records_nothing() -> None:
    """log(dict) whose shared tensor weight fits one value but not another records none of them."""
    bus = MetricBus(dist=None)
    bus.log("loss", 1.0)
    with pytest.raises(MetricValueError, match="'b'"):
        bus.log({"a": torch.ones(3), "b": torch.ones(2)}, weight=torch.ones(3))
    assert bus.commit(0) == {"loss": 1.0}
