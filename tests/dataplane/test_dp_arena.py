"""The carry's one byte allocator (`dataplane/arena.py`): the device arena and the host tier are
ranges of one allocation of exactly their budget, page-locked once for the host tier (through the
CUDA seam `pinned._cudart` on CPU: registrations are recorded), handed out first fit, reused after
a copy's event, compacted when fragmented; a device compaction that runs out of memory leaves
every range where its bytes are."""

from __future__ import annotations

import pytest
import torch

from trtllm_mtp_carry.dataplane import pinned
from trtllm_mtp_carry.dataplane.arena import Arena


class FakeCudart:
    class cudaError:  # noqa: N801 (torch's binding's name)
        success = 0

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", size))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister",))
        return 0


class FakeEvent:
    def __init__(self, log: list[str], name: str, done: bool = False) -> None:
        self.log, self.name, self.done = log, name, done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(f"wait {self.name}")
        self.done = True


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    return fake


def arena(nbytes: int, **kw) -> Arena:
    return Arena(torch.zeros(nbytes, dtype=torch.uint8), **kw)


def at(a: Arena, key) -> int:
    return a.view(key).data_ptr() - a.storage.data_ptr()


def test_a_pinned_arena_registers_exactly_the_budget_once_and_its_ranges_register_nothing(monkeypatch, cudart):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # torch_allocate pins where CUDA runs
    a = Arena.reserve(10_000, "cpu", pinned=True)
    for key in range(5):
        assert a.take(key, 1_000 + key * 16) is not None
    a.release(2)
    assert a.take(9, 500) is not None
    assert cudart.calls == [("register", 10_000)] and a.nbytes == 10_000 and a.pinned
    assert a.held_bytes == 1_000 + 1_016 + 1_048 + 1_064 + 500


def test_ranges_are_first_fit_on_4_byte_starts_of_exactly_the_bytes_asked_and_merge_when_released():
    a = arena(320)
    r_a, r_b, r_c = a.take("a", 100), a.take("b", 50), a.take("c", 64)
    assert (r_a.numel(), r_b.numel(), r_c.numel()) == (100, 50, 64)
    assert (at(a, "a"), at(a, "b"), at(a, "c")) == (0, 100, 152)
    a.release("a")
    a.release("b")  # 0..152 free again, one range
    assert a.take("d", 150) is not None and at(a, "d") == 0
    assert a.take("e", 110) is None  # 104 bytes free after c
    a.check()
    assert a.room == 320 - 152 - 64
    assert a.keys() == ["c", "d"] and "c" in a and "a" not in a


def test_a_range_released_after_an_event_is_reused_only_once_the_event_completed():
    log: list[str] = []
    a = arena(128)
    a.take("a", 64)
    a.release("a", after=FakeEvent(log, "copy-back"))
    assert a.pending_bytes == 64 and a.held_bytes == 0
    assert a.take("b", 64) is not None and at(a, "b") == 64 and log == []  # the free half
    assert a.take("c", 64, wait=False) is None and log == []  # never blocks without `wait`
    assert a.take("c", 64) is not None and at(a, "c") == 0
    assert log == ["wait copy-back"]  # nothing else fitted: the CPU waited for the copy back
    a.release("b", after=FakeEvent(log, "done", done=True))
    assert a.take("d", 64, wait=False) is not None and at(a, "d") == 64 and log == ["wait copy-back"]
    a.check()


def test_compaction_waits_for_the_device_slides_the_bytes_down_and_tells_the_owner():
    log: list[str] = []
    a = arena(192, sync=lambda: log.append("sync"), on_move=lambda k: log.append(f"moved {k}"))
    for i, key in enumerate("abc"):
        a.take(key, 64).fill_(i + 1)
    a.release("a")
    a.release("c")  # 128 bytes free, in two ranges of 64
    d = a.take("d", 128)
    assert d is not None and log == ["sync", "moved b"] and a.compactions == 1
    assert (at(a, "b"), at(a, "d")) == (0, 64)
    assert torch.equal(a.view("b"), torch.full((64,), 2, dtype=torch.uint8))
    a.check()


def test_the_stores_victims_are_released_only_when_they_make_the_copy_fit():
    a = arena(128)
    a.take("a", 64)
    a.take("b", 64)
    assert a.take("c", 128, spare=["a"]) is None and "a" in a and "b" in a  # not enough: untouched
    assert a.take("c", 64, spare=["a", "x"]) is not None and "a" not in a and at(a, "c") == 0
    assert a.take("d", 32, spare=["b"]) is not None and "b" not in a and at(a, "d") == 64
    a.check()


def test_a_key_holds_one_range_and_a_bad_size_or_storage_is_one_error_line():
    a = arena(64)
    a.take("a", 16)
    with pytest.raises(ValueError, match=r"^'a' holds a range already$"):
        a.take("a", 16)
    a.take("b", 16)
    with pytest.raises(ValueError, match=r"^'b' holds a range already$"):
        a.rename("a", "b")
    with pytest.raises(ValueError, match=r"^nbytes must be a non-negative int, got -1$"):
        Arena.reserve(-1, "cpu")
    with pytest.raises(TypeError, match=r"^storage must be a 1-D uint8 tensor, got torch.float32 \(4,\)$"):
        Arena(torch.zeros(4))


def test_compaction_moves_a_range_over_its_own_bytes_intact():
    a = arena(160)
    a.take("a", 32)
    pattern = torch.arange(96, dtype=torch.uint8)
    a.take("b", 96).copy_(pattern)  # at 32: its move to 0 overlaps itself
    a.release("a")
    assert a.take("c", 64) is not None  # 32 + 32 free bytes, in two ranges
    assert (at(a, "b"), at(a, "c")) == (0, 96) and torch.equal(a.view("b"), pattern)
    a.check()


def test_a_device_compaction_out_of_memory_is_raised_with_nothing_taken_and_every_range_intact(monkeypatch):
    """A device arena stages a range whose move overlaps itself through a clone: out of memory
    there, the compaction stops with every range where its bytes are (a CPU arena moves with
    memmove and stages nothing: the staging is injected)."""
    a = arena(160)
    a.take("a", 32)
    pattern = torch.arange(96, dtype=torch.uint8)
    a.take("b", 96).copy_(pattern)
    a.release("a")

    def staged(dst: int, src: int, n: int) -> None:
        raise torch.OutOfMemoryError("staging")

    monkeypatch.setattr(a, "_move", staged)
    with pytest.raises(torch.OutOfMemoryError):
        a.take("c", 64)
    assert a.keys() == ["b"] and at(a, "b") == 32 and torch.equal(a.view("b"), pattern)
    a.check()
    monkeypatch.undo()
    assert a.take("c", 32) is not None and at(a, "c") == 0  # the free span it had is still free


def test_clear_frees_every_range_once_every_event_completed_and_the_storage_stays():
    log: list[str] = []
    a = arena(128)
    a.take("a", 64)
    a.take("b", 32)
    a.release("b", after=FakeEvent(log, "read"))
    storage = a.storage
    a.clear()
    assert log == ["wait read"] and a.keys() == [] and a.held_bytes == a.pending_bytes == 0
    assert a.room == a.capacity == 128 and a.storage is storage
    a.check()


def test_reserve_raises_what_the_allocation_raises_and_holds_nothing():
    def no_memory(nbytes: int, device: torch.device, pinned: bool) -> torch.Tensor:
        raise torch.OutOfMemoryError(f"tried to allocate {nbytes} bytes on {device}")

    with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 4096 bytes on cpu"):
        Arena.reserve(4096, "cpu", allocate=no_memory)
    a = Arena.reserve(4098, "cpu")
    assert (a.nbytes, a.capacity, a.device.type) == (4098, 4096, "cpu")  # ranges start on 4 bytes
