"""A warm turn's drafter prep makes no host-device sync beyond blind's (counted on CPU).

The drafter prep (`CarryRuntime.prepare` at admission, `build_chunk` after each
prefill chunk) sits on the executor's critical path; on CUDA every host read of
device data, and every upload from pageable memory, makes the host wait for the
target's forward queued before it. `sync_trace.SyncTrace` counts the calls that
would do so on CUDA, with their call sites, on a CPU run.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import pytest
import torch
from engine_factories import engine, first_turn_then, tiny_model
from sync_trace import SyncTrace, patch_uploads

CARRY_EXTRA_SYNCS = 0
"""Host syncs a carry warm turn's prep may make beyond blind's for the same appended rows:
none (adoption is bookkeeping on the host: block ids and key runs, no tensor read)."""

def _warm_turn_prep_syncs(monkeypatch: pytest.MonkeyPatch, policy: str, row_dtype: str | None = None
                          ) -> tuple[Counter[tuple[str, str]], str, Counter[str]]:
    """The would-be syncs of one warm turn's drafter prep under `policy`, its outcome kind,
    and its non-blocking uploads by site."""
    model = tiny_model()
    eng = engine(model, policy=policy, carry_row_dtype=row_dtype, prefill_chunk=32)
    gen = torch.Generator().manual_seed(7)
    _, _, prompt = first_turn_then(eng, gen, "s", history=150, max_new_tokens=6, span=70)
    arena = getattr(eng.runtime.service.home, "arena", None)  # packed rows live in the device arena
    held = [] if arena is None else [arena.storage]
    trace = SyncTrace([eng.drafter_pool.k_cache, eng.drafter_pool.v_cache, eng.hidden_store.buffer,
                       *model.parameters(), *model.buffers(), *held])
    active: list[SyncTrace | None] = [None]
    uploads = patch_uploads(monkeypatch, lambda: active[0])

    @contextmanager
    def tracing():
        active[0] = trace
        try:
            with trace:
                yield
        finally:
            active[0] = None

    runtime = eng.runtime
    for name in ("prepare", "build_chunk"):
        original = getattr(runtime, name)

        def traced(*args, _original=original, **kwargs):
            with tracing():
                return _original(*args, **kwargs)

        monkeypatch.setattr(runtime, name, traced)
    result = eng.generate("s", prompt, max_new_tokens=4)
    assert result.stats.reused_tokens > 0 and result.stats.drafter_rows_computed > 0  # a warm turn
    eng.check()
    return trace.syncs, result.stats.outcome_kind, uploads


@pytest.mark.parametrize("policy", ["carry", "blind"])
def test_a_warm_turns_drafter_prep_makes_no_host_device_sync(monkeypatch, policy):
    syncs, kind, uploads = _warm_turn_prep_syncs(monkeypatch, policy)
    assert kind == ("adopted" if policy == "carry" else "blind")
    assert dict(syncs) == {}
    # what goes up is uploaded without a sync, once per prefill chunk of the new span (4 chunks
    # of 32 here): the next tokens (carry_runtime._append) and the block ids the pool hands the
    # append kernel (the keys are an arange made on the device)
    assert sorted(site.split(":")[0] for site in uploads) == ["dataplane/kv_pool.py", "runtime/carry_runtime.py"]
    assert set(uploads.values()) == {4}


def test_carry_prep_syncs_at_most_blinds_plus_the_documented_extra(monkeypatch):
    carry, kind, _ = _warm_turn_prep_syncs(monkeypatch, "carry")
    blind, _, _ = _warm_turn_prep_syncs(monkeypatch, "blind")
    assert kind == "adopted"
    assert sum(carry.values()) <= sum(blind.values()) + CARRY_EXTRA_SYNCS


def test_carry_fp8_prep_makes_none_either_its_unpack_included(monkeypatch):
    # the adoption unpacks the entry into fresh pool blocks (DrafterKVPool.carry_in):
    # its block ids go up pinned and non-blocking too
    carry, kind, _ = _warm_turn_prep_syncs(monkeypatch, "carry", "fp8")
    blind, _, _ = _warm_turn_prep_syncs(monkeypatch, "blind")
    assert kind == "adopted"
    assert dict(carry) == {} == dict(blind)
