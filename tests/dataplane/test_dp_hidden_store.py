"""HiddenStore: writes stamp the range, reads only inside visible_to, addresses agree with the core."""

from __future__ import annotations

import pytest
import torch
from dp_helpers import bits, rand

from trtllm_mtp_carry.core.plan import hidden_row_offset
from trtllm_mtp_carry.core.store_range import StoreRange
from trtllm_mtp_carry.dataplane.hidden_store import HiddenRowsNotVisible, HiddenStore


@pytest.fixture
def store() -> HiddenStore:
    return HiddenStore(capacity=64, hidden_size=24)


def test_row_address_matches_hidden_row_offset(store):
    base = store.buffer.data_ptr()
    for pos in (0, 1, 17, 63):
        assert store.row_address(pos) == hidden_row_offset(base, pos, 24)
        assert store.row_address(pos) == store.buffer[pos].data_ptr()
    with pytest.raises(ValueError, match="pos"):
        store.row_address(64)


def test_write_then_read_round_trips(store, gen):
    rows = rand(gen, 10, 24)
    assert store.write(7, 5, rows) == StoreRange(7, 5, 15)
    assert torch.equal(bits(store.read(7, 5, 15)), bits(rows))
    assert torch.equal(bits(store.read(7, 8, 11)), bits(rows[3:6]))
    out = torch.zeros(8, 24, dtype=torch.bfloat16)
    got = store.read(7, 6, 9, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(bits(got), bits(rows[1:4]))


def test_same_ticket_merges_other_ticket_replaces(store, gen):
    store.write(7, 0, rand(gen, 4, 24))
    assert store.write(7, 4, rand(gen, 4, 24)) == StoreRange(7, 0, 8)  # abutting: extends
    assert store.write(9, 2, rand(gen, 3, 24)) == StoreRange(9, 2, 5)  # foreign: replaces
    assert store.visible_to(7) == (0, 0)
    with pytest.raises(HiddenRowsNotVisible, match="ticket 7"):
        store.read(7, 0, 4)
    assert store.write(0, 10, rand(gen, 2, 24)).owner == 0  # ticket 0: unclaimed
    with pytest.raises(HiddenRowsNotVisible):
        store.read(0, 10, 12)


def test_read_outside_visible_refused(store, gen):
    store.write(3, 10, rand(gen, 5, 24))
    for a, b in ((9, 12), (12, 16), (0, 1)):
        with pytest.raises(HiddenRowsNotVisible, match=rf"rows \[{a}, {b}\)"):
            store.read(3, a, b)
    assert store.read(3, 12, 12).shape == (0, 24)


def test_bad_writes_change_nothing(store, gen):
    store.write(3, 0, rand(gen, 4, 24))
    before, rng = bits(store.buffer), store.range
    bad = [
        (dict(ticket=3, start=62, rows=rand(gen, 4, 24)), "capacity 64"),
        (dict(ticket=3, start=-1, rows=rand(gen, 1, 24)), "start=-1"),
        (dict(ticket=3, start=0, rows=rand(gen, 2, 20)), "hidden_size=24"),
        (dict(ticket=3, start=0, rows=rand(gen, 2, 24, dtype=torch.float16)), "dtype"),
        (dict(ticket=-1, start=0, rows=rand(gen, 2, 24)), "ticket"),
        (dict(ticket=2**64, start=0, rows=rand(gen, 2, 24)), "ticket"),
    ]
    for kwargs, msg in bad:
        with pytest.raises(ValueError, match=msg):
            store.write(**kwargs)
    assert torch.equal(bits(store.buffer), before) and store.range == rng
    with pytest.raises(ValueError, match="a <= b"):
        store.read(3, 3, 1)


def test_zero_row_write_is_a_no_op(store, gen):
    store.write(3, 0, rand(gen, 4, 24))
    assert store.write(5, 9, rand(gen, 0, 24)) == StoreRange(3, 0, 4)


def test_reset_and_construction_errors():
    s = HiddenStore(4, 8)
    s.reset()
    assert s.range == StoreRange.EMPTY
    with pytest.raises(ValueError, match="capacity"):
        HiddenStore(0, 8)
    with pytest.raises(ValueError, match="BF16"):
        HiddenStore(4, 8, dtype=torch.float32)
