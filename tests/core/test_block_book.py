"""BlockBook: the drafter pool's bookkeeping without a tensor, against exact block ids.

Every ownership transition (allocate, grow, write, truncate, carry, adopt, free, evict,
share, copy on write), every refusal leaving the book unchanged, and `check()` catching a
leaked and a double-owned block that the test builds by hand.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from trtllm_mtp_carry.core.block_book import (
    BlockBook,
    CarriedBlocks,
    Growth,
    PoolExhaustedError,
    check_runs,
)


@dataclass
class Keys:
    """Prefix keys of `num_tokens` tokens: equal salts give equal keys (a fake `BlockKeys`)."""

    num_tokens: int
    salt: int = 0

    def key(self, depth: int) -> int:
        return self.salt * 1_000 + depth


def written(book: BlockBook, seq_id: int, rows: int, first_key: int = 0) -> CarriedBlocks:
    """Grow `seq_id` (allocated first when new) by `rows` rows and record them, keys from `first_key`."""
    if not book.has_sequence(seq_id):
        book.allocate_sequence(seq_id)
    book.grow(seq_id, rows)
    book.blocks_to_write(seq_id, rows)
    return book.append(seq_id, ((first_key, rows),))


def carried(book: BlockBook, seq_id: int, key: int, rows: int, first_key: int = 0) -> CarriedBlocks:
    written(book, seq_id, rows, first_key)
    return book.move_to_carried(seq_id, key)


def free_list(book: BlockBook) -> list[int]:
    """The free ids in the order grows take them (what `grow` pops next comes first)."""
    book.allocate_sequence(-99)  # take them all, then give them back (ungrow: to the front, in order)
    growth = book.grow(-99, book.num_free_blocks * book.block_size)
    ids = list(growth.blocks)
    book.ungrow(-99, ids)
    book.free_sequence(-99)
    return ids


def test_a_new_book_has_every_block_free_and_counts_nothing():
    book = BlockBook(4, 2)
    s = book.stats()
    assert (s.num_free_blocks, s.num_sequence_blocks, s.num_carried_blocks, s.num_sequences, s.num_carried) == \
        (4, 0, 0, 0, 0)
    assert free_list(book) == [0, 1, 2, 3] and book.slot is None and book.slot_key is None
    book.check()
    with pytest.raises(ValueError, match="block_size must be positive, got 0"):
        BlockBook(4, 0)


def test_grow_takes_the_free_lists_head_and_blocks_to_write_names_them_with_the_next_rows_offset():
    book = BlockBook(6, 4)
    book.allocate_sequence(1)
    assert book.num_blocks_needed(1, 6) == 2 and book.can_grow(1, 6)
    assert book.grow(1, 6) == Growth((0, 1), None)
    assert book.blocks_to_write(1, 6) == ([0, 1], 0)
    assert book.append(1, ((10, 3), (20, 3))) == CarriedBlocks((0, 1), 6, 22)
    assert book.blocks_to_write(1, 2) == ([1], 2)  # rows 6, 7: block 1 from offset 2
    assert book.num_blocks_needed(1, 2) == 0 and book.grow(1, 2) == Growth((), None)
    assert book.append(1, ((23, 2),)) == CarriedBlocks((0, 1), 8, 24)
    assert book.sequence_runs(1) == ((10, 3), (20, 5))  # the consecutive run joined
    assert book.num_free_blocks == 4
    book.check()


def test_keys_that_do_not_follow_the_rows_are_refused_before_any_change():
    book = BlockBook(6, 4)
    written(book, 1, 3, first_key=5)
    stats = book.stats()
    for runs, msg in [(((7, 1),), "first key 7 must exceed sequence 1's last_pair_key 7"),
                      (((8, 2), (9, 1)), "strictly increasing"),
                      (((8, 0),), "do not count"),
                      (((-1, 2),), "keys must be >= 0, got min key -1")]:
        with pytest.raises(ValueError, match=msg):
            book.check_next_keys(1, runs)
        with pytest.raises(ValueError, match=msg):
            book.append(1, runs)
    with pytest.raises(RuntimeError, match="1 blocks cannot hold 3 \\+ 2 rows"):
        book.append(1, ((8, 2),))  # not grown for them
    assert book.stats() == stats and book.sequence(1) == CarriedBlocks((0,), 3, 7)
    book.check()


def test_a_write_must_be_grown_for_first():
    book = BlockBook(6, 4)
    written(book, 1, 3)
    with pytest.raises(RuntimeError, match="grow it before writing 2 more"):
        book.blocks_to_write(1, 2)
    assert book.blocks_to_write(1, 1) == ([0], 3) and book.blocks_to_write(1, 0) == ([], 3)


def test_ungrow_gives_unwritten_blocks_back_to_the_front_of_the_free_list():
    book = BlockBook(6, 2)
    written(book, 1, 1)
    growth = book.grow(1, 4)  # rows 1..4: block 0's slot, then blocks 1, 2
    assert growth == Growth((1, 2), None)
    with pytest.raises(RuntimeError, match="not sequence 1's unwritten last blocks"):
        book.ungrow(1, [1])
    book.ungrow(1, [1, 2])
    assert book.sequence(1) == CarriedBlocks((0,), 1, 0) and free_list(book) == [1, 2, 3, 4, 5]
    book.check()


def test_carry_adopt_truncate_and_free_move_ownership_without_copies():
    book = BlockBook(6, 4)
    written(book, 1, 6)
    book.grow(1, 8)  # a reservation past the rows: blocks 2, 3 reserved (rows 6..13)
    assert book.sequence(1).block_table == (0, 1, 2, 3)
    assert book.move_to_carried(1, 0xA) == CarriedBlocks((0, 1), 6, 5)  # reserved blocks went back
    assert not book.has_sequence(1) and book.carried_keys() == (0xA,) and book.slot_key == 0xA
    assert free_list(book) == [4, 5, 2, 3]
    s = book.stats()
    assert (s.num_sequence_blocks, s.num_carried_blocks, s.num_carried, s.carried_rows) == (0, 2, 1, 6)
    assert book.adopt_carried(0xA, 2, rows_kept=3) == CarriedBlocks((0,), 3, 2)  # block 1 dropped
    assert book.carried(0xA) is None and book.sequence_runs(2) == ((0, 3),)
    assert free_list(book) == [4, 5, 2, 3, 1]
    assert book.free_sequence(2) == 1
    assert free_list(book) == [4, 5, 2, 3, 1, 0] and book.stats().num_sequences == 0
    book.check()


def test_double_claims_and_releases_without_a_hold_are_refused_and_change_nothing():
    book = BlockBook(6, 4)
    carried(book, 1, 5, 2)
    written(book, 2, 1)
    stats, held = book.stats(), book.sequence(2)
    refusals = [
        (lambda: book.allocate_sequence(2), "sequence 2 is already live"),
        (lambda: book.move_to_carried(2, 5), "carried entry 5 already holds 1 blocks"),
        (lambda: book.adopt_carried(5, 2), "sequence 2 already holds 1 blocks; it cannot adopt carried entry 5"),
        (lambda: book.adopt_carried(6, 3), "nothing carried under 6 for sequence 3 to adopt"),
        (lambda: book.free_sequence(9), "sequence 9 is not live"),
        (lambda: book.free_carried(6), "nothing carried under 6: nothing to free"),
        (lambda: book.carried_runs(6), "nothing carried under 6: no keys"),
        (lambda: book.truncate(9, 0), "sequence 9 is not live"),
        (lambda: book.ungrow(2, [0]), "not sequence 2's unwritten last blocks"),
    ]
    for call, msg in refusals:
        with pytest.raises(RuntimeError, match=msg):
            call()
    with pytest.raises(ValueError, match=r"rows_kept must be in \[0, 2\], got 3"):
        book.adopt_carried(5, 3, rows_kept=3)
    assert book.stats() == stats and book.sequence(2) == held and book.carried(5) == CarriedBlocks((0,), 2, 1)
    assert not book.has_sequence(3)
    book.check()


def test_a_short_free_list_evicts_the_named_victims_one_at_a_time_and_each_is_heard_first():
    book = BlockBook(5, 2)
    for key in (1, 2, 3):
        carried(book, key, key, 2)  # blocks 0, 1, 2
    heard: list[tuple[int, tuple[int, ...]]] = []
    named = [3, 99]  # the store names 3, then a key that is not carried: the oldest (1) goes
    book.victim = lambda: named.pop(0)
    book.on_evict = lambda key: heard.append((key, book.carried_keys()))
    book.allocate_sequence(7)
    assert book.grow(7, 8) == Growth((3, 4, 2, 0), None)
    assert heard == [(3, (1, 2)), (1, (2,))] and book.carried_keys() == (2,)
    assert book.stats().evictions_for_pressure == 2
    book.check()


def test_a_grow_every_carried_block_could_not_serve_is_refused_and_evicts_nothing():
    book = BlockBook(3, 2)
    carried(book, 1, 0xA, 2)
    book.allocate_sequence(2)
    heard: list[int] = []
    book.on_evict = heard.append
    stats = book.stats()
    assert book.can_grow(2, 6) and not book.can_grow(2, 7)
    with pytest.raises(PoolExhaustedError, match="only 2 of 3 blocks are free and 1 are carried"):
        book.grow(2, 7)
    assert book.stats() == stats and heard == [] and book.carried_keys() == (0xA,)
    book.check()


def test_share_publishes_first_then_merges_only_the_pairs_whose_bytes_were_equal():
    book = BlockBook(10, 2)
    written(book, 1, 5)  # blocks 0, 1, 2 (keys 0..4)
    plan = book.plan_share(1, Keys(6))  # full blocks 0, 1 (the third holds 1 row)
    assert plan.publish == ((0, 3), (1, 5)) and plan.compare == ()
    assert book.share(plan, []).published == 2
    book.move_to_carried(1, 0xA)
    written(book, 2, 5)  # blocks 3, 4, 5: the same prefix keys
    plan = book.plan_share(2, Keys(6))
    assert plan.publish == () and plan.compare == ((0, 3, 0), (1, 4, 1))
    stats = book.share(plan, [True, False])  # block 3's bytes equal block 0's; block 4's differ
    assert (stats.merged, stats.published, stats.mismatched) == (1, 0, 1)
    assert book.sequence(2).block_table == (0, 4, 5) and free_list(book)[-1] == 3
    s = book.stats()
    assert (s.num_shared_blocks, s.blocks_saved, s.shared_merges, s.share_mismatches, s.blocks_published) == \
        (1, 1, 1, 1, 2)
    assert (s.num_sequence_blocks, s.num_carried_blocks) == (3, 2)  # block 0 counts once, as live
    assert book.plan_share(2, Keys(6)).compare == ((1, 4, 1),)  # the merged block is published: skipped
    book.move_to_carried(2, 0xB)
    book.free_carried(0xA)  # block 0 stays, held by entry 0xB; block 1 goes, and leaves the index
    assert book.stats().num_shared_blocks == 0 and free_list(book)[-2:] == [1, 2]
    book.adopt_carried(0xB, 3)
    assert book.plan_share(3, Keys(6)).publish == ((4, 5),)  # key 5's block went: block 4 may publish now
    assert book.plan_share(3, Keys(6, salt=1)).publish == ((4, 1005),)  # another salt shares nothing
    book.check()


def test_a_stale_share_plan_or_a_short_answer_is_refused_before_any_change():
    book = BlockBook(10, 2)
    written(book, 1, 4)  # blocks 0, 1
    written(book, 2, 4)  # blocks 2, 3: the same keys, both plan to publish
    first, second = book.plan_share(1, Keys(5)), book.plan_share(2, Keys(5))
    assert first.publish == ((0, 3), (1, 5)) and second.publish == ((2, 3), (3, 5))
    book.share(first, [])
    stats = book.stats()
    with pytest.raises(RuntimeError, match="a stale share plan for sequence 2: prefix key 0x3"):
        book.share(second, [])
    plan = book.plan_share(2, Keys(5))
    assert plan.compare == ((0, 2, 0), (1, 3, 1))
    with pytest.raises(ValueError, match="1 byte comparisons for a plan of 2"):
        book.share(plan, [True])
    book.truncate(2, 0)
    book.grow(2, 4)  # the table now holds other blocks
    stats = book.stats()
    with pytest.raises(RuntimeError, match="a stale share plan for sequence 2: block index 0"):
        book.share(plan, [True, True])
    assert book.stats() == stats and book.sequence(2).block_table == (4, 5)
    book.check()


def test_a_grow_into_a_shared_tail_copies_it_first_and_a_shared_block_is_never_named_for_a_write():
    book = BlockBook(8, 4)
    written(book, 1, 8)  # blocks 0, 1
    book.share(book.plan_share(1, Keys(9)), [])  # published under keys 5, 9
    book.move_to_carried(1, 0xA)
    written(book, 2, 8)  # blocks 2, 3: equal bytes, merged into 0, 1
    assert book.share(book.plan_share(2, Keys(9)), [True, True]).merged == 2
    assert book.adopt_carried(0xA, 3, rows_kept=6) == CarriedBlocks((0, 1), 6, 5)  # block 1: 2 of its rows
    assert book.num_blocks_needed(3, 1) == 1  # the copy of the shared tail
    growth = book.grow(3, 1)
    assert growth == Growth((), (1, 4))  # fresh block 4 replaces block 1 for sequence 3 only
    assert book.sequence(3).block_table == (0, 4) and book.sequence(2).block_table == (0, 1)
    assert book.blocks_to_write(3, 1) == ([4], 2) and book.stats().cow_copies == 1
    book.truncate(2, 2)  # sequence 2 keeps 2 rows of block 0, which sequence 3 shares
    with pytest.raises(RuntimeError, match="block 0 of sequence 2 has 2 owners: it cannot be written"):
        book.blocks_to_write(2, 1)
    book.check()


def test_check_catches_a_leaked_block():
    book = BlockBook(4, 2)
    written(book, 1, 2)
    book._free.remove(3)  # block 3: neither free nor held
    with pytest.raises(RuntimeError, match="block 3 is owned by nobody and not in the free pool"):
        book.check()


def test_check_catches_a_double_owned_block():
    book = BlockBook(4, 2)
    carried(book, 1, 0xA, 2)
    written(book, 2, 2)
    book._seqs[2].block_table.append(0)  # block 0 is entry 0xA's, counted once
    with pytest.raises(RuntimeError, match=r"block 0 is owned by \['sequence 2', 'carried entry 10'\] but "
                                           r"counted 1 references \(0 live\)"):
        book.check()


def test_check_catches_a_free_block_that_is_held_and_a_count_gone_astray():
    book = BlockBook(4, 2)
    written(book, 1, 2)
    book._free.append(0)
    with pytest.raises(RuntimeError, match=r"block 0 is in the free pool and owned by \['sequence 1'\]"):
        book.check()
    book._free.pop()
    book._num_shared += 1
    with pytest.raises(RuntimeError, match=r"block counts .* \(1, 1, 0, 1\) differ from the running ones "
                                           r"\(1, 1, 1, 1\)"):
        book.check()


def test_check_runs_names_the_offending_runs():
    check_runs(((0, 2), (5, 1)), 3)
    with pytest.raises(ValueError, match=r"key runs \[\(0, 2\)\] do not count the 3 rows"):
        check_runs(((0, 2),), 3)
    with pytest.raises(ValueError, match=r"strictly increasing, got key runs \[\(0, 2\), \(1, 1\)\]"):
        check_runs(((0, 2), (1, 1)), 3)


def test_the_book_imports_no_torch_and_no_numpy():
    code = ("import sys\nfrom trtllm_mtp_carry.core.block_book import BlockBook\n"
            "b = BlockBook(4, 2)\nb.allocate_sequence(1)\nb.grow(1, 3)\nb.check()\n"
            "print([m for m in ('numpy', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
