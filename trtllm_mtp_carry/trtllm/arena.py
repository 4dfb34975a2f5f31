"""The carry's memory, reserved once: one preallocated byte arena per tier, rows held in block extents.

What it is for: TensorRT-LLM sizes its KV cache from the device memory it finds
free (`_torch/pyexecutor/_util.py` `KvCacheCreator.configure_kv_cache_capacity`,
read @ 0004396720054fd8e205cbf616f21f0b57c6b412: after the estimation build's
dummy run, `torch.cuda.mem_get_info()` and the allocator's peak give
`available = (total - peak + estimation KV bytes) * free_gpu_memory_fraction`).
Memory the carry allocated later, one tensor per deposit, came out of the
headroom TensorRT-LLM left for activations and CUDA graphs, unreserved and
unreported, and a failed allocation was a `torch.OutOfMemoryError`. Here the
carry's rows live in one `uint8` tensor of `carry_memory` bytes, reserved before any
KV cache exists: in the worker at `KvCacheCreator.try_prepare_estimation`, before it
measures (`py_executor_creator.py` @ 000429d57d42ecc8d481e5cdf653fff238be5974:
`try_prepare_estimation`, `build_managers(resources, True)`,
`create_py_executor_instance(...)`, then `configure_kv_cache_capacity(py_executor)`,
`teardown_managers`, `build_managers(resources, False)`, the second
`create_py_executor_instance`). KV cache manager V2 sizes its estimation cache there
(`fraction * free`, the dummy workload's quota if smaller, mapped at construction), so
an arena reserved after it would have to fit in the `(1 - fraction)` margin. The row
size is known only at the first `create_py_executor_instance` (the draft pool's
pages): `arenas_over` cuts the early bytes into whole rows there; `reserve_arenas`
reserves there when the early point did not run. The same arena serves both builds
(`trtllm.worker` hands it over), so the KV cache is sized around it. The host tier's
pinned memory is one arena of `carry_host_memory` bytes the same way.

```
  arena (uint8, capacity = blocks * block_nbytes):
  | entry a: n_a blocks | free | entry b: n_b blocks | free ...        |
  block = one carried row in the carry's row format:
    bf16: 2 * Hkv * D * 2 bytes, an entry's rows [n, 2, Hkv, D] viewed in place
    fp8:  2 * Hkv * D + 2 * Hkv * 4 bytes, an entry = payload [n, 2, Hkv, D] e4m3
          then scales [n, 2, Hkv] float32, both views of its one extent
```

Invariants:
- One block is one row of the carry's format, so an entry of `n` rows costs
  exactly `n` blocks and the bytes the store charges (`CarriedRows`: the codec's
  `nbytes`, payload plus scales for fp8): the store's byte budget is the arena's
  capacity, and whatever the store admits fits in the arena's free blocks.
- Each entry holds one contiguous extent (zero-copy views for the scatter). Free
  extents are kept sorted and merged; when no free extent is long enough but the
  free blocks are, `compact` slides every entry down (staged through a clone, so
  it never reads bytes it overwrote). A compaction that cannot stage (allocation
  failure) leaves the arena as it was and raises `torch.OutOfMemoryError` to the
  caller, which refuses that deposit as `oom`.
- The arena never grows and never frees its tensor while the carry lives:
  the bytes TensorRT-LLM measured are the bytes it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..core.free_spans import FreeSpans
from ..dataplane.pinned import pinned_empty
from ..dataplane.row_codec import RowCodec, Rows, codec_for, codec_of

__all__ = ["Allocate", "EarlyReservation", "HeldRows", "Reserved", "RowArena", "Rows", "arenas_over",
           "reserve_arenas", "reserve_early", "reserve_for", "row_nbytes", "torch_allocate"]

Allocate = Callable[[int, torch.device, bool], torch.Tensor]
"""`allocate(nbytes, device, pinned)`: a 1-D uint8 tensor of `nbytes` (raises `torch.OutOfMemoryError`)."""


def torch_allocate(nbytes: int, device: torch.device, pinned: bool) -> torch.Tensor:
    """The arena's storage: device memory from torch's allocator; host memory plain, page-locked
    for exactly `nbytes` where CUDA runs (`dataplane.pinned.pinned_empty`: torch's pinned
    allocator would round it up to a power of two, 24 GiB pinning 32)."""
    if device.type == "cpu":
        if pinned and torch.cuda.is_available():
            return pinned_empty(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def row_nbytes(num_kv_heads: int, head_dim: int, dtype: torch.dtype, row_dtype: str) -> int:
    """Bytes of one carried row `[2, Hkv, D]` (K and V) of a `dtype` pool under `row_dtype`, as its
    codec holds it and the store charges it (`row_codec.codec_for`: bf16 as gathered, fp8 payload
    plus scales, an FP8 KV pool's own bytes): the arena's block size."""
    return codec_for(row_dtype, dtype).row_nbytes(num_kv_heads, head_dim)


@dataclass(frozen=True)
class Reserved:
    """The carry's memory, reserved at install: the device arena and the host tier's (or None)."""

    device: RowArena
    host: RowArena | None
    early: bool = False  # reserved at try_prepare_estimation, before any KV cache existed

    def line(self) -> str:
        """What the start line says about it."""
        host = self.host.nbytes if self.host is not None else 0
        kind = "pinned " if self.host is not None and self.host.storage.is_pinned() else ""
        when = ("before any KV cache exists (a kv_cache_config.max_gpu_total_bytes or max_tokens "
                "you fixed leaves them on top of the KV cache)" if self.early else
                "(a fixed kv_cache_config.max_gpu_total_bytes or max_tokens, or a skipped estimation, "
                "leaves them on top of the KV cache)")
        from ..core.settings import format_bytes  # the one unit rule of every byte figure

        return (f"carried rows hold {format_bytes(self.device.nbytes)} of {self.device.device.type} memory, "
                f"reserved before TensorRT-LLM's KV cache estimation measures free memory {when}, and "
                f"{format_bytes(host)} of {kind}host memory (one block = one {self.device.block_nbytes}-byte row)")

    def release_entries(self) -> None:
        """Free every extent (both arenas stay reserved): a new carry manager takes them over."""
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
    device = RowArena.reserve(carry_memory, block, buf.device, False, allocate)
    host = (RowArena.reserve(host_memory, block, torch.device("cpu"), buf.device.type == "cuda", allocate_host)
            if host_memory > 0 else None)
    return Reserved(device, host)


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

    def whole_rows(storage: torch.Tensor) -> RowArena:
        return RowArena(storage[: storage.numel() // block * block], block)

    return Reserved(whole_rows(early.device), None if early.host is None else whole_rows(early.host), early=True)


@dataclass(frozen=True, slots=True)
class _Extent:
    start: int  # first block
    blocks: int
    shape: tuple[int, ...]  # the rows' shape [n, 2, Hkv, D]
    codec: RowCodec  # the rows' format (the view's form)


class RowArena:
    """Carried rows held in one preallocated `uint8` tensor, each entry one extent of whole blocks."""

    def __init__(self, storage: torch.Tensor, block_nbytes: int) -> None:
        if storage.dtype != torch.uint8 or storage.dim() != 1:
            raise TypeError(f"storage must be a 1-D uint8 tensor, got {storage.dtype} {tuple(storage.shape)}")
        if type(block_nbytes) is not int or block_nbytes < 1 or block_nbytes % 4:
            raise ValueError(f"block_nbytes must be a positive multiple of 4 (float32 scales stay aligned), "
                             f"got {block_nbytes!r}")
        self.storage = storage
        self.block_nbytes = block_nbytes
        self.capacity_blocks = storage.numel() // block_nbytes
        self._free = FreeSpans(self.capacity_blocks)
        self._held: dict[int, _Extent] = {}
        self.compactions = 0

    @classmethod
    def reserve(cls, nbytes: int, block_nbytes: int, device: torch.device | str, pinned: bool = False,
                allocate: Allocate = torch_allocate) -> RowArena:
        """Allocate an arena of `nbytes` rounded down to whole blocks, on `device` (pinned host
        memory with `pinned`). Raises what `allocate` raises (`torch.OutOfMemoryError`)."""
        blocks = nbytes // block_nbytes if block_nbytes > 0 else 0
        storage = allocate(blocks * block_nbytes, torch.device(device), pinned)
        return cls(storage, block_nbytes)

    @property
    def nbytes(self) -> int:
        """The bytes reserved (the storage's size)."""
        return self.storage.numel()

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def blocks_held(self) -> int:
        return sum(e.blocks for e in self._held.values())

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def keys(self) -> list[int]:
        """The keys holding an extent."""
        return list(self._held)

    def blocks_for(self, rows: Rows) -> int:
        """Blocks `rows` take: their bytes over the block size (ValueError unless whole blocks)."""
        nbytes = rows.nbytes
        if nbytes % self.block_nbytes:
            raise ValueError(f"rows of {nbytes} bytes are not whole {self.block_nbytes}-byte blocks "
                             "(a carried row is one block)")
        return nbytes // self.block_nbytes

    def put(self, key: int, rows: Rows, codec: RowCodec | None = None) -> bool:
        """Copy `rows` (held in `codec`'s form; None: `codec_of(rows)`) into an extent held under
        `key` (any older extent of `key` released first).

        False when the free blocks do not suffice; compacts when they do but no free extent
        is long enough. `torch.OutOfMemoryError` from a compaction's staging copy leaves the
        arena unchanged (`key`'s older extent released)."""
        self.release(key)
        n = self.blocks_for(rows)
        start = self._free.find(n)
        if start is None:
            if self._free.total() < n:
                return False
            self.compact()
            start = self._free.find(n)
            assert start is not None  # after compaction the free blocks are one extent
        self._free.cut(start, n)
        codec = codec_of(rows) if codec is None else codec
        extent = _Extent(start, n, tuple(rows.shape), codec)
        self._held[key] = extent
        codec.copy_(self._view(extent), rows)
        if self.storage.is_cuda:
            # the rows were gathered on the draft pool's stream and are copied here on the
            # current one: the allocator must not hand their memory out again before it ran
            stream = torch.cuda.current_stream(self.storage.device)
            for t in codec.tensors(rows):
                if t.is_cuda:
                    t.record_stream(stream)
        return True

    def get(self, key: int) -> Rows:
        """`key`'s rows, views into the arena (valid until `key` is released or the arena compacts)."""
        return self._view(self._held[key])

    def release(self, key: int) -> bool:
        """Free `key`'s extent (False if it held none)."""
        extent = self._held.pop(key, None)
        if extent is None:
            return False
        self._free.give(extent.start, extent.blocks)
        return True

    def clear(self) -> None:
        """Free every extent (the storage stays reserved)."""
        self._held.clear()
        self._free.reset_around([])

    def compact(self) -> None:
        """Slide every extent down towards the arena's start, in address order, leaving one free
        extent. A move whose source and destination overlap is staged through a clone of that
        one extent; `torch.OutOfMemoryError` from it stops the compaction with every extent
        where its bytes are (the arena stays consistent) and is raised."""
        cursor = 0
        try:
            for key, extent in sorted(self._held.items(), key=lambda kv: kv[1].start):
                if extent.start != cursor:
                    src = self._bytes(extent.start, extent.blocks)
                    if extent.start < cursor + extent.blocks:  # overlapping: stage this extent
                        src = src.clone()
                    self._bytes(cursor, extent.blocks).copy_(src)
                    self._held[key] = _Extent(cursor, extent.blocks, extent.shape, extent.codec)
                cursor += extent.blocks
        finally:
            self._free.reset_around((e.start, e.blocks) for e in self._held.values())
        self.compactions += 1

    def check(self) -> None:
        """RuntimeError unless the held and free extents tile the arena exactly once."""
        self._free.check_tiles(((e.start, e.blocks) for e in self._held.values()), "arena extents (blocks)")

    # ---- extents -----------------------------------------------------------------------

    def _bytes(self, start: int, blocks: int) -> torch.Tensor:
        return self.storage[start * self.block_nbytes:(start + blocks) * self.block_nbytes]

    def _view(self, e: _Extent) -> Rows:
        return e.codec.view(self._bytes(e.start, e.blocks), e.shape)


class HeldRows:
    """Rows by carry key: copied into `arena` (`put`), or the tensors themselves (`keep`, and
    every `put` without an arena).

    A popped arena entry's view stays valid until the next `put` (its blocks are released
    then, before the new rows are placed): the manager queues a taken entry's scatter on the
    draft stream before the executor thread deposits again, and that deposit's gather runs
    on the same stream after it (ordered there; the deposit then synchronizes it), so the
    scatter has read the extent before a `put` overwrites it.
    """

    def __init__(self, arena: RowArena | None = None, codec: RowCodec | None = None) -> None:
        self.arena = arena
        self.codec = codec  # the rows' format (None: each `put`'s own, `codec_of`)
        self._kept: dict[int, Rows] = {}
        self._popped: list[int] = []  # arena keys taken, released at the next put

    def put(self, key: int, rows: Rows) -> None:
        """Hold `rows` under `key`: copied into the arena; `torch.OutOfMemoryError` when the arena
        cannot hold them (its free blocks do not suffice, or a compaction could not stage)."""
        self._kept.pop(key, None)
        if self.arena is None:
            self._kept[key] = rows
            return
        for k in self._popped:
            self.arena.release(k)
        self._popped.clear()
        if not self.arena.put(key, rows, self.codec):
            raise torch.OutOfMemoryError(
                f"the carry's arena has no room for {rows.nbytes} bytes "
                f"({self.arena.capacity_blocks - self.arena.blocks_held} of {self.arena.capacity_blocks} "
                "blocks free)")

    def free_blocks(self) -> int:
        """Arena blocks the next `put` may use: free ones and popped entries' (released then)."""
        assert self.arena is not None
        popped = sum(self.arena.blocks_for(self.arena.get(k)) for k in self._popped if k in self.arena)
        return self.arena.capacity_blocks - self.arena.blocks_held + popped

    def keep(self, key: int, rows: Rows) -> None:
        """Hold `rows` themselves (not copied into the arena)."""
        if self.arena is not None:
            self.arena.release(key)
        self._kept[key] = rows

    def __getitem__(self, key: int) -> Rows:
        rows = self._kept.get(key)
        if rows is not None:
            return rows
        if not self._in_arena(key):
            raise KeyError(key)
        assert self.arena is not None
        return self.arena.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._kept or (isinstance(key, int) and self._in_arena(key))

    def _in_arena(self, key: int) -> bool:
        return self.arena is not None and key in self.arena and key not in self._popped

    def __iter__(self) -> Iterator[int]:
        yield from list(self._kept)
        if self.arena is not None:
            yield from [k for k in self.arena.keys() if k not in self._popped]

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __delitem__(self, key: int) -> None:
        if self._kept.pop(key, None) is not None:
            return
        if not self._in_arena(key):
            raise KeyError(key)
        assert self.arena is not None
        self.arena.release(key)

    def pop(self, key: int, *default: Rows | None) -> Rows | None:
        """`key`'s rows, no longer held (an arena entry's view: valid until the next `put`)."""
        rows = self._kept.pop(key, None)
        if rows is not None:
            return rows
        if self._in_arena(key):
            assert self.arena is not None
            self._popped.append(key)
            return self.arena.get(key)
        if default:
            return default[0]
        raise KeyError(key)

    def clear(self) -> None:
        self._kept.clear()
        self._popped.clear()
        if self.arena is not None:
            self.arena.clear()


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
