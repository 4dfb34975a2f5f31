"""Entry moves over the carry service (`service/moves.py`), on the reference engine: an entry lent by one engine and
received by another is adopted there bit for bit, with the outputs and acceptance of the turn that
adopts it where it was deposited; every refusal leaves the receiver's store as it was."""

from __future__ import annotations

import pytest
import torch
from engine_factories import engine, random_prompt, tiny_model

from trtllm_mtp_carry import EVICTION_CAUSES, carry_key, session_hash
from trtllm_mtp_carry.runtime import CarryRuntime
from trtllm_mtp_carry.service.moves import EntryMeta, EntryMoves, digest_bytes


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


def carrying(eng, row_dtype="bf16", host_memory=0, slots=None):
    eng.runtime = CarryRuntime(eng, eng.config.policy, slots=slots, share=False, row_dtype=row_dtype,
                               host_memory=host_memory)
    return eng


def check_all(eng):
    eng.check()
    eng.runtime.check()
    eng.drafter_pool.check()


def two_turns(seed):
    gen = torch.Generator().manual_seed(seed)
    return random_prompt(gen, 70), random_prompt(gen, 20)


def second_prompt(first, result, extra):
    return first + result.output + extra


@pytest.mark.parametrize("row_dtype", ["bf16", "fp8"])
def test_a_received_entry_is_adopted_bit_for_bit_as_where_it_was_deposited(model, row_dtype):
    holder, receiver, control = (carrying(engine(model), row_dtype) for _ in range(3))
    first, extra = two_turns(3)
    r1 = holder.generate("s", first, max_new_tokens=8)
    assert control.generate("s", first, max_new_tokens=8).output == r1.output
    key = carry_key(session_hash("s"))
    lender, taker = EntryMoves(holder.runtime.service), EntryMoves(receiver.runtime.service)
    assert taker.pullable(key, session_hash("s")) and not lender.pullable(key, session_hash("s"))
    loan = lender.lend(key)
    assert loan is not None and loan.meta.digest == lender.held_digest(key) == digest_bytes(loan.raw)
    assert loan.meta.layout == taker.layout() and loan.meta.nbytes == taker.nbytes_for(loan.meta.rows)
    assert loan.meta.tokens == tuple(first + r1.output) and loan.meta.session == session_hash("s")
    assert taker.receive(loan.meta, lambda landing: landing.copy_(loan.raw)) == "received"
    assert taker.held_digest(key) == loan.meta.digest  # the bytes as deposited, now the receiver's
    assert lender.end_loan(loan, moved=True) and not lender.holds(key)
    assert holder.runtime.stats().evictions == {c: int(c == "moved") for c in EVICTION_CAUSES}
    check_all(holder)
    check_all(receiver)

    prompt = second_prompt(first, r1, extra)
    moved, kept = receiver.generate("s", prompt, max_new_tokens=8), control.generate("s", prompt, max_new_tokens=8)
    assert moved.output == kept.output
    assert moved.stats.outcome_kind == kept.stats.outcome_kind == "adopted"
    assert (moved.stats.drafter_rows_kept, moved.stats.drafted, moved.stats.accepted) == (
        kept.stats.drafter_rows_kept, kept.stats.drafted, kept.stats.accepted)
    back = holder.generate("s", prompt, max_new_tokens=8)  # the session returns to its old worker
    assert (back.stats.outcome_kind, back.stats.no_carry_reason) == ("no_carry", "moved")
    check_all(receiver)


def test_an_entry_lent_from_the_host_tier_moves_too(model):
    holder = carrying(engine(model), host_memory="1MiB", slots=1)  # one device slot: older entries wait in host memory
    receiver, control = carrying(engine(model)), carrying(engine(model))
    first, extra = two_turns(7)
    r1 = holder.generate("h", first, max_new_tokens=6)
    control.generate("h", first, max_new_tokens=6)
    holder.generate("other", two_turns(8)[0], max_new_tokens=6)  # "h" is demoted
    key = carry_key(session_hash("h"))
    assert holder.runtime.service.store.tier(key) == "host"
    lender = EntryMoves(holder.runtime.service)
    loan = lender.lend(key)
    assert loan is not None
    assert EntryMoves(receiver.runtime.service).receive(loan.meta, lambda landing: landing.copy_(loan.raw)) == "received"
    assert lender.end_loan(loan, moved=True) and holder.runtime.service.store.tier(key) is None
    check_all(holder)
    prompt = second_prompt(first, r1, extra)
    moved, kept = receiver.generate("h", prompt, max_new_tokens=6), control.generate("h", prompt, max_new_tokens=6)
    assert moved.output == kept.output and moved.stats.outcome_kind == "adopted"
    assert (moved.stats.drafter_rows_kept, moved.stats.accepted) == (kept.stats.drafter_rows_kept, kept.stats.accepted)


def test_refused_receives_leave_the_receiver_unchanged(model):
    holder, receiver = carrying(engine(model)), carrying(engine(model))
    fp8 = carrying(engine(model), "fp8")
    first, _ = two_turns(11)
    holder.generate("r", first, max_new_tokens=6)
    receiver.generate("r", first, max_new_tokens=6)  # the receiver holds the key already
    key = carry_key(session_hash("r"))
    loan = EntryMoves(holder.runtime.service).lend(key)
    assert loan is not None
    copy = lambda landing: landing.copy_(loan.raw)  # noqa: E731
    assert EntryMoves(receiver.runtime.service).receive(loan.meta, copy) == "held_locally"
    assert EntryMoves(fp8.runtime.service).receive(loan.meta, copy) == "format"  # bf16 blocks, an fp8 store
    other = carrying(engine(model))
    corrupt = EntryMoves(other.runtime.service).receive(loan.meta, lambda landing: (copy(landing), landing[7].add_(1)))
    assert corrupt == "digest_mismatch" and not EntryMoves(other.runtime.service).holds(key)
    short = EntryMeta(**{**loan.meta.__dict__, "nbytes": loan.meta.nbytes - 1})
    assert EntryMoves(other.runtime.service).receive(short, copy) == "format"
    with pytest.raises(ValueError, match="runs"):
        EntryMeta(**{**loan.meta.__dict__, "runs": ((0, 3),)}).check()
    for eng in (receiver, fp8, other):
        check_all(eng)
    assert other.runtime.stats().entries_held == 0


def test_ending_a_loan_keeps_a_newer_deposit_of_the_key(model):
    holder = carrying(engine(model))
    first, extra = two_turns(13)
    r1 = holder.generate("n", first, max_new_tokens=6)
    key = carry_key(session_hash("n"))
    loan = EntryMoves(holder.runtime.service).lend(key)
    assert loan is not None
    holder.generate("n", second_prompt(first, r1, extra), max_new_tokens=6)  # adopted and deposited again
    assert not EntryMoves(holder.runtime.service).end_loan(loan, moved=True)
    assert EntryMoves(holder.runtime.service).holds(key) and holder.runtime.stats().evictions["moved"] == 0
    assert not EntryMoves(holder.runtime.service).end_loan(loan, moved=False)
    check_all(holder)
