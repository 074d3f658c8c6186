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


def test_a_rule_defined_after_agg_or_an_earlier_rule_leaves_those_names_alone() -> None:
    """A name logged with agg= keeps it (agg= comes before rules) and the rule still applies to the other names it
    matches, whichever came first; a name an earlier rule matches keeps that rule's spec."""
    b = bus(rules={"ab*": "min"})
    b.log("actor/pg_loss", [1.0, 5.0], agg="max")
    b.log("actor/kl", [2.0, 4.0])
    b.log("ab", [1.0, 5.0])
    b.define("actor/*", "sum")
    b.define("ab", "sum")  # shadowed by "ab*" for "ab": no change
    assert b.commit() == {"ab": 1.0, "actor/kl": 6.0, "actor/pg_loss": 5.0}


def test_a_rule_that_changes_the_nan_policy_of_records_already_logged_is_refused() -> None:
    """The records logged so far were checked (nan='error') or dropped (nan='ignore') at log() under the policy they
    had: a rule giving another nan= policy is a SpecError naming the metric and both policies, and is not added;
    the same policy is fine."""
    b = bus()
    b.log("x", [math.nan, 1.0])
    with pytest.raises(SpecError, match=r"the rule 'x' gives 'x' nan='ignore', but its records were already logged "
                                        r"under nan='propagate'"):
        b.define("x", Agg(micro="mean", nan="ignore"))
    b.define("x", "sum")
    assert math.isnan(b.commit()["x"])
    b.log("y", 2.0)
    b.define("y*", Agg(micro="sum", nan="propagate"))
    assert b.commit() == {"y": 2.0}


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
