"""The carry's memory inside TensorRT-LLM, reserved once: a device arena and a host arena.

What it is for: TensorRT-LLM sizes its KV cache from the device memory it finds free
(`_torch/pyexecutor/_util.py` `KvCacheCreator.configure_kv_cache_capacity`, read @
0004396720054fd8e205cbf616f21f0b57c6b412: after the estimation build's dummy run,
`torch.cuda.mem_get_info()` and the allocator's peak give
`available = (total - peak + estimation KV bytes) * free_gpu_memory_fraction`). Memory the
carry allocated one deposit at a time would come out of the headroom TensorRT-LLM left for
activations and CUDA graphs, unreserved and unreported. Here the carry's rows live in one
`uint8` tensor of `carry_memory` bytes (`dataplane.arena.Arena`), reserved before any KV
cache exists: in the worker at `KvCacheCreator.try_prepare_estimation`, before it measures
(`py_executor_creator.py` @ 000429d57d42ecc8d481e5cdf653fff238be5974:
`try_prepare_estimation`, `build_managers(resources, True)`,
`create_py_executor_instance(...)`, then `configure_kv_cache_capacity(py_executor)`,
`teardown_managers`, `build_managers(resources, False)`, the second
`create_py_executor_instance`). KV cache manager V2 sizes its estimation cache there
(`fraction * free`, the dummy workload's quota if smaller, mapped at construction), so an
arena reserved after it would have to fit in the `(1 - fraction)` margin. The row size is
known only at the first `create_py_executor_instance` (the draft pool's pages): `arenas_over`
cuts the early bytes to whole rows there; `reserve_arenas` reserves there when the early
point did not run. The same arenas serve both builds (`trtllm.worker` hands them over), so
the KV cache is sized around them. The host tier's memory is one arena of
`carry_host_memory` bytes the same way (page-locked where the pages are on a GPU).

Invariants:
- Each arena holds whole rows of the carry's row format (a row `[2, Hkv, D]` in its codec's
  held form), so the store's byte budget is the arena's capacity and whatever it admits fits.
- The arenas never grow and never free their tensors while the carry lives: the bytes
  TensorRT-LLM measured are the bytes they hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..dataplane.arena import Allocate, Arena, torch_allocate
from ..dataplane.row_codec import RowCodec, codec_for
from ..service import host_tier

__all__ = ["Allocate", "EarlyReservation", "Reserved", "arenas_over", "reserve_arenas", "reserve_early",
           "reserve_for", "row_nbytes", "torch_allocate"]


def row_nbytes(num_kv_heads: int, head_dim: int, dtype: torch.dtype, row_dtype: str) -> int:
    """Bytes of one carried row `[2, Hkv, D]` (K and V) of a `dtype` pool under `row_dtype`, as its
    codec holds it and the store charges it (`row_codec.codec_for`: bf16 as gathered, fp8 payload
    plus scales, an FP8 KV pool's own bytes): the arena's block size."""
    return codec_for(row_dtype, dtype).row_nbytes(num_kv_heads, head_dim)


@dataclass(frozen=True)
class Reserved:
    """The carry's memory, reserved at install: the device arena and the host tier's (or None)."""

    device: Arena
    host: Arena | None
    row_nbytes: int  # one carried row in the carry's row format: both arenas hold whole rows
    early: bool = False  # reserved at try_prepare_estimation, before any KV cache existed

    def line(self) -> str:
        """What the start line says about it."""
        host = self.host.nbytes if self.host is not None else 0
        kind = "pinned " if self.host is not None and self.host.pinned else ""
        when = ("before any KV cache exists (a kv_cache_config.max_gpu_total_bytes or max_tokens "
                "you fixed leaves them on top of the KV cache)" if self.early else
                "(a fixed kv_cache_config.max_gpu_total_bytes or max_tokens, or a skipped estimation, "
                "leaves them on top of the KV cache)")
        from ..core.settings import format_bytes  # the one unit rule of every byte figure

        return (f"carried rows hold {format_bytes(self.device.nbytes)} of {self.device.device.type} memory, "
                f"reserved before TensorRT-LLM's KV cache estimation measures free memory {when}, and "
                f"{format_bytes(host)} of {kind}host memory (one row = {self.row_nbytes} bytes)")

    def release_entries(self) -> None:
        """Free every range (both arenas stay reserved): a new carry manager takes them over."""
        self.device.clear()
        if self.host is not None:
            self.host.clear()


def reserve_arenas(buf: torch.Tensor, row_dtype: str, carry_memory: int, host_memory: int,
                   allocate: Allocate = torch_allocate, allocate_host: Allocate = torch_allocate,
                   codec: RowCodec | None = None) -> Reserved:
    """Reserve the carry's memory for rows of the MTP layer's pages `buf` (`[pages, 2, Hkv, tpb, D]`,
    HND): a device arena of `carry_memory` bytes on `buf`'s device and, with `host_memory` > 0,
    a host arena of `host_memory` bytes (pinned when `buf` is on a GPU), each rounded down to
    whole rows of `row_dtype` (`codec`'s rows when given: a QSA pool's carry side rows too), from
    `allocate` and `allocate_host`. Raises what they raise (`torch.OutOfMemoryError`)."""
    if buf.dim() != 5:
        raise ValueError(f"the MTP layer's pages must be HND [pages, 2, Hkv, tpb, D], got {tuple(buf.shape)}")
    block = _block(buf, row_dtype, codec)
    device = Arena.reserve(carry_memory // block * block, buf.device, False, allocate)
    host = (host_tier.host_arena(host_memory // block * block, buf.device, allocate_host)
            if host_memory > 0 else None)
    return Reserved(device, host, block)


@dataclass
class EarlyReservation:
    """The carry's bytes, reserved before any KV cache exists (`trtllm.worker` at
    `KvCacheCreator.try_prepare_estimation`), before the row size is known: `device` holds
    `carry_memory` bytes, `host` `carry_host_memory` bytes (or None). `arenas_over` turns them
    into the arenas at install; `release` gives them back (a carry that stands aside); `free`
    gives back what the device `allocate` took."""

    device: torch.Tensor
    host: torch.Tensor | None
    free: Callable[[torch.Tensor], None]
    released: bool = False

    def release(self) -> None:
        """Give both back, once: `free` the device bytes (from the `allocate` that `free` pairs
        with); the host bytes (torch's) go with their last reference."""
        if not self.released:
            self.released = True
            self.free(self.device)
            self.host = None


def reserve_early(device_memory: int, host_memory: int, device: torch.device,
                  allocate: Allocate = torch_allocate, free: Callable[[torch.Tensor], None] = lambda t: None,
                  allocate_host: Allocate = torch_allocate) -> EarlyReservation:
    """Reserve `device_memory` bytes on `device` and, with `host_memory` > 0, `host_memory` bytes of
    host memory (pinned when `device` is a GPU). Raises what `allocate` raises
    (`torch.OutOfMemoryError`), holding nothing then."""
    storage = allocate(device_memory, device, False)
    try:
        host = (allocate_host(host_memory, torch.device("cpu"), device.type == "cuda")
                if host_memory > 0 else None)
    except BaseException:
        free(storage)
        raise
    return EarlyReservation(storage, host, free)


def _block(buf: torch.Tensor, row_dtype: str, codec: RowCodec | None) -> int:
    """The arena's block: one row of `codec` (None: `row_dtype`'s codec for `buf`'s pool)."""
    if codec is None:
        return row_nbytes(buf.shape[2], buf.shape[4], buf.dtype, row_dtype)
    return codec.row_nbytes(buf.shape[2], buf.shape[4])


def arenas_over(early: EarlyReservation, buf: torch.Tensor, row_dtype: str,
                codec: RowCodec | None = None) -> Reserved | None:
    """The arenas for rows of the MTP layer's pages `buf` (`[pages, 2, Hkv, tpb, D]`, HND) over the
    bytes `early` holds, each cut to whole rows (the rest, under one row, stays reserved and
    unused), as `reserve_arenas` would have sized them; None when `early` is not on `buf`'s device."""
    if buf.dim() != 5:
        raise ValueError(f"the MTP layer's pages must be HND [pages, 2, Hkv, tpb, D], got {tuple(buf.shape)}")
    if early.device.device != buf.device:
        return None
    block = _block(buf, row_dtype, codec)
    cuda = buf.device.type == "cuda"

    def whole_rows(storage: torch.Tensor, pinned: bool, sync: Callable[[], None]) -> Arena:
        return Arena(storage[: storage.numel() // block * block], pinned, sync)

    host = None if early.host is None else whole_rows(
        early.host, cuda, (lambda: torch.cuda.synchronize(buf.device)) if cuda else (lambda: None))
    return Reserved(whole_rows(early.device, False, lambda: None), host, block, early=True)


def reserve_for(draft: Any, mtp_layer: int, options: Any, allocate: Allocate = torch_allocate) -> Reserved:
    """The carry's arenas for draft KV manager `draft`'s MTP layer `mtp_layer` under `options`
    (`CarryOptions`: `carry_memory`, `carry_host_memory`, `carry_row_dtype`; None fields take the
    process settings). Raises `torch.OutOfMemoryError` when the memory is not there."""
    from ..core import carry_row_dtype
    from .draft_pages import pages_of

    pages = pages_of(draft, mtp_layer)
    row_dtype = options.carry_row_dtype or carry_row_dtype()
    return reserve_arenas(pages.kv(), row_dtype, options.device_bytes(), options.host_bytes(), allocate,
                          codec=pages.codec(row_dtype))
