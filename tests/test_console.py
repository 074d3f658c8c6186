"""The console adapter: one compact, aligned line per emitted step."""

from __future__ import annotations

import io
import math

import pytest
from metricbus.adapters.console import ConsoleAdapter, format_value

from metricbus import MetricBus, RunInfo
from metricbus.config import bus_options
from metricbus.errors import ConfigError
from metricbus.registry import make_adapter


def run_console(steps: list[dict[str, float]], **options: object) -> list[str]:
    """Lines a ConsoleAdapter writes for ``steps`` through a bus."""
    stream = io.StringIO()
    with MetricBus(adapters=[ConsoleAdapter(stream=stream, **options)], dist=None, strict=True,  # type: ignore[arg-type]
                   run=RunInfo(name="demo")) as bus:
        for metrics in steps:
            bus.log(metrics)
            bus.commit()
    return stream.getvalue().splitlines()


def test_one_line_per_step_between_open_and_close_lines() -> None:
    """The run name opens, each step is one line, the status closes."""
    lines = run_console([{"loss": 0.5}, {"loss": 0.25}])
    assert lines[0] == "metricbus run demo"
    assert lines[-1] == "metricbus run finished"
    assert [line.split("|")[0].split() for line in lines[1:-1]] == [["step", "0"], ["step", "1"]]


def test_columns_stay_aligned() -> None:
    """A metric's column starts at the same offset on every line."""
    lines = run_console([{"a": 0.5, "b": 1.0}, {"a": 12345.678, "b": 2.0}, {"a": 1.0, "b": 3.0}])
    offsets = {line.index("| b ") for line in lines[1:-1]}
    assert len(offsets) == 1


def test_values_are_rendered_compactly() -> None:
    """Integers print plainly, ordinary floats with 4 decimals, extremes in scientific notation."""
    assert format_value(3.0).strip() == "3"
    assert format_value(0.123456).strip() == "0.1235"
    assert format_value(1.5e-7).strip() == "1.500e-07"
    assert format_value(math.nan).strip() == "nan"
    assert format_value(-math.inf).strip() == "-inf"


def test_many_metrics_are_truncated_with_a_count() -> None:
    """More metrics than max_metrics show '(+N more)'."""
    (line,) = run_console([{f"m{i:02d}": float(i) for i in range(5)}], max_metrics=3)[1:-1]
    assert line.endswith("(+2 more)")
    assert "m02" in line
    assert "m03" not in line


def test_default_stream_is_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    """Without a stream, lines go to sys.stdout at write time."""
    adapter = ConsoleAdapter()
    adapter.write(step=3, metrics={"x": 1.5})
    assert "step      3 | x 1.5000" in capsys.readouterr().out


@pytest.mark.parametrize("max_metrics", [0, -1, 2.5, "3", True, None])
def test_a_bad_max_metrics_is_a_config_error_at_construction(max_metrics: object) -> None:
    """max_metrics must be an int >= 1; anything else fails when the adapter is built, naming the option."""
    with pytest.raises(ConfigError, match=r"console: max_metrics must be an int >= 1.*got"):
        ConsoleAdapter(max_metrics=max_metrics)  # type: ignore[arg-type]


def test_a_stream_without_write_is_a_config_error() -> None:
    """'console:x' would set the stream to a string: refused, with how to set max_metrics instead."""
    with pytest.raises(ConfigError, match=r"stream must be a text stream.*max_metrics"):
        make_adapter("console:x")


def test_a_config_names_the_bad_console_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a config the error also says which adapter entry it is."""
    monkeypatch.delenv("METRICBUS_ADAPTERS", raising=False)
    with pytest.raises(ConfigError, match=r"adapters\[0\].*max_metrics"):
        bus_options({"adapters": [{"type": "console", "max_metrics": 0}]})
