"""CarriedDrafter: prefix, session identity and usable_by, exact values."""

import array

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trtllm_mtp_carry import CarriedDrafter
from trtllm_mtp_carry.core import common_prefix_len

SESSION = 0xC0FFEE


def entry(tokens=(1, 2, 3, 4, 5), rows=4, key=3, session=SESSION, blocks=(7,)):
    return CarriedDrafter(list(blocks), rows, key, list(tokens), session)


def test_spec_examples():
    e = entry()
    assert e.usable_by([1, 2, 3, 4, 5, 6, 7], SESSION) == (4, 3)
    assert e.usable_by([1, 2, 3, 4, 9, 6, 7], SESSION) == (3, 2)
    assert e.usable_by([1, 9, 9], SESSION) is None


def test_session_identity():
    e = entry()
    assert e.session_matches(SESSION)
    assert not e.session_matches(SESSION + 1)
    assert not e.session_matches(0)
    assert not entry(session=0).session_matches(0)  # 0 is never a wildcard
    assert entry().usable_by([1, 2, 3, 4, 5, 6], SESSION + 1) is None


def test_common_below_two_keeps_nothing():
    e = entry()
    assert e.usable_by([1], SESSION) is None
    assert e.usable_by([], SESSION) is None
    assert e.usable_by([9, 9, 9], SESSION) is None
    assert e.usable_by([1, 2], SESSION) == (1, 0)  # common 2: the row for key 0 survives


def test_common_two_keeps_row_for_key_zero_when_dense():
    e = entry(rows=4, key=3)
    assert e.usable_at(2) == (1, 0)


def test_no_rows_or_no_key_is_none():
    assert entry(rows=0, key=None).usable_by([1, 2, 3, 4, 5, 6], SESSION) is None
    assert entry(rows=0, key=3).usable_by([1, 2, 3, 4, 5, 6], SESSION) is None


def test_keys_dropped_below_row_count_give_none_not_negative():
    # 2 rows whose newest key is 3 (keys 0 and 1 were skipped): common 3 -> key 1 -> 2 - 2 = 0
    e = entry(rows=2, key=3)
    assert e.usable_at(3) is None
    assert e.usable_at(4) == (1, 2)


def test_prompt_shorter_than_tokens():
    e = entry()
    assert e.usable_by([1, 2, 3, 4], SESSION) == (3, 2)


def test_tokens_of_any_int_sequence():
    e = entry()
    prompt = [1, 2, 3, 4, 5, 6]
    for p in (tuple(prompt), array.array("q", prompt), np.array(prompt), range(1, 7)):
        assert e.usable_by(p, SESSION) == (4, 3)
    assert CarriedDrafter([], 4, 3, np.array([1, 2, 3, 4, 5]), SESSION).tokens == [1, 2, 3, 4, 5]


def test_invalid_entries_name_the_value():
    with pytest.raises(ValueError, match="rows=2 with last_pair_key=None"):
        entry(rows=2, key=None)
    with pytest.raises(ValueError, match="rows=5 exceeds"):
        entry(rows=5, key=3)
    with pytest.raises(ValueError, match="last_pair_key=4 past the tokens"):
        entry(rows=4, key=4)
    with pytest.raises(ValueError, match="session_hash"):
        entry(session=-1)
    with pytest.raises(ValueError, match="rows"):
        entry(rows=-1)


def test_common_prefix_len_long_lists():
    n = 150_000
    a = list(range(n))
    assert common_prefix_len(a, list(a)) == n
    for cut in (0, 1, 15, 16, 17, 255, 4095, 4096, 4097, 70_001, n - 1):
        b = list(a)
        b[cut] = -1
        assert common_prefix_len(a, b) == cut
    assert common_prefix_len(a, a[:999]) == 999
    assert common_prefix_len([], a) == 0


@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.integers(0, 3), max_size=60))
def test_common_prefix_len_matches_naive(a, b):
    naive = 0
    while naive < min(len(a), len(b)) and a[naive] == b[naive]:
        naive += 1
    assert common_prefix_len(a, b) == naive


@given(
    tokens=st.lists(st.integers(0, 2), min_size=2, max_size=40),
    prompt=st.lists(st.integers(0, 2), max_size=40),
    data=st.data(),
)
def test_usable_by_never_non_positive_nor_above_common_minus_two(tokens, prompt, data):
    key = data.draw(st.integers(0, len(tokens) - 2))
    rows = data.draw(st.integers(0, key + 1))
    e = CarriedDrafter([], rows, key, tokens, SESSION)
    got = e.usable_by(prompt, SESSION)
    common = e.common_prefix_len(prompt)
    if got is not None:
        kept, k = got
        assert 1 <= kept <= rows
        assert k <= common - 2 and k <= key
        assert kept == rows - (key - k)
    else:
        assert rows == 0 or common < 2 or rows - (key - min(key, common - 2)) <= 0
