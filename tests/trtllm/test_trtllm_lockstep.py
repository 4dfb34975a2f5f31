"""`trtllm/lockstep.py`: what each agreement decides from every rank's vote, and TP=1 without a collective.

The agreements over real rank processes are test_trtllm_tensor_parallel.py's; here the
communicator is `Votes`: it hands this rank the vectors the other ranks sent (as
`Distributed.tp_allgather` returns them, rank order), so each reduction is pinned exactly.
"""

from __future__ import annotations

from typing import Any

import pytest

from trtllm_mtp_carry.trtllm.lockstep import NS, Lockstep, LockstepError


class Votes:
    """A TP group's `tp_allgather`, as seen from rank `rank`: the queued vectors of the other
    ranks (each call takes the next), this rank's own in its place."""

    def __init__(self, rank: int, others: list[list[list[int]]]) -> None:
        self.rank = rank
        self.others = others
        self.calls: list[list[int]] = []

    def tp_allgather(self, obj: Any) -> list[Any]:
        self.calls.append(list(obj))
        row = self.others.pop(0)
        return [*row[:self.rank], list(obj), *row[self.rank:]]


def test_at_tp_one_no_agreement_is_a_collective_and_the_clock_is_the_local_one() -> None:
    ticks = iter([5.0, 7.5, 9.0])
    lockstep = Lockstep.single(clock=lambda: next(ticks))
    assert not lockstep.active
    assert lockstep.agree_first_sights([(0x1234, 64), (0, 0)]) == [1, 0]
    assert lockstep.agree_rows([40, 0]) == ([40, 0], [40, 0])
    assert lockstep.agree_deposit(0x1234, 0, 99) == 0 and lockstep.agree_deposit(0x1234, 3, 99) == 3
    assert lockstep.agree_all(False) == (False, False)
    assert (lockstep.now(), lockstep.now(), lockstep.agreements) == (5.0, 7.5, 0)


def test_the_clock_is_rank_zeros_reading_as_agreed_on_every_rank() -> None:
    # rank 1's own clock is far ahead; rank 0's readings (first element) ride on each vote
    votes = Votes(1, [[[round(100.0 * NS), 1]], [[round(130.5 * NS), 1]]])
    lockstep = Lockstep(votes, 2, 1, clock=lambda: 10_000.0)
    assert lockstep.agree_all(True) == (True, True) and lockstep.now() == 100.0
    assert lockstep.now() == 100.0  # it moves only with an agreement
    lockstep.agree_all(True)
    assert (lockstep.now(), lockstep.agreements) == (130.5, 2)
    assert votes.calls == [[round(10_000.0 * NS), 1]] * 2  # this rank sends its own reading too


def test_first_sights_are_judged_only_where_every_rank_has_the_same_key_and_depth() -> None:
    others = [[[0, 7, 64, 0, 0, 9, 32, 5, 64]]]  # rank 0: (7, 64), (0, 0), (9, 32), (5, 64)
    lockstep = Lockstep(Votes(1, others), 2, 1)
    got = lockstep.agree_first_sights([(7, 64), (0, 0), (9, 64), (0, 0)])
    assert got == [1, 0, -1, -1]  # alike; nobody; another depth; another rank has a key


def test_the_agreed_rows_are_the_fewest_any_rank_can_restore() -> None:
    others = [[[0, 40, 0, 12], [0, 40, 30, 0]]]  # ranks 0 and 2
    agreed, best = Lockstep(Votes(1, others), 3, 1).agree_rows([40, 30, 12])
    assert (agreed, best) == ([40, 0, 0], [40, 30, 12])  # the last two: some rank could not


def test_a_deposit_agrees_only_on_the_same_rows_of_the_same_key_else_the_lowest_ranks_reason() -> None:
    def agreed(mine: list[int], *others: list[int], rank: int = 1) -> int:
        row = [[0, *o] for o in others]
        return Lockstep(Votes(rank, [row]), len(others) + 1, rank).agree_deposit(*mine)

    assert agreed([5, 0, 99], [5, 0, 99], [5, 0, 99]) == 0
    assert agreed([5, 6, 99], [5, 4, 99], [5, 0, 99]) == 4  # rank 0's reason first (rank order)
    assert agreed([5, 0, 99], [5, 0, 99], [5, 6, 99]) == 6
    assert agreed([5, 0, 99], [5, 0, 98], [5, 0, 99]) == -1  # every rank would, not the same rows
    assert agreed([5, 0, 99], [4, 0, 99], [5, 0, 99]) == -1  # nor the same key


def test_every_rank_installs_only_with_the_same_carry_memory() -> None:
    def install(*others: list[int]) -> tuple[list[bool], bool]:
        return Lockstep(Votes(0, [[[0, *o] for o in others]]), len(others) + 1, 0).agree_install(True, 4096, 0)

    assert install([1, 4096, 0]) == ([True, True], True)
    assert install([0, 0, 0]) == ([True, False], True)  # a rank that could not: every rank stands aside
    assert install([1, 2048, 0]) == ([True, True], False)


def test_ranks_voting_on_different_things_raise_on_every_rank() -> None:
    lockstep = Lockstep(Votes(1, [[[0, 7, 64, 9, 64]]]), 2, 1)  # rank 0 votes on two requests
    with pytest.raises(LockstepError, match="vectors of widths"):
        lockstep.agree_first_sights([(7, 64)])


def test_a_tensor_parallel_lockstep_needs_the_executors_communicator() -> None:
    with pytest.raises(ValueError, match="tensor parallel size 2 needs the executor's communicator"):
        Lockstep(None, 2, 0)
    with pytest.raises(ValueError, match="tp_rank 2 is not a rank of a group of 2"):
        Lockstep(Votes(2, []), 2, 2)
