"""NVFP4 row format for carried drafter KV rows: e2m1 pairs, e4m3 block scales, an e8m0 global scale.

What it is for: a carried entry held in NVFP4 costs 580 B a Qwen3-Next MTP row
(1,024 values: 512 B of e2m1 pairs, 64 B of block scales, 4 B of global scales)
against 2,048 B in bf16 and 1,040 B in fp8, so a 1 GiB store holds
about 3.5x the bf16 sessions. The rows are a cache of a drafter's KV: the target
verifies every draft, so the rounding here can cost accepted tokens, never correctness.

A "vector" is one last-dim slice of the rows (one (row, K/V, head) vector of `D`
values for the rows `[n, 2, Hkv, D]` both executors gather); `D` a positive
multiple of 16::

    rows     [..., D] bf16/f16/f32  ->  payload  [..., D/2]  uint8  (e2m1 pairs)
                                        scales   [..., D/16] uint8  (e4m3fn bits, float8_e4m3fn's)
                                        gscales  [...]       uint8  (e8m0: a power of two's biased exponent)
    bytes    V*D*2                  ->  V*(D/2 + D/16 + 1)           (D=256: 145/512 = 0.283x)

The definition followed (NVIDIA's NVFP4, as its public source writes it):
- ModelOpt `modelopt/torch/quantization/qtensor/nvfp4_tensor.py`
  @5a4242faf4147fb0688bb73e10ca30b8ad3aabb3 (`NVFP4QTensor.quantize`/`dequantize`): a
  global scale `g = amax / (6 * 448)`; per 16 consecutive elements a block scale
  `s = e4m3(block_amax / (6 * g))`; values `x / (float(s) * g)` rounded to e2m1
  (0, 0.5, 1, 1.5, 2, 3, 4, 6; nearest, ties to even, saturating at 6: `_cast_fp4`);
  two to a byte, the even element in the low nibble (`(q[1::2] << 4) | q[0::2]`);
  unpack `e2m1 * (float(s) * g)`.
- TensorRT-LLM `cpp/tensorrt_llm/kernels/quantization.cuh`
  @0193dbd4189221d0fd5e9f20cdb384d3da8dbc24 (`cvt_warp_fp16_to_fp4`: `SF = SFScale *
  vecMax / 6` to e4m3, `cvt.rn.satfinite.e2m1x2.f32 byte, x[1], x[0]`: the same nibble
  order; its KV test `cpp/tests/unit_tests/kernels/ropeTest.cu`@e1b4ce4e2725c9c463cab1a25ce0818e80b7ac29
  packs "even elements in low bits"), and its NVFP4 KV cache,
  `cpp/tensorrt_llm/kernels/unfusedAttentionKernels/unfusedAttentionKernels_2_template.h`
  @0097566bd62be830bcbb29fb4782de9564020cda (`quantizeAndWriteFP4KVCache`): each
  (token, head) vector's `D` values as `D/2` bytes in the KV pool, its `D/16` e4m3 block
  scales in a separate block-scale pool (K's in vector order, V's interleaved by groups
  of 4 tokens for the trtllm-gen kernels), one float32 second-level scale per layer for K
  and one for V (`qkv_scale_orig_quant[1]`, `[2]`). This format's payload and block
  scales are those bytes, vector by vector (V's scales in vector order: the interleave
  is the pool's page layout, undone by a gather).
Where this format differs, and why: the global scale is derived per vector (no
calibrated per-layer scale exists for carried rows) and rounded UP to a power of two,
held as one e8m0 byte: every product with it is exact, so pack and unpack need no
rounding but one division and the e2m1/e4m3 roundings, and the top block's scale
lies in (224, 448], inside e4m3's normal range, where its 3 mantissa bits are the
same relative precision as at 448. (A pool's own NVFP4 rows would carry the layer's
float32 scale once per entry instead of a byte per vector.)

Format (what `pack_rows` writes, bit for bit), per vector, in float32:
- `y = amax(|v|) / 2688` (correctly rounded), `y = max(y, 2**-112)`, `g` = the least
  power of two >= y (`gscales = log2(g) + 127`). The floor keeps every block decode
  scale `s * g` and every nonzero unpacked value normal floats (no subnormal, so no
  flush-to-zero can change a bit).
- per block of 16: `s = e4m3(block_amax / (6 * g))` (division correctly rounded,
  `6 * g` exact; round to nearest even; `<= 448 (1 + 2**-22)`, so it rounds to <= 448,
  no clamp); `d = float(s) * g` (exact).
- per value: `e2m1(v / d)` (division correctly rounded, then nearest-even to the e2m1
  grid, saturating at 6), its sign bit the value's (zeros keep their sign); a block
  with `s == 0` (all its values below `2**-10 * 6 * g`) packs magnitudes 0.
- unpack: `e2m1 * d`, exact in float32 and in bf16 (at most 6 significant bits, normal),
  cast to the rows' dtype (fp16 rounds to nearest even); NaN is written as the dtype's
  quiet NaN (bf16 0x7FC0, fp16 0x7E00, f32 0x7FC00000) on every path and device.
No division is by a reciprocal or a CPU scalar (CUDA computes `t / python_float` as
`t * (1 / b)`): the torch path divides by tensors on the rows' device, the Triton
kernels by `div_rn`. The e4m3 codes come from torch's float32 -> float8_e4m3fn cast
(nearest even) on the torch path and from integer arithmetic in Triton; both are
pinned against each other and against an independent table in the tests.

Exactness: zeros (signed) unpack exactly; a vector already on the grid (every
nonzero block `q * s_b * 2**k` with `max |q| = 6`, the largest `s_b` in (224, 448])
round-trips exactly. Error bound (what the tests pin), per value `v` of a block with
amax `b`, `x = b / (6 * g)` and decode scale `d = s * g`, plus float32 rounding:
- `|v| <= 6 d`: `|unpack - v| <= max(|v|, d) / 4` (e2m1's half spacing is a quarter of
  the value from 1 up, a quarter of `d` below);
- `|v| > 6 d` (the block scale rounded down, the value saturates to `6 d`): the error
  is exactly `|v| - 6 d`. A normal scale is `s >= x (1 - 2**-4)`, so `|v| <= 6.4 d` and
  the error is under `0.4 d < |v| / 4`. A subnormal one, `s = k * 2**-9` (k = 1..7),
  is `s >= x - 2**-10`, so `|v| <= 6 d (k + 1/2) / k` and the error is at most `3 d / k`:
  within `|v| / 4` for `k >= 2` (`|v| <= 7.5 d`), but not for `k = 1` (code 0x01, the
  least subnormal, `d = 2**-9 g`), where `|v| < 9 d` and the error, under `3 d`,
  exceeds `|v| / 4` once `|v| > 8 d`;
- so in every block `|unpack - v| <= max(max(|v|, d) / 4, |v| - 6 d)`, and the first
  term alone bounds every value but those above `8 d` in a block whose scale is 0x01;
- a block whose scale rounds to 0 (its amax <= `2**-10 * 6 * g`) unpacks to 0.

Non-finite: a vector holding a NaN or inf packs to gscale 0xFF, every block scale
0x7F (e4m3fn NaN) and zero payload, bits fully defined, and unpacks to all NaN,
never to a finite wrong value.

Invariants:
- vectorized: no Python loop over rows, vectors, blocks or heads; deterministic;
- `Nvfp4Rows.nbytes == nvfp4_nbytes(vectors, head_dim) == core.row_format.rows_nbytes(
  "nvfp4", vectors, head_dim)`: the bytes a carry store charges are the bytes held;
- `kernel="torch"` and `kernel="triton"` give the same bits, on CPU (Triton's
  interpreter) and on a GPU; the default is Triton for CUDA tensors (no float8
  hardware needed: any GPU Triton runs on) unless `$TRTLLM_MTP_CARRY_KERNELS=aot`,
  torch elsewhere.

`pack_blocks` / `unpack_blocks` / `unpack_into_blocks` do for the reference pool's
whole-block K and V caches (`[num_blocks, block_size, Hkv, D]`), and `gather_pages` /
`scatter_pages` for TensorRT-LLM's HND pages, what `row_format`'s and `hnd_pages`' FP8
twins do, through the same code (`row_layout`, with `NVFP4_OPS`). `row_codec.Nvfp4Codec`
is this format as a carried-row codec (both executors, the arena, the host tier).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.row_format import NVFP4_BLOCK, rows_nbytes
from . import row_layout as _rl
from .hnd_pages import gather_pages_packed, scatter_pages_packed
from .row_format import PACKABLE_DTYPES
from .row_layout import VectorLayout

__all__ = [
    "E2M1_VALUES",
    "G_FLOOR",
    "gather_pages",
    "scatter_pages",
    "NVFP4_BLOCK",
    "NVFP4_OPS",
    "Nvfp4Rows",
    "nvfp4_kernel",
    "nvfp4_nbytes",
    "pack_blocks",
    "pack_rows",
    "unpack_blocks",
    "unpack_into_blocks",
    "unpack_rows",
]

#: e2m1's 16 codes' values (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6, then their negatives.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: The least global scale (see the header).
G_FLOOR = 2.0**-112
#: e2m1's largest value times e4m3fn's.
_AMAX_PER_G = 6.0 * 448.0
_NAN_SCALE = 0x7F  # e4m3fn NaN
_NAN_G = 0xFF  # e8m0 NaN


def nvfp4_nbytes(num_vectors: int, head_dim: int) -> int:
    """Bytes of `num_vectors` packed vectors of `head_dim` values: payload, block and global scales, exact."""
    _rl.check_counts(num_vectors, head_dim)
    _check_head_dim(head_dim)
    return rows_nbytes("nvfp4", num_vectors, head_dim)


def _check_head_dim(head_dim: int) -> None:
    if head_dim < NVFP4_BLOCK or head_dim % NVFP4_BLOCK:
        raise ValueError(f"head_dim={head_dim!r} must be a positive multiple of {NVFP4_BLOCK} for nvfp4")


@dataclass(frozen=True)
class Nvfp4Rows(_rl.PackedRowsBase):
    """Rows in the NVFP4 row format: `payload` `[..., D/2]`, `scales` `[..., D/16]`, `gscales` `[...]`, all uint8.

    `dtype` is the rows' dtype before packing, the dtype `unpack_rows` returns.
    Construction checks dtypes, shapes and devices (metadata only, no sync).
    """

    payload: torch.Tensor
    scales: torch.Tensor
    gscales: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("payload", "scales", "gscales"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
                raise TypeError(f"{name} must be a torch.uint8 tensor, got "
                                f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        p, s, g = self.payload, self.scales, self.gscales
        if p.dim() < 1 or g.shape != p.shape[:-1] or s.shape != (*g.shape, p.shape[-1] // 8) \
                or p.shape[-1] % 8 or p.shape[-1] == 0:
            raise ValueError(f"payload {tuple(p.shape)}, scales {tuple(s.shape)} and gscales {tuple(g.shape)} "
                             "must be [..., D/2], [..., D/16] and [...] for a D that is a positive multiple of 16")
        if not p.device == s.device == g.device:
            raise ValueError(f"payload on {p.device}, scales on {s.device}, gscales on {g.device}")
        if self.dtype not in PACKABLE_DTYPES:
            raise TypeError(f"dtype must be one of {PACKABLE_DTYPES}, got {self.dtype}")

    @property
    def shape(self) -> torch.Size:
        """The rows' shape: the payload's with its last dimension doubled."""
        return torch.Size((*self.payload.shape[:-1], 2 * self.payload.shape[-1]))

    @property
    def head_dim(self) -> int:
        return 2 * self.payload.shape[-1]

    @property
    def num_vectors(self) -> int:
        """Vectors held: one global scale each."""
        return self.gscales.numel()

    @property
    def nbytes(self) -> int:
        """Payload plus block and global scale bytes; equals `nvfp4_nbytes(num_vectors, head_dim)`."""
        return self.payload.nbytes + self.scales.nbytes + self.gscales.nbytes


# Every e4m3fn code's float32 value (NaNs included), and every payload byte's two e2m1 values
# (low nibble first): index tables (exact).
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_E2M1_PAIRS = torch.tensor([(E2M1_VALUES[b & 15], E2M1_VALUES[b >> 4]) for b in range(256)], dtype=torch.float32)


# e2m1's rounding bounds (nearest, ties to the even code): |y| rounds to code c when it
# passes exactly c of them (strictly at 0.25, 1.25, 2.5, 5: a tie goes down; at 0.75,
# 1.75, 3.5 a tie goes up), the last one saturating at 6. (A constant loop of 7 passes:
# torch.bucketize is one pass but a scalar binary search, 5x slower on the CPU.)
_E2M1_BOUNDS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False),
                (5.0, True))


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, e2m1 pairs, 2688 as a 1-element tensor) on `device` (made once, read only).

    The torch path divides by the tensor, never by the Python float: aten's CUDA
    division computes `t / python_float` as `t * (1 / b)` (see `row_format._fp8_max`)."""
    return (_E4M3_VALUES.to(device), _E2M1_PAIRS.to(device),
            torch.full((1,), _AMAX_PER_G, dtype=torch.float32, device=device))


def _check_rows(rows: torch.Tensor) -> None:
    _rl.check_rows(rows)
    _check_head_dim(rows.shape[-1])


def nvfp4_kernel(t: torch.Tensor, kernel: str | None = None) -> str:
    """The implementation that packs/unpacks `t`: `kernel` when given, else Triton for CUDA tensors
    (unless the AOT kernels are selected) and torch elsewhere."""
    return _rl.choose_kernel(t, kernel, lambda device: True)  # no float8 hardware needed


def _pack_torch(rows: torch.Tensor) -> Nvfp4Rows:
    e4m3, _, amax_per_g = _tables(rows.device)
    lead, d = rows.shape[:-1], rows.shape[-1]
    x = rows.float().reshape(*lead, d // NVFP4_BLOCK, NVFP4_BLOCK)
    ax = x.abs()
    amax_b = ax.amax(-1)  # [..., NB]; exact, NaN-propagating
    amax_v = amax_b.amax(-1, keepdim=True)  # [..., 1]
    bad = ~torch.isfinite(amax_v.squeeze(-1))  # a vector holding a NaN or inf
    y = (amax_v / amax_per_g).squeeze(-1)  # by a [1] tensor on the device: correctly rounded
    y = torch.where(y >= G_FLOOR, y, torch.full_like(y, G_FLOOR))  # a NaN quotient too (a bad vector)
    gbits = ((y.view(torch.int32) + 0x7FFFFF) >> 23) & 0xFF  # rounded up to a power of two
    g = (gbits << 23).view(torch.float32)
    b = amax_b / (g * 6.0).unsqueeze(-1)  # 6 g exact; b <= 448 (1 + 2**-22)
    b = torch.where(bad.unsqueeze(-1), torch.zeros_like(b), b)
    sc = b.to(torch.float8_e4m3fn).view(torch.uint8)  # nearest even
    sc = torch.where(bad.unsqueeze(-1), torch.full_like(sc, _NAN_SCALE), sc)
    dec = e4m3.index_select(0, sc.reshape(-1).int()).view(sc.shape) * g.unsqueeze(-1)  # exact
    # a block whose scale is 0 (or NaN: a bad vector) divides by inf: every magnitude packs 0
    dec = torch.where(dec > 0, dec, torch.full_like(dec, float("inf")))
    a = ax.div_(dec.unsqueeze(-1))  # |x / d|, divided by a tensor: correctly rounded
    # e2m1: how many rounding bounds |x / d| passes (ties to even: > at 0.25, 1.25, 2.5, 5;
    # >= at 0.75, 1.75, 3.5), the last saturating at 6
    code = torch.signbit(x).to(torch.uint8) << 3
    for bound, strict in _E2M1_BOUNDS:
        code += (a > bound) if strict else (a >= bound)
    code = code.view(*lead, d)
    payload = code[..., 0::2] | (code[..., 1::2] << 4)
    payload = torch.where(bad.unsqueeze(-1), torch.zeros_like(payload), payload)
    gbytes = torch.where(bad, torch.full_like(gbits, _NAN_G), gbits).to(torch.uint8)
    return Nvfp4Rows(payload, sc, gbytes, rows.dtype)


def _dequant_torch(packed: Nvfp4Rows) -> torch.Tensor:
    """`e2m1 * float(s) * g` (exact in float32 and in the rows' dtype), cast to `packed.dtype`,
    `[..., D]`; a NaN-scaled block's values are the dtype's one NaN `float("nan")` fills
    (0x7FC0 in bf16: torch's CPU cast writes 0xFFFF, a GPU 0x7FFF), so every path and device
    writes the same bits."""
    e4m3, e2m1, _ = _tables(packed.device)
    gb = packed.gscales
    g = (gb.int() << 23).view(torch.float32)
    g = torch.where(gb == _NAN_G, torch.full_like(g, float("nan")), g)
    sc = packed.scales
    dec = (e4m3.index_select(0, sc.reshape(-1).int()).view(sc.shape) * g.unsqueeze(-1)).unsqueeze(-1)
    # every byte's two values, even element first: one gather
    q = e2m1.index_select(0, packed.payload.reshape(-1).int()).view(*sc.shape, NVFP4_BLOCK)
    values = (q * dec).to(packed.dtype)
    values.masked_fill_(torch.isnan(dec), float("nan"))
    return values.view(packed.shape)


def pack_rows(rows: torch.Tensor, kernel: str | None = None, out: Nvfp4Rows | None = None) -> Nvfp4Rows:
    """`rows` `[..., D]` in the NVFP4 row format, one global scale per last-dim vector (see the header).

    Deterministic and loop-free; the result is on `rows`' device; `kernel` as `nvfp4_kernel`.
    With `out` (Nvfp4Rows of `rows`' shape and dtype, contiguous, on its device:
    `row_layout.check_out`) the same bytes are written there and `out` is returned: the
    Triton kernel writes them itself; the torch path computes in float32 temporaries
    and copies its result in.
    """
    _check_rows(rows)
    if out is not None:
        _rl.check_out(out, Nvfp4Rows, rows.shape, rows.dtype, rows.device)
    if nvfp4_kernel(rows, kernel) == "triton":
        return _rl.pack_plain_triton(NVFP4_OPS, rows, out)
    packed = _pack_torch(rows)
    return packed if out is None else _rl.fill(out, packed)


def _pack_layout_triton(src0: torch.Tensor, src1: torch.Tensor | None, layout: VectorLayout,
                        shape: Sequence[int], out: Nvfp4Rows | None = None) -> Nvfp4Rows:
    """`layout`'s vectors packed by the Triton kernel as `shape` (one launch), into `out`'s tensors
    when given (`shape`, contiguous: the caller's duty), else fresh ones."""
    from . import nvfp4_kernels as nk

    n, d = layout.num_vectors, layout.head_dim
    if out is None:
        dev, lead = src0.device, tuple(shape[:-1])
        out = Nvfp4Rows(torch.empty((*lead, d // 2), dtype=torch.uint8, device=dev),
                        torch.empty((*lead, d // NVFP4_BLOCK), dtype=torch.uint8, device=dev),
                        torch.empty(lead, dtype=torch.uint8, device=dev), src0.dtype)
    # the kernel's flat views of out's own storage: [V, D/2], [V, D/16], [V] uint8
    nk.nvfp4_pack_triton(src0, src1, layout, out.payload.view(n, d // 2), out.scales.view(n, d // NVFP4_BLOCK),
                         out.gscales.view(n))
    return out


def _unpack_layout_triton(packed: Nvfp4Rows, dst0: torch.Tensor, dst1: torch.Tensor | None,
                          layout: VectorLayout) -> None:
    from . import nvfp4_kernels as nk

    d = layout.head_dim
    nk.nvfp4_unpack_triton(packed.payload.reshape(-1, d // 2).contiguous(),
                           packed.scales.reshape(-1, d // NVFP4_BLOCK).contiguous(),
                           packed.gscales.reshape(-1).contiguous(), dst0, dst1, layout)


def unpack_rows(packed: Nvfp4Rows, out: torch.Tensor | None = None, kernel: str | None = None) -> torch.Tensor:
    """`e2m1 * s * g` cast to `packed.dtype`; written into `out` when given.

    `out` must have the rows' shape and dtype (any device: the values are copied
    there; the Triton path writes straight into an `out` on the packed rows' device).
    """
    _rl.check_unpack_out(NVFP4_OPS, packed, out)
    if nvfp4_kernel(packed.payload, kernel) == "triton":
        return _rl.unpack_plain_triton(NVFP4_OPS, packed, out)
    values = _dequant_torch(packed)
    if out is None:
        return values
    out.copy_(values)
    return out


# ---- the reference runtime's pool: whole blocks of separate K and V caches ----------------


def pack_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: Sequence[int],
                rows: int, kernel: str | None = None, out: Nvfp4Rows | None = None) -> Nvfp4Rows:
    """The first `rows` rows held in blocks `block_ids` of the pool's caches, packed as `[rows, 2, Hkv, D]`.

    As `row_format.pack_blocks` (row `r` is slot `r % block_size` of block
    `block_ids[r // block_size]`; only live rows are packed; `out` as there), in NVFP4:
    bit for bit `pack_rows` of those rows stacked `[rows, 2, Hkv, D]`. The Triton path
    reads K and V in place in one launch; the torch path gathers them first.
    """
    return _rl.pack_blocks(NVFP4_OPS, k_cache, v_cache, block_ids, rows, kernel, out)


def unpack_blocks(packed: Nvfp4Rows, block_size: int,
                  kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole blocks `(k, v)`, each `[cdiv(rows, block_size), block_size, Hkv, D]`, from `pack_blocks`' rows.

    Row `r` lands at block `r // block_size`, slot `r % block_size`; the last
    block's tail past the rows is zeros (`HostRows`' shape).
    """
    return _rl.unpack_blocks(NVFP4_OPS, packed, block_size, kernel)


def unpack_into_blocks(packed: Nvfp4Rows, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_ids: torch.Tensor, kernel: str | None = None) -> None:
    """Write `pack_blocks`' rows `[rows, 2, Hkv, D]` into blocks `block_ids` of the pool's caches.

    `block_ids`: `[cdiv(rows, block_size)]` int64 on the caches' device (blocks the
    caller alone holds). Row `r` goes to slot `r % block_size` of block
    `block_ids[r // block_size]`; nothing else is written. Bit for bit `unpack_blocks`
    copied into those blocks (Triton: one launch).
    """
    _rl.unpack_into_blocks(NVFP4_OPS, packed, k_cache, v_cache, block_ids, kernel)


# ---- TensorRT-LLM's HND pages (the adapter's draft pool) ---------------------------------


def gather_pages(buf: torch.Tensor, pages: Sequence[int], lo: int, hi: int,
                 kernel: str | None = None, out: Nvfp4Rows | None = None) -> Nvfp4Rows:
    """Rows of keys `[lo, hi)` of HND pages `buf` `[pages, 2, Hkv, tpb, D]`, packed `[hi - lo, 2, Hkv, D]`.

    Bit for bit `pack_rows(hnd_pages.gather_rows(buf, pages, lo, hi))`: the Triton
    kernel reads the pages through the page table in one launch (no bf16 copy) and
    writes the packed rows (into `out`'s tensors when given: `pack_rows`' `out`); the
    torch path packs the indexed read.
    """
    _check_rows(buf)
    return gather_pages_packed(NVFP4_OPS, buf, pages, lo, hi, kernel, out)


def scatter_pages(buf: torch.Tensor, pages: Sequence[int], lo: int, packed: Nvfp4Rows,
                  kernel: str | None = None) -> None:
    """Unpack `packed` `[n, 2, Hkv, D]` straight into keys `[lo, lo + n)` of HND pages `buf`.

    Bit for bit `hnd_pages.scatter_rows(buf, pages, lo, unpack_rows(packed))`, with its
    checks (shape; the packed rows' dtype must be the pages') before any write.
    """
    if not isinstance(packed, Nvfp4Rows):
        raise TypeError(f"packed must be Nvfp4Rows, got {type(packed).__name__}")
    scatter_pages_packed(NVFP4_OPS, buf, pages, lo, packed, kernel)


#: This format as `row_layout`'s shared block/page plumbing calls it.
NVFP4_OPS: _rl.RowFormatOps[Nvfp4Rows] = _rl.RowFormatOps(
    Nvfp4Rows, nvfp4_kernel, pack_rows, unpack_rows, _pack_layout_triton, _unpack_layout_triton, _check_head_dim)
