"""Quantiles, spreads and paired ratios: exact values on small hand-checked inputs."""

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trtllm_mtp_carry.bench.stats import NEAR_ZERO, Spread, paired_ratio, quantile


def test_quantile_interpolates_between_order_statistics():
    xs = [40.0, 10.0, 30.0, 20.0]  # sorted: 10 20 30 40
    assert quantile(xs, 0.5) == 25.0  # even count: mean of the middle two
    assert quantile(xs, 0.25) == 17.5  # position 0.75 between 10 and 20
    assert quantile(xs, 0.75) == 32.5
    assert (quantile(xs, 0.0), quantile(xs, 1.0)) == (10.0, 40.0)
    assert quantile([7.0], 0.25) == 7.0


def test_quantile_rejects_no_values_and_bad_q():
    with pytest.raises(ValueError, match="quantile of no values"):
        quantile([], 0.5)
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\], got 1.5"):
        quantile([1.0], 1.5)


def test_spread_of_odd_count_and_of_nothing():
    assert Spread.of([5.0, 1.0, 3.0, 9.0, 7.0]) == Spread(median=5.0, p25=3.0, p75=7.0, n=5)
    assert Spread.of([]) == Spread(None, None, None, 0)


def test_paired_ratio_is_the_median_of_per_pair_ratios_not_a_ratio_of_medians():
    a = [10.0, 30.0, 100.0]
    b = [20.0, 10.0, 100.0]  # per-pair ratios 0.5, 3.0, 1.0
    r = paired_ratio(a, b, "ttft_ms")
    assert r.reason is None
    assert r.spread == Spread(median=1.0, p25=0.75, p75=2.0, n=3)
    assert quantile(a, 0.5) / quantile(b, 0.5) == 1.5  # what a ratio of medians would say


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


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6, allow_nan=False), min_size=2, max_size=40))
def test_spread_agrees_with_the_standard_librarys_inclusive_quartiles(xs):
    p25, p50, p75 = statistics.quantiles(xs, n=4, method="inclusive")
    s = Spread.of(xs)
    assert s.n == len(xs)
    assert s.median == pytest.approx(p50, rel=1e-9, abs=1e-6)
    assert s.p25 == pytest.approx(p25, rel=1e-9, abs=1e-6)
    assert s.p75 == pytest.approx(p75, rel=1e-9, abs=1e-6)
