"""The carry's copy back from the host tier: on CUDA asynchronous on a side stream, with an
event recorded after the copy that the reading stream waits on before the rows are read; on the
CPU a plain copy with no stream. The CUDA calls go through one seam (`dataplane.streams`),
recorded by a stand-in (this runs on CPU; the home says its rows are on `cuda:0`): what is pinned
is their order, which is what keeps a scatter from reading rows still in flight."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from arena_carry import ArenaCarry, RowsSink, clone_rows

from trtllm_mtp_carry.dataplane import streams as streams_mod
from trtllm_mtp_carry.dataplane.row_format import pack_rows

CUDA0 = torch.device("cuda", 0)


def rows_of(seed: int) -> torch.Tensor:
    return torch.randn(10, 2, 2, 4, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))


class FakeEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.done = log, name, False

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return self.done  # still running until waited for: what the ordering must cope with

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))
        self.done = True


class FakeCuda:
    """Stands in for `dataplane.streams` (and the codec's copy to the device), logging each call in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple] = []
        self.active = "current"
        self.events = 0
        self.monkeypatch = monkeypatch
        monkeypatch.setattr(streams_mod, "side_stream", self._side_stream)
        monkeypatch.setattr(streams_mod, "current_stream", lambda device: FakeStream(self.log, "current"))
        monkeypatch.setattr(streams_mod, "on_stream", self._on_stream)
        monkeypatch.setattr(streams_mod, "timing_event", self._event)
        monkeypatch.setattr(streams_mod, "after_current", self._after_current)
        monkeypatch.setattr(streams_mod, "record_stream",
                            lambda t, stream: self.log.append(("record_stream", stream.name)))

    def _side_stream(self, device):
        self.log.append(("new stream", str(device)))
        return FakeStream(self.log, "side")

    def _event(self):
        self.events += 1
        return FakeEvent(self.log, f"e{self.events}")

    def _after_current(self, device):
        event = self._event()
        event.record(FakeStream(self.log, "current"))
        return event

    @contextmanager
    def _on_stream(self, stream):
        self.active = stream.name
        try:
            yield
        finally:
            self.active = "current"

    def copies_to_the_device(self, carried: ArenaCarry) -> None:
        """The codec's copy back to `cuda:0` is logged with the stream it runs on (a copy of the rows;
        the codec is shared, so it is patched for this test only)."""
        codec = carried.codec

        def to(rows, device, non_blocking=False):
            assert device == CUDA0 and non_blocking
            self.log.append(("copy", self.active))
            return clone_rows(codec, rows)

        self.monkeypatch.setattr(codec, "to", to)


class LoggedSink(RowsSink):
    """A turn's pages: the scatter is logged with the stream it runs on."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def scatter(self, codec, rows, runs, key):
        self.cuda.log.append(("scatter", self.cuda.active))
        super().scatter(codec, rows, runs, key)


def cuda_carry(cuda: FakeCuda, **kw) -> ArenaCarry:
    carried = ArenaCarry(None, policy="lrd", device=CUDA0, **kw)
    cuda.copies_to_the_device(carried)
    return carried


def adopt(carried: ArenaCarry, key: int, sink: RowsSink) -> None:
    """`key`'s turn adopts its entry into `sink`, and ends."""
    carried.service.adopt(key, key, carried.get(key).rows, sink)
    carried.service.end_turn(key)


@pytest.mark.parametrize("row_dtype", ["bf16", "fp8", "fp8_kv"])  # fp8_kv: an FP8 KV pool's own rows
def test_a_cuda_restore_copies_on_a_side_stream_and_the_reader_waits_for_its_event(monkeypatch, row_dtype):
    cuda = FakeCuda(monkeypatch)
    packed = row_dtype == "fp8"
    form = ((lambda r: pack_rows(r)) if packed else
            (lambda r: r.to(torch.float8_e4m3fn)) if row_dtype == "fp8_kv" else (lambda r: r))
    per = form(rows_of(1)).nbytes
    carried = cuda_carry(cuda, budget_bytes=per, host_budget_bytes=4 * per, row_dtype="fp8" if packed else "bf16",
                         pool_dtype=torch.float8_e4m3fn if row_dtype == "fp8_kv" else torch.bfloat16)
    assert carried.deposit(11, list(range(12)), form(rows_of(1)))
    assert carried.deposit(12, list(range(12)), form(rows_of(2)))  # 11 is demoted
    assert cuda.log == [("new stream", "cuda:0")]  # the host tier's side stream, made once
    sink = LoggedSink(cuda)
    adopt(carried, 11, sink)
    # the copy runs on the side stream (after the work queued so far) and its event is recorded
    # there after it; the reading stream waits for that event on the GPU before the scatter reads
    # the rows; their memory goes back only after the scatter (an event on the reading stream)
    tensors = len(carried.codec.tensors(form(rows_of(1))))
    assert cuda.log[1:] == [("wait_stream", "side", "current"), ("copy", "side"), ("record", "e1", "side"),
                            ("record", "e2", "current"), ("wait_event", "current", "e1"),
                            ("scatter", "current"), ("record", "e3", "current"),
                            *[("record_stream", "current")] * tensors]
    assert carried.service.host.waits == 1  # the copy was still running when the reader needed it
    got = carried.codec.tensors(sink.rows)
    want = carried.codec.tensors(form(rows_of(1)))  # the pool's rows (or packed ones), bit for bit
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))
    assert carried.host_arena.held_bytes == 0 and carried.host_arena.pending_bytes == per  # until e1 completes
    carried.check()


def test_the_side_stream_is_made_once_and_a_demote_waits_for_copies_still_reading_host_rows(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    carried = cuda_carry(cuda, budget_bytes=320, host_budget_bytes=640)  # two entries in host memory
    for key in (11, 12, 13):
        assert carried.deposit(key, list(range(12)), rows_of(key))  # 11, 12 demoted: the host arena is full
    adopt(carried, 11, RowsSink())  # copies back e1 and e4 still read their ranges
    adopt(carried, 12, RowsSink())
    assert [e for e in cuda.log if e[0] == "new stream"] == [("new stream", "cuda:0")]
    del cuda.log[:]
    assert carried.deposit(14, list(range(12)), rows_of(14))  # demotes 13: host rows get written
    assert cuda.log == [("synchronize", "e1"), ("synchronize", "e4")]  # both copies back settled first
    assert carried.stats().demotions == 3 and carried.service.host.keys() == [13]
    carried.check()


def test_a_cpu_restore_is_a_plain_copy_with_no_stream_and_no_event(monkeypatch):
    for name in ("side_stream", "current_stream", "on_stream", "timing_event", "record_stream"):
        monkeypatch.setattr(streams_mod, name, lambda *a, _n=name: pytest.fail(f"{_n} called on the CPU"))
    carried = ArenaCarry(None, budget_bytes=320, policy="lrd", host_budget_bytes=640)
    assert carried.deposit(11, list(range(12)), rows_of(1))
    assert carried.deposit(12, list(range(12)), rows_of(2))
    assert torch.equal(carried.take(11), rows_of(1))
    assert carried.service.host.in_flight() == [] and carried.host_arena.pending_bytes == 0
    stats = carried.stats()
    assert (stats.hits_device, stats.hits_host) == (0, 1)


def test_an_adoption_orders_the_forward_after_its_scatter_on_the_gpu_without_the_cpu_waiting(monkeypatch):
    """prepare_resources scatters a warm turn's rows on the draft manager's stream and returns:
    the executor's stream (where the forward that reads the pages is queued) waits for the draft
    stream on the GPU. Each use of the draft stream first orders it after the executor's (a
    gather reads the forward's pages, a scatter rows a deposit put). Only a deposit's gather,
    whose pages go back to the pool at free, makes the CPU wait. (Before: a `synchronize` after the scatter too, so a host-tier copy back could
    never overlap the prefill.) The CUDA calls are the manager's seam, recorded."""
    from standin_helpers import ADOPTION_ORDER, GATHER_ORDER, cold_then_warm_turn, make_llm

    from trtllm_mtp_carry.dataplane import streams as streams_mod

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
