"""decide_adopt: every step of SPEC.md's decision, in order, with exact outcomes."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trtllm_mtp_carry import CarriedDrafter, CarryOutcome, StoreRange, decide_adopt

H = 0xABCDEF
G = 41  # this sequence's ticket


def carried(n_tokens=100, rows=None, key=None, session=H):
    tokens = list(range(1000, 1000 + n_tokens))
    key = n_tokens - 2 if key is None else key
    rows = key + 1 if rows is None else rows
    return CarriedDrafter([0, 1], rows, key, tokens, session)


def prompt_extending(entry, extra):
    return entry.tokens + list(range(5000, 5000 + extra))


def test_empty_slot_is_no_carry():
    assert decide_adopt(None, [1, 2, 3], H, G, StoreRange.EMPTY) == CarryOutcome.NoCarry()


def test_foreign_session_refused_before_tokens_are_compared():
    e = carried()
    out = decide_adopt(e, prompt_extending(e, 10), H + 1, G, StoreRange(G, 0, 200))
    assert out == CarryOutcome.ForeignSession(entry_session=H, prompt_session=H + 1)


def test_session_zero_is_foreign_even_for_zero_entry():
    e = carried(session=0)
    out = decide_adopt(e, prompt_extending(e, 10), 0, G, StoreRange(G, 0, 200))
    assert out == CarryOutcome.ForeignSession(0, 0)


def test_prefix_mismatch_reports_common_and_rows():
    e = carried()
    out = decide_adopt(e, [1000, 7, 7, 7], H, G, StoreRange(G, 0, 4))
    assert out == CarryOutcome.PrefixMismatch(common=1, entry_rows=99)


def test_entry_without_rows_is_prefix_mismatch():
    e = CarriedDrafter([], 0, None, list(range(10)), H)
    assert decide_adopt(e, list(range(12)), H, G, StoreRange(G, 0, 12)) == (
        CarryOutcome.PrefixMismatch(10, 0)
    )


def test_nothing_missing_adopts_without_reading_the_store():
    e = carried(n_tokens=100)
    # prompt equals tokens: keys 0..98 all present; foreign store does not matter
    out = decide_adopt(e, e.tokens, H, G, StoreRange(G + 1, 0, 100))
    assert out == CarryOutcome.Adopted(rows=99, appended=0, first_key=99)


def test_foreign_hiddens_named_by_owner_and_expected():
    e = carried()
    out = decide_adopt(e, prompt_extending(e, 50), H, G, StoreRange(7, 0, 150))
    assert out == CarryOutcome.ForeignHiddens(owner=7, expected=G)


def test_unclaimed_store_is_no_hiddens():
    e = carried()
    out = decide_adopt(e, prompt_extending(e, 50), H, G, StoreRange(0, 0, 150))
    assert out == CarryOutcome.NoHiddens()


def test_store_short_of_last_key_is_no_hiddens():
    e = carried()  # keys 0..98, prompt of 150 needs keys 99..148
    out = decide_adopt(e, prompt_extending(e, 50), H, G, StoreRange(G, 98, 148))
    assert out == CarryOutcome.NoHiddens()


def test_adopted_appends_exactly_the_new_span():
    e = carried()  # 100 tokens, rows for keys 0..98
    out = decide_adopt(e, prompt_extending(e, 50), H, G, StoreRange(G, 98, 150))
    assert out == CarryOutcome.Adopted(rows=99, appended=50, first_key=99)


def test_adopted_skips_keys_below_the_store_floor():
    e = carried()
    out = decide_adopt(e, prompt_extending(e, 50), H, G, StoreRange(G, 120, 150))
    assert out == CarryOutcome.Adopted(rows=99, appended=29, first_key=120)


def test_retokenized_tail_truncates_instead_of_refusing():
    e = carried()  # tokens 0..99, keys 0..98
    prompt = e.tokens[:95] + [7, 7, 7] + list(range(20))  # diverges at 95
    out = decide_adopt(e, prompt, H, G, StoreRange(G, 90, len(prompt)))
    # common 95 -> key 93 -> 94 rows kept; append keys 94 .. len-2
    assert out == CarryOutcome.Adopted(rows=94, appended=len(prompt) - 1 - 94, first_key=94)


def test_ticket_zero_never_reads_hiddens():
    e = carried()
    out = decide_adopt(e, prompt_extending(e, 5), H, 0, StoreRange(0, 0, 200))
    assert out == CarryOutcome.NoHiddens()


@pytest.mark.parametrize("field", ["session_hash", "ticket"])
def test_out_of_range_ids_are_named(field):
    args = {"session_hash": H, "ticket": G}
    args[field] = 2**64
    with pytest.raises(ValueError, match=field):
        decide_adopt(None, [1, 2], args["session_hash"], args["ticket"], StoreRange.EMPTY)


def test_outcome_texts():
    assert str(CarryOutcome.Adopted(4, 2, 9)) == "adopted rows=4 appended=2 first_key=9"
    assert str(CarryOutcome.NoCarry()) == "no carried state: never_carried"
    assert str(CarryOutcome.NoCarry("memory")) == "no carried state: memory"
    assert str(CarryOutcome.PrefixMismatch(3, 8)) == "prefix mismatch (common=3 entry_rows=8)"
    assert str(CarryOutcome.ForeignSession(0xAB, 0x1)) == (
        "foreign session (entry=0x00000000000000ab prompt=0x0000000000000001)"
    )
    assert str(CarryOutcome.ForeignHiddens(3, 5)) == "hidden rows belong to sequence gen 3, not 5"
    assert str(CarryOutcome.NoHiddens()) == "hidden store does not cover the append span"


def test_outcomes_compare_by_fields_and_kind():
    assert CarryOutcome.Adopted(1, 2, 3) == CarryOutcome.Adopted(1, 2, 3)
    assert CarryOutcome.Adopted(1, 2, 3) != CarryOutcome.Adopted(1, 2, 4)
    assert CarryOutcome.NoCarry() == CarryOutcome.NoCarry()
    assert CarryOutcome.NoCarry() != CarryOutcome.NoHiddens()
    assert CarryOutcome.Adopted(1, 2, 3).adopted and not CarryOutcome.NoCarry().adopted
    assert isinstance(CarryOutcome.NoHiddens(), CarryOutcome)
    assert CarryOutcome.ForeignHiddens(1, 2).kind == "foreign_hiddens"


@given(
    tokens=st.lists(st.integers(0, 2), min_size=2, max_size=30),
    extra=st.lists(st.integers(0, 2), max_size=30),
    cut=st.integers(0, 30),
    data=st.data(),
)
def test_adopted_only_own_session_and_own_hidden_rows(tokens, extra, cut, data):
    """Whatever the inputs, an adoption keeps this session's rows and reads this ticket's rows."""
    key = data.draw(st.integers(0, len(tokens) - 2))
    rows = data.draw(st.integers(0, key + 1))
    entry_session = data.draw(st.sampled_from([0, 1, 2]))
    session, ticket = data.draw(st.sampled_from([0, 1, 2])), data.draw(st.sampled_from([0, 5, 6]))
    owner = data.draw(st.sampled_from([0, 5, 6]))
    lo = data.draw(st.integers(0, 70))
    store = StoreRange(owner, lo, lo + data.draw(st.integers(0, 70)))
    entry = CarriedDrafter([], rows, key, tokens, entry_session)
    prompt = tokens[:cut] + extra
    out = decide_adopt(entry, prompt, session, ticket, store)
    if isinstance(out, CarryOutcome.Adopted):
        assert session == entry_session != 0
        assert 1 <= out.rows <= rows
        kept_key = key - (rows - out.rows)
        assert kept_key <= entry.common_prefix_len(prompt) - 2
        if out.appended:
            assert store.owner == ticket != 0
            assert store.lo <= out.first_key and out.first_key + out.appended <= store.hi
            assert out.first_key + out.appended == len(prompt) - 1  # up to the last key
            assert out.first_key > kept_key
        else:
            assert out.first_key == kept_key + 1 >= len(prompt) - 1
