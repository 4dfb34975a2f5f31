"""The carry on an NVFP4 KV draft pool (issue 41 item 2, issue 43 item 2), on the TensorRT-LLM STAND-IN.

An NVFP4 pool's row is its bytes: `D/2` bytes of e2m1 pairs per (K/V, head) vector in the
payload pages and `D/16` e4m3 block scales in the KEY_BLOCK_SCALE / VALUE_BLOCK_SCALE pages
at the same page index (V's interleaved by groups of 4 tokens), under each layer's static
global scale. The adapter gathers and scatters those bytes exactly (`row_codec` `nvfp4_kv`),
whatever `carry_row_dtype` says, the arena and the store count `D/2 + D/16` bytes a vector,
and the host tier holds and restores the same bytes. Every check compares the warm turn's
draft pages of [0, R), payload and scale bytes, with a rebuild's (every turn prefilled from
position 0), byte for byte.
"""

from __future__ import annotations

import pytest
import torch
from standin_helpers import CHUNK, make_llm, padded, user_tokens

from trtllm_mtp_carry.trtllm import CarryAttachment, attach
from trtllm_mtp_carry.trtllm.kv_formats import kv_verdict
from trtllm_mtp_carry.trtllm.standin import ConversationParams, StandinLLM
from trtllm_mtp_carry.trtllm.standin.resource_manager import DataType

MAX_NEW = 24
HISTORY = 4 * CHUNK


def warm_bytes(llm: StandinLLM, sessions: int) -> list[torch.Tensor]:
    """Run `sessions` conversations two turns each (first turns all before second turns); return
    each warm turn's draft bytes of keys [0, R) (payload and scales), read one chunk past R."""
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
        out.append(paged.key_bytes(second.py_request_id, 0, reused))
        llm.run_until_done()
    return out


def run(policy: str, sessions: int = 2) -> tuple[list[torch.Tensor], CarryAttachment | None]:
    llm, carry = make_llm(policy, kv_dtype=DataType.NVFP4)
    got = warm_bytes(llm, sessions)
    llm.executor.check()
    return got, carry


def row_nbytes(llm: StandinLLM) -> int:
    cfg = llm.executor.model.cfg
    return 2 * cfg.num_kv_heads * (cfg.head_dim // 2 + cfg.head_dim // 16)  # no per-row global scale


@pytest.fixture(scope="module")
def rebuild() -> list[torch.Tensor]:
    return run("rebuild")[0]


@pytest.mark.parametrize("row_dtype", ["bf16", "fp8", "nvfp4"])
def test_an_nvfp4_pool_carries_its_own_payload_and_scale_bytes_whatever_carry_row_dtype_says(
        rebuild, row_dtype: str) -> None:
    llm, _ = make_llm("blind", kv_dtype=DataType.NVFP4)
    carry = attach(llm, {"carry_slots": 8, "carry_row_dtype": row_dtype})
    assert carry.armed and carry.reason.startswith("NVFP4 KV: the drafter's rows are carried bit for bit")
    got = warm_bytes(llm, 2)
    assert all(g.shape[0] >= HISTORY for g in got)
    assert all(torch.equal(g, w) for g, w in zip(got, rebuild, strict=True))  # every byte of [0, R)
    stats = carry.manager.stats()
    assert stats.outcomes["adopted"] == 2 and stats.row_dtype == "nvfp4_kv"
    row = row_nbytes(llm)
    reserved = carry.manager.reserved  # the arenas hold whole such rows, and the store charges one a row
    assert reserved.row_nbytes == carry.manager.service.home.row_nbytes == row
    assert reserved.device.capacity % row == 0 and stats.carry_memory_bytes == reserved.device.capacity
    assert stats.bytes_held == stats.rows_held * row > 0  # the budget counts the bytes held


def test_an_nvfp4_pool_without_the_carry_drafts_blind_over_the_reused_prefix(rebuild) -> None:
    blind, _ = run("blind")
    assert all(not torch.equal(b, w) for b, w in zip(blind, rebuild, strict=True))  # the check can fail


def test_nvfp4_rows_demoted_to_the_host_tier_come_back_bit_for_bit(rebuild) -> None:
    llm, _ = make_llm("blind", kv_dtype=DataType.NVFP4)
    row = row_nbytes(llm)
    # the device arena holds one first turn's rows; the other waits in host memory
    carry = attach(llm, {"carry_slots": 8, "carry_memory": (HISTORY + CHUNK) * row,
                         "carry_host_memory": 8 * (HISTORY + CHUNK) * row})
    got = warm_bytes(llm, 2)
    assert all(torch.equal(g, w) for g, w in zip(got, rebuild, strict=True))
    stats = carry.manager.stats()
    assert stats.demotions + stats.host_deposits >= 1 and stats.hits_host >= 1
    assert stats.outcomes["adopted"] == 2 and stats.bytes_demoted % row == 0


def test_the_verdict_carries_nvfp4_and_says_where_its_scales_are(rebuild) -> None:
    llm, carry = make_llm("carry", kv_dtype=DataType.NVFP4)
    assert carry is not None and carry.armed
    verdict = kv_verdict("nvfp4")
    assert verdict.carries and verdict.line == ("NVFP4 KV: the drafter's rows are carried bit for bit as their "
                                                "own e2m1 payload and E4M3 block-scale bytes, never re-scaled")
    (where,) = verdict.details  # where the scales are, and the source, on the line below it
    assert "KEY_BLOCK_SCALE/VALUE_BLOCK_SCALE pages at the same page index" in where
    assert "kv_cache_manager_v2.py @ 38198e34582cf777ecc72062f477987284ba9999" in where
