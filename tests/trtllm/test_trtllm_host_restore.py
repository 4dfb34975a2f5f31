"""The adapter's copy back from the host tier: on CUDA asynchronous on a side stream, with an
event recorded after the copy that the reading stream waits on before the rows are read; on the
CPU a plain copy with no stream. The CUDA calls are recorded by a stand-in (this runs on CPU):
what is pinned is their order, which is what keeps a scatter from reading rows still in flight."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from trtllm_mtp_carry.dataplane.row_format import PackedRows, pack_rows
from trtllm_mtp_carry.trtllm import carried as carried_mod
from trtllm_mtp_carry.trtllm.carried import CarriedRows

CUDA0 = torch.device("cuda", 0)


def rows_of(seed: int) -> torch.Tensor:
    return torch.randn(10, 2, 2, 4, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", self.name, event.name))


class FakeEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return False  # still running: what the ordering must cope with

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class FakeCuda:
    """Stands in for carried.py's CUDA calls, logging each in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple] = []
        self.active = "current"
        self.events = 0
        for name in ("_side_stream", "_new_event", "_current_stream", "_on_stream", "_copy_to", "_record_stream"):
            monkeypatch.setattr(carried_mod, name, getattr(self, name))

    def _side_stream(self, device):
        self.log.append(("new stream", str(device)))
        return FakeStream(self.log, "side")

    def _new_event(self):
        self.events += 1
        return FakeEvent(self.log, f"e{self.events}")

    def _current_stream(self, device):
        return FakeStream(self.log, "current")

    @contextmanager
    def _on_stream(self, stream):
        self.active = stream.name
        try:
            yield
        finally:
            self.active = "current"

    def _copy_to(self, rows, device):
        self.log.append(("copy", self.active))
        if isinstance(rows, PackedRows):
            return PackedRows(rows.payload.clone(), rows.scales.clone(), rows.dtype)
        return rows.clone()

    def _record_stream(self, rows, stream):
        self.log.append(("record_stream", stream.name))


def demoted_from_a_gpu(carried: CarriedRows, key: int) -> None:
    """Mark host entry `key` as having come from a GPU (this test's rows live on the CPU)."""
    assert key in carried._host_device
    carried._host_device[key] = CUDA0


@pytest.mark.parametrize("row_dtype", ["bf16", "fp8", "fp8_kv"])  # fp8_kv: an FP8 KV pool's own rows
def test_a_cuda_restore_copies_on_a_side_stream_and_the_reader_waits_for_its_event(monkeypatch, row_dtype):
    cuda = FakeCuda(monkeypatch)
    packed = row_dtype == "fp8"
    form = ((lambda r: pack_rows(r)) if packed else
            (lambda r: r.to(torch.float8_e4m3fn)) if row_dtype == "fp8_kv" else (lambda r: r))
    per = form(rows_of(1)).nbytes
    carried = CarriedRows(None, budget_bytes=per, policy="lrd", host_budget_bytes=4 * per,
                          row_dtype="fp8" if packed else "bf16",
                          pool_dtype=torch.float8_e4m3fn if row_dtype == "fp8_kv" else torch.bfloat16)
    assert carried.deposit(11, list(range(12)), form(rows_of(1)))
    assert carried.deposit(12, list(range(12)), form(rows_of(2)))  # 11 is demoted
    demoted_from_a_gpu(carried, 11)
    taken = carried.take(11)
    # the copy runs on the side stream and the event is recorded there after it; nothing waits yet
    assert cuda.log == [("new stream", "cuda:0"), ("copy", "side"), ("record", "e1", "side")]
    assert taken.copied is not None and taken.copied.name == "e1"
    taken.ready()  # the reading stream waits on the GPU, and the allocator hears who reads the rows
    assert cuda.log[3:] == [("wait", "current", "e1"), ("record_stream", "current")]
    head = taken.head(4)  # head waits too: rows cannot be read before the wait
    assert cuda.log[5:] == [("wait", "current", "e1"), ("record_stream", "current")]
    want = form(rows_of(1))
    if packed:
        assert torch.equal(head.payload.view(torch.uint8), want.payload[:4].view(torch.uint8))
    else:  # the pool's rows, bit for bit (float8 compared as bytes)
        assert torch.equal(head.view(torch.uint8), want[:4].view(torch.uint8))
    carried.check()


def test_the_side_stream_is_made_once_and_a_demote_waits_for_copies_still_reading_host_rows(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    carried = CarriedRows(None, budget_bytes=320, policy="lrd", host_budget_bytes=1280)
    for key in (11, 12, 13):
        assert carried.deposit(key, list(range(12)), rows_of(key))  # 11, 12 demoted
    demoted_from_a_gpu(carried, 11)
    demoted_from_a_gpu(carried, 12)
    carried.take(11)
    carried.take(12)
    assert [e for e in cuda.log if e[0] == "new stream"] == [("new stream", "cuda:0")]
    del cuda.log[:]
    assert carried.deposit(14, list(range(12)), rows_of(14))  # demotes 13: host rows get written
    assert cuda.log == [("synchronize", "e1"), ("synchronize", "e2")]  # both copies back settled first
    assert carried.stats()["demotions"] == 3
    carried.check()


def test_a_cpu_restore_is_a_plain_copy_with_no_stream_and_no_event(monkeypatch):
    for name in ("_side_stream", "_new_event", "_current_stream", "_on_stream", "_copy_to", "_record_stream"):
        monkeypatch.setattr(carried_mod, name, lambda *a, _n=name: pytest.fail(f"{_n} called on the CPU"))
    carried = CarriedRows(None, budget_bytes=320, policy="lrd", host_budget_bytes=640)
    assert carried.deposit(11, list(range(12)), rows_of(1))
    assert carried.deposit(12, list(range(12)), rows_of(2))
    taken = carried.take(11)
    assert taken.copied is None
    taken.ready()
    assert torch.equal(taken.head(10), rows_of(1))
    assert carried.stats()["hits"] == {"device": 0, "host": 1}


def test_an_adoption_orders_the_forward_after_its_scatter_on_the_gpu_without_the_cpu_waiting(monkeypatch):
    """prepare_resources scatters a warm turn's rows on the draft manager's stream and returns:
    the executor's stream (where the forward that reads the pages is queued) waits for the draft
    stream on the GPU. Each use of the draft stream first orders it after the executor's (a
    gather reads the forward's pages, a scatter rows a deposit put). Only a deposit's gather,
    whose pages go back to the pool at free, makes the CPU wait. (Before: a `synchronize` after the scatter too, so a host-tier copy back could
    never overlap the prefill.) The CUDA calls are the manager's seam, recorded."""
    from standin_helpers import ADOPTION_ORDER, GATHER_ORDER, cold_then_warm_turn, make_llm

    from trtllm_mtp_carry.service import streams as streams_mod

    log: list[str] = []

    class DraftStream:
        device = CUDA0

        def synchronize(self) -> None:
            log.append("cpu waits for the draft stream")

        def wait_stream(self, stream: object) -> None:
            assert isinstance(stream, ExecutorStream)
            log.append("draft stream waits for the executor stream")

    class ExecutorStream:
        def wait_stream(self, stream: object) -> None:
            assert stream is draft_stream
            log.append("executor stream waits for the draft stream")

    @contextmanager
    def on_stream(stream: object):
        assert stream is draft_stream
        log.append("on the draft stream")
        yield

    draft_stream = DraftStream()
    monkeypatch.setattr(streams_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(streams_mod, "on_stream", on_stream)
    monkeypatch.setattr(streams_mod, "current_stream", lambda device: ExecutorStream())
    llm, carry = make_llm("carry")
    assert carry is not None and carry.manager is not None
    carry.manager.draft._stream = draft_stream
    cold_log, warm_log = cold_then_warm_turn(llm, carry, log)
    assert (cold_log, warm_log) == (GATHER_ORDER, ADOPTION_ORDER)
