"""The rank level's vectorized finish (metricbus.rank_finish) gives the same bits as the per-column algorithm it
replaced (kept here as the reference), on hostile data; fixed.components is a function of the value alone."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from metricbus import exact, fixed, rank_finish, rank_level
from metricbus.rank_level import Block, block_of, finish, maxima, merge, merge_collective, prepare, sums
from metricbus.summary import Rest, Summary

Sum = Callable[[int, int], tuple[float, ...] | None]
NS, SLOTS = rank_finish.NS, rank_finish.SLOTS
_MAX_AT = 2 * SLOTS  # the extrema's columns in the maxima


# -- the reference: the per-column finish as it was before vectorizing (fixed-point limbs as Python ints) ----------


def reference_components(n: int, q: int) -> tuple[float, ...]:
    """The greedy components of ``n · 2**q`` by exact rational arithmetic (round-half-even, ±MAX beyond the range)."""
    if n == 0:
        return (0.0,)
    return exact._of_ratio(n << q, 1) if q >= 0 else exact._of_ratio(n, 1 << -q)


def reference_finish(agreed: np.ndarray, summed: np.ndarray, moments: np.ndarray) -> list[Summary | None]:  # type: ignore[type-arg]
    n_cols = agreed.shape[0]
    nq_max, offsets, _ = rank_level.layout(agreed)
    ends = [*offsets[1:].tolist(), len(summed)]
    starts = offsets.tolist()
    q = (-nq_max.astype(np.int64)).tolist()
    values = summed.tolist()

    def limbs_of(c: int, slot: int) -> tuple[float, ...] | None:
        i = c * SLOTS + slot
        n = sum(v << (32 * j) for j, v in enumerate(values[starts[i] : ends[i]]))
        return None if n == 0 else reference_components(n, q[i])

    head = summed[: n_cols * NS].reshape(n_cols, NS)
    extrema = agreed[:, _MAX_AT:]
    rows = head.tolist()
    floats = head[:, 2:5].copy().view(np.float64).tolist()
    out: list[Summary | None] = []
    for c, h in enumerate(rows):
        if not h[1]:
            out.append(None)
            continue
        total = _slot_sum(h, c, 2, limbs_of)
        count = h[0]
        if extrema[c, 3] > 0:
            weight, wsum = _slot_sum(h, c, 0, limbs_of), _slot_sum(h, c, 1, limbs_of)
        else:
            weight, wsum = (float(count),) if count < 2**53 else reference_components(count, 0), total
        if h[1] == 1:
            m2 = floats[c][2]
        elif moments[c]:
            m2 = rank_finish.second_moment.m2(total=total, weight=weight, wsum=wsum, t=_slot_sum(h, c, 3, limbs_of))
        else:
            m2 = math.nan
        rest: Rest = () if max(len(weight), len(wsum), len(total)) < 3 else (weight[2:], wsum[2:], total[2:])
        nan = h[rank_finish.NAN_MINMAX]
        lowest, highest = (math.nan, math.nan) if nan else (-float(extrema[c, 1]), float(extrema[c, 0]))
        if lowest == 0.0:  # -0.0 where some worker's min is
            lowest = -0.0 if h[rank_finish.NEGATIVE_ZERO_MIN] else 0.0
        if highest == 0.0:  # +0.0 where some worker's max is
            highest = 0.0 if h[rank_finish.POSITIVE_ZERO_MAX] else -0.0
        out.append(Summary(count, weight[0], weight[1] if len(weight) > 1 else 0.0, wsum[0],
                           wsum[1] if len(wsum) > 1 else 0.0, total[0], total[1] if len(total) > 1 else 0.0, m2,
                           lowest, highest, floats[c][0], floats[c][1], rest, None))
    return out


def _slot_sum(h: list[int], c: int, slot: int, exact_sum: Sum) -> tuple[float, ...]:
    base = 5 + 4 * slot
    nan, pos, neg = h[base], h[base + 1], h[base + 2]
    if nan or pos or neg:
        return (math.nan,) if nan or (pos and neg) else (math.inf if pos else -math.inf,)
    held = exact_sum(c, slot)
    if held is None:
        return (-0.0,) if h[base + 3] == h[1] else (0.0,)
    return held


def bits(s: Summary | None) -> object:
    if s is None:
        return None
    return tuple(struct.pack("<d", float(x)) for x in s[:12]), type(s[0]), s.rest, s.sketch


# -- hostile data -----------------------------------------------------------------------------------------------------

HOSTILE = [0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1e-310, -1e-310, 1.7976931348623157e308,
           -1.7976931348623157e308, 1e308, 1e16, -1e16, 1.0, -1.0, 1e-20, 3.0, 0.1, 2.0**-1000, 2.0**600,
           math.nan, math.inf, -math.inf]
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
tiny = st.floats(min_value=-1e-300, max_value=1e-300, allow_nan=False)
value = st.one_of(finite, tiny, st.sampled_from(HOSTILE), st.integers(-(2**60), 2**60).map(float))
weight = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 3.0, 1e-300, 1e300, 2.0**-1060, 0.1]), st.floats(0.0, 1e10))


benign = st.one_of(st.floats(-2.0, 2.0), st.integers(-(2**40), 2**40).map(lambda i: i / 1024), st.floats(1e3, 1e4))
zeros = st.sampled_from([0.0, -0.0, -0.0, 5e-324, -5e-324])
easy_weight = st.sampled_from([0.5, 1.0, 3.0, 0.25, 2.0])
REGIMES = ((benign, easy_weight), (value, weight), (zeros, easy_weight))


@st.composite
def state(draw: st.DrawFn, pool: list[float], regime: tuple[st.SearchStrategy[float], ...], thirds: bool) -> (
        Summary | None):
    """One worker's Summary of a column (None: the worker lacks it): records drawn from ``pool`` (so that workers
    share magnitudes and cancel) or the regime's values, unit or weighted, with three-component sums if ``thirds``."""
    if draw(st.integers(0, 5)) == 0:
        return None
    values, weights = regime
    xs = draw(st.lists(st.one_of(st.sampled_from(pool), values, st.sampled_from(pool).map(lambda x: -x)),
                       min_size=1, max_size=5))
    if thirds and draw(st.booleans()):
        xs += [1e16, 1.0, 1e-20][: draw(st.integers(1, 3))]
    kind = draw(st.integers(0, 3))
    if kind <= 1:
        return Summary.of_batch(xs, None)
    ws = [draw(weights) for _ in xs] if kind == 2 else [draw(weights)] * len(xs)
    return Summary.of_batch(xs, ws)


@st.composite
def blocks(draw: st.DrawFn) -> Block:
    """Up to 9 workers' states of up to 4 columns, each column's data ordinary, hostile or (signed) zeros."""
    n_rows, n_cols = draw(st.integers(1, 9)), draw(st.integers(1, 4))
    regimes = [draw(st.sampled_from(REGIMES)) for _ in range(n_cols)]
    pools = [draw(st.lists(regime[0], min_size=1, max_size=4)) for regime in regimes]
    thirds = [draw(st.integers(0, 2)) == 0 for _ in range(n_cols)]
    rows = [[draw(state(pools[c], regimes[c], thirds[c])) for c in range(n_cols)] for _ in range(n_rows)]
    ranks = draw(st.permutations(range(n_rows)))
    return block_of(rows, ranks, draw(st.lists(st.booleans(), min_size=n_cols, max_size=n_cols)))


def passes(block: Block) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[type-arg]
    """What torch.distributed reduces: each row one participant."""
    parts = [prepare(block_of([[_row_state(block, r, c) for c in range(block.fields.shape[2])]], [int(block.ranks[r])],
                              block.moments.tolist())) for r in range(block.fields.shape[1])]
    agreed = np.maximum.reduce([maxima(p) for p in parts])
    return agreed, np.sum([sums(p, agreed) for p in parts], axis=0)


def _row_state(block: Block, r: int, c: int) -> Summary | None:
    fields = block.fields[:, r, c].tolist()
    if not fields[0]:
        return None
    rest = [(w, parts) for row, col, w, parts in block.rests if row == r and col == c]
    held: list[tuple[float, ...]] = [(), (), ()]
    for w, parts in rest:
        held[w] = parts
    return Summary(int(fields[0]), *fields[1:12], tuple(held) if rest else (), None)  # type: ignore[arg-type]


# -- the tests --------------------------------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(blocks())
def test_the_fast_finish_is_the_per_column_finish_bit_for_bit(block: Block) -> None:
    """finish (vectorized, with its per-column fallback) gives every field of the reference's Summaries."""
    agreed, summed = passes(block)
    want = [bits(s) for s in reference_finish(agreed, summed, block.moments)]
    assert [bits(s) for s in finish(agreed, summed, block.moments)] == want


@settings(max_examples=300, deadline=None)
@given(blocks())
def test_merge_and_the_collective_merge_match_the_reference(block: Block) -> None:
    """The one-process merge and the collective merge give the reference finish's bits."""
    prep = prepare(block)
    agreed = maxima(prep)
    want = [bits(s) for s in reference_finish(agreed, sums(prep, agreed), block.moments)]
    assert [bits(s) for s in merge(block)] == want
    assert [bits(s) for s in merge_collective(block)] == want


def test_the_fast_path_takes_the_common_columns() -> None:
    """Unit and weighted sums of ordinary data, one worker or many, are found without Python integers wherever they
    are double-doubles."""
    rng = np.random.default_rng(5)
    for n_rows in (1, 4):
        rows = [[Summary.of_batch((rng.standard_normal(8) * 10.0 ** float(e)).tolist(), w)
                 for e in (-5, 0, 7) for w in (None, rng.random(8).tolist())] for _ in range(n_rows)]
        block = block_of(rows, list(range(n_rows)), [False] * 6)
        agreed, summed = passes(block)
        held = rank_finish.plan(agreed)
        nq_max, offsets, sizes = held.nq_max, held.offsets, held.sizes
        _, _, ok = rank_finish.limb_sums(summed, nq_max, offsets, sizes)
        for i in range(len(sizes)):  # ok wherever the exact sum is a double-double
            n = sum(v << (32 * j) for j, v in enumerate(summed[offsets[i] : offsets[i] + sizes[i]].tolist()))
            assert ok[i] == (len(reference_components(n, -int(nq_max[i]))) < 3)
        assert [bits(s) for s in finish(agreed, summed, block.moments)] == [
            bits(s) for s in reference_finish(agreed, summed, block.moments)]


limbs = st.lists(st.one_of(st.integers(-(2**40), 2**40), st.sampled_from([0, 1, -1, 2**31, -(2**31), 2**32 - 1])),
                 min_size=1, max_size=12)


@settings(max_examples=500, deadline=None)
@given(st.lists(limbs, min_size=1, max_size=6), st.lists(st.integers(-1074, 1000), min_size=6, max_size=6))
def test_limb_sums_are_the_greedy_components_where_ok(slots: list[list[int]], qs: list[int]) -> None:
    """Where limb_sums says ok, (hi, lo) are the exact components of the limbs' value."""
    sizes = np.array([len(s) for s in slots], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    summed = np.array([x for s in slots for x in s], dtype=np.int64)
    nq_max = -np.array(qs[: len(slots)], dtype=np.float64)
    hi, lo, ok = rank_finish.limb_sums(summed, nq_max, offsets, sizes)
    for i, s in enumerate(slots):
        if not ok[i]:
            continue
        n = sum(v << (32 * j) for j, v in enumerate(s))
        if n == 0:
            assert hi[i] == 0.0
            continue
        want = reference_components(n, qs[i])
        got = (float(hi[i]), float(lo[i])) if lo[i] != 0.0 else (float(hi[i]),)
        assert got == want


magnitudes = st.one_of(st.integers(1, 2**60), st.integers(1, 2**200), st.integers(1, 2**1100))


@settings(max_examples=500, deadline=None)
@given(magnitudes, st.booleans(), st.integers(-1074, 1100), st.integers(0, 2000))
def test_components_are_a_function_of_the_value(n: int, negative: bool, q: int, k: int) -> None:
    """fixed.components(n << k, q - k) == fixed.components(n, q), and both are the greedy components of the value
    (across the double range: beyond it, subnormals; a sum of doubles is a multiple of 2**-1074)."""
    q = min(q, 1026 - n.bit_length())  # beyond 2**1026 the components are |V| / MAX copies of MAX: keep a few
    n = -n if negative else n
    want = reference_components(n, q)
    assert fixed.components(n, q) == want
    assert fixed.components(n << k, q - k) == want


def test_components_of_a_wide_window_near_the_top_of_the_range() -> None:
    """A value near MAX held with 2000 extra low bits (float(n) would overflow) keeps its components."""
    n, q = 2**53 - 1, 971
    assert fixed.components(n << 2000, q - 2000) == fixed.components(n, q) == (1.7976931348623157e308,)
    assert fixed.components(3 << 2100, -3174) == (3.0 * 2.0**-1074,)
