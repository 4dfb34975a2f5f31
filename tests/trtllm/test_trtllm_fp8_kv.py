"""The carry on an FP8 KV draft pool (issue 41 item 1), on the TensorRT-LLM STAND-IN.

A float8_e4m3fn page row, written with the layer's static KV scale, is its bytes: the
adapter gathers and scatters them exactly (`row_codec` `fp8_kv`), whatever
`carry_row_dtype` says (never a second quantization), the arena and the store count one
byte an element, and the host tier holds and restores the same bytes. Every check
compares the warm turn's draft pages of [0, R) with a rebuild's (every turn prefilled
from position 0), byte for byte.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from standin_helpers import CHUNK, make_llm, padded, user_tokens

from trtllm_mtp_carry.trtllm import CarryAttachment, attach
from trtllm_mtp_carry.trtllm.standin import ConversationParams, StandinLLM
from trtllm_mtp_carry.trtllm.standin.resource_manager import DataType

MAX_NEW = 24
HISTORY = 4 * CHUNK


def warm_pages(llm: StandinLLM, sessions: int) -> list[torch.Tensor]:
    """Run `sessions` conversations two turns each (first turns all before second turns); return
    each warm turn's draft pages of keys [0, R) as bytes `[R, 2, Hkv, D]`, read one chunk past R."""
    convs = [ConversationParams(conversation_id=f"c{i}") for i in range(sessions)]
    first = [llm.generate_async(user_tokens(700 * i, HISTORY), MAX_NEW, conversation_params=c)
             for i, c in enumerate(convs)]
    llm.run_until_done()
    out = []
    paged = llm.executor.paged
    for i, (req, conv) in enumerate(zip(first, convs, strict=True)):
        second = llm.generate_async(padded(req.get_tokens(0), 50 + i), MAX_NEW, conversation_params=conv)
        reused = len(req.get_tokens(0)) // CHUNK * CHUNK  # prefix blocks reused (chunk-aligned R)
        while second.context_current_position < reused + CHUNK:
            llm.executor.step()
        k, v = paged.read(second.py_request_id, 0, reused)
        out.append(torch.stack((k, v), dim=1).contiguous().view(torch.uint8))
        llm.run_until_done()
    return out


def run(policy: str, sessions: int = 2, **options: Any) -> tuple[list[torch.Tensor], CarryAttachment | None]:
    llm, carry = make_llm(policy, kv_dtype=DataType.FP8, **options)
    pages = warm_pages(llm, sessions)
    llm.executor.check()
    return pages, carry


@pytest.fixture(scope="module")
def rebuild() -> list[torch.Tensor]:
    return run("rebuild")[0]


@pytest.mark.parametrize("row_dtype", ["bf16", "fp8"])
def test_an_fp8_pool_carries_its_own_bytes_whatever_carry_row_dtype_says(rebuild, row_dtype: str) -> None:
    llm, _ = make_llm("blind", kv_dtype=DataType.FP8)
    carry = attach(llm, {"carry_slots": 8, "carry_row_dtype": row_dtype})
    got = warm_pages(llm, 2)
    assert all(torch.equal(g, w) for g, w in zip(got, rebuild, strict=True))  # every row of [0, R)
    stats = carry.manager.stats()
    assert stats.outcomes["adopted"] == 2 and stats.row_dtype == "fp8_kv"
    buf = llm.executor.paged.buf
    row = 2 * buf.shape[2] * buf.shape[4]  # 2 x Hkv x D bytes: one e4m3 byte an element, no scales
    reserved = carry.manager.reserved  # the arenas hold whole such rows, and the store charges one a row
    assert reserved.row_nbytes == carry.manager.service.home.row_nbytes == row
    assert reserved.device.capacity % row == 0 and stats.carry_memory_bytes == reserved.device.capacity
    assert stats.bytes_held == stats.rows_held * row > 0  # the budget counts the bytes held


def test_an_fp8_pool_without_the_carry_drafts_blind_over_the_reused_prefix(rebuild) -> None:
    blind, _ = run("blind")
    assert all(not torch.equal(b, w) for b, w in zip(blind, rebuild, strict=True))  # the check can fail


def test_fp8_rows_demoted_to_the_host_tier_come_back_bit_for_bit(rebuild) -> None:
    llm, _ = make_llm("blind", kv_dtype=DataType.FP8)
    buf = llm.executor.paged.buf
    row = 2 * buf.shape[2] * buf.shape[4]
    # the device arena holds one first turn's rows; the other waits in host memory
    carry = attach(llm, {"carry_slots": 8, "carry_memory": (HISTORY + CHUNK) * row,
                         "carry_host_memory": 8 * (HISTORY + CHUNK) * row})
    got = warm_pages(llm, 2)
    assert all(torch.equal(g, w) for g, w in zip(got, rebuild, strict=True))
    stats = carry.manager.stats()
    assert stats.demotions + stats.host_deposits >= 1 and stats.hits_host >= 1 and stats.outcomes["adopted"] == 2
    assert stats.bytes_demoted % row == 0  # whole one-byte-an-element rows moved
