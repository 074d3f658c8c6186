"""MetricBus.from_config: every accepted form of source and adapter, and each kind of mistake with its location."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from metricbus.adapters.console import ConsoleAdapter
from metricbus.adapters.jsonl import JsonlAdapter, read_jsonl
from metricbus.adapters.mlflow import MlflowAdapter
from metricbus.adapters.tensorboard import TensorBoardAdapter
from omegaconf import OmegaConf

from metricbus import Agg, ConfigError, MetricBus
from metricbus.config import bus_options
from metricbus.testing import MemoryAdapter

RULES_YAML = """\
metrics:
  "actor/pg_loss": {micro: sum, rank: mean}
  response_length: [mean, max, min]
log_every: 1
dist: null
strict: true
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No METRICBUS_* variables leak in from the environment."""
    monkeypatch.delenv("METRICBUS_CONFIG", raising=False)
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)


def _train(bus: MetricBus) -> None:
    for step in range(3):
        for micro in range(2):
            bus.log("actor/pg_loss", float(step + micro))
            bus.log("response_length", float(10 * step + micro))
        bus.commit()
    bus.close()


EXPECTED = [
    (step, {
        "actor/pg_loss": 2.0 * step + 1.0,
        "response_length/mean": 10.0 * step + 0.5,
        "response_length/max": 10.0 * step + 1.0,
        "response_length/min": 10.0 * step,
    })
    for step in range(3)
]  # fmt: skip


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _config_files(tmp_path: Path) -> dict[str, Path]:
    out = tmp_path / "out.jsonl"
    return {
        "yaml": _write(tmp_path / "c.yaml", RULES_YAML + f"adapters: ['jsonl:{out}']\n"),
        "yml": _write(tmp_path / "c.yml", RULES_YAML + f"adapters:\n  - type: jsonl\n    path: {out}\n"),
        "toml": _write(tmp_path / "c.toml", (
            f'adapters = ["jsonl:{out}"]\nlog_every = 1\ndist = "none"\nstrict = true\n'
            '[metrics]\n"actor/pg_loss" = {micro = "sum", rank = "mean"}\nresponse_length = ["mean", "max", "min"]\n'
        )),
        "json": _write(tmp_path / "c.json", json.dumps({
            "adapters": [{"type": "jsonl", "path": str(out)}], "dist": None, "strict": True,
            "metrics": {"actor/pg_loss": {"micro": "sum", "rank": "mean"}, "response_length": ["mean", "max", "min"]},
        })),
    }  # fmt: skip


@pytest.mark.parametrize("fmt", ["yaml", "yml", "toml", "json"])
def test_file_sources(tmp_path: Path, fmt: str) -> None:
    """A YAML, TOML or JSON file sets adapters and metric rules; the trainer's values arrive reduced as declared."""
    _train(MetricBus.from_config(_config_files(tmp_path)[fmt]))
    assert read_jsonl(tmp_path / "out.jsonl") == EXPECTED


def test_path_object_source(tmp_path: Path) -> None:
    """A pathlib.Path works like a string path."""
    _train(MetricBus.from_config(Path(_config_files(tmp_path)["yaml"])))
    assert read_jsonl(tmp_path / "out.jsonl") == EXPECTED


def test_dict_source(tmp_path: Path) -> None:
    """A plain dict is a config."""
    out = tmp_path / "out.jsonl"
    source = {
        "adapters": [f"jsonl:{out}"], "dist": None,
        "metrics": {"actor/pg_loss": {"micro": "sum", "rank": "mean"}, "response_length": ["mean", "max", "min"]},
    }  # fmt: skip
    _train(MetricBus.from_config(source))
    assert read_jsonl(out) == EXPECTED


def test_dictconfig_source_is_resolved(tmp_path: Path) -> None:
    """An OmegaConf DictConfig (as Hydra and verl pass) is read with interpolations resolved."""
    cfg = OmegaConf.create({
        "out_dir": str(tmp_path),
        "metricbus": {
            "adapters": ["jsonl:${out_dir}/out.jsonl"], "dist": None,
            "metrics": {"actor/pg_loss": {"micro": "sum", "rank": "mean"},
                        "response_length": ["mean", "max", "min"]},
        },
    })  # fmt: skip
    _train(MetricBus.from_config(cfg.metricbus))
    assert read_jsonl(tmp_path / "out.jsonl") == EXPECTED


def test_listconfig_inside_a_dict(tmp_path: Path) -> None:
    """An OmegaConf list nested in a plain dict (verl's ``trainer.logger``) is accepted."""
    cfg = OmegaConf.create({"logger": ["console", f"jsonl:{tmp_path / 'x.jsonl'}"]})
    options = bus_options({"adapters": cfg.logger})
    assert [type(a) for a in options["adapters"]] == [ConsoleAdapter, JsonlAdapter]


def test_env_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no source, the file named by METRICBUS_CONFIG is read."""
    monkeypatch.setenv("METRICBUS_CONFIG", str(_config_files(tmp_path)["toml"]))
    _train(MetricBus.from_config())
    assert read_jsonl(tmp_path / "out.jsonl") == EXPECTED


def test_no_source_no_env_is_empty() -> None:
    """With no source and no METRICBUS_CONFIG the config is empty: a bus with no adapters."""
    assert bus_options(None) == {}
    bus = MetricBus.from_config(dist=None)
    bus.log("x", 1.0)
    assert bus.commit() == {"x": 1.0}
    bus.close()


def test_env_adapters_replace_the_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """METRICBUS_ADAPTERS replaces the source's adapter list; the rest of the source still applies."""
    other = tmp_path / "other.jsonl"
    monkeypatch.setenv("METRICBUS_ADAPTERS", f"console, jsonl:{other}")
    options = bus_options(_config_files(tmp_path)["yaml"])
    assert [type(a) for a in options["adapters"]] == [ConsoleAdapter, JsonlAdapter]
    assert options["adapters"][1].path == other
    assert options["log_every"] == 1


def test_env_adapters_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """METRICBUS_ADAPTERS=none switches every adapter off."""
    monkeypatch.setenv("METRICBUS_ADAPTERS", "none")
    assert bus_options({"adapters": ["console"]})["adapters"] == []


def test_overrides_win(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keyword overrides win over the source and over METRICBUS_ADAPTERS, and may hold adapter objects."""
    monkeypatch.setenv("METRICBUS_ADAPTERS", "console")
    mem = MemoryAdapter()
    _train(MetricBus.from_config(_config_files(tmp_path)["yaml"], adapters=[mem], log_every=3))
    assert not (tmp_path / "out.jsonl").exists()
    assert [step for step, _ in mem.rows] == [2]


@pytest.mark.parametrize(
    ("adapters", "types"),
    [
        ("console", [ConsoleAdapter]),
        (["console"], [ConsoleAdapter]),
        (["console", "tensorboard"], [ConsoleAdapter, TensorBoardAdapter]),
        ({"type": "tensorboard", "log_dir": "runs/exp"}, [TensorBoardAdapter]),
        ([{"type": "console", "max_metrics": 3}, "tensorboard:runs/exp"], [ConsoleAdapter, TensorBoardAdapter]),
        (["mlflow:sqlite:///m.db"], [MlflowAdapter]),
    ],
)
def test_adapter_forms(adapters: Any, types: list[type]) -> None:
    """Adapters as a name, a verl-style list, a mapping or a URI string."""
    built = bus_options({"adapters": adapters})["adapters"]
    assert [type(a) for a in built] == types


def test_adapter_options_reach_the_adapter() -> None:
    """Mapping options and URI values land in the adapter's own options."""
    tb, ml = bus_options({"adapters": [{"type": "tensorboard", "log_dir": "runs/a"}, "mlflow:sqlite:///m.db"]})[
        "adapters"
    ]
    assert tb.log_dir == "runs/a"
    assert ml.tracking_uri == "sqlite:///m.db"


def test_run_metadata(tmp_path: Path) -> None:
    """run: {project, name, tags, config} reaches each adapter's open()."""
    mem = MemoryAdapter()
    source = {"dist": None, "run": {"project": "p", "name": "n", "tags": ["a", "b"], "config": {"lr": 0.1}}}
    MetricBus.from_config(source, adapters=[mem]).close()
    assert mem.run is not None
    assert (mem.run.project, mem.run.name, mem.run.tags, dict(mem.run.config)) == ("p", "n", ("a", "b"), {"lr": 0.1})


def test_every_option_is_settable(tmp_path: Path) -> None:
    """Every bus option can be set from a config."""
    source = {
        "log_every": 2, "nan": "ignore", "strict": True, "dist": None, "writer_rank": 0, "queue_size": 8,
        "queue_policy": "drop", "queue_timeout_s": 1.5, "fsync": "never", "metrics": {"x": "sum"},
    }  # fmt: skip
    options = bus_options(source)
    assert {k: v for k, v in options.items() if k != "rules"} == {k: v for k, v in source.items() if k != "metrics"}
    mem = MemoryAdapter()
    bus = MetricBus.from_config(source, adapters=[mem])
    for step in range(4):
        bus.log("x", float(step))
        bus.log("x", float("nan"))
        bus.commit()
    bus.close()
    assert mem.rows == [(1, {"x": 1.0}), (3, {"x": 5.0})]


MISTAKES = [
    ({"log_evry": 3}, "log_evry: unknown key 'log_evry' (did you mean 'log_every'?); valid keys: adapters"),
    ({"adapters": ["console", "tensorbord"]}, "adapters[1]: no adapter named 'tensorbord'; known adapters:"),
    ({"adapters": ["console", {"type": "tensorboard", "logdir": "x"}]},
     "adapters[1].logdir: unknown option 'logdir' for adapter 'tensorboard'; valid options: log_dir"),
    ({"adapters": [{"log_dir": "x"}]}, "adapters[0]: an adapter mapping needs 'type': one of console,"),
    ({"adapters": ["nosuch:x"]}, "adapters[0]: no adapter named 'nosuch'"),
    ({"adapters": 3}, "adapters: must be a name, a list"),
    ({"adapters": [{"type": "console", "max_metrics": 1, "colour": 1}]}, "adapters[0].colour: unknown option"),
    ({"metrics": {"loss": "avg"}},
     'metrics["loss"]: unknown aggregation \'avg\' for \'loss\' (every level); use one of mean, sum'),
    ({"metrics": {"actor/pg_loss": {"micro": "total", "rank": "mean"}}},
     'metrics["actor/pg_loss"].micro: unknown aggregation \'total\''),
    ({"metrics": {"x": {"mikro": "sum"}}}, 'metrics["x"].mikro: unknown key \'mikro\' (did you mean \'micro\'?)'),
    ({"metrics": {"x": ["mean", "median"]}}, 'metrics["x"][1]: unknown aggregation \'median\''),
    ({"metrics": {"x": ["mean", {"micro": "sum", "step": "p999x"}]}}, 'metrics["x"][1].step: unknown aggregation'),
    ({"metrics": {"x": ["mean", "mean"]}}, 'metrics["x"]: spec list for \'x\' emits x/mean twice'),
    ({"metrics": {"x": []}}, 'metrics["x"]: empty spec list for \'x\'; give at least one kind'),
    ({"metrics": {"x": {"nan": "skip"}}},
     'metrics["x"].nan: unknown nan policy \'skip\' for \'x\'; use one of propagate'),
    ({"metrics": {"x": 3}}, 'metrics["x"]: invalid spec 3'),
    ({"metrics": ["x"]}, "metrics: must be a mapping"),
    ({"nan": "drop"}, "nan: unknown nan policy 'drop' for 'MetricBus(nan=)'; use one of propagate, ignore, error"),
    ({"log_every": 0}, "log_every: must be an int >= 1, got 0"),
    ({"log_every": "2"}, "log_every: must be an int >= 1, got '2'"),
    ({"strict": "yes"}, "strict: must be a bool (True or False), got 'yes'"),
    ({"queue_policy": "wait"}, "queue_policy: unknown queue_policy 'wait'; use one of block, drop"),
    ({"queue_size": 0}, "queue_size: must be an int >= 1"),
    ({"queue_timeout_s": -1}, "queue_timeout_s: must be a number of seconds >= 0"),
    ({"dist": "mpi"}, "dist: must be 'auto', 'torch' or None, got 'mpi'; in a file, null or \"none\" (TOML has no"),
    ({"writer_rank": -1}, "writer_rank: must be an int >= 0"),
    ({"journal": 5}, "journal: must be a path (a non-empty str or os.PathLike) or None, got 5"),
    ({"fsync": "always"}, "fsync: unknown fsync mode 'always'; use one of commit, interval, never"),
    ({"run": {"tag": ["a"]}}, "run.tag: unknown key 'tag' (did you mean 'tags'?)"),
    ({"run": {"tags": "a"}}, "run.tags: must be a list of strings"),
    ({"run": {"config": [1]}}, "run.config: must be a mapping"),
    ({"run": "x"}, "run: must be a mapping with project, name, tags, config (or a RunInfo), got 'x'"),
    ({"run": {"name": 3}}, "run.name: must be a string or None, got 3"),
    ({"writer_rank": True}, "writer_rank: must be an int >= 0, got True"),
    ({"metrics": {3: "sum"}}, 'metrics["3"]: rule pattern must be a non-empty string, got 3'),
    ({"metrics": {"x": [["sum"]]}}, 'metrics["x"][0]: invalid spec [\'sum\']; use a kind (mean, sum'),
    ({"metrics": {"x": {"update": "avg"}}}, 'metrics["x"].update: unknown aggregation \'avg\''),
    ({"group": None}, "group: unknown key 'group'"),
]  # fmt: skip


@pytest.mark.parametrize(("source", "message"), MISTAKES, ids=[m for _, m in MISTAKES])
def test_mistakes_name_their_location(source: dict[str, Any], message: str) -> None:
    """Each kind of mistake raises ConfigError whose message says where it is and what is valid."""
    with pytest.raises(ConfigError) as info:
        MetricBus.from_config(source)
    assert message in str(info.value)


def test_mistake_in_a_file_names_the_file(tmp_path: Path) -> None:
    """A mistake in a file names the file and the location in it."""
    path = _write(tmp_path / "c.yaml", "adapters:\n  - console\n  - {type: tensorboard, logdir: x}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: adapters\[1\]\.logdir: unknown option"):
        MetricBus.from_config(path)


def test_mistake_in_env_adapters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mistake in METRICBUS_ADAPTERS names the variable and the entry."""
    monkeypatch.setenv("METRICBUS_ADAPTERS", "console,tensorbord")
    with pytest.raises(ConfigError, match=r"\$METRICBUS_ADAPTERS: \[1\]: no adapter named 'tensorbord'"):
        MetricBus.from_config({})


def test_mistake_in_overrides() -> None:
    """An unknown keyword override is reported as such."""
    with pytest.raises(ConfigError, match=r"from_config\(\) override: rulez: unknown key"):
        MetricBus.from_config({}, rulez={})


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("c.ini", "x=1", "unknown config file type '.ini'; use one of .yaml, .yml, .toml, .json"),
        ("c.yaml", "adapters: [console\n", "cannot parse"),
        ("c.toml", "adapters = [", "cannot parse"),
        ("c.json", "{", "cannot parse"),
        ("c.yaml", "- console\n", "the top level must be a mapping"),
    ],
)
def test_bad_files(tmp_path: Path, name: str, text: str, message: str) -> None:
    """Unreadable, unparsable or non-mapping files raise ConfigError naming the file."""
    path = _write(tmp_path / name, text)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")) as info:
        MetricBus.from_config(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing file (given or named by METRICBUS_CONFIG) raises ConfigError naming it."""
    with pytest.raises(ConfigError, match="cannot read the config file"):
        MetricBus.from_config(tmp_path / "nope.yaml")
    monkeypatch.setenv("METRICBUS_CONFIG", str(tmp_path / "gone.json"))
    with pytest.raises(ConfigError, match=r"METRICBUS_CONFIG=.*gone\.json: cannot read"):
        MetricBus.from_config()


def test_bad_source_type() -> None:
    """A source that is neither a path, a mapping nor None is refused."""
    with pytest.raises(ConfigError, match="takes a file path, a mapping"):
        MetricBus.from_config(42)


def test_journal_from_config(tmp_path: Path) -> None:
    """journal and fsync from a config give the bus a journal holding every commit."""
    from metricbus.journal import read_journal

    _train(MetricBus.from_config({"journal": str(tmp_path / "j"), "fsync": "commit", "dist": None}))
    assert [step for step, _ in read_journal(tmp_path / "j").commits] == [0, 1, 2]


def test_validation_happens_before_any_adapter_opens(tmp_path: Path) -> None:
    """A mistake anywhere stops the config before any adapter is opened (nothing is written)."""
    out = tmp_path / "out.jsonl"
    for source in (
        {"adapters": [f"jsonl:{out}"], "metrics": {"x": {"micro": "avg"}}},
        {"adapters": [f"jsonl:{out}", "tensorbord"]},
        {"adapters": [f"jsonl:{out}"], "queue_policy": "wait"},
    ):
        with pytest.raises(ConfigError):
            MetricBus.from_config(source)
    assert not out.exists()


def test_an_override_in_code_may_give_agg_objects() -> None:
    """``metrics=`` given in code takes ``Agg`` objects as a file's mappings (review: it was a ConfigError)."""
    bus = MetricBus.from_config({"dist": None}, metrics={"x": Agg(micro="sum"), "y": [Agg(micro="sum"), "max"]})
    bus.log("x", 1.0)
    bus.log("x", 2.0)
    assert bus.commit(0) == {"x": 3.0}
    assert str(bus.spec_of("y")) == "[sum, max]"
    bus.close()
