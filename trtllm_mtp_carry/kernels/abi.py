"""The TensorRT kernel ABI of the two data-plane kernels, and their launch rules (plain ints).

What it is for: the one description of each plugin kernel that the TensorRT
plugin (`plugins/`), the AOT launcher (`kernels/aot_launcher.py`), the builder
(`builders/build_abi_kernels.py`) and the tests all read. No torch, no triton.

The ABI (TensorRT AOT Quickly Deployable Plugins, `tensorrt.plugin` >= 10.9,
`samples/python/quickly_deployable_plugins/qdp_defs.py`, `circ_pad_plugin_aot_impl`):
the kernel is launched with the input pointers, then the int32 extra arguments,
then the output pointers, and nothing else. In-place writes into the caches are
aliased outputs (`TensorDesc.aliased()`), so a written tensor appears twice:
once as an input (`*_in`, never dereferenced) and once as the output the
kernel writes through (TensorRT passes the same address for both).

    hidden_row_copy:    src, dst_row, dst_in | src_stride, dst_stride, hidden_size,
                        dst_capacity | dst
    drafter_row_append: k_new, v_new, keys, block_table, inv_freq, start_row,
                        k_cache_in, v_cache_in | num_kv_heads, head_dim, page_size,
                        rotary_dim, k_s0, k_s1, v_s0, v_s1, max_blocks, num_blocks |
                        k_cache, v_cache

Row offsets (`dst_row`, `start_row`) are one-element int32 device tensors, not
extras: TensorRT extras are functions of shapes, and a row offset is data.

Launch rules (one function each, generic over the number type so the plugin
evaluates them on `trtp` symbolic shape expressions and launchers on ints):

    hidden_row_copy    grid (n, cdiv(hidden_size, COPY_BLOCK), 1)   block (128, 1, 1)
                       program (r, c) copies row r, columns [c*COPY_BLOCK, (c+1)*COPY_BLOCK) & < H
    drafter_row_append grid (n, 1, 1)                                block (128, 1, 1)
                       program i writes compacted row start_row + i, every head and column

Invariants: a row whose destination is out of range (a negative offset, a row
past `dst_capacity`, a block-table index past `max_blocks`, a block id outside
`[0, num_blocks)`) is skipped by the kernel, never written: inside an engine
there is no error channel, so a bad offset must not become a stray write.
The block table holds at least one entry (`max_blocks >= 1`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.block_book import cdiv

__all__ = [
    "APPEND_ABI",
    "COPY_ABI",
    "COPY_BLOCK",
    "NUM_WARPS",
    "KernelABI",
    "Launch",
    "Param",
    "append_block_shape",
    "append_launch",
    "append_program_cells",
    "cdiv",
    "copy_launch",
    "copy_program_cells",
]

#: Columns per program of the copy kernel (baked into the PTX; one build serves every hidden size).
COPY_BLOCK = 1024
#: Warps per program of both kernels; the block is `NUM_WARPS * 32` threads.
NUM_WARPS = 4


@dataclass(frozen=True)
class Param:
    """One `.entry` parameter: its name, its role and its Triton type (`*bf16`, `*i32`, `i32`).

    `*data` stands for a pointer to the kernel's data dtype, filled in per build.
    """

    name: str
    role: str  # "input" | "extra" | "output"
    ty: str  # Triton signature type; "*data" for the data dtype's pointer

    def triton_type(self, data: str) -> str:
        """The Triton signature type with the data dtype (`bf16`, `fp16`, `fp32`) filled in."""
        return self.ty.replace("data", data)

    def ptx_type(self) -> str:
        """The PTX parameter type: `.u64` for a pointer, `.u32` for an int32 extra."""
        return ".u64" if self.ty.startswith("*") else ".u32"


@dataclass(frozen=True)
class KernelABI:
    """A kernel's ordered parameters (inputs, extras, outputs) and which output aliases which input."""

    name: str
    params: tuple[Param, ...]
    aliases: tuple[tuple[str, str], ...]  # (output, input it aliases)

    def __post_init__(self) -> None:
        order = {"input": 0, "extra": 1, "output": 2}
        roles = [order[p.role] for p in self.params]
        if roles != sorted(roles):
            raise ValueError(f"{self.name}: parameters must be inputs, then extras, then outputs")

    def names(self, role: str | None = None) -> list[str]:
        """Parameter names in ABI order, optionally only those of one role."""
        return [p.name for p in self.params if role is None or p.role == role]

    def signature(self, data: str) -> dict[str, str]:
        """The Triton `ASTSource` signature (ABI order) with the data dtype filled in."""
        return {p.name: p.triton_type(data) for p in self.params}


COPY_ABI = KernelABI(
    name="hidden_row_copy",
    params=(
        Param("src", "input", "*data"),  # [n, H]
        Param("dst_row", "input", "*i32"),  # [1] first destination row
        Param("dst_in", "input", "*data"),  # [C, H] aliased by dst; never dereferenced
        Param("src_stride", "extra", "i32"),
        Param("dst_stride", "extra", "i32"),
        Param("hidden_size", "extra", "i32"),
        Param("dst_capacity", "extra", "i32"),
        Param("dst", "output", "*data"),  # [C, H]
    ),
    aliases=(("dst", "dst_in"),),
)

APPEND_ABI = KernelABI(
    name="drafter_row_append",
    params=(
        Param("k_new", "input", "*data"),  # [n, Hkv, D], last dim contiguous
        Param("v_new", "input", "*data"),  # [n, Hkv, D], last dim contiguous
        Param("keys", "input", "*i32"),  # [n] pair keys; RoPE position key + 1
        Param("block_table", "input", "*i32"),  # [max_blocks]
        Param("inv_freq", "input", "*fp32"),  # [rotary_dim // 2] (rope.rope_inv_freq)
        Param("start_row", "input", "*i32"),  # [1] compacted row of k_new[0]
        Param("k_cache_in", "input", "*data"),  # aliased by k_cache
        Param("v_cache_in", "input", "*data"),  # aliased by v_cache
        Param("num_kv_heads", "extra", "i32"),
        Param("head_dim", "extra", "i32"),
        Param("page_size", "extra", "i32"),
        Param("rotary_dim", "extra", "i32"),
        Param("k_s0", "extra", "i32"),
        Param("k_s1", "extra", "i32"),
        Param("v_s0", "extra", "i32"),
        Param("v_s1", "extra", "i32"),
        Param("max_blocks", "extra", "i32"),
        Param("num_blocks", "extra", "i32"),
        Param("k_cache", "output", "*data"),  # [num_blocks, page_size, Hkv, D] contiguous
        Param("v_cache", "output", "*data"),
    ),
    aliases=(("k_cache", "k_cache_in"), ("v_cache", "v_cache_in")),
)


@dataclass(frozen=True)
class Launch:
    """Grid, block and dynamic shared memory of one launch (values of any number type)."""

    grid: tuple[Any, Any, Any]
    block: tuple[int, int, int]
    shared_bytes: int


def copy_launch(n: Any, hidden_size: Any, shared_bytes: int = 0,
                div: Callable[[Any, int], Any] = cdiv) -> Launch:
    """Launch of `hidden_row_copy` for `n` rows of `hidden_size` columns.

    `div` is the ceiling division of the number type (`trtp.cdiv` on shape expressions).
    """
    return Launch((n, div(hidden_size, COPY_BLOCK), 1), (NUM_WARPS * 32, 1, 1), shared_bytes)


def append_block_shape(num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """`(BLOCK_H, BLOCK_D)` a build for these shapes bakes in: the next powers of two."""
    if num_kv_heads < 1 or head_dim < 1:
        raise ValueError(f"num_kv_heads and head_dim must be >= 1, got {num_kv_heads}, {head_dim}")
    return 1 << (num_kv_heads - 1).bit_length(), 1 << (head_dim - 1).bit_length()


def append_launch(n: Any, shared_bytes: int = 0) -> Launch:
    """Launch of `drafter_row_append` for `n` rows: one program per row, all heads and columns."""
    return Launch((n, 1, 1), (NUM_WARPS * 32, 1, 1), shared_bytes)


def copy_program_cells(pid: tuple[int, int], hidden_size: int) -> tuple[int, range]:
    """The (row, columns) the copy kernel's program `pid` touches (mirrors its index math)."""
    r, c = pid
    return r, range(c * COPY_BLOCK, min((c + 1) * COPY_BLOCK, hidden_size))


def append_program_cells(i: int, start_row: int, num_kv_heads: int, head_dim: int,
                         block_h: int, block_d: int) -> tuple[int, list[tuple[int, int]]]:
    """The (compacted row, [(head, column)]) the append kernel's program `i` writes.

    Mirrors its masks: lanes `h < num_kv_heads`, `d < head_dim` of a `block_h x block_d` tile.
    """
    cells = [(h, d) for h in range(block_h) for d in range(block_d)
             if h < num_kv_heads and d < head_dim]
    return start_row + i, cells
