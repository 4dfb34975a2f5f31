"""Pinned memory is what the budget says (issue 42, item 6): `dataplane.pinned.pinned_empty`
page-locks exactly the bytes asked for (torch's pinned allocator rounds up to a power of two:
a 24 GiB host arena would pin 32 GiB) and unregisters them once the last view is gone; the
host tier's arena (`dataplane.arena.Arena`, pinned) is allocated through it. On CPU, through the seam: the CUDA
runtime's `cudaHostRegister`/`cudaHostUnregister` are recorded."""

from __future__ import annotations

import gc

import pytest
import torch

from trtllm_mtp_carry.dataplane import pinned
from trtllm_mtp_carry.service.host_tier import host_arena


class FakeCudart:
    class cudaError:  # noqa: N801 (torch's binding's name)
        success = 0
        memoryAllocation = 2

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", ptr, size, flags))
        return self.cudaError.memoryAllocation if self.fail else self.cudaError.success

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return self.cudaError.success


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    return fake


def test_exactly_the_bytes_asked_are_registered_from_a_page_until_the_last_view_is_gone(cudart):
    before = pinned.registered_bytes()
    t = pinned.pinned_empty(24 * 1024 + 8)  # torch's pinned allocator would lock 32 KiB
    assert (t.dtype, t.dim(), t.numel(), t.device.type) == (torch.uint8, 1, 24 * 1024 + 8, "cpu")
    assert cudart.calls == [("register", t.data_ptr(), 24 * 1024 + 8, 0)] and t.data_ptr() % 4096 == 0
    assert pinned.registered_bytes() == before + 24 * 1024 + 8
    view = t[100:200].view(torch.int32)
    del t
    gc.collect()
    assert len(cudart.calls) == 1  # a view still reads it: still page-locked
    ptr = cudart.calls[0][1]
    del view
    gc.collect()
    assert cudart.calls[1:] == [("unregister", ptr)] and pinned.registered_bytes() == before


def test_a_refused_registration_is_out_of_memory_and_holds_nothing(monkeypatch):
    fake = FakeCudart(fail=True)
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    before = pinned.registered_bytes()
    with pytest.raises(torch.OutOfMemoryError, match="cudaHostRegister of 4096 bytes failed"):
        pinned.pinned_empty(4096)
    assert pinned.registered_bytes() == before and [c[0] for c in fake.calls] == ["register"]


def test_zero_bytes_register_nothing_and_a_bad_size_is_one_error_line(cudart):
    assert pinned.pinned_empty(0).numel() == 0 and cudart.calls == []
    with pytest.raises(ValueError, match=r"^nbytes must be a non-negative int, got -1$"):
        pinned.pinned_empty(-1)


def test_a_pinned_host_arena_locks_exactly_its_whole_rows(monkeypatch, cudart):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    arena = host_arena(10_000 // 96 * 96, torch.device("cuda"))  # 104 rows of 96 bytes, as reserved
    assert arena is not None and arena.pinned and arena.nbytes == 104 * 96 == 9984
    assert cudart.calls == [("register", arena.storage.data_ptr(), 9984, 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pinned.held() == {"registered": pinned.registered_bytes(), "torch_pool": 0}
    assert pinned.registered_bytes() >= 9984


def test_page_locked_host_copies_register_exactly_their_tensors_bytes(cudart):
    from trtllm_mtp_carry.dataplane import nvfp4
    from trtllm_mtp_carry.dataplane.row_format import pack_rows
    from trtllm_mtp_carry.dataplane.row_layout import map_tensors

    def registered():
        return [c[2] for c in cudart.calls if c[0] == "register"]

    rows = torch.randn(5, 2, 2, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    t = pinned.host_empty((3, 7), torch.bfloat16, True)
    assert (t.shape, t.dtype) == ((3, 7), torch.bfloat16) and registered() == [42]
    def pinned_copy(t: torch.Tensor) -> torch.Tensor:  # what host_clone makes of a GPU tensor
        return pinned.host_empty(t.shape, t.dtype, True).copy_(t)

    copy = pinned_copy(rows)
    assert torch.equal(copy, rows) and registered()[-1] == rows.nbytes == 1280
    fp8 = pack_rows(rows)
    pinned_fp8 = map_tensors(fp8, pinned_copy)  # torch's t.pin_memory() takes a power-of-two block each
    assert registered()[-2:] == [fp8.payload.nbytes, fp8.scales.nbytes] == [640, 80]
    assert torch.equal(pinned_fp8.payload.view(torch.uint8), fp8.payload.view(torch.uint8))
    fp4 = nvfp4.pack_rows(rows)
    map_tensors(fp4, pinned_copy)
    assert registered()[-3:] == [fp4.payload.nbytes, fp4.scales.nbytes, fp4.gscales.nbytes]
    assert sum(registered()[-3:]) == fp4.nbytes
    assert pinned.host_empty((3, 7), torch.bfloat16, False).shape == (3, 7) and len(registered()) == 7
