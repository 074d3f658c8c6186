"""metricbus.integrations.verl against verl 0.9.1's own code (installed sources in .venv/verl-src, see verl_source)."""

from __future__ import annotations

import inspect
import json
import logging
import math
import subprocess
import sys
import types
import unittest
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import verl_source
from hypothesis import given, settings
from hypothesis import strategies as st
from metricbus.adapters.jsonl import read_jsonl

from metricbus import ConfigError, SpecError
from metricbus.errors import MetricTypeError
from metricbus.integrations.verl import (
    PRESCALED_LOSS,
    VERL_RULES,
    TrackingBackend,
    VerlIntegrationError,
    aggregate_dp,
    install_tracking_backend,
    metric_spec,
    reduce_metrics,
)
from metricbus.testing import MemoryAdapter

pytestmark = pytest.mark.skipif(
    not verl_source.available(), reason=f"verl {verl_source.VERSION} sources not installed at {verl_source.SOURCE}"
)
WORKERS = Path(__file__).with_name("verl_workers.py")
REFERENCE = {"mean": np.mean, "max": np.max, "min": np.min, "sum": np.sum}

# Names verl's trainer reduces (actor/critic outputs after rename_dict), names of stat-suffixed metrics, and the
# examples in verl's reduce_metrics docstring: verl's substring test picks the right kind for all of them.
VERL_NAMES = (
    "actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy_loss",
    "actor/kl_loss", "actor/kl_coef", "actor/loss", "actor/grad_norm", "actor/lr", "actor/perf/max_memory_allocated_gb",
    "actor/perf/max_memory_reserved_gb", "actor/perf/cpu_memory_used_gb", "perf/mfu/actor", "critic/vf_loss",
    "critic/vf_clipfrac", "critic/vpred_mean", "critic/loss", "critic/grad_norm", "response_length/mean",
    "response_length/max", "response_length/min", "response_length/clip_ratio", "critic/score/max",
    "critic/score/min", "moe/max_vio/layer_0", "moe/min_vio/layer_0", "moe/min_vio/max", "moe/max_vio/avg",
    "global_seqlen/balanced_max", "global_seqlen/balanced_min", "loss", "accuracy", "max_reward", "min_error",
)  # fmt: skip
# Names where the substring test is wrong: name -> (kind verl picks, kind the name means).
SUBSTRING_BUGS = {
    "actor/minibatch_loss": ("min", "mean"),  # "minibatch" contains "min"
    "env/terminal_reward": ("min", "mean"),  # "terminal" contains "min"
    "rollout/dominant_share": ("min", "mean"),  # "dominant" contains "min"
    "moe/max_vio/min": ("max", "min"),  # verl tests "max" first
    "global_seqlen/minmax_diff": ("max", "mean"),  # a per-batch difference, averaged like any per-update value
}


def _verl_metric() -> Any:
    verl_source.verl_modules()
    from verl.utils.metric import utils

    return utils


def _metric(aggregation: str, values: list[float]) -> Any:
    metric = _verl_metric().Metric(aggregation=aggregation)
    metric.extend(values)
    return metric


def _compatible(theirs: Any, ours: Any) -> None:
    """Every parameter of ``theirs`` is in ``ours`` with the same name, kind and default; extras are keyword-only
    with defaults."""
    a, b = inspect.signature(theirs).parameters, inspect.signature(ours).parameters
    assert [(p.name, p.kind, p.default) for p in a.values()] == [(p.name, p.kind, p.default) for p in b.values()][
        : len(a)
    ]
    extra = list(b.values())[len(a) :]
    assert all(p.kind is p.KEYWORD_ONLY or p.default is not p.empty for p in extra)
    assert all(p.default is not p.empty for p in extra)


@pytest.fixture
def tracking_module() -> Iterator[Any]:
    """verl's tracking module with metricbus installed in its Tracking; the class is restored afterwards."""
    verl_source.verl_modules()
    from verl.utils import tracking

    saved = dict(vars(tracking.Tracking))
    install_tracking_backend()
    yield tracking
    for key in set(vars(tracking.Tracking)) - set(saved):
        delattr(tracking.Tracking, key)
    for key in ("__init__", "finish", "supported_backend"):
        setattr(tracking.Tracking, key, saved[key])


@pytest.fixture
def no_metricbus_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No METRICBUS_* variables from the environment running the tests."""
    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)


# -- (a) signatures ----------------------------------------------------------------------------------------------


def test_reduce_metrics_signature_matches_verl() -> None:
    """reduce_metrics takes verl's parameters (plus keyword-only rules=)."""
    _compatible(_verl_metric().reduce_metrics, reduce_metrics)


def test_aggregate_dp_signature_matches_verl() -> None:
    """aggregate_dp takes Metric.aggregate_dp's parameters."""
    _compatible(_verl_metric().Metric.aggregate_dp, aggregate_dp)


def test_backend_signatures_match_verl_loggers(tracking_module: Any) -> None:
    """TrackingBackend.log/finish take what Tracking.log and Tracking.finish pass to a logger."""
    _compatible(tracking_module.FileLogger.log, TrackingBackend.log)
    _compatible(tracking_module.FileLogger.finish, TrackingBackend.finish)
    _compatible(tracking_module.Tracking.finish, TrackingBackend.finish)


def test_installed_tracking_keeps_its_signatures(tracking_module: Any) -> None:
    """The patched Tracking.__init__ and finish have verl's signatures."""
    params = list(inspect.signature(tracking_module.Tracking.__init__).parameters)
    assert params == ["self", "project_name", "experiment_name", "default_backend", "config"]
    assert list(inspect.signature(tracking_module.Tracking.finish).parameters) == ["self", "exit_code"]


# -- (b) reduce_metrics against verl's -----------------------------------------------------------------------------


def test_reduce_metrics_agrees_with_verl_where_verl_is_right() -> None:
    """On verl's metric names the drop-in gives verl's value; only the substring-bug names differ."""
    rng = np.random.default_rng(7)
    names = (*VERL_NAMES, *SUBSTRING_BUGS)
    data = {name: rng.normal(size=int(rng.integers(3, 7))).tolist() for name in names}
    theirs = _verl_metric().reduce_metrics({k: list(v) for k, v in data.items()})
    ours = reduce_metrics({k: list(v) for k, v in data.items()})
    differ = {name for name in names if not math.isclose(ours[name], theirs[name], rel_tol=1e-12)}
    assert differ == set(SUBSTRING_BUGS)
    for name, (verl_kind, meant) in SUBSTRING_BUGS.items():
        assert theirs[name] == REFERENCE[verl_kind](data[name])
        assert ours[name] == pytest.approx(REFERENCE[meant](data[name]), rel=1e-12)


def test_reduce_metrics_fixes_minibatch_loss() -> None:
    """actor/minibatch_loss is a mean (verl: a min, because the name contains 'min')."""
    values = [3.0, 1.0, 2.0]
    assert _verl_metric().reduce_metrics({"actor/minibatch_loss": list(values)})["actor/minibatch_loss"] == 1.0
    assert reduce_metrics({"actor/minibatch_loss": list(values)})["actor/minibatch_loss"] == 2.0


@pytest.mark.parametrize("aggregation", ["mean", "sum", "min", "max"])
def test_reduce_metrics_metric_values_agree_with_verl(aggregation: str) -> None:
    """A verl Metric is reduced with its own aggregation, as verl's Metric.aggregate() does."""
    values = [0.5, -1.25, 4.0, 2.0]
    theirs = _verl_metric().reduce_metrics({"x": _metric(aggregation, values)})["x"]
    assert reduce_metrics({"x": _metric(aggregation, values)})["x"] == pytest.approx(theirs, rel=1e-15)


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=20))
@settings(max_examples=50, deadline=None)
def test_reduce_metrics_matches_numpy_reference(values: list[float]) -> None:
    """Each rule's kind equals numpy on the whole list (mean exact to rounding)."""
    names = {"actor/pg_loss": "mean", "response_length/max": "max", "critic/score/min": "min", "x": "mean"}
    out = reduce_metrics({name: list(values) for name in names})
    for name, kind in names.items():
        assert out[name] == pytest.approx(REFERENCE[kind](values), rel=1e-12, abs=1e-9)


def test_reduce_metrics_is_in_place() -> None:
    """The same dict comes back with every value replaced by a float, as verl's does."""
    metrics: dict[str, Any] = {"a": [1.0, 2.0], "b": 4, "c": np.array([1.0, 5.0]), "empty": []}
    out = reduce_metrics(metrics)
    assert out is metrics
    assert list(out) == ["a", "b", "c", "empty"]
    assert {k: out[k] for k in ("a", "b", "c")} == {"a": 1.5, "b": 4.0, "c": 3.0}
    assert math.isnan(out["empty"])


def test_reduce_metrics_bad_value_changes_nothing() -> None:
    """A value metricbus cannot record raises MetricTypeError (a TypeError) and leaves the dict as it was."""
    metrics: dict[str, Any] = {"a": [1.0, 2.0], "b": ["x"]}
    with pytest.raises(MetricTypeError, match="'b'"):
        reduce_metrics(metrics)
    assert metrics == {"a": [1.0, 2.0], "b": ["x"]}


def test_reduce_metrics_rules_override() -> None:
    """rules= replaces the default rules: first match wins."""
    metrics = {"actor/minibatch_loss": [3.0, 1.0], "response_length/max": [1.0, 2.0]}
    out = reduce_metrics(dict(metrics), rules=[("actor/minibatch_loss", "min")])
    assert out == {"actor/minibatch_loss": 1.0, "response_length/max": 1.5}
    out = reduce_metrics(dict(metrics), rules=[("actor/minibatch_loss", "sum"), *VERL_RULES])
    assert out == {"actor/minibatch_loss": 4.0, "response_length/max": 2.0}


def test_reduce_metrics_plain_list_is_one_value_per_update() -> None:
    """A pre-scaled loss's list holds one value per mini-batch: averaged (update level), not summed."""
    assert reduce_metrics({"actor/pg_loss": [1.0, 3.0]}, rules={"actor/pg_loss": PRESCALED_LOSS}) == {
        "actor/pg_loss": 2.0
    }


@pytest.mark.parametrize(("rules", "match"), [({"x": ["mean", "max"]}, "one kind"), ({"x": "avg"}, "'avg'")])
def test_reduce_metrics_rejects_bad_rules(rules: dict[str, Any], match: str) -> None:
    """A list spec (it would rename the key) or an unknown kind is a SpecError naming the rule."""
    with pytest.raises(SpecError, match=match):
        reduce_metrics({"x": [1.0]}, rules=rules)


def test_metric_spec_table() -> None:
    """AggregationType values map to specs; SUM is the pre-scaled loss; others are a SpecError."""
    aggregation = _verl_metric().AggregationType
    assert [metric_spec(a) for a in aggregation] == ["mean", PRESCALED_LOSS, "min", "max"]
    with pytest.raises(SpecError, match="'median'"):
        metric_spec("median")


def test_aggregate_dp_unequal_micro_batch_counts() -> None:
    """Ranks with different micro-batch counts: the mean over ranks of each rank's sum (verl raises)."""
    ranks = [_metric("sum", [1.0, 2.0]), _metric("sum", [3.0, 4.0, 5.0])]
    with pytest.raises(ValueError, match="same number"):
        _verl_metric().Metric.aggregate_dp(ranks)
    assert aggregate_dp(ranks) == (3.0 + 12.0) / 2


# -- (c) verl's own metric tests, ported -------------------------------------------------------------------------

PORTED_CLASSES = ("TestReduceMetrics", "TestMetric")
# verl's expectation that metricbus deliberately does not meet (none of verl's tests encodes the substring bug):
DIFFERENT = {
    ("TestMetric", "test_aggregate_dp_mismatched_lengths"): "unequal micro-batch counts are reduced, not an error",
}


@pytest.fixture(scope="module")
def verl_metric_tests() -> Any:
    """verl's tests/trainer/ppo/test_metric_utils_on_cpu.py, loaded with its metric_utils import stubbed.

    ``verl.trainer.ppo.metric_utils`` needs transformers and verl's DataProto; the two ported classes do not use
    the names the file imports from it.
    """
    verl_source.verl_modules()
    stub = types.ModuleType("verl.trainer.ppo.metric_utils")
    for name in ("bootstrap_metric", "calc_maj_val", "compute_data_metrics", "compute_throughout_metrics",
                 "compute_timing_metrics", "process_validation_metrics"):  # fmt: skip
        setattr(stub, name, None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, stub.__name__, stub)
        return verl_source.load_file(
            "tests/trainer/ppo/test_metric_utils_on_cpu.py", name="verl_tests_test_metric_utils_on_cpu"
        )


@pytest.fixture
def ported(verl_metric_tests: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """verl's test module with reduce_metrics, Metric.aggregate and Metric.aggregate_dp replaced by metricbus's."""
    metric = verl_metric_tests.Metric
    monkeypatch.setattr(verl_metric_tests, "reduce_metrics", reduce_metrics)
    monkeypatch.setattr(metric, "aggregate", lambda self: reduce_metrics({"metric": self})["metric"])
    monkeypatch.setattr(metric, "aggregate_dp", staticmethod(aggregate_dp))
    return verl_metric_tests


def _methods(module: Any) -> list[tuple[str, str]]:
    loader = unittest.TestLoader()
    return [(cls, m) for cls in PORTED_CLASSES for m in loader.getTestCaseNames(getattr(module, cls))]


def test_ported_verl_tests_are_the_expected_ones(verl_metric_tests: Any) -> None:
    """verl 0.9.1's two metric test classes hold the 3 + 22 methods ported here."""
    methods = _methods(verl_metric_tests)
    assert len(methods) == 25
    assert set(DIFFERENT) <= set(methods)


def test_verl_metric_tests_pass_with_metricbus(ported: Any) -> None:
    """Every method of TestReduceMetrics and TestMetric passes against metricbus, except the documented one."""
    failures = {}
    for cls, method in _methods(ported):
        case = getattr(ported, cls)(method)
        try:
            case.debug()
        except AssertionError as exc:
            failures[(cls, method)] = str(exc)
    assert set(failures) == set(DIFFERENT), failures
    assert "ValueError not raised" in failures[("TestMetric", "test_aggregate_dp_mismatched_lengths")]


# -- (d) verl's file backend and metricbus's jsonl write the same ----------------------------------------------


def test_file_backend_and_metricbus_jsonl_agree(
    tracking_module: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_metricbus_env: None
) -> None:
    """The same Tracking.log calls reach verl's file backend and metricbus's jsonl as the same steps and values."""
    file_path, jsonl_path = tmp_path / "verl.jsonl", tmp_path / "metricbus.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(file_path))
    config = {"trainer": {"project_name": "p"}, "metricbus": {"adapters": [f"jsonl:{jsonl_path}"]}}
    tracking = tracking_module.Tracking("p", "e", default_backend=["file", "metricbus"], config=config)
    calls = [
        ({"actor/pg_loss": 0.1 + 0.2, "response_length/max": 7, "critic/score/mean": np.float64(1e-300)}, 1),
        ({"val-core/acc/mean@1": 2.0 / 3.0}, 1),  # a second call at one step, other names (validation)
        ({"actor/pg_loss": -1.5e308, "response_length/max": np.int64(9), "critic/score/mean": 5e-324}, 2),
        ({"actor/pg_loss": 123456789.123456789}, 4),
    ]
    for data, step in calls:
        tracking.log(data=data, step=step)
    tracking.finish()
    lines = [json.loads(line) for line in file_path.read_text(encoding="utf-8").splitlines()]
    from_file = [(line["step"], {k: float(v) for k, v in line["data"].items()}) for line in lines]
    assert read_jsonl(jsonl_path) == from_file
    assert [step for step, _ in from_file] == [1, 1, 2, 4]


# -- (e) the verl.plugins entry point ----------------------------------------------------------------------------


def _worker(mode: str, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{mode}.json"
    done = subprocess.run(
        [sys.executable, str(WORKERS), mode, str(out)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    result["stdout"] = done.stdout
    return result


def test_plugin_entry_point_is_registered() -> None:
    """The installed metricbus registers verl_plugin in the verl.plugins group."""
    from importlib.metadata import entry_points

    assert [(ep.name, ep.value) for ep in entry_points(group="verl.plugins") if ep.name == "metricbus"] == [
        ("metricbus", "metricbus.integrations.verl_plugin")
    ]


def test_plugin_load_makes_tracking_accept_metricbus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's own plugin loader in a fresh process: Tracking(console, metricbus) delivers to metricbus's jsonl."""
    jsonl_path = tmp_path / "metrics.jsonl"
    config = tmp_path / "metricbus.json"
    config.write_text(json.dumps({"adapters": [f"jsonl:{jsonl_path}"]}), encoding="utf-8")
    monkeypatch.setenv("METRICBUS_CONFIG", str(config))
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    monkeypatch.delenv("VERL_USE_EXTERNAL_PLUGINS", raising=False)
    result = _worker("plugin", tmp_path)
    assert result["supported"] is True
    assert result["backends"] == ["console", "metricbus"]
    assert result["run"] == ["proj", "exp"]
    assert "step:2 - actor/pg_loss:0.125" in result["stdout"]  # verl's console backend still runs
    assert read_jsonl(jsonl_path) == [
        (1, {"actor/pg_loss": 0.25, "response_length/max": 7.0}),
        (2, {"actor/pg_loss": 0.125, "response_length/max": 9.0}),
    ]


def test_plugin_warns_loudly_on_another_verl(tmp_path: Path) -> None:
    """With a Tracking unlike verl 0.9's, loading the plugin raises nothing and warns at WARNING level."""
    result = _worker("mismatch", tmp_path)
    assert result["loaded"] is True
    assert [level for level, _ in result["logged"]] == ["WARNING"]
    assert "supports verl 0.9.x" in result["logged"][0][1]
    assert len(result["warned"]) == 1
    assert "supports verl 0.9.x" in result["warned"][0]


def test_importing_metricbus_does_not_import_verl(tmp_path: Path) -> None:
    """import metricbus and metricbus.integrations.verl import no verl, torch, ray or omegaconf."""
    assert _worker("imports", tmp_path)["imported"] == []


# -- the backend and its installation ----------------------------------------------------------------------------


def test_install_is_idempotent(tracking_module: Any) -> None:
    """Installing twice adds the backend name once and wraps __init__ once."""
    init = tracking_module.Tracking.__init__
    install_tracking_backend()
    assert tracking_module.Tracking.supported_backend.count("metricbus") == 1
    assert tracking_module.Tracking.__init__ is init


def test_install_refuses_another_tracking_shape() -> None:
    """A Tracking without verl 0.9's shape is a VerlIntegrationError that says which verl is supported."""

    class Tracking:
        def __init__(self, project_name: str) -> None: ...

    with pytest.raises(VerlIntegrationError, match=r"supported_backend.*verl 0\.9\.x"):
        install_tracking_backend(Tracking)


def test_unknown_backend_still_fails_verls_assert(tracking_module: Any) -> None:
    """Installing metricbus leaves verl's check of other names alone."""
    with pytest.raises(AssertionError, match="metricbux is not supported"):
        tracking_module.Tracking("p", "e", default_backend=["metricbux"])


def test_backend_without_config_is_a_config_error(no_metricbus_env: None) -> None:
    """No metricbus section, METRICBUS_CONFIG or METRICBUS_ADAPTERS: a ConfigError saying what to set."""
    with pytest.raises(ConfigError, match="METRICBUS_CONFIG"):
        TrackingBackend.from_verl("p", "e", {"trainer": {}})


def test_backend_config_section_wins_over_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A metricbus section in verl's config is used instead of $METRICBUS_CONFIG."""
    monkeypatch.setenv("METRICBUS_CONFIG", str(tmp_path / "missing.json"))
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    mem = MemoryAdapter()
    backend = TrackingBackend.from_verl("p", "e", {"metricbus": {"adapters": [mem], "strict": True}, "lr": 0.1})
    backend.log({"a": 1.0}, step=3)
    backend.finish()
    assert mem.rows == [(3, {"a": 1.0})]
    assert (mem.run.project, mem.run.name, dict(mem.run.config)) == ("p", "e", {"lr": 0.1})  # type: ignore[union-attr]
    assert mem.status == "finished"


def test_backend_omegaconf_section(tmp_path: Path, no_metricbus_env: None) -> None:
    """verl's config as an OmegaConf DictConfig works the same."""
    from omegaconf import OmegaConf

    path = tmp_path / "m.jsonl"
    config = OmegaConf.create({"metricbus": {"adapters": [f"jsonl:{path}"]}, "trainer": {"logger": ["metricbus"]}})
    backend = TrackingBackend.from_verl("p", "e", config)
    backend.log({"a": 0.5}, step=2)
    backend.finish()
    assert read_jsonl(path) == [(2, {"a": 0.5})]
    assert dict(backend.bus.run.config) == {"trainer": {"logger": ["metricbus"]}}


def _memory_backend() -> tuple[TrackingBackend, MemoryAdapter]:
    mem = MemoryAdapter()
    return TrackingBackend.from_verl("p", "e", {"metricbus": {"adapters": [mem], "strict": True}}), mem


def test_backend_skips_repeated_name_at_a_step(caplog: pytest.LogCaptureFixture, no_metricbus_env: None) -> None:
    """A name logged twice at one step is left out and reported once; other names at that step still arrive."""
    backend, mem = _memory_backend()
    with caplog.at_level(logging.WARNING, logger="metricbus.verl"):
        backend.log({"a": 1.0}, step=1)
        backend.log({"a": 2.0, "b": 3.0}, step=1)
        backend.log({"a": 4.0}, step=1)
        backend.log({"a": 5.0}, step=2)
    backend.finish()
    assert mem.rows == [(1, {"a": 1.0}), (1, {"b": 3.0}), (2, {"a": 5.0})]
    assert [r.getMessage().count("already logged") for r in caplog.records] == [1]


def test_backend_skips_values_it_cannot_record(caplog: pytest.LogCaptureFixture, no_metricbus_env: None) -> None:
    """A non-numeric value is reported and left out; the step's numbers arrive."""
    backend, mem = _memory_backend()
    with caplog.at_level(logging.WARNING, logger="metricbus.verl"):
        backend.log({"a": 1.0, "table": "not a number", "none": None}, step=0)
    backend.finish()
    assert mem.rows == [(0, {"a": 1.0})]
    assert len(caplog.records) == 2


def test_backend_ignores_a_step_going_back(caplog: pytest.LogCaptureFixture, no_metricbus_env: None) -> None:
    """A step below the last one is reported and not logged (steps never go back within a run)."""
    backend, mem = _memory_backend()
    backend.log({"a": 1.0}, step=5)
    with caplog.at_level(logging.WARNING, logger="metricbus.verl"):
        backend.log({"a": 2.0}, step=4)
    backend.log({"a": 3.0}, step=6)
    backend.finish()
    assert mem.rows == [(5, {"a": 1.0}), (6, {"a": 3.0})]
    assert "below the last step 5" in caplog.text


def test_tracking_finish_with_exit_code_fails_the_run(tracking_module: Any, no_metricbus_env: None) -> None:
    """Tracking.finish(exit_code=1) closes the metricbus run as failed, once."""
    mem = MemoryAdapter()
    tracking = tracking_module.Tracking(
        "p", "e", default_backend="metricbus", config={"metricbus": {"adapters": [mem]}}
    )
    tracking.log({"a": 1.0}, step=0)
    tracking.finish(exit_code=1)
    tracking.finish()
    assert mem.status == "failed"
    assert mem.rows == [(0, {"a": 1.0})]


def test_backend_applies_verl_rules_over_a_window(no_metricbus_env: None) -> None:
    """With log_every=2 the step level follows VERL_RULES: max for */max, mean for losses."""
    mem = MemoryAdapter()
    backend = TrackingBackend.from_verl("p", "e", {"metricbus": {"adapters": [mem], "log_every": 2}})
    backend.log({"response_length/max": 3.0, "actor/pg_loss": 1.0}, step=0)
    backend.log({"response_length/max": 2.0, "actor/pg_loss": 2.0}, step=1)
    backend.finish()
    assert mem.rows == [(1, {"response_length/max": 3.0, "actor/pg_loss": 1.5})]
