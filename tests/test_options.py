"""BusOptions: one validator per MetricBus option, each naming the option and what is valid."""

from __future__ import annotations

import dataclasses
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from metricbus import Agg, RunInfo
from metricbus.errors import ConfigError, SpecError
from metricbus.options import VALIDATORS, BusOptions
from metricbus.spec import parse_spec
from metricbus.testing import MemoryAdapter

# option -> (a bad value, the error class, what the message says: the option first, then what is valid)
BAD: dict[str, tuple[Any, type[ValueError], str]] = {
    "adapters": ("console", ConfigError, "adapters: must be a list of adapters, names ('console', 'jsonl:out.jsonl') "
                                         "or {'type': ...} mappings, got 'console'"),
    "rules": ({"loss": "avg"}, SpecError, "rules: unknown aggregation 'avg' for 'loss' (every level); use one of "
                                          "mean, sum, min, max, first, last, count, std"),
    "log_every": (0, ConfigError, "log_every: must be an int >= 1, got 0"),
    "nan": ("drop", SpecError, "nan: unknown nan policy 'drop' for 'MetricBus(nan=)'; use one of propagate, ignore, "
                               "error"),
    "strict": ("yes", ConfigError, "strict: must be a bool (True or False), got 'yes'"),
    "run": ("x", ConfigError, "run: must be a mapping with project, name, tags, config (or a RunInfo), got 'x'"),
    "dist": ("mpi", ConfigError, "dist: must be 'auto', 'torch' or None, got 'mpi'"),
    "writer_rank": (-1, ConfigError, "writer_rank: must be an int >= 0, got -1"),
    "journal": (5, ConfigError, "journal: must be a path (a non-empty str or os.PathLike) or None, got 5"),
    "fsync": ("always", ConfigError, "fsync: unknown fsync mode 'always'; use one of commit, interval, never"),
    "queue_size": (0, ConfigError, "queue_size: must be an int >= 1, got 0"),
    "queue_policy": ("wait", ConfigError, "queue_policy: unknown queue_policy 'wait'; use one of block, drop"),
    "queue_timeout_s": (
        -1,
        ConfigError,
        f"queue_timeout_s: must be a number of seconds >= 0 (at most {threading.TIMEOUT_MAX:g}), got -1",
    ),
}  # fmt: skip


def test_build_with_no_arguments_is_the_defaults() -> None:
    """BusOptions.build() equals BusOptions(): the defaults pass their own validators unchanged."""
    assert BusOptions.build() == BusOptions()


def test_defaults_are_metricbus_defaults() -> None:
    """The defaults are MetricBus's: log_every=1, nan='propagate', dist='auto', fsync='interval', a 1024 queue..."""
    assert dataclasses.asdict(BusOptions()) == {
        "adapters": (), "rules": (), "log_every": 1, "nan": "propagate", "strict": False, "run": None,
        "dist": "auto", "group": None, "writer_rank": 0, "journal": None, "fsync": "interval",
        "queue_size": 1024, "queue_policy": "block", "queue_timeout_s": 10.0, "write_timeout_s": 30.0,
        "exit_timeout_s": 20.0, "resume": False, "on_open_error": "raise",
    }  # fmt: skip


def test_one_validator_per_field() -> None:
    """The validator table has exactly one entry per field, in field order."""
    assert list(VALIDATORS) == [f.name for f in dataclasses.fields(BusOptions)]


@pytest.mark.parametrize("option", list(BAD))
def test_bad_value_names_the_option_and_what_is_valid(option: str) -> None:
    """A bad value raises the option's ValueError subclass, naming the option and the valid values."""
    value, error, message = BAD[option]
    with pytest.raises(error, match=re.escape(message)):
        BusOptions.build(**{option: value})


def test_group_is_passed_through() -> None:
    """group (a process group) is held as given; the transport checks it against torch.distributed."""
    group = object()
    assert BusOptions.build(group=group).group is group


def test_unknown_option_is_a_type_error() -> None:
    """A misspelt option is a TypeError that suggests the right name."""
    with pytest.raises(TypeError, match=r"unknown key 'log_evry' \(did you mean 'log_every'\?\)"):
        BusOptions.build(log_evry=3)


def test_bools_are_not_ints() -> None:
    """log_every=True is refused like any non-int."""
    with pytest.raises(ConfigError, match="log_every: must be an int >= 1, got True"):
        BusOptions.build(log_every=True)


def test_options_are_frozen() -> None:
    """A BusOptions cannot be changed after it is built."""
    options = BusOptions.build()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.log_every = 2  # type: ignore[misc]


def test_valid_values_are_normalized() -> None:
    """Valid values come back in their one held form: a str journal, a float timeout, a tuple of adapters."""
    mem = MemoryAdapter()
    options = BusOptions.build(
        adapters=[mem, "console"], journal=Path("runs/j"), queue_timeout_s=3, dist=None, nan="ignore", strict=True
    )
    assert options.adapters == (mem, "console")
    assert options.journal == str(Path("runs/j"))
    assert options.queue_timeout_s == 3.0
    assert isinstance(options.queue_timeout_s, float)
    assert (options.dist, options.nan, options.strict) == (None, "ignore", True)


def test_adapter_mappings_are_copied() -> None:
    """An adapter mapping is copied on intake: changing the caller's dict later changes nothing."""
    given = {"type": "console"}
    options = BusOptions.build(adapters=[given])
    given["type"] = "jsonl"
    assert dict(options.adapters[0]) == {"type": "console"}  # type: ignore[arg-type]


def test_adapter_object_without_the_verbs() -> None:
    """An adapter object lacking open/write/flush/close is refused with its index and the missing verbs."""
    with pytest.raises(ConfigError, match=r"adapters\[1\]: .* has no open\(\), write\(\), flush\(\), close\(\)"):
        BusOptions.build(adapters=[MemoryAdapter(), object()])


def test_rules_are_held_parsed_in_order() -> None:
    """rules={pattern: spec} becomes (pattern, Spec) pairs in declaration order; build accepts them back."""
    options = BusOptions.build(rules={"actor/*": Agg(micro="sum", rank="mean"), "len": ["mean", "max"]})
    assert options.rules == (
        ("actor/*", parse_spec(Agg(micro="sum", rank="mean"), metric="actor/*")),
        ("len", parse_spec(["mean", "max"], metric="len")),
    )
    assert BusOptions.build(rules=options.rules) == options


def test_rules_none_is_no_rules() -> None:
    """rules=None (MetricBus's default) holds no rules."""
    assert BusOptions.build(rules=None).rules == ()


def test_rules_not_a_mapping() -> None:
    """rules given as a list of names is refused, saying what rules are."""
    with pytest.raises(SpecError, match="rules: must be a mapping of name pattern -> spec"):
        BusOptions.build(rules=["loss"])


def test_run_mapping_becomes_run_info() -> None:
    """run={"name": "x"} is a RunInfo named x with the other fields at their defaults."""
    run = BusOptions.build(run={"name": "x"}).run
    assert isinstance(run, RunInfo)
    assert (run.project, run.name, run.tags, dict(run.config)) == ("metricbus", "x", (), {})


def test_run_mapping_with_every_key() -> None:
    """run with project, name, tags and config sets each of them."""
    run = BusOptions.build(run={"project": "p", "name": "n", "tags": ["a", "b"], "config": {"lr": 0.1}}).run
    assert run is not None
    assert (run.project, run.name, run.tags, dict(run.config)) == ("p", "n", ("a", "b"), {"lr": 0.1})


def test_run_info_is_kept() -> None:
    """A RunInfo is held as given."""
    run = RunInfo(project="p")
    assert BusOptions.build(run=run).run is run


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"tag": ["a"]}, "run.tag: unknown key 'tag' (did you mean 'tags'?); valid keys: project, name, tags, config"),
        ({"tags": "a"}, "run.tags: must be a list of strings, got 'a'"),
        ({"config": [1]}, "run.config: must be a mapping, got [1]"),
        ({"project": None}, "run.project: must be a string, got None"),
        ({"name": 3}, "run.name: must be a string or None, got 3"),
    ],
)
def test_run_mapping_mistakes(run: dict[str, Any], message: str) -> None:
    """A bad run mapping names the key inside run and what it must be."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        BusOptions.build(run=run)
