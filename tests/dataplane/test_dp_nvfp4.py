"""The NVFP4 row format: packed bytes against an independent implementation, exact charges,
the torch path and the Triton kernels bit for bit, grid values exact, non-finite kept non-finite.

The independent implementation below is written apart from `dataplane/nvfp4.py`:
pure Python floats (exact), numpy float32 for the format's two divisions, and the
e4m3 and e2m1 roundings as nearest-in-a-table searches with ties to the even code
(no bit tricks, no torch casts). Every run draws fresh random inputs (seed printed).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from dp_helpers import bits, poison
from triton_modules import load_kernels

from trtllm_mtp_carry.core.row_format import ROW_FORMATS, RowFormat, rows_nbytes
from trtllm_mtp_carry.dataplane.hnd_pages import gather_rows
from trtllm_mtp_carry.dataplane.nvfp4 import (
    E2M1_VALUES,
    Nvfp4Rows,
    gather_pages,
    nvfp4_nbytes,
    pack_blocks,
    pack_rows,
    scatter_pages,
    unpack_blocks,
    unpack_into_blocks,
    unpack_rows,
)

_NK = load_kernels("trtllm_mtp_carry.dataplane.nvfp4_kernels", "nvfp4_pack_kernel")
KERNELS = ["torch", "triton"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ---- the independent implementation ------------------------------------------------------

def _e4m3_table() -> list[float]:
    """e4m3fn's non-negative finite values by code 0..126 (exponent bias 7, subnormals below 2**-6)."""
    out = []
    for code in range(127):
        e, m = code >> 3, code & 7
        out.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return out


E4M3 = _e4m3_table()
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def nearest_even(table: list[float], a: float) -> int:
    """The code of `table`'s value nearest `a` (>= 0), ties to the even code; past the top: the top."""
    if a >= table[-1]:
        return len(table) - 1
    best = min(range(len(table)), key=lambda c: (abs(table[c] - a), c % 2))
    return best


def f32(x: float) -> float:
    return float(np.float32(x))


def f32_div(a: float, b: float) -> float:
    """`a / b` rounded once to float32 (both exact float32 values)."""
    return float(np.float32(a) / np.float32(b))


def reference_pack_vector(v: list[float]) -> tuple[list[int], list[int], int]:
    """(payload bytes, scale codes, gscale byte) of one vector, as the header defines them."""
    nb = len(v) // 16
    if not all(math.isfinite(x) for x in v):
        return [0] * (len(v) // 2), [0x7F] * nb, 0xFF
    y = max(f32_div(max(abs(x) for x in v), 2688.0), 2.0**-112)
    mant, exp = math.frexp(y)  # y = mant * 2**exp, mant in [0.5, 1)
    g = y if mant == 0.5 else 2.0**exp
    scales, codes = [], []
    for i in range(nb):
        block = v[16 * i:16 * i + 16]
        b = f32_div(max(abs(x) for x in block), 6 * g)
        s = nearest_even(E4M3, b)
        scales.append(s)
        d = E4M3[s] * g
        for x in block:
            mag = 0 if d == 0 else nearest_even(E2M1, abs(f32_div(x, d)))
            codes.append(mag | (8 if math.copysign(1.0, x) < 0 else 0))
    payload = [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(len(v) // 2)]
    return payload, scales, int(round(math.log2(g))) + 127


def reference_unpack_vector(payload: list[int], scales: list[int], gbyte: int) -> list[float]:
    if gbyte == 0xFF:
        return [math.nan] * (2 * len(payload))
    g = 2.0 ** (gbyte - 127)
    out = []
    for i, byte in enumerate(payload):
        d = E4M3[scales[i // 8]] * g
        for c in (byte & 15, byte >> 4):
            out.append(math.copysign(E2M1[c & 7] * d, -1.0 if c & 8 else 1.0))
    return out


# ---- inputs ---------------------------------------------------------------------------------

def mixed_vectors(gen: torch.Generator, n: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """`n` vectors of `d`: random scales per vector and per block, zero blocks, tiny blocks
    (e4m3-subnormal and zero scales), exact e2m1 ties, signed zeros."""
    x = torch.randn(n, d // 16, 16, generator=gen, dtype=torch.float64)
    x *= 2.0 ** torch.randint(-12, 12, (n, 1, 1), generator=gen).double()
    x *= 2.0 ** torch.randint(-6, 1, (n, d // 16, 1), generator=gen).double()
    x[0] = 0.0
    x[1] = -0.0
    x[2, 0] = 0.0  # a zero block
    x[3, 1 % (d // 16)] *= 2.0**-14  # a block whose scale is e4m3-subnormal
    x[3, 2 % (d // 16)] *= 2.0**-22  # ... and one whose scale rounds to 0
    x[4 % n, 0] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -5, 5.5, 0.3, -0.0, 4, 3, 2],
                           dtype=torch.float64)  # ties, with the block's scale exactly 1 (g = 2**-8)
    x[4 % n, 1:] = 0.0
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.reshape(n, d).to(dtype)


def assert_equals_reference(rows: torch.Tensor, packed: Nvfp4Rows) -> None:
    flat = rows.reshape(-1, rows.shape[-1]).double().tolist()
    p = packed.payload.reshape(len(flat), -1).cpu().tolist()
    s = packed.scales.reshape(len(flat), -1).cpu().tolist()
    g = packed.gscales.reshape(-1).cpu().tolist()
    for i, v in enumerate(flat):
        assert (p[i], s[i], g[i]) == reference_pack_vector(v), f"vector {i}: {v}"


# ---- the format against the independent implementation ------------------------------------

@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_bytes_equal_the_independent_implementation_bit_for_bit(kernel, dtype, gen, device) -> None:
    rows = mixed_vectors(gen, 8, 64, dtype)
    rows[6, 5] = float("nan")
    rows[7, 40] = -float("inf")
    packed = pack_rows(rows.to(device), kernel=kernel)
    assert_equals_reference(rows, packed)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_unpacked_rows_equal_the_independent_decode_exactly(kernel, dtype, gen, device) -> None:
    rows = mixed_vectors(gen, 8, 32, dtype)
    packed = pack_rows(rows, kernel="torch").to(device)
    out = unpack_rows(packed, kernel=kernel).cpu()
    p, s, g = (t.reshape(8, -1).tolist() for t in (packed.payload.cpu(), packed.scales.cpu(), packed.gscales.cpu()))
    want = torch.tensor([reference_unpack_vector(p[i], s[i], g[i][0]) for i in range(8)], dtype=torch.float64)
    assert torch.equal(bits(out), bits(want.to(dtype)))


def test_e2m1_rounds_to_nearest_even_and_saturates_at_six() -> None:
    # amax 6: g = 2**-8, the block's scale 256 exactly, so the packed values are the rows' own
    v = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -5, 5.75, 0.3, -0.0, 0.2, 2.75, 1.1])
    out = unpack_rows(pack_rows(v.bfloat16()))
    assert out.float().tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -4, 6, 0.5, -0.0, 0, 3, 1]
    assert torch.signbit(out.float()).tolist() == [x < 0 or str(x) == "-0.0" for x in v.tolist()]


@pytest.mark.parametrize("kernel", KERNELS)
def test_scale_bytes_follow_the_definition_on_a_worked_vector(kernel, device) -> None:
    # amax 12 -> 12 / 2688 = 0.00446 -> g = 2**-7 (gscale 120); block 0: 12 / (6 * 2**-7) = 256
    # (e4m3 code 0x78); block 1: amax 0.5 -> 10.67 -> e4m3 11 (code 0x53) -> d = 11 * 2**-7
    v = torch.zeros(32)
    v[0], v[1], v[16], v[17] = 12.0, -3.0, 0.5, -0.3
    packed = pack_rows(v.to(device), kernel=kernel)
    assert packed.gscales.item() == 120
    assert packed.scales.tolist() == [0x78, 0x53]
    # 12 / 2 = 6 -> code 7; -3 / 2 = -1.5 -> 0xB; 0.5 / 0.0859 = 5.82 -> 6 (code 7); -0.3 / 0.0859 = -3.49 -> -3 (0xD)
    assert packed.payload[0].item() == 0x7 | (0xB << 4)
    assert packed.payload[8].item() == 0x7 | (0xD << 4)


# ---- exactness and the error bound ------------------------------------------------------------

@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_vectors_unpack_to_exact_signed_zeros(kernel, dtype, device) -> None:
    rows = torch.zeros(3, 2, 48, dtype=dtype)
    rows[1] = -0.0
    rows[2, :, ::3] = -0.0
    packed = pack_rows(rows.to(device), kernel=kernel)
    assert torch.equal(bits(unpack_rows(packed, kernel=kernel)), bits(rows))
    assert packed.scales.eq(0).all() and packed.gscales.eq(15).all()  # the floor 2**-112


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_values_on_the_grid_round_trip_exactly(kernel, dtype, gen, device) -> None:
    n, nb = 6, 4
    q = torch.tensor(E2M1_VALUES)[torch.randint(0, 16, (n, nb, 16), generator=gen)]
    q[..., 0] = 6.0  # each block's max |q| is 6
    s = torch.tensor(_e4m3_table())[torch.randint(1, 127, (n, nb), generator=gen)]
    s[:, 0] = torch.tensor(_e4m3_table())[torch.randint(119, 127, (n,), generator=gen)]  # the top in (224, 448]
    s = torch.minimum(s, s[:, :1])
    k = 2.0 ** torch.randint(-20, 20, (n, 1, 1), generator=gen).float()
    rows = (q * s.unsqueeze(-1) * k).reshape(n, nb * 16).to(dtype)
    rows[0, 16:32] = 0.0  # a zero block on the grid too
    out = unpack_rows(pack_rows(rows.to(device), kernel=kernel), kernel=kernel)
    assert torch.equal(bits(out), bits(rows))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_error_is_within_a_quarter_of_the_value_or_of_its_block_scale(kernel, dtype, gen,
                                                                                  device) -> None:
    rows = mixed_vectors(gen, 16, 64, dtype)
    packed = pack_rows(rows.to(device), kernel=kernel)
    out = unpack_rows(packed, kernel=kernel).cpu().double()
    e4m3 = torch.tensor(_e4m3_table() + [math.nan], dtype=torch.float64)
    g = 2.0 ** (packed.gscales.cpu().double() - 127).unsqueeze(-1)
    d = (e4m3[packed.scales.cpu().long().clamp(max=127)] * g).repeat_interleave(16, dim=-1)  # [16, 64]
    v = rows.double()
    # a block whose scale rounded to 0 holds |v| <= 2**-10 * 6 g: it unpacks to zeros
    bound = torch.where(d > 0, torch.maximum(v.abs(), d) / 4, 6 * g / 1024) * (1 + 2.0**-20)
    # a value past 6 d (the e4m3 block scale rounded down) saturates to 6 d, off by exactly
    # |v| - 6 d; past |v| / 4 only in a block whose scale is e4m3's least subnormal (row 3's
    # subnormal-scale block, for some seeds; the worked case is the next test)
    bound = torch.maximum(bound, torch.where(d > 0, v.abs() - 6 * d, 0.0) * (1 + 2.0**-20))
    if dtype == torch.float16:  # fp16's own rounding of the unpacked value
        bound = bound + out.abs() * 2.0**-11 + 2.0**-25
    assert bool(((out - v).abs() <= bound).all())
    assert bool(((out - v).abs() > 0).any())  # the bound is met by rounding, not by a copy


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_value_past_8d_in_a_block_scaled_by_the_least_e4m3_subnormal_saturates_off_by_v_minus_6d(
        kernel, dtype, device) -> None:
    # each vector's amax 2688 = 6 * 448 makes g = 1; its second block's amax b gives x = b / 6:
    # row 0: b = 8.5 * 2**-9, x = 1.417 * 2**-9 rounds down to the least subnormal 2**-9 (code 1),
    #   so d = 2**-9 and b = 8.5 d saturates to 6 d, off by 2.5 d > max(|v|, d) / 4 = 2.125 d;
    # row 1: b = 7.5 * 2**-8, x = 2.5 * 2**-9 ties to the even code 2, d = 2**-8: off by
    #   1.5 d <= 7.5 d / 4, the worst a subnormal scale above the least one gives
    rows = torch.zeros(2, 32, dtype=dtype)
    rows[:, 0] = 2688.0
    rows[:, 16] = torch.tensor([-8.5 * 2.0**-9, 7.5 * 2.0**-8])
    rows[:, 17] = torch.tensor([3 * 2.0**-9, 3 * 2.0**-8])  # 3 d: on the grid, exact
    packed = pack_rows(rows.to(device), kernel=kernel)
    assert packed.gscales.cpu().tolist() == [127, 127]
    assert packed.scales.cpu().tolist() == [[126, 1], [126, 2]]  # 448, then 2**-9 and 2 * 2**-9
    out = unpack_rows(packed, kernel=kernel).cpu().double()
    d = torch.tensor([2.0**-9, 2.0**-8], dtype=torch.float64)
    assert out[:, 16].tolist() == [-6 * 2.0**-9, 6 * 2.0**-8]
    assert out[:, 17].tolist() == [3 * 2.0**-9, 3 * 2.0**-8]
    v = rows[:, 16].double()
    err = (out[:, 16] - v).abs()
    assert err.tolist() == (v.abs() - 6 * d).tolist() == [2.5 * 2.0**-9, 1.5 * 2.0**-8]
    quarter = torch.maximum(v.abs(), d) / 4  # the bound without the saturation case
    assert (err > quarter).tolist() == [True, False]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_non_finite_vector_packs_defined_bits_and_unpacks_to_nan_never_finite(kernel, gen, device) -> None:
    rows = mixed_vectors(gen, 4, 32, torch.bfloat16)
    rows[0, 3] = float("nan")
    rows[1, 31] = float("inf")
    rows[2, 0] = -float("inf")
    packed = pack_rows(rows.to(device), kernel=kernel)
    assert packed.gscales.cpu().tolist() == [255, 255, 255, packed.gscales[3].item()]
    assert packed.scales[:3].eq(0x7F).all() and packed.payload[:3].eq(0).all()
    out = unpack_rows(packed, kernel=kernel).cpu()
    assert torch.isnan(out[:3]).all() and torch.isfinite(out[3]).all()
    assert out[:3].view(torch.int16).eq(0x7FC0).all()  # one NaN's bits on every path


# ---- exact charges --------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(5, 2, 3, 16), (7, 256), (1, 2, 2, 128), (0, 2, 2, 64)])
def test_nbytes_is_payload_block_and_global_scales_exactly(shape) -> None:
    packed = pack_rows(torch.ones(shape, dtype=torch.bfloat16))
    vectors, d = math.prod(shape[:-1]), shape[-1]
    assert packed.nbytes == nvfp4_nbytes(vectors, d) == vectors * (d // 2 + d // 16 + 1)
    assert packed.nbytes == rows_nbytes("nvfp4", vectors, d)


def test_a_qwen3_next_mtp_row_costs_580_bytes_of_2048() -> None:
    # 2 KV heads x 256 x K and V = 1,024 values: 512 B of pairs, 64 B of block scales, 4 global bytes
    assert RowFormat("nvfp4", 4, 256).row_nbytes == 580 == pack_rows(torch.ones(1, 2, 2, 256)).nbytes
    assert RowFormat("bf16", 4, 256).row_nbytes == 2048
    assert "nvfp4" in ROW_FORMATS


def test_a_head_dim_not_a_multiple_of_16_is_refused_with_the_value_named() -> None:
    with pytest.raises(ValueError, match="head_dim=24"):
        pack_rows(torch.ones(2, 24))
    with pytest.raises(ValueError, match="head_dim=24"):
        rows_nbytes("nvfp4", 3, 24)
    with pytest.raises(ValueError, match="row format; expected one of bf16, fp8, nvfp4"):
        RowFormat("fp4", 4, 256)
    with pytest.raises(TypeError, match="payload must be a torch.uint8"):
        Nvfp4Rows(torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8),
                  torch.bfloat16)
    with pytest.raises(ValueError, match="must be"):
        Nvfp4Rows(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8),
                  torch.zeros(2, dtype=torch.uint8), torch.bfloat16)


# ---- the two paths bit for bit; the pool's blocks -----------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_pack_and_unpack_equal_torch_bit_for_bit(dtype, gen, device) -> None:
    rows = mixed_vectors(gen, 24, 256, dtype).view(6, 2, 2, 256).to(device)
    a, b = pack_rows(rows, kernel="torch"), pack_rows(rows, kernel="triton")
    for name in ("payload", "scales", "gscales"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(bits(unpack_rows(a, kernel="torch")), bits(unpack_rows(a, kernel="triton")))


def test_triton_packs_a_strided_view_as_torch_packs_its_copy(gen, device) -> None:
    base = mixed_vectors(gen, 12, 64, torch.bfloat16).view(3, 4, 64).to(device)
    view = base.transpose(0, 1)[:, ::2]
    a, b = pack_rows(view.contiguous(), kernel="torch"), pack_rows(view, kernel="triton")
    assert torch.equal(a.payload, b.payload) and torch.equal(a.scales, b.scales)
    out = poison(gen, 12, 64, device=device).view(3, 4, 64).transpose(0, 1)[:, ::2]
    unpack_rows(b, out=out, kernel="triton")
    assert torch.equal(bits(out), bits(unpack_rows(a, kernel="torch")))


@pytest.mark.parametrize("kernel", KERNELS)
def test_pack_blocks_packs_the_live_rows_as_pack_rows_of_them(kernel, gen, device) -> None:
    nblocks, bs, hkv, d = 6, 4, 2, 32
    k, v = (mixed_vectors(gen, nblocks * bs * hkv, d, torch.bfloat16).view(nblocks, bs, hkv, d).to(device)
            for _ in range(2))
    ids, rows = [4, 1, 3], 10
    packed = pack_blocks(k, v, ids, rows, kernel=kernel)
    idx = torch.tensor(ids, device=device)
    stacked = torch.stack([c[idx].flatten(0, 1)[:rows] for c in (k, v)], dim=1)
    want = pack_rows(stacked, kernel="torch")
    assert packed.shape == (rows, 2, hkv, d) and packed.nbytes == nvfp4_nbytes(rows * 2 * hkv, d)
    for name in ("payload", "scales", "gscales"):
        assert torch.equal(getattr(packed, name), getattr(want, name)), name
    kb, vb = unpack_blocks(packed, bs, kernel=kernel)
    assert kb.shape == (3, bs, hkv, d) and kb.view(-1, hkv, d)[rows:].eq(0).all()
    assert torch.equal(bits(torch.stack([kb.flatten(0, 1)[:rows], vb.flatten(0, 1)[:rows]], 1)),
                       bits(unpack_rows(want, kernel="torch")))


@pytest.mark.parametrize("kernel", KERNELS)
def test_unpack_into_blocks_writes_the_rows_into_the_named_blocks_only(kernel, gen, device) -> None:
    bs, hkv, d, rows = 4, 2, 16, 6
    src = mixed_vectors(gen, rows * 2 * hkv, d, torch.bfloat16).view(rows, 2, hkv, d)
    packed = pack_rows(src)
    k, v = (poison(gen, 5, bs, hkv, d, device=device) for _ in range(2))
    before = (k.clone(), v.clone())
    unpack_into_blocks(packed, k, v, torch.tensor([3, 0], device=device), kernel=kernel)
    want = unpack_rows(packed)
    for i, (cache, old) in enumerate(zip((k, v), before, strict=True)):
        flat = cache.view(5, bs, hkv, d)
        assert torch.equal(bits(flat[3]), bits(want[:4, i])) and torch.equal(bits(flat[0, :2]), bits(want[4:, i]))
        assert torch.equal(bits(flat[0, 2:]), bits(old[0, 2:]))
        for b in (1, 2, 4):
            assert torch.equal(bits(flat[b]), bits(old[b]))


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_page_gather_and_scatter_are_pack_and_unpack_of_the_plain_ones(kernel, gen, device) -> None:
    buf = mixed_vectors(gen, 6 * 2 * 2 * 8, 32, torch.bfloat16).view(6, 2, 2, 8, 32).to(device)  # HND pages
    pages = [4, 1, 3]
    packed = gather_pages(buf, pages, 3, 20, kernel=kernel)  # keys [3, 20) across three pages
    want = pack_rows(gather_rows(buf, pages, 3, 20), kernel="torch")
    for name in ("payload", "scales", "gscales"):
        assert torch.equal(getattr(packed, name), getattr(want, name)), name
    out = poison(gen, 6, 2, 2, 8, 32, device=device)
    before = out.clone()
    scatter_pages(out, [0, 2, 5], 3, packed, kernel=kernel)
    assert torch.equal(bits(gather_rows(out, [0, 2, 5], 3, 20)), bits(unpack_rows(packed, kernel="torch")))
    assert torch.equal(bits(out[[1, 3, 4]]), bits(before[[1, 3, 4]]))  # no other page written
    assert torch.equal(bits(out[0, :, :, :3]), bits(before[0, :, :, :3]))  # nor other keys


def test_to_pin_and_host_copy_keep_every_bit(gen) -> None:
    packed = pack_rows(mixed_vectors(gen, 4, 32, torch.bfloat16))
    copy = packed.host_copy()
    assert copy.payload.data_ptr() != packed.payload.data_ptr()
    for other in (packed.to("cpu"), copy):
        for name in ("payload", "scales", "gscales"):
            assert torch.equal(getattr(other, name), getattr(packed, name))


def test_the_torch_paths_never_divide_by_a_cpu_scalar(gen) -> None:
    # CUDA computes `t / python_float` as `t * (1 / b)`, one rounding more: every torch path of
    # the format (rows, pages, blocks) must divide by tensors on the rows' device only
    from test_dp_row_format import ScalarDivisions

    rows = mixed_vectors(gen, 8, 32, torch.bfloat16).view(2, 2, 2, 32)
    buf = mixed_vectors(gen, 4 * 2 * 2 * 8, 32, torch.bfloat16).view(4, 2, 2, 8, 32)
    k, v = (mixed_vectors(gen, 5 * 4 * 2, 32, torch.bfloat16).view(5, 4, 2, 32) for _ in range(2))
    with ScalarDivisions() as mode:
        packed = pack_rows(rows, kernel="torch")
        unpack_rows(packed, out=torch.empty_like(rows), kernel="torch")
        scatter_pages(buf, [3, 1], 2, pack_rows(rows, kernel="torch"), kernel="torch")
        gather_pages(buf, [3, 1, 0], 2, 12, kernel="torch")
        blocks = pack_blocks(k, v, [4, 0, 2], 9, kernel="torch")
        unpack_blocks(blocks, 4, kernel="torch")
        unpack_into_blocks(blocks, k, v, torch.tensor([1, 3, 0]), kernel="torch")
    assert mode.seen == []
