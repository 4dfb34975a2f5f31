"""plan_append and hidden_row_offset: SPEC.md examples and edges, exact values."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trtllm_mtp_carry import AppendPlan, hidden_row_offset, plan_append


def test_spec_examples():
    assert plan_append(97, 200, 97, 200) == AppendPlan(first_key=98, rows=101)
    assert plan_append(97, 200, 150, 200) == AppendPlan(150, 49)
    assert plan_append(97, 200, 97, 198) is None


def test_store_ending_exactly_after_last_key_covers_it():
    assert plan_append(97, 200, 97, 199) == AppendPlan(98, 101)


def test_nothing_missing_is_none():
    assert plan_append(198, 200, 0, 200) is None
    assert plan_append(250, 200, 0, 300) is None  # key past the prompt


def test_short_prompts_are_none():
    assert plan_append(None, 0, 0, 10) is None
    assert plan_append(None, 1, 0, 10) is None


def test_two_token_prompt_plans_key_zero():
    assert plan_append(None, 2, 0, 1) == AppendPlan(0, 1)


def test_cold_start_plans_every_key():
    assert plan_append(None, 10, 0, 10) == AppendPlan(0, 9)


def test_unclaimed_store_is_refused():
    assert plan_append(3, 10, 0, 0) is None


def test_floor_past_the_last_key_is_none():
    assert plan_append(97, 200, 199, 200) is None


def test_last_key_and_plan_fields():
    plan = plan_append(97, 200, 150, 200)
    assert (plan.first_key, plan.rows, plan.last_key) == (150, 49, 198)


@pytest.mark.parametrize(
    "args, name",
    [
        ((-1, 10, 0, 10), "last_pair_key"),
        ((None, -1, 0, 10), "prompt_len"),
        ((None, 10, -1, 10), "hidden_lo"),
        ((None, 10, 0, -3), "hidden_hi"),
    ],
)
def test_negative_arguments_name_the_argument(args, name):
    with pytest.raises(ValueError, match=name):
        plan_append(*args)


def test_inverted_interval_is_refused():
    with pytest.raises(ValueError, match=r"\[5, 3\)"):
        plan_append(None, 10, 5, 3)


def test_bool_and_float_are_refused():
    with pytest.raises(TypeError, match="prompt_len"):
        plan_append(None, 10.0, 0, 10)
    with pytest.raises(TypeError, match="last_pair_key"):
        plan_append(True, 10, 0, 10)


def test_hidden_row_offset_is_bf16_row_major():
    assert hidden_row_offset(0, 0, 2048) == 0
    assert hidden_row_offset(0x1000, 3, 2048) == 0x1000 + 3 * 4096
    assert hidden_row_offset(7, 11_947, 4) == 7 + 11_947 * 8
    with pytest.raises(ValueError, match="pos"):
        hidden_row_offset(0, -1, 8)


@given(
    last=st.one_of(st.none(), st.integers(0, 300)),
    prompt_len=st.integers(0, 300),
    lo=st.integers(0, 300),
    width=st.integers(0, 300),
)
def test_plan_covers_exactly_the_missing_keys_the_store_holds(last, prompt_len, lo, width):
    hi = lo + width
    plan = plan_append(last, prompt_len, lo, hi)
    missing = set(range(0 if last is None else last + 1, prompt_len - 1))
    held = set(range(lo, hi))
    if plan is None:
        # refused: nothing missing, or some missing key at/above the floor is not held
        wanted = {k for k in missing if k >= lo}
        assert not wanted or not wanted <= held
    else:
        keys = set(range(plan.first_key, plan.first_key + plan.rows))
        assert plan.rows >= 1
        assert keys == {k for k in missing if k >= lo}
        assert keys <= held
        assert plan.last_key == prompt_len - 2
