"""The host tier's slab (issue 42, item 6): host copies are ranges of one allocation of exactly the
host budget, page-locked once (through the CUDA seam `pinned._cudart` on CPU: registrations are
recorded), handed out first fit, reused after a copy back's event, compacted when fragmented."""

from __future__ import annotations

import pytest
import torch

from trtllm_mtp_carry.dataplane import pinned
from trtllm_mtp_carry.dataplane.host_slab import HostSlab


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


def at(slab: HostSlab, key) -> int:
    return slab.view(key).data_ptr() - slab.storage.data_ptr()


def test_a_pinned_slab_registers_exactly_the_budget_once_and_its_ranges_register_nothing(cudart):
    slab = HostSlab(10_000, pinned=True)
    for key in range(5):
        assert slab.take(key, 1_000 + key * 16) is not None
    slab.release(2)
    assert slab.take(9, 500) is not None
    assert cudart.calls == [("register", 10_000)] and slab.nbytes == 10_000
    assert slab.held_bytes == 1_000 + 1_016 + 1_048 + 1_064 + 500


def test_ranges_are_first_fit_on_4_byte_starts_of_exactly_the_bytes_asked_and_merge_when_released():
    slab = HostSlab(320, pinned=False)
    a, b, c = slab.take("a", 100), slab.take("b", 50), slab.take("c", 64)
    assert (a.numel(), b.numel(), c.numel()) == (100, 50, 64)
    assert (at(slab, "a"), at(slab, "b"), at(slab, "c")) == (0, 100, 152)
    slab.release("a")
    slab.release("b")  # 0..152 free again, one range
    assert slab.take("d", 150) is not None and at(slab, "d") == 0
    assert slab.take("e", 110) is None  # 104 bytes free after c
    slab.check()
    assert slab.room == 320 - 152 - 64


def test_a_range_released_after_an_event_is_reused_only_once_the_event_completed():
    log: list[str] = []
    slab = HostSlab(128, pinned=False)
    slab.take("a", 64)
    slab.release("a", after=FakeEvent(log, "copy-back"))
    assert slab.take("b", 64) is not None and at(slab, "b") == 64 and log == []  # the free half
    assert slab.take("c", 64) is not None and at(slab, "c") == 0
    assert log == ["wait copy-back"]  # nothing else fitted: the CPU waited for the copy back
    slab.release("b", after=FakeEvent(log, "done", done=True))
    assert slab.take("d", 64) is not None and at(slab, "d") == 64 and log == ["wait copy-back"]
    slab.check()


def test_compaction_waits_for_the_device_slides_the_bytes_down_and_tells_the_owner():
    log: list[str] = []
    slab = HostSlab(192, pinned=False, sync=lambda: log.append("sync"), on_move=lambda k: log.append(f"moved {k}"))
    for i, key in enumerate("abc"):
        slab.take(key, 64).fill_(i + 1)
    slab.release("a")
    slab.release("c")  # 128 bytes free, in two ranges of 64
    d = slab.take("d", 128)
    assert d is not None and log == ["sync", "moved b"] and slab.compactions == 1
    assert (at(slab, "b"), at(slab, "d")) == (0, 64)
    assert torch.equal(slab.view("b"), torch.full((64,), 2, dtype=torch.uint8))
    slab.check()


def test_the_stores_victims_are_released_only_when_they_make_the_copy_fit():
    slab = HostSlab(128, pinned=False)
    slab.take("a", 64)
    slab.take("b", 64)
    assert slab.take("c", 128, spare=["a"]) is None and "a" in slab and "b" in slab  # not enough: untouched
    assert slab.take("c", 64, spare=["a", "x"]) is not None and "a" not in slab and at(slab, "c") == 0
    assert slab.take("d", 32, spare=["b"]) is not None and "b" not in slab and at(slab, "d") == 64
    slab.check()


def test_a_key_holds_one_range_and_a_bad_size_is_one_error_line():
    slab = HostSlab(64, pinned=False)
    slab.take("a", 16)
    with pytest.raises(ValueError, match=r"^'a' holds a host range already$"):
        slab.take("a", 16)
    with pytest.raises(ValueError, match=r"^nbytes must be a non-negative int, got -1$"):
        HostSlab(-1, pinned=False)


def test_compaction_moves_a_range_over_its_own_bytes_intact():
    slab = HostSlab(160, pinned=False)
    slab.take("a", 32)
    pattern = torch.arange(96, dtype=torch.uint8)
    slab.take("b", 96).copy_(pattern)  # at 32: its move to 0 overlaps itself
    slab.release("a")
    assert slab.take("c", 64) is not None  # 32 + 32 free bytes, in two ranges
    assert (at(slab, "b"), at(slab, "c")) == (0, 96) and torch.equal(slab.view("b"), pattern)
    slab.check()
