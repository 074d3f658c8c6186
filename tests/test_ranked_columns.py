"""The rank level held in columns (torch.distributed's steady commit) emits what its Summaries emit, bit for bit."""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from metricbus import rank_level
from metricbus.ranked_columns import RankedColumns
from metricbus.reduce import StepReducer, lift_columns
from metricbus.spec import Agg, parse_spec, parse_spec_text
from metricbus.summary import Summary

SPECS = {
    "a/mean": parse_spec("mean", metric="a/mean"),
    "b/sum": parse_spec("sum", metric="b/sum"),
    "c/count": parse_spec("count", metric="c/count"),
    "d/first": parse_spec("first", metric="d/first"),
    "e/last": parse_spec("last", metric="e/last"),
    "f/lifted": parse_spec_text("micro:sum,rank:mean", metric="f/lifted"),  # one column, a lift: per metric
    "g/steps": parse_spec(Agg(micro="mean", rank="mean", step="sum"), metric="g/steps"),
    "h/list": parse_spec(["mean", "sum"], metric="h/list"),
}


def _bits(values: dict[str, float]) -> dict[str, bytes]:
    return {k: struct.pack("<d", v) for k, v in values.items()}


def _fields(summary: Summary | None) -> bytes:
    assert summary is not None
    return struct.pack("<12d", *summary.as_tuple())


def _merged(rows: list[dict[str, list[float]]], names: list[str]) -> tuple[list[str], Any]:
    """Each worker's records of ``names`` merged across the workers by the collective merge (one process): the
    names some worker has, and the merged columns (a Merged list)."""
    reducer = StepReducer(log_every=1)
    columns = [reducer.columns(n, SPECS[n]) for n in names]
    assert all(len(c) == 1 for c in columns)
    block_rows = []
    for row in rows:
        states = reducer.worker([{n: Summary.of_batch(v, None) for n, v in row.items() if v}], SPECS)
        pairs = zip(names, columns, strict=True)
        block_rows.append([lift_columns(states[n], c)[0] if n in states else None for n, c in pairs])
    block = rank_level.block_of(block_rows, list(range(len(rows))), [False] * len(names))
    prep = rank_level.prepare(block)
    agreed = rank_level.maxima(prep)
    return names, rank_level.finish(agreed, rank_level.sums(prep, agreed), block.moments)


finite = st.floats(allow_nan=False, allow_infinity=False, width=64, min_value=-1e300, max_value=1e300)
values = st.lists(st.one_of(finite, st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324])), max_size=5)


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.fixed_dictionaries(dict.fromkeys(SPECS, values)), min_size=1, max_size=4))
@example(rows=[{n: [] for n in SPECS}, {n: [] for n in SPECS}])
@example(rows=[{n: [1.0, 2.0] if n != "c/count" else [] for n in SPECS}])
def test_columns_emit_what_the_summaries_emit(rows: list[dict[str, list[float]]]) -> None:
    names, merged = _merged(rows, sorted(SPECS))
    dict_path = {n: (merged[i],) for i, n in enumerate(names) if merged[i] is not None}
    want = StepReducer(log_every=1).commit_ranked(dict_path, SPECS)
    if merged.fields is None:  # a column took the per-column path: torch.distributed keeps the dict
        return
    kept = tuple(names) if merged.picks is None else tuple(names[i] for i in merged.picks.tolist())
    assert set(kept) == set(dict_path)
    ranked = RankedColumns(names=kept, fields=merged.fields, version=0)
    got = StepReducer(log_every=1).commit_ranked(ranked, SPECS)
    assert got is not None
    assert want is not None
    assert list(got) == list(want)  # sorted keys, the same ones
    assert _bits(got) == _bits(want)
    assert [_fields(ranked[n][0]) for n in kept] == [_fields(dict_path[n][0]) for n in kept]


def test_a_window_of_several_commits_reads_the_summaries() -> None:
    names, merged = _merged([{n: [1.0, 2.5] for n in SPECS}, {n: [4.0] for n in SPECS}], sorted(SPECS))
    assert merged.fields is not None
    assert merged.picks is None
    ranked = RankedColumns(names=tuple(names), fields=merged.fields, version=0)
    dict_path = {n: (merged[i],) for i, n in enumerate(names)}
    columns, summaries = StepReducer(log_every=2), StepReducer(log_every=2)
    for reducer, given_ranked in ((columns, ranked), (summaries, dict_path)):
        assert reducer.commit_ranked(given_ranked, SPECS) is None
    assert _bits(columns.commit_ranked(ranked, SPECS) or {}) == _bits(summaries.commit_ranked(dict_path, SPECS) or {})


def test_a_replaced_column_drops_the_fields() -> None:
    _, merged = _merged([{n: [1.0] for n in SPECS}], sorted(SPECS))
    assert merged.fields is not None
    merged[0] = None
    assert merged.fields is None


@pytest.mark.parametrize("absent", [["a/mean"], ["a/mean", "h/list"], sorted(SPECS)[1:]])
def test_a_metric_no_worker_has_is_left_out(absent: list[str]) -> None:
    rows = [{n: ([] if n in absent else [3.0, float(r)]) for n in SPECS} for r in range(3)]
    names, merged = _merged(rows, sorted(SPECS))
    assert merged.fields is not None
    assert merged.picks is not None
    kept = [names[i] for i in merged.picks.tolist()]
    assert kept == [n for n in sorted(SPECS) if n not in absent]
    assert merged.fields.shape == (12, len(kept))
    # 3 workers x 2 records; a lifted micro sum is one record per worker
    assert merged.fields[0].tolist() == [3.0 if n == "f/lifted" else 6.0 for n in kept]
