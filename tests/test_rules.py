"""Rules: fnmatchcase patterns, first match wins, explicit agg wins, a name's spec fixed at first sight."""

from __future__ import annotations

import math

import pytest

from metricbus import Agg, MetricBus, SpecError
from metricbus.spec import parse_spec


def bus(**options: object) -> MetricBus:
    """A strict local bus with no adapters."""
    return MetricBus(dist=None, strict=True, **options)  # type: ignore[arg-type]


def test_default_spec_is_mean() -> None:
    """A metric no rule matches is averaged."""
    b = bus()
    b.log("x", 1.0)
    b.log("x", 4.0)
    assert b.commit() == {"x": 2.5}


def test_first_matching_rule_wins() -> None:
    """Of two matching rules, the one declared first applies."""
    b = bus(rules={"actor/*": "sum"})
    b.define("actor/pg_*", "max")
    b.log("actor/pg_loss", 1.0)
    b.log("actor/pg_loss", 2.0)
    assert b.commit() == {"actor/pg_loss": 3.0}


def test_define_patterns_use_fnmatchcase() -> None:
    """Patterns are case-sensitive glob patterns."""
    b = bus()
    b.define("actor/*clipfrac*", "max")
    b.log("actor/pg_clipfrac", [0.1, 0.3])
    b.log("Actor/pg_clipfrac", [0.1, 0.3])
    assert b.commit() == {"Actor/pg_clipfrac": pytest.approx(0.2), "actor/pg_clipfrac": 0.3}


def test_explicit_agg_wins_over_rules() -> None:
    """agg= on the first record beats a matching rule."""
    b = bus(rules={"x": "sum"})
    b.log("x", [1.0, 5.0], agg="min")
    assert b.commit() == {"x": 1.0}


def test_a_rule_defined_after_a_name_was_logged_replaces_its_default_until_its_first_commit() -> None:
    """define() is a declaration: a name logged with the default takes it until its first commit (its records so
    far included); once committed, a different rule is a SpecError naming it, and the rule is not added."""
    b = bus()
    b.log("x", 1.0)
    b.define("x", "sum")
    b.log("x", 2.0)
    assert b.spec_of("x") == parse_spec("sum", metric="x")
    assert b.commit() == {"x": 3.0}
    b.log("y", 1.0)
    b.commit()
    b.log("y", 3.0)
    with pytest.raises(SpecError, match=r"'y' has spec mean from the default .* this bus's rule 'y\*' gives max"):
        b.define("y*", "max")
    b.define("y", "mean")  # the same spec: fine
    b.log("y2", 5.0)  # the refused rule was not added
    assert b.commit() == {"y": 3.0, "y2": 5.0}


def test_a_rule_defined_after_a_different_declaration_is_a_spec_error() -> None:
    """A name logged with agg= (or matched first by an earlier rule) keeps its spec: a later rule that differs and
    comes first for it is a SpecError; one that an earlier rule shadows changes nothing."""
    b = bus(rules={"a*": "min"})
    b.log("x", [1.0, 5.0], agg="max")
    b.log("ab", [1.0, 5.0])
    with pytest.raises(SpecError, match=r"'x' has spec max from agg= in log\(\) on this bus"):
        b.define("x", "sum")
    b.define("ab", "sum")  # shadowed by "a*" for "ab": no change
    assert b.commit() == {"ab": 1.0, "x": 5.0}


def test_same_name_with_a_different_explicit_spec_names_both() -> None:
    """Logging a name again with another explicit spec is a SpecError naming both specs."""
    b = bus()
    b.log("x", 1.0, agg="sum")
    with pytest.raises(SpecError) as info:
        b.log("x", 2.0, agg="max")
    assert "'x'" in str(info.value)
    assert "sum" in str(info.value)
    assert "max" in str(info.value)
    assert b.commit() == {"x": 1.0}


def test_same_explicit_spec_again_is_fine() -> None:
    """Repeating the spec a name already has is allowed."""
    b = bus()
    b.log("x", 1.0, agg=Agg(micro="sum", rank="mean"))
    b.log("x", 2.0, agg=Agg(micro="sum", rank="mean"))
    assert b.commit() == {"x": 3.0}


def test_define_nan_option_applies_to_matching_metrics() -> None:
    """define(..., nan='ignore') drops NaN for matching metrics only."""
    b = bus()
    b.define("clean/*", "mean", nan="ignore")
    b.log({"clean/a": math.nan, "raw": math.nan})
    b.log({"clean/a": 2.0, "raw": 2.0})
    out = b.commit()
    assert out["clean/a"] == 2.0
    assert math.isnan(out["raw"])


def test_agg_nan_option_applies_to_its_metric() -> None:
    """Agg(nan='ignore') as a rule drops NaN for that metric."""
    b = bus(rules={"a": Agg(micro="mean", nan="ignore")})
    b.log("a", [1.0, math.nan, 3.0])
    assert b.commit() == {"a": 2.0}


def test_bad_rule_is_rejected_when_declared() -> None:
    """An unknown kind in rules fails when the bus is built."""
    with pytest.raises(ValueError, match="avg"):
        bus(rules={"x": "avg"})
