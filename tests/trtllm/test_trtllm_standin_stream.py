"""The stand-in's KV cache managers have a CUDA stream of their own on CUDA pages, as
TensorRT-LLM's `KVCacheManagerV2._stream` (`kv_cache_manager_v2.py` @ 0004396: the executor's
execution stream, else `torch.cuda.current_stream()`), so the adapter's draft-stream ordering
(its `wait_stream` calls, the deposit's CPU sync) runs on the stand-in too (issue 42, item 3).
On CPU pages the stream is None. This runs on CPU: the CUDA calls are recorded."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch

from trtllm_mtp_carry.trtllm.standin import kv_cache_manager_v2 as kvm

CUDA0 = torch.device("cuda", 0)


class RecordedStream:
    def __init__(self, device: torch.device, log: list[str] | None = None) -> None:
        self.device, self.log = device, log if log is not None else []

    def synchronize(self) -> None:
        self.log.append("cpu waits for the draft stream")

    def wait_stream(self, stream: object) -> None:
        self.log.append("draft stream waits for the executor stream")


def test_cuda_pages_give_the_draft_manager_a_stream_of_its_own_on_their_device_and_cpu_pages_none(
        monkeypatch):
    from standin_helpers import make_llm

    llm, _ = make_llm("blind")
    draft = next(m for m in llm.executor.resource_manager.resource_managers.values()
                 if isinstance(m, kvm.DraftKVManager))
    assert draft._stream is None  # CPU pages: no CUDA, no stream
    monkeypatch.setattr(torch.cuda, "Stream", RecordedStream)
    on_gpu = SimpleNamespace(tpb=draft.tokens_per_block, buf=SimpleNamespace(device=CUDA0))
    made = kvm.DraftKVManager(on_gpu, mtp_layer=draft.mtp_layer, paired=draft.paired,  # type: ignore[arg-type]
                              entries=draft.entries, draft_len=draft.draft_len, dtype=draft.dtype,
                              mapping=draft.mapping, kv_cache_config=draft.kv_cache_config)
    assert isinstance(made._stream, RecordedStream) and made._stream.device == CUDA0


def test_with_the_stand_ins_own_stream_the_adapter_orders_its_gather_and_scatter_on_it(monkeypatch):
    """The stream the stand-in made (here recorded: CPU pages standing for CUDA ones) is the one
    the adapter's deposit and adoption use: each orders it after the executor's stream, the
    scatter orders the executor's after it, only the deposit's gather makes the CPU wait."""
    from standin_helpers import ADOPTION_ORDER, GATHER_ORDER, cold_then_warm_turn, make_llm

    from trtllm_mtp_carry.dataplane import streams as streams_mod

    log: list[str] = []
    made: list[RecordedStream] = []

    def manager_stream(device: torch.device) -> RecordedStream:
        made.append(RecordedStream(CUDA0, log))
        return made[-1]

    class ExecutorStream:
        def wait_stream(self, stream: object) -> None:
            assert stream is made[-1]
            log.append("executor stream waits for the draft stream")

    @contextmanager
    def on_stream(stream: object):
        assert stream is made[-1]
        log.append("on the draft stream")
        yield

    monkeypatch.setattr(kvm, "_manager_stream", manager_stream)
    monkeypatch.setattr(streams_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(streams_mod, "on_stream", on_stream)
    monkeypatch.setattr(streams_mod, "current_stream", lambda device: ExecutorStream())
    llm, carry = make_llm("carry")
    assert carry is not None and carry.manager is not None
    assert carry.manager.draft._stream is made[-1]  # the stand-in's own, not set by the test
    cold_log, warm_log = cold_then_warm_turn(llm, carry, log)
    assert (cold_log, warm_log) == (GATHER_ORDER, ADOPTION_ORDER)
