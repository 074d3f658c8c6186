"""Spec parsing: kinds, Agg level fallback, list specs, and eager validation."""

from __future__ import annotations

import pytest

from metricbus import Agg, MetricBus, SpecError
from metricbus.kinds import KIND_NAMES
from metricbus.spec import parse_spec


def bus(**options: object) -> MetricBus:
    """A strict local bus with no adapters."""
    return MetricBus(dist=None, strict=True, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_a_kind_is_used_at_every_level(kind: str) -> None:
    """A plain kind string resolves to that kind at micro, rank and step."""
    (chain,) = parse_spec(kind, metric="m").chains
    assert (chain.micro, chain.update, chain.rank, chain.step) == (kind, kind, kind, kind)


def test_agg_levels_left_out_take_the_level_below() -> None:
    """Agg(micro='sum') is sum everywhere; Agg(micro='sum', rank='mean') is mean at step."""
    (only_micro,) = parse_spec(Agg(micro="sum"), metric="m").chains
    assert (only_micro.rank, only_micro.step) == ("sum", "sum")
    (two,) = parse_spec(Agg(micro="sum", rank="mean"), metric="m").chains
    assert (two.micro, two.rank, two.step) == ("sum", "mean", "mean")


def test_agg_micro_defaults_to_mean() -> None:
    """Agg(rank='max') means the per-worker mean, then the max over workers."""
    (chain,) = parse_spec(Agg(rank="max"), metric="m").chains
    assert (chain.micro, chain.rank, chain.step) == ("mean", "max", "max")


def test_unknown_kind_lists_valid_kinds() -> None:
    """An unknown kind is a ValueError naming the metric and every valid kind."""
    with pytest.raises(ValueError, match="'avg'") as info:
        bus().log("actor/pg_loss", 1.0, agg="avg")
    assert "actor/pg_loss" in str(info.value)
    for kind in KIND_NAMES:
        assert kind in str(info.value)


def test_unknown_kind_in_agg_is_rejected_when_built() -> None:
    """Agg(rank='median') fails at construction, before any record."""
    with pytest.raises(ValueError, match="median"):
        Agg(rank="median")


def test_list_spec_emits_name_slash_kind() -> None:
    """agg=['mean', 'max', 'min'] emits name/mean, name/max, name/min."""
    b = bus()
    b.log("response_length", [3.0, 5.0, 10.0], agg=["mean", "max", "min"])
    assert b.commit() == {"response_length/max": 10.0, "response_length/mean": 6.0, "response_length/min": 3.0}


def test_list_spec_with_duplicate_kind_is_rejected() -> None:
    """A list naming a kind twice is an error."""
    with pytest.raises(SpecError, match="twice"):
        parse_spec(["mean", "mean"], metric="m")


def test_empty_list_spec_is_rejected() -> None:
    """An empty list spec is an error naming the metric."""
    with pytest.raises(SpecError, match="'m'"):
        parse_spec([], metric="m")


def test_invalid_spec_type_is_rejected() -> None:
    """A spec that is not a kind, Agg or list is a SpecError."""
    with pytest.raises(SpecError, match="invalid spec"):
        parse_spec(3, metric="m")  # type: ignore[arg-type]


def test_unknown_nan_policy_is_rejected() -> None:
    """Agg(nan='skip') fails and names the valid policies."""
    with pytest.raises(ValueError, match="propagate"):
        Agg(nan="skip")  # type: ignore[arg-type]


def test_list_of_aggs_is_suffixed_by_the_step_kind() -> None:
    """A list item Agg(micro='sum', rank='mean') is emitted under name/mean."""
    b = bus()
    b.log("x", [1.0, 2.0], agg=[Agg(micro="sum", rank="mean"), "max"])
    assert b.commit() == {"x/max": 2.0, "x/mean": 3.0}
