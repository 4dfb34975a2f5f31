"""A fault never frees blocks a copy is still writing (issue 42, item 5), pinned on CPU through
the CUDA seams of `kv_pool` and `service.host_tier`: the CUDA calls are recorded, in order, by a
stand-in, together with the pool's frees.

- `DrafterKVPool._import` whose V copy raises after K's was queued on the side stream: the CPU
  waits for that stream before the fresh blocks go back to the free list.
- `CarryRuntime` restoring a host entry whose adoption then faults (before the pool adopted
  the rows: `_repair` frees the carried entry; after: `_drop` frees the sequence): the CPU
  waits for the copy back's event before the free, and no in-flight record outlives the rows.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from engine_factories import engine, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry.dataplane import kv_pool as kv_pool_mod
from trtllm_mtp_carry.dataplane import streams as streams_mod
from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool
from trtllm_mtp_carry.dataplane.rope import RopeConfig
from trtllm_mtp_carry.runtime import CarryRuntime

NEW = 6


class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class FakeEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return False  # still running: what the order must cope with

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class FakeCuda:
    """Stands in for kv_pool's and host_tier's CUDA calls, logging each (and the pool's frees)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pool: DrafterKVPool) -> None:
        self.log: list[tuple] = []
        self.active = "current"
        self.events = 0
        monkeypatch.setattr(streams_mod, "current_stream", lambda device: FakeStream(self.log, "current"))
        monkeypatch.setattr(streams_mod, "on_stream", self._on_stream)
        monkeypatch.setattr(streams_mod, "record_stream",
                            lambda t, stream: self.log.append(("record_stream", stream.name)))
        monkeypatch.setattr(streams_mod, "timing_event", self._event)
        for name in ("free_sequence", "free_carried"):
            real = getattr(pool, name)

            def free(arg, real=real, name=name):
                self.log.append((name, arg))
                return real(arg)

            monkeypatch.setattr(pool, name, free)

    def _event(self) -> FakeEvent:
        self.events += 1
        return FakeEvent(self.log, f"e{self.events}")

    @contextmanager
    def _on_stream(self, stream: FakeStream):
        self.active = stream.name
        try:
            yield
        finally:
            self.active = "current"


def test_an_import_whose_v_copy_raises_waits_for_ks_copy_before_freeing_its_blocks(monkeypatch):
    pool = DrafterKVPool(8, 16, 2, 32, RopeConfig(32, 8, 1e6), device="cpu")
    pool.allocate_sequence(1)
    pool.append_rows(1, torch.arange(40), torch.randn(40, 2, 32).bfloat16(), torch.randn(40, 2, 32).bfloat16())
    pool.move_to_carried(1, 7)
    rows = pool.export_carried(7)
    pool.free_carried(7)
    cuda = FakeCuda(monkeypatch, pool)

    def copy_in(idx, host):  # K's copy is queued on the side stream, then V's raises
        cuda.log.append(("copy k", cuda.active, tuple(idx.tolist())))
        raise RuntimeError("v copy")

    monkeypatch.setattr(pool, "_copy_blocks_in", copy_in)
    with pytest.raises(RuntimeError, match="v copy"):
        pool.import_carried(7, rows, FakeStream(cuda.log, "side"))
    blocks = cuda.log[2][2]
    assert len(blocks) == 3
    assert cuda.log == [("wait_stream", "side", "current"), ("record_stream", "side"),
                        ("copy k", "side", blocks), ("synchronize", "side"),
                        ("free_sequence", kv_pool_mod._IMPORTING)]
    assert pool.carried_keys() == () and pool.num_free_blocks == 8
    pool.check()


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=13)


def host_engine(model):
    """A carry engine whose store holds 4 drafter blocks (one 40-token entry) and a host tier;
    two sessions' first turns ran, so `a`'s entry waits in host memory."""
    eng = engine(model, num_drafter_blocks=256)
    eng.runtime = CarryRuntime(eng, "carry", slots=None, memory=4 * eng.drafter_pool.block_nbytes,
                               eviction="lrd", share=False, host_memory="1MiB", row_dtype="bf16")
    gen = torch.Generator().manual_seed(5)
    prompts = {}
    for s in "ab":
        prompts[s] = random_prompt(gen, 40)
        r = run_turn(eng, model, s, prompts[s])
        prompts[s] += r.output + random_prompt(gen, 5)
    assert eng.runtime.stats().host_entries == 1
    return eng, prompts


def run_turn(eng, model, session, prompt):
    rid = eng.submit(session, prompt, max_new_tokens=NEW)
    result = None
    while result is None:
        for r in eng.step():
            assert r.request_id == rid
            result = r
    assert result.output == greedy_oracle(model, prompt, NEW)
    return result


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_fault_adopting_restored_rows_waits_for_their_copy_back_before_freeing_them(model, monkeypatch,
                                                                                      when):
    eng, prompts = host_engine(model)
    pool, host = eng.drafter_pool, eng.runtime.service.host
    cuda = FakeCuda(monkeypatch, pool)
    host._stream = FakeStream(cuda.log, "side")  # the copy back "runs" on a side stream
    real = pool.adopt_carried

    def adopt(key, seq_id, rows_kept):
        if when == "before":  # the pool refuses: `_repair` frees the restored carried entry
            raise RuntimeError("adopt")
        held = real(key, seq_id, rows_kept=rows_kept)
        raise RuntimeError("after adopt")  # the sequence holds the rows: `_drop` frees it
        return held

    monkeypatch.setattr(pool, "adopt_carried", adopt)
    (key,) = host.keys()  # a's entry, in host memory
    r = run_turn(eng, model, "a", prompts["a"])
    assert r.stats.fault_step == "prepare"
    log = cuda.log
    restored = log.index(("record", "e1", "side"))  # after the copy back, on the side stream
    frees = [i for i, e in enumerate(log) if e[0].startswith("free_") and i > restored]
    first = log[frees[0]]
    assert first == ("free_carried", key) if when == "before" else first[0] == "free_sequence"
    assert restored < log.index(("synchronize", "e1")) < frees[0]  # the CPU waited, then freed
    assert ("wait_event", "current", "e1") not in log  # no reader ever waited: the CPU did
    assert host.in_flight() == []
    eng.check()
    eng.runtime.check()
    pool.check()
