"""Review of the CLI, config and core API: each test a contract break found by running the real code."""

from __future__ import annotations

import math
import re
import struct
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metricbus import Agg, MetricBus, SpecError, StepError, quantile
from metricbus.adapter import RunInfo, Status
from metricbus.cli import main
from metricbus.errors import ConfigError, JournalError
from metricbus.journal import read_journal, stream_journal
from metricbus.kinds import canonical
from metricbus.partial import Partial
from metricbus.replay import parse_rule, replay
from metricbus.spec import parse_spec
from metricbus.testing import MemoryAdapter
from tests.test_replay import single_controller_run


@pytest.fixture
def journal(tmp_path: Path) -> Path:
    """A single-controller journal (11 commits, log_every 3; metrics grad/norm, loss, pg_loss, tokens)."""
    single_controller_run(tmp_path / "journal")
    return tmp_path / "journal"


# -- --rule: the level form -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("loss=micro:mean,rank:avg", r"unknown aggregation 'avg' for 'loss' \(rank level\); use one of mean, sum"),
        ("loss=micro:", r"no kind for the micro level in spec for 'loss'; use e\.g\. 'micro:sum'"),
        ("loss=micro:sum,micro:mean", r"the micro level is given twice in spec for 'loss'"),
        ("loss=nan:ignore,nan:error", r"the nan level is given twice in spec for 'loss'"),
    ],
)
def test_a_bad_level_rule_names_the_metric_and_exits_2(
    journal: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], rule: str, message: str
) -> None:
    """A wrong kind, an empty kind or a level given twice in a --rule is one line naming the metric (it named 'Agg',
    or the last of two kinds silently won), and nothing is written."""
    out = tmp_path / "out.jsonl"
    assert main(["replay", str(journal), "--to", f"jsonl:{out}", "--rule", rule]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "'Agg'" not in err
    assert re.search(message, err), err
    assert not out.exists()


def test_spaces_after_a_level_colon_are_allowed() -> None:
    """``micro: sum, rank: mean`` is ``micro:sum,rank:mean`` (spaces around commas were already allowed; around the
    colon they made the kind ' sum', an unknown aggregation)."""
    assert parse_rule("pg_loss=micro: sum, rank :mean") == parse_rule("pg_loss=micro:sum,rank:mean")


# -- --rule: a pattern that matches nothing -----------------------------------------------------------------------


def test_a_rule_matching_no_metric_is_an_error(
    journal: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --rule whose pattern matches no journaled metric (a typo: 'los') re-aggregated nothing and exited 0; it is
    an error naming the rule and the journal's metrics, as ``show --metric`` does, and nothing is written."""
    out = tmp_path / "out.jsonl"
    assert main(["replay", str(journal), "--to", f"jsonl:{out}", "--rule", "los=sum"]) == 2
    err = capsys.readouterr().err
    assert "replay rule 'los' matches no metric of the journal; it has grad/norm, loss, pg_loss, tokens" in err
    assert not out.exists()


def test_a_rule_matching_some_metric_still_replays(journal: Path) -> None:
    """With every_rule (the CLI's --rule), of two rules one matching nothing is refused; from Python it is left
    unused by default, as a live bus's rule that matches nothing (a shared rule set names metrics a run may lack)."""
    mem = MemoryAdapter()
    assert replay(journal, [mem], rules=[parse_rule("grad/*=max")], every_rule=True) == 4
    both = [parse_rule("grad/*=max"), parse_rule("nosuch=sum")]
    with pytest.raises(SpecError, match="replay rule 'nosuch' matches no metric"):
        replay(journal, [MemoryAdapter()], rules=both, every_rule=True)
    lenient = MemoryAdapter()
    assert replay(journal, [lenient], rules=both) == 4
    assert lenient.rows == mem.rows


# -- sync without adapters ------------------------------------------------------------------------------------


def test_sync_without_adapters_says_how_to_give_them(
    journal: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sync`` has no --to: with no adapters it said "give --to ADAPTER"; it names --config and the variables."""
    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    assert main(["sync", str(journal)]) == 2
    err = capsys.readouterr().err
    assert "--to" not in err
    assert "give --config FILE with adapters, or set $METRICBUS_CONFIG or $METRICBUS_ADAPTERS" in err


# -- replay closes every adapter it opened ----------------------------------------------------------------------


class _Refuses(MemoryAdapter):
    """An adapter whose ``open`` (or ``flush``) raises, as a backend that is down does."""

    name = "refuses"

    def __init__(self, *, at: str) -> None:
        super().__init__()
        self.at = at

    def open(self, *, run: RunInfo) -> None:
        if self.at == "open":
            raise ConnectionError("backend down")
        super().open(run=run)

    def flush(self) -> None:
        if self.at == "flush":
            raise ConnectionError("backend down")


def test_replay_closes_the_adapters_it_opened_when_a_later_one_cannot_open(journal: Path) -> None:
    """An adapter that cannot open left the ones opened before it open (an MLflow run RUNNING for ever); they are
    closed as failed, and the error is raised."""
    first = MemoryAdapter()
    with pytest.raises(ConnectionError, match="backend down"):
        replay(journal, [first, _Refuses(at="open"), MemoryAdapter()])
    assert first.status == "failed"


def test_replay_closes_every_adapter_when_one_flush_fails(journal: Path) -> None:
    """A flush that raises at the end left the adapters after it unflushed and unclosed; each is flushed and closed
    (the one that failed as failed), and the error is raised."""
    failing, after = _Refuses(at="flush"), MemoryAdapter()
    with pytest.raises(ConnectionError, match="backend down"):
        replay(journal, [failing, after])
    statuses: list[Status | None] = [failing.status, after.status]
    assert statuses == ["failed", "finished"]
    assert [step for step, _ in after.rows] == [2, 5, 8, 10]


# -- quantile(-0.0) ----------------------------------------------------------------------------------------------


def test_quantile_of_negative_zero_is_p0() -> None:
    """``quantile(-0.0)`` returned 'p-0', a kind the library itself refused; ``quantile(-0)`` in a spec emitted
    'x/p-0' next to 'x/p0'. Both are p0."""
    assert quantile(-0.0) == "p0"
    assert canonical("quantile(-0)") == canonical("quantile(-0.0)") == "p0"
    with MetricBus(dist=None) as bus:
        bus.define("x", quantile(-0.0))
        bus.log("x", [1.0, 2.0])
        assert list(bus.commit(0)) == ["x"]
    with pytest.raises(SpecError, match="emits x/p0 twice"):
        parse_spec(["p0", "quantile(-0)"], metric="x")


# -- a StepError keeps ingested partials worker by worker ---------------------------------------------------------


def _partial(value: float) -> Partial:
    """One worker's export of ``value`` for ``x``, declared ``Agg(micro="sum", rank="mean")``."""
    with MetricBus(dist=None, rules=_SUM_MEAN) as worker:
        worker.log("x", value)
        return worker.export()


_SUM_MEAN = {"x": Agg(micro="sum", rank="mean")}


@pytest.mark.parametrize("bad", [3, True, 2**63])
def test_a_refused_step_keeps_ingested_partials_worker_by_worker(tmp_path: Path, bad: object) -> None:
    """A commit refused for its step (below the last, a bool, out of range) kept the driver's ingested partials as
    extra workers: the next commit averaged over 4 workers instead of 2 (8.25, not 16.5). Worker i's records join
    the i-th partial ingested after the error, as the README says, live and in replay."""
    mem = MemoryAdapter()
    with MetricBus(dist=None, rules=_SUM_MEAN, strict=True, adapters=[mem], journal=str(tmp_path / "j")) as driver:
        driver.commit(step=5)
        driver.ingest([_partial(1.0), _partial(2.0)])
        with pytest.raises(StepError):
            driver.commit(step=bad)  # type: ignore[arg-type]
        driver.ingest([_partial(10.0), _partial(20.0)])
        assert driver.commit(step=6) == {"x": (11.0 + 22.0) / 2}
    again = MemoryAdapter()
    replay(tmp_path / "j", [again])
    assert again.rows == mem.rows == [(6, {"x": 16.5})]


# -- an OmegaConf config that does not resolve ------------------------------------------------------------------


def test_an_unresolvable_omegaconf_interpolation_is_a_config_error() -> None:
    """``${missing}`` in an OmegaConf config escaped from_config() as omegaconf's InterpolationKeyError; it is a
    ConfigError naming the key, as every other config mistake."""
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"dist": None, "run": {"name": "${trainer.name}"}})
    with pytest.raises(ConfigError, match=r"^config: run\.name: cannot resolve the OmegaConf config: Interpolation key "
                       r"'trainer\.name' not found$"):
        MetricBus.from_config(cfg)


# -- resume with another log_every --------------------------------------------------------------------------------


def test_resuming_with_another_log_every_is_refused(tmp_path: Path) -> None:
    """A journal written with log_every=3 and resumed with log_every=2 replayed its first segment's windows with 2
    (steps 1, 3, 5 instead of the live 2, 5: other values than live delivered). The resume is refused naming both,
    before anything is written, and the journal still replays what live delivered."""
    live = MemoryAdapter()
    with MetricBus(dist=None, log_every=3, adapters=[live], journal=str(tmp_path / "j")) as bus:
        for step in range(6):
            bus.log("x", float(step))
            bus.commit(step)
    with pytest.raises(JournalError, match=r"written with log_every=3; resume it with log_every=3.* got log_every=2"):
        MetricBus(dist=None, log_every=2, journal=str(tmp_path / "j"), resume=True)
    again = MemoryAdapter()
    replay(tmp_path / "j", [again])
    assert again.rows == live.rows == [(2, {"x": 1.0}), (5, {"x": 4.0})]
    with MetricBus(dist=None, log_every=3, adapters=[live], journal=str(tmp_path / "j"), resume=True) as bus:
        for step in range(6, 9):
            bus.log("x", float(step))
            bus.commit(step)
    replay(tmp_path / "j", [fresh := MemoryAdapter()])
    assert fresh.rows == live.rows == [(2, {"x": 1.0}), (5, {"x": 4.0}), (8, {"x": 7.0})]


# -- a config file that does not parse ----------------------------------------------------------------------------


def test_a_yaml_parse_error_is_one_line_with_its_position(
    journal: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """PyYAML's message is seven lines (a caret drawing among them), so ``sync --config`` printed seven lines where
    the CLI promises one; it is one line with the file, the problem and its line and column."""
    config = tmp_path / "c.yaml"
    config.write_text("adapters: [console\n")
    assert main(["sync", str(journal), "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"metricbus: error: {config}: cannot parse: expected ',' or ']', but got '<stream end>' at line 2, column 1 "
        "(while parsing a flow sequence at line 1, column 11)\n"
    )


# -- --rule with a nan policy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["x=nan:ignore", "x=micro:mean,nan:error"])
def test_a_rule_that_changes_the_nan_policy_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rule: str
) -> None:
    """``--rule 'x=nan:ignore'`` (advertised by ``replay --help``) replayed x's NaN at step 2 as before and exited 0:
    a nan policy acts when records are logged, and the journal holds their summaries. The rule is refused naming
    the metric, before anything is written."""
    with MetricBus(dist=None, journal=str(tmp_path / "j")) as bus:
        for step in range(3):
            bus.log("x", [1.0, math.nan if step == 2 else 2.0])
            bus.commit(step)
    out = tmp_path / "out.jsonl"
    assert main(["replay", str(tmp_path / "j"), "--to", f"jsonl:{out}", "--rule", rule]) == 2
    err = capsys.readouterr().err
    assert "for 'x' sets nan=" in err
    assert "a replay cannot drop or check non-finite records again; leave nan out of the rule" in err
    assert not out.exists()


def test_a_rule_may_repeat_the_journaled_nan_policy(tmp_path: Path) -> None:
    """A rule whose nan policy is the one the metric was logged under changes nothing and replays."""
    with MetricBus(dist=None, journal=str(tmp_path / "j"), rules={"x": Agg(nan="ignore")}) as bus:
        bus.log("x", [1.0, math.nan, 3.0])
        bus.commit(0)
    mem = MemoryAdapter()
    replay(tmp_path / "j", [mem], rules=[parse_rule("x=micro:sum,nan:ignore")])
    assert mem.rows == [(0, {"x": 4.0})]


# -- define() with two nan policies --------------------------------------------------------------------------------


def test_define_with_two_different_nan_policies_is_refused() -> None:
    """``define("x", Agg(micro="sum", nan="ignore"), nan="propagate")`` silently kept 'propagate' (x's NaN made the
    sum NaN); two policies in one declaration are a SpecError naming both, as a spec list mixing them is, and the
    rule is not added. The same policy twice is fine."""
    with MetricBus(dist=None) as bus:
        with pytest.raises(SpecError, match=r"define\('x'\) gives nan='propagate' and its spec nan='ignore'; give one"):
            bus.define("x", Agg(micro="sum", nan="ignore"), nan="propagate")
        assert str(bus.spec_of("x")) == "mean"
        bus.define("x", Agg(micro="sum", nan="ignore"), nan="ignore")
        bus.log("x", [1.0, math.nan, 2.0])
        assert bus.commit(0) == {"x": 3.0}


# -- property: one bus == a driver's ingest == replay, and each equals a plain reference ---------------------------

_PROPERTY_RULES: dict[str, Any] = {
    "m": "mean", "s": "sum", "sd": ["std", "mean"], "q": ["p50", "p90", "hist"],
    "fl": ["first", "last", "min", "max", "count"], "pl": Agg(micro="sum", update="mean", rank="mean"),
    "rq": Agg(micro="mean", rank="p90"), "stp": Agg(micro="sum", step="max"), "lst": Agg(micro="first", rank="last"),
}  # fmt: skip
_VALUES = st.one_of(st.floats(-1e6, 1e6, allow_nan=False), st.sampled_from([0.0, -0.0, 1e300, -1e-300, 3.0]))
# (update, name, values, weights or None, logged one float at a time)
_Record = tuple[int, str, list[float], list[float] | None, bool]


@st.composite
def _plans(draw: st.DrawFn) -> tuple[int, int, list[list[list[_Record]]]]:
    """(workers, log_every, per commit per worker the records): 1-3 updates of 0-2 calls each, any metric, weights
    on about half of the calls, so a metric appears in some commits and updates only."""
    workers, log_every = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    plan = []
    for _ in range(draw(st.integers(1, 6))):
        per_worker = []
        for _ in range(workers):
            records: list[_Record] = []
            for update in range(draw(st.integers(1, 3))):
                for _ in range(draw(st.integers(0, 2))):
                    values = draw(st.lists(_VALUES, min_size=1, max_size=4))
                    weights = [float(draw(st.integers(0, 5))) for _ in values] if draw(st.booleans()) else None
                    records.append((update, draw(st.sampled_from(sorted(_PROPERTY_RULES))), values, weights,
                                    draw(st.booleans())))
            per_worker.append(records)
        plan.append(per_worker)
    return workers, log_every, plan


def _log_records(bus: MetricBus, records: list[_Record]) -> None:
    update = 0
    for at, name, values, weights, one_by_one in records:
        while update < at:
            bus.end_update()
            update += 1
        if one_by_one and weights is None:
            for value in values:
                bus.log(name, value)
        else:
            bus.log(name, values, weight=weights)


def _bits(rows: list[tuple[int, dict[str, float]]]) -> list[tuple[int, dict[str, bytes]]]:
    return [(step, {k: struct.pack("<d", v) for k, v in metrics.items()}) for step, metrics in rows]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plans())
def test_one_bus_ingest_and_replay_emit_the_same_bits(plan: tuple[int, int, list[list[list[_Record]]]]) -> None:
    """Over random splits into workers, updates, calls and commits (weights, std, quantiles, lifted chains, metrics
    in some commits only, any log_every): the driver's ingest, the streamed and the in-memory replay of its journal
    emit the same bits, and with one worker so does a bus logging everything itself."""
    workers, log_every, commits = plan
    with tempfile.TemporaryDirectory() as tmp:
        live = MemoryAdapter()
        with MetricBus(dist=None, rules=_PROPERTY_RULES, journal=f"{tmp}/j", adapters=[live], strict=True,
                       log_every=log_every) as driver:
            for step, per_worker in enumerate(commits):
                parts = []
                for records in per_worker:
                    with MetricBus(dist=None, rules=_PROPERTY_RULES) as worker:
                        _log_records(worker, records)
                        parts.append(worker.export())
                driver.ingest(parts)
                driver.commit(step)
        streamed, in_memory = MemoryAdapter(), MemoryAdapter()
        replay(stream_journal(f"{tmp}/j"), [streamed])
        replay(read_journal(f"{tmp}/j"), [in_memory])
    assert _bits(streamed.rows) == _bits(in_memory.rows) == _bits(live.rows)
    if workers == 1:
        alone = MemoryAdapter()
        with MetricBus(dist=None, rules=_PROPERTY_RULES, adapters=[alone], strict=True, log_every=log_every) as bus:
            for step, per_worker in enumerate(commits):
                _log_records(bus, per_worker[0])
                bus.commit(step)
        assert _bits(alone.rows) == _bits(live.rows)


_LEVEL_SPECS: dict[str, Agg | str] = {
    "a": Agg(micro="sum", update="mean", rank="mean"), "b": Agg(micro="sum", rank="mean"), "c": "mean", "d": "sum",
    "e": "std", "f": "first", "g": "last", "h": "count", "i": Agg(micro="mean", rank="max"),
    "j": Agg(micro="max", update="sum", rank="min", step="mean"), "k": Agg(micro="count", rank="sum", step="max"),
    "l": Agg(micro="last", update="first", rank="sum"), "m": Agg(micro="std", rank="mean"),
    "n": Agg(micro="mean", update="std"), "o": Agg(micro="first", rank="last", step="first"),
}  # fmt: skip


def _kind(kind: str, records: list[tuple[float, float]]) -> float:
    """``kind`` of ``records`` ((x, w) pairs, in order), computed on the whole with fractions."""
    xs = [x for x, _ in records]
    simple = {"sum": lambda: float(sum(map(Fraction, xs))), "count": lambda: float(len(xs)), "min": lambda: min(xs),
              "max": lambda: max(xs), "first": lambda: xs[0], "last": lambda: xs[-1]}  # fmt: skip
    if kind in simple:
        return simple[kind]()
    weight = sum(Fraction(w) for _, w in records)
    mean = sum(Fraction(w) * Fraction(x) for x, w in records) / weight
    if kind == "mean":
        return float(mean)
    return math.sqrt(float(sum(Fraction(w) * (Fraction(x) - mean) ** 2 for x, w in records) / weight))


def _level(below: str, above: str, groups: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The records of the next level: the groups' states merged where the kind stays, else each group's value as
    one unit-weight record."""
    groups = [g for g in groups if g]
    if below == above:
        return [r for g in groups for r in g]
    return [(_kind(below, g), 1.0) for g in groups]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_levels_match_a_plain_reference(data: st.DataObject) -> None:
    """Each emitted value is the README's continuation rule applied to the unsplit records: micro -> update -> rank
    (ingested workers; ``last`` takes the lowest-ranked worker) -> step (the commits of a log_every window)."""
    workers, log_every = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    value = st.sampled_from([1.0, 2.0, -3.5, 0.25, 7.0, 1e3, -1e-3])
    # per commit, per worker, per update: name -> [(x, w)]
    commits = [[[{name: [(data.draw(value), float(data.draw(st.integers(1, 4))))
                         for _ in range(data.draw(st.integers(1, 3)))]
                  for name in data.draw(st.sets(st.sampled_from(sorted(_LEVEL_SPECS)), max_size=4))}
                 for _ in range(data.draw(st.integers(1, 3)))] for _ in range(workers)]
               for _ in range(data.draw(st.integers(1, 5)))]  # fmt: skip
    live = MemoryAdapter()
    with MetricBus(dist=None, rules=_LEVEL_SPECS, adapters=[live], strict=True, log_every=log_every) as driver:
        for step, per_worker in enumerate(commits):
            parts = []
            for updates in per_worker:
                with MetricBus(dist=None, rules=_LEVEL_SPECS) as worker:
                    for update in updates:
                        for name, records in update.items():
                            worker.log(name, [x for x, _ in records], weight=[w for _, w in records])
                        worker.end_update()
                    parts.append(worker.export())
            driver.ingest(parts)
            driver.commit(step)
    want: list[tuple[int, dict[str, float]]] = []
    for start in range(0, len(commits), log_every):
        window = range(start, min(start + log_every, len(commits)))
        row = {}
        for name, spec in _LEVEL_SPECS.items():
            chain = parse_spec(spec, metric=name).chains[0]
            per_commit = []
            for step in window:
                ranked = [_level(chain.micro, chain.update, [u.get(name, []) for u in ups]) for ups in commits[step]]
                records = _level(chain.update, chain.rank, ranked)
                if chain.rank == "last" and records:  # across workers, last takes the lowest-ranked worker
                    lowest = next(r for r in ranked if r)
                    records = lowest if chain.update == "last" else records[:1]
                per_commit.append(records)
            records = _level(chain.rank, chain.step, per_commit)
            if records:
                row[name] = _kind(chain.step, records)
        if row:
            want.append((window[-1], row))
    assert [(s, sorted(m)) for s, m in live.rows] == [(s, sorted(m)) for s, m in want]
    for (_, got), (_, expected) in zip(live.rows, want, strict=True):
        for name, value_ in expected.items():
            exact = _LEVEL_SPECS[name] in ("mean", "sum", "first", "last", "count")
            assert got[name] == (value_ if exact else pytest.approx(value_, rel=1e-9, abs=1e-12)), name
