"""Helpers of the reference runtime's packed-row tests (`test_carry_fp8.py`,
`test_carry_packed.py`): an engine whose runtime packs carried rows, and an adoption probe."""

from __future__ import annotations

from engine_factories import engine

from trtllm_mtp_carry.runtime import CarryRuntime


def packed_engine(model, row_dtype, memory=None, host_memory=0, **overrides):
    """An engine whose runtime stores carried rows as `row_dtype` (the pool holds bf16), with a
    device budget of `memory` bytes (None: the process setting)."""
    eng = engine(model, **overrides)
    eng.runtime = CarryRuntime(eng, eng.config.policy, slots=None, memory=memory, eviction="lrd",
                               host_memory=host_memory, share=False, row_dtype=row_dtype)
    return eng


def check_all(eng):
    eng.check()
    eng.runtime.check()
    eng.drafter_pool.check()


def adopted_rows(eng, key, rows):
    """Adopt `key`'s entry into a scratch sequence and return its rows and keys (then release it)."""
    eng.runtime._take(99, key, rows_kept=rows)
    k, v, keys = (t.clone() for t in eng.drafter_pool.gather(99))
    eng.runtime.release(99)
    return k, v, keys
