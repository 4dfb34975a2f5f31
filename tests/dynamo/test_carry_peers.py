"""The carry endpoint's lend, take and receive checks in one process (`serve/dynamo/carry_peers.py`):
two engines, each with its real NIXL agent, the request plane left out (its handlers are called
directly; tests/dynamo/test_dynamo_moves.py runs them through Dynamo).

Pins: an entry lent by one side and taken by the other arrives bit for bit and leaves the lender
(one holder); an answer for another key, another salt, another model or a prompt that keeps no
row is refused before any byte moves, and the receiver's store is unchanged.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from unittest import mock

import pytest
import torch
from engine_factories import engine, random_prompt, tiny_model

from trtllm_mtp_carry import carry_key, session_hash
from trtllm_mtp_carry.runtime import CarryRuntime
from trtllm_mtp_carry.serve.dynamo.carry_peers import CarryPeers
from trtllm_mtp_carry.serve.dynamo.metrics import WorkerMetrics
from trtllm_mtp_carry.serve.dynamo.nixl_transport import UCX_SHARED_MEMORY, NixlTransport
from trtllm_mtp_carry.service.moves import EntryMoves

pytestmark = pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                reason='NIXL is not installed (pip install -e ".[nixl]")')


async def _inline(fn):  # type: ignore[no-untyped-def]
    return fn()  # one thread drives each engine here: the engine's thread is this one


def _side(model, name: str, identity: str = "model-a") -> CarryPeers:  # type: ignore[no-untyped-def]
    eng = engine(model)
    eng.runtime = CarryRuntime(eng, eng.config.policy, slots=None, share=False)
    with mock.patch.dict(os.environ, UCX_SHARED_MEMORY):  # the agent reads UCX's settings at creation
        transport = NixlTransport(f"{name}-{os.getpid()}")
    peers = CarryPeers(EntryMoves(eng.runtime.service), _inline, transport, identity, worker_id=hash(name) & 0xFFFF,
                       metrics=WorkerMetrics("m", name))
    peers.engine = eng  # type: ignore[attr-defined]
    return peers


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=8)


def _deposit(side: CarryPeers, session: str, salt: str | None = None) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(len(session))
    first = random_prompt(gen, 60)
    r = side.engine.generate(session, first, max_new_tokens=6, cache_salt=salt)  # type: ignore[attr-defined]
    return first, first + r.output + random_prompt(gen, 10)


def test_a_pushed_entry_arrives_bit_for_bit_and_leaves_its_holder(model) -> None:
    holder, taker = _side(model, "holder"), _side(model, "taker")

    async def run() -> tuple[dict, dict]:
        holder._pump = asyncio.ensure_future(holder._pump_loop())
        try:
            lent = await holder._lend(carry_key(session_hash("p")), "model-a")
            taken = await taker._take([lent], budget_s=30.0)
            return lent, taken
        finally:
            holder._pump.cancel()

    _deposit(holder, "p")
    key = carry_key(session_hash("p"))
    lent, taken = asyncio.run(run())
    assert lent["held"] and taken == {"taken": [lent["loan_id"]], "refused": {}}
    assert taker.moves.held_digest(key) == lent["meta"]["digest"]
    receipt = taker.take_receipt(key)
    assert receipt is not None and (receipt.via, receipt.digest) == ("push", lent["meta"]["digest"])
    assert asyncio.run(holder._release(lent["loan_id"], moved=True))
    assert not holder.moves.holds(key) and holder.transport.exposed == 0
    taker.engine.runtime.check()  # type: ignore[attr-defined]
    holder.engine.runtime.check()  # type: ignore[attr-defined]


def test_answers_for_another_key_salt_model_or_a_prompt_keeping_no_row_are_refused_before_any_read(model) -> None:
    holder, taker = _side(model, "h2"), _side(model, "t2")
    _, prompt = _deposit(holder, "s", salt="tenant-a")
    salted, plain = carry_key(session_hash("s"), "tenant-a"), carry_key(session_hash("s"))
    assert asyncio.run(holder._lend(plain, "model-a")) == {"held": False, "reason": "no_holder"}
    assert asyncio.run(holder._lend(salted, "model-b")) == {"held": False, "reason": "model"}
    lent = asyncio.run(holder._lend(salted, "model-a"))
    assert asyncio.run(holder._lend(salted, "model-a")) == {"held": False, "reason": "busy"}  # one loan a key

    def receive(answer: dict, key: int, prompt: list[int]) -> str:
        result, receipt = asyncio.run(taker._receive(answer, "pull", 1e12, key, session_hash("s"), prompt))
        assert receipt is None
        return result

    assert receive(lent, plain, prompt) == "format"  # the unsalted key asked, a salted entry answered
    assert receive(dict(lent, identity="model-b"), salted, prompt) == "model"
    assert receive(lent, salted, [7, 7, 7] + prompt) == "prefix_mismatch"
    forged = dict(lent, meta=dict(lent["meta"], tokens=lent["meta"]["tokens"][:-1] + [1]))
    assert receive(forged, salted, prompt) == "format"  # tokens that differ from their digest
    assert taker.engine.runtime.stats().entries_held == 0  # type: ignore[attr-defined]
    assert taker.transport._remotes == {}  # nothing was read: no holder's agent was ever loaded
    asyncio.run(holder._release(lent["loan_id"], moved=False))
    assert holder.moves.holds(salted) and holder.transport.exposed == 0


async def _answering_later(fn):  # type: ignore[no-untyped-def]
    await asyncio.sleep(0)  # the engine's thread answers a step later: other requests run meanwhile
    return fn()


def test_two_lends_of_one_key_at_once_make_one_loan_and_the_other_is_busy(model) -> None:
    holder = _side(model, "h3")
    holder.on_engine = _answering_later
    _deposit(holder, "q")
    key = carry_key(session_hash("q"))

    async def both() -> list[dict]:
        return await asyncio.gather(holder._lend(key, "model-a"), holder._lend(key, "model-a"))

    first, second = asyncio.run(both())
    assert first["held"] and second == {"held": False, "reason": "busy"}, (first, second)
    assert list(holder._lent) == [first["loan_id"]] and holder._lent_keys == {key: first["loan_id"]}
    assert asyncio.run(holder._release(first["loan_id"], moved=False)) is False
    assert holder._lent_keys == {} and holder.transport.exposed == 0 and holder.moves.holds(key)
