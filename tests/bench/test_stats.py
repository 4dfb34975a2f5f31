"""Quartile spreads and paired ratios: exact values on small hand-checked inputs."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trtllm_mtp_carry.bench.stats import NEAR_ZERO, Spread, paired_ratio


def test_spread_interpolates_between_order_statistics():
    assert Spread.of([40.0, 10.0, 30.0, 20.0]) == Spread(median=25.0, p25=17.5, p75=32.5, n=4)
    assert Spread.of([7.0]) == Spread(7.0, 7.0, 7.0, 1)


def test_spread_of_odd_count_and_of_nothing():
    assert Spread.of([5.0, 1.0, 3.0, 9.0, 7.0]) == Spread(median=5.0, p25=3.0, p75=7.0, n=5)
    assert Spread.of([]) == Spread(None, None, None, 0)


def test_paired_ratio_is_the_median_of_per_pair_ratios_not_a_ratio_of_medians():
    a = [10.0, 30.0, 100.0]
    b = [20.0, 10.0, 100.0]  # per-pair ratios 0.5, 3.0, 1.0
    r = paired_ratio(a, b, "ttft_ms")
    assert r.reason is None
    assert r.spread == Spread(median=1.0, p25=0.75, p75=2.0, n=3)
    assert Spread.of(a).median / Spread.of(b).median == 1.5  # what a ratio of medians would say


def test_paired_ratio_with_a_near_zero_denominator_is_null_with_a_reason():
    r = paired_ratio([1.5, 1.7, 1.6], [0.02, 0.0, 1.0], "drafter_prep_ms", "blind")
    assert r.spread == Spread(None, None, None, 0)
    assert r.reason == "blind has drafter_prep_ms at or near zero (<= 0.05) on 2 of 3 turns"
    assert NEAR_ZERO["acceptance"] == 0.01
    off = paired_ratio([0.6, 0.7], [0.0, 0.0], "acceptance", "off")
    assert off.reason == "off has acceptance at or near zero (<= 0.01) on 2 of 2 turns"


def test_paired_ratio_without_pairs_or_with_unequal_lengths():
    assert paired_ratio([], [], "ttft_ms").reason == "no paired turns"
    with pytest.raises(ValueError, match="differ in length: 2 and 1"):
        paired_ratio([1.0, 2.0], [1.0], "ttft_ms")


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=1, max_size=41))
def test_spread_is_ordered_inside_the_range_and_its_median_is_the_middle(xs):
    s = Spread.of(xs)
    ordered = sorted(xs)
    assert s.n == len(xs)
    tol = 1e-9 * max(1.0, abs(ordered[0]), abs(ordered[-1]))  # interpolation rounds
    assert ordered[0] - tol <= s.p25 <= s.median + tol <= s.p75 + 2 * tol <= ordered[-1] + 3 * tol
    mid = len(xs) // 2
    expected = ordered[mid] if len(xs) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    assert s.median == pytest.approx(expected, rel=1e-12, abs=1e-9)
