"""On CUDA, a warm turn's drafter prep makes no host-device sync: run under
`torch.cuda.set_sync_debug_mode("error")`, where CUDA's own synchronizing calls raise
(issue 42, item 4). The CPU counterpart (`test_prep_syncs.py`) counts would-be syncs with a
tracer; this checks the real calls: carry, carry-fp8, a host-tier hit, and the TensorRT-LLM
adapter's `prepare_resources` (the stand-in with CUDA pages). Skipped without CUDA.

A sync inside the carry is caught as a fault (the turn runs without the carry), so each
test asserts the warm turn adopted and nothing faulted."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from engine_factories import engine, random_prompt, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA: the sync debug mode checks CUDA's own syncs")


@contextmanager
def syncs_raise():
    torch.cuda.synchronize()  # what came before is not the prep's
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def guard(monkeypatch: pytest.MonkeyPatch, obj: object, *names: str) -> list[str]:
    """Run `obj.<name>` calls with syncs raising; returns the names called, in order."""
    called: list[str] = []
    for name in names:
        original = getattr(obj, name)

        def guarded(*args, _original=original, _name=name, **kwargs):
            called.append(_name)
            with syncs_raise():
                return _original(*args, **kwargs)

        monkeypatch.setattr(obj, name, guarded)
    return called


@pytest.mark.parametrize(("row_dtype", "host"), [("bf16", False), ("fp8", False), ("bf16", True)],
                         ids=["carry", "carry-fp8", "host-hit"])
def test_a_warm_turns_prep_makes_no_cuda_sync(monkeypatch, row_dtype, host):
    eng = engine(tiny_model(), device="cuda", policy="carry", carry_row_dtype=row_dtype,
                 prefill_chunk=32, carry_host_only=host)
    gen = torch.Generator().manual_seed(11)
    prompts = {s: random_prompt(gen, 150) for s in ("a", "b")}
    for s in ("a", "b") if host else ("a",):  # host: b's deposit demotes a's entry to host memory
        r = eng.generate(s, prompts[s], max_new_tokens=6)
        prompts[s] = prompts[s] + r.output + random_prompt(gen, 70)
    called = guard(monkeypatch, eng.runtime, "prepare", "build_chunk")
    result = eng.generate("a", prompts["a"], max_new_tokens=4)
    stats = eng.runtime.stats()
    assert result.stats.outcome_kind == "adopted" and stats.faults == {}
    assert called[0] == "prepare" and called.count("build_chunk") >= 2
    if host:
        assert stats.hits_host == 1
    eng.check()


def test_the_adapters_prepare_resources_makes_no_cuda_sync(monkeypatch):
    from standin_helpers import make_llm, user_tokens

    llm, carry = make_llm("carry", device="cuda")
    assert carry is not None and carry.manager is not None
    cold = llm.executor.submit(user_tokens(0, 70), 6, conversation_id="c", client_id=901)
    llm.run_until_done()
    called = guard(monkeypatch, carry.manager, "prepare_resources")
    llm.executor.submit(cold.get_tokens(0) + user_tokens(100, 20), 6, conversation_id="c", client_id=902)
    llm.run_until_done()
    assert carry.pop_turn(902)["outcome"] == "adopted"  # type: ignore[index]
    assert carry.manager.stats()["faults"] == {} and called
