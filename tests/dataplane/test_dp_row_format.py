"""The FP8 row format: round trip within e4m3's rounding, exact bytes, fused paged twins bit for bit.

Every run draws fresh random inputs (seed printed); bounds are the format's
own (see `row_format`'s header), computed in float64.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dp_helpers import bits, poison
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_mtp_carry.dataplane.hnd_pages import (
    gather_packed_rows,
    gather_rows,
    scatter_packed_rows,
    scatter_rows,
)
from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool, HostRows, PoolExhaustedError
from trtllm_mtp_carry.dataplane.rope import RopeConfig
from trtllm_mtp_carry.dataplane.row_format import (
    FP8_MAX,
    FP8_TRITON_MIN_CAPABILITY,
    SCALE_FLOOR,
    PackedRows,
    VectorLayout,
    pack_blocks,
    pack_rows,
    packed_nbytes,
    plain_layout,
    unpack_blocks,
    unpack_into_blocks,
    unpack_rows,
)


@pytest.fixture
def fp8_tk(tk, device):
    """The Triton kernels, where they can run the FP8 ones (interpreted on CPU; on a GPU from sm_89)."""
    if device == "cuda" and torch.cuda.get_device_capability() < FP8_TRITON_MIN_CAPABILITY:
        pytest.skip("Triton's float8 e4m3 conversions need compute capability 8.9 or later")
    return tk


# Half an ulp of the output dtype, relative (bf16: 7 stored mantissa bits; fp16: 10; f32: 23).
OUT_HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
# Half the output dtype's subnormal spacing: the absolute floor of its rounding.
OUT_HALF_TINY = {torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25, torch.float32: 2.0**-150}


def mixed_rows(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    """Normal values at a random scale per vector, with zero, tiny and large vectors and zero entries."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    mag = 10.0 ** torch.randint(-30, 30, shape[:-1], generator=gen, dtype=torch.float64)
    x = x * mag.unsqueeze(-1)
    flat = x.view(-1, shape[-1])
    flat[0] = 0.0  # a zero vector
    flat[1] = -0.0
    flat[2, ::2] = 0.0  # zeros inside a vector
    flat[3] = torch.linspace(-1e-30, 1e-30, shape[-1], dtype=torch.float64)  # tiny
    flat[4] = torch.linspace(-3e38, 3e38, shape[-1], dtype=torch.float64)  # near the top of bf16/f32
    flat[5, 0] = 1e4  # one outlier: the rest of the vector goes subnormal in e4m3
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype)


def assert_within_fp8_rounding(rows: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    """`|out - rows| <= 2**-4 |rows| + 2**-10 scale` (e4m3: normal / subnormal), plus the output cast."""
    v, o = rows.double(), out.double()
    s = scales.double().unsqueeze(-1)
    core = 2.0**-4 * v.abs() + 2.0**-10 * s
    core = core * (1 + 2.0**-20) + 2.0**-149  # float32 arithmetic of divide and multiply
    bound = core + OUT_HALF_ULP[rows.dtype] * (v.abs() + core) + OUT_HALF_TINY[rows.dtype]
    err = (o - v).abs()
    worst = (err - bound).max()
    assert bool((err <= bound).all()), f"error over the bound by {float(worst)}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_within_fp8_rounding_of_the_rows(dtype, gen) -> None:
    rows = mixed_rows(gen, 9, 2, 3, 64, dtype=dtype)
    packed = pack_rows(rows)
    out = unpack_rows(packed)
    assert out.dtype == dtype and out.shape == rows.shape
    assert packed.payload.dtype == torch.float8_e4m3fn and packed.scales.dtype == torch.float32
    assert packed.scales.shape == rows.shape[:-1]
    assert bool(torch.isfinite(out).all())
    assert_within_fp8_rounding(rows, out, packed.scales)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=40))
def test_any_finite_float32_vector_round_trips_within_fp8_rounding(values) -> None:
    rows = torch.tensor(values, dtype=torch.float32)
    packed = pack_rows(rows)
    out = unpack_rows(packed)
    assert bool(torch.isfinite(out).all())
    assert_within_fp8_rounding(rows, out, packed.scales)
    assert torch.equal(bits(out), bits(unpack_rows(pack_rows(rows.clone()))))


def test_scale_is_amax_over_448_floored_at_float32_smallest_normal(gen) -> None:
    rows = mixed_rows(gen, 6, 2, 2, 32, dtype=torch.bfloat16)
    packed = pack_rows(rows)
    expect = (rows.float().abs().amax(-1) / FP8_MAX).clamp(min=SCALE_FLOOR)
    assert torch.equal(packed.scales, expect)
    # the largest |value| of every non-zero vector packs to +-448 exactly
    top = packed.payload.float().abs().amax(-1)
    nonzero = rows.float().abs().amax(-1) > FP8_MAX * SCALE_FLOOR
    assert torch.equal(top[nonzero], torch.full_like(top[nonzero], FP8_MAX))


def test_zero_vectors_unpack_to_exact_signed_zeros() -> None:
    rows = torch.tensor([[0.0, -0.0, 0.0, -0.0], [1.0, -0.0, 0.0, -2.0]], dtype=torch.bfloat16)
    packed = pack_rows(rows)
    assert packed.scales.tolist() == [SCALE_FLOOR, torch.tensor(2.0 / FP8_MAX, dtype=torch.float32).item()]
    out = unpack_rows(packed)
    assert torch.equal(bits(out), bits(rows))  # signs of zero kept, 1 and -2 exact


def test_values_e4m3_holds_exactly_round_trip_exactly() -> None:
    # scale 1 (amax 448): every e4m3 value times 1 is exact in bf16
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].view(-1, 2)  # 254 finite codes (the two NaNs dropped)
    grid[:, 0] = FP8_MAX  # every vector's amax is 448 -> scale exactly 1
    rows = grid.to(torch.bfloat16)
    assert torch.equal(pack_rows(rows).scales, torch.ones(rows.shape[0]))
    assert torch.equal(bits(unpack_rows(pack_rows(rows))), bits(rows))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_unpack_is_the_float32_product_cast_for_every_code_nans_included(dtype, gen) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(16, 16)
    scales = torch.rand(16, generator=gen) * 2.0 ** torch.randint(-20, 20, (16,), generator=gen)
    packed = PackedRows(codes, scales, dtype)
    expect = (codes.float() * scales.unsqueeze(-1)).to(dtype)
    assert torch.equal(bits(unpack_rows(packed, kernel="torch")), bits(expect))


def test_non_finite_vectors_unpack_to_nan_never_a_finite_value() -> None:
    rows = torch.tensor([[1.0, float("inf"), 2.0], [float("nan"), 1.0, 0.0], [1.0, 2.0, 4.0]],
                        dtype=torch.bfloat16)
    out = unpack_rows(pack_rows(rows))
    assert bool(torch.isnan(out[:2]).all())
    assert out[2].tolist() == [1.0, 2.0, 4.0]  # 112, 224, 448 in e4m3: exact


def test_pack_is_bit_identical_across_runs(gen) -> None:
    rows = mixed_rows(gen, 17, 2, 4, 128, dtype=torch.bfloat16)
    a, b = pack_rows(rows), pack_rows(rows.clone())
    assert torch.equal(bits(a.payload), bits(b.payload)) and torch.equal(bits(a.scales), bits(b.scales))
    assert torch.equal(bits(unpack_rows(a)), bits(unpack_rows(b)))


@pytest.mark.parametrize("shape", [(5, 2, 3, 64), (1, 2, 1, 128), (0, 2, 4, 128), (7, 16)])
def test_nbytes_is_payload_plus_scales_exactly(shape) -> None:
    packed = pack_rows(torch.ones(shape, dtype=torch.bfloat16))
    vectors = 1
    for n in shape[:-1]:
        vectors *= n
    assert packed.nbytes == packed_nbytes(vectors, shape[-1]) == vectors * shape[-1] + 4 * vectors
    assert packed.nbytes == (packed.payload.untyped_storage().nbytes()
                             + packed.scales.untyped_storage().nbytes())


def test_packed_nbytes_of_a_128_dim_row_is_516_of_1024_bf16_bytes() -> None:
    assert packed_nbytes(2 * 4, 128) == 8 * 128 + 32 == 1056
    assert packed_nbytes(0, 128) == 0
    with pytest.raises(ValueError, match="num_vectors must be an int >= 0, got -1"):
        packed_nbytes(-1, 128)
    with pytest.raises(ValueError, match="head_dim must be an int >= 0, got 1.5"):
        packed_nbytes(1, 1.5)  # type: ignore[arg-type]


def test_unpack_into_out_writes_the_same_bits(gen) -> None:
    rows = mixed_rows(gen, 4, 2, 2, 16, dtype=torch.bfloat16)
    packed = pack_rows(rows)
    out = poison(gen, 4, 2, 2, 16)
    assert unpack_rows(packed, out=out) is out
    assert torch.equal(bits(out), bits(unpack_rows(packed)))
    with pytest.raises(ValueError, match=r"out is torch.float32 \(4, 2, 2, 16\), the packed rows torch.bfloat16"):
        unpack_rows(packed, out=torch.empty(4, 2, 2, 16))


def test_bad_rows_and_bad_packed_parts_are_refused_with_the_value_named() -> None:
    with pytest.raises(TypeError, match="rows must be one of .* got torch.int32"):
        pack_rows(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"rows need a last \(head_dim\) dimension, got shape \(\)"):
        pack_rows(torch.tensor(1.0))
    with pytest.raises(TypeError, match="payload must be torch.float8_e4m3fn, got torch.bfloat16"):
        PackedRows(torch.zeros(2, 4, dtype=torch.bfloat16), torch.ones(2), torch.bfloat16)
    with pytest.raises(ValueError, match=r"scales \(3,\) must be payload \(2, 4\) without its last"):
        PackedRows(torch.zeros(2, 4, dtype=torch.float8_e4m3fn), torch.ones(3), torch.bfloat16)


def test_to_and_a_gpus_pinned_host_copy_keep_every_bit(gen) -> None:
    packed = pack_rows(mixed_rows(gen, 3, 2, 2, 8, dtype=torch.bfloat16))
    moved = packed.to("cpu")
    assert torch.equal(bits(moved.payload), bits(packed.payload)) and moved.dtype == packed.dtype
    if torch.cuda.is_available():
        pinned = packed.to("cuda").host_copy()
        assert pinned.payload.is_pinned() and pinned.scales.is_pinned()
        assert torch.equal(bits(pinned.to("cuda").payload), bits(packed.payload))


def test_host_copy_keeps_every_bit_in_fresh_host_memory_pinned_only_from_a_gpu(gen) -> None:
    packed = pack_rows(mixed_rows(gen, 3, 2, 2, 8, dtype=torch.bfloat16))
    copy = packed.host_copy()
    assert torch.equal(bits(copy.payload), bits(packed.payload)) and torch.equal(copy.scales, packed.scales)
    assert copy.dtype == packed.dtype and copy.device.type == "cpu" and not copy.payload.is_pinned()
    assert copy.payload.data_ptr() != packed.payload.data_ptr()  # a copy, also from the host
    assert copy.scales.data_ptr() != packed.scales.data_ptr()
    if torch.cuda.is_available():
        pinned = packed.to("cuda").host_copy()
        assert pinned.payload.is_pinned() and pinned.scales.is_pinned()
        assert torch.equal(bits(pinned.payload), bits(packed.payload))


# ---- TensorRT-LLM's HND draft pages (the adapter) -----------------------------------------


def hnd_buf(gen: torch.Generator) -> torch.Tensor:
    return poison(gen, 8, 2, 2, 4, 16)  # [pages, 2, Hkv, tpb=4, D]; random bits, NaNs included


def test_gather_packed_rows_equals_gather_then_pack_bit_for_bit(gen) -> None:
    buf = hnd_buf(gen)
    scatter_rows(buf, [7, 5, 2, 0], 3, mixed_rows(gen, 11, 2, 2, 16, dtype=torch.bfloat16))
    fused = gather_packed_rows(buf, [7, 5, 2, 0], 3, 14)
    plain = pack_rows(gather_rows(buf, [7, 5, 2, 0], 3, 14))
    assert torch.equal(bits(fused.payload), bits(plain.payload))
    assert torch.equal(bits(fused.scales), bits(plain.scales)) and fused.dtype == plain.dtype
    assert fused.nbytes == packed_nbytes(11 * 2 * 2, 16)


def test_scatter_packed_rows_equals_unpack_then_scatter_and_writes_only_the_named_slots(gen) -> None:
    buf = hnd_buf(gen)
    before = buf.clone()
    packed = pack_rows(mixed_rows(gen, 11, 2, 2, 16, dtype=torch.bfloat16))
    scatter_packed_rows(buf, [7, 5, 2, 0], 3, packed)  # keys 3..13: page 7 slot 3, pages 5, 2, page 0 slots 0-1
    expect = before.clone()
    scatter_rows(expect, [7, 5, 2, 0], 3, unpack_rows(packed))
    assert torch.equal(bits(buf), bits(expect))
    written = torch.zeros(8, 4, dtype=torch.bool)  # [page, slot]
    written[7, 3] = written[5, :] = written[2, :] = True
    written[0, :2] = True
    keep = ~written[:, None, None, :, None].expand_as(buf)
    assert torch.equal(bits(buf[keep]), bits(before[keep]))
    assert torch.equal(gather_rows(buf, [7, 5, 2, 0], 3, 14), unpack_rows(packed))


def test_scatter_packed_rows_refuses_a_misfit_before_writing(gen) -> None:
    buf = hnd_buf(gen)
    before = buf.clone()
    with pytest.raises(RuntimeError, match="do not fit HND pages"):
        scatter_packed_rows(buf, [3, 4], 0, pack_rows(torch.zeros(2, 2, 3, 16, dtype=torch.bfloat16)))
    with pytest.raises(RuntimeError, match="rows are torch.float32, the pages torch.bfloat16"):
        scatter_packed_rows(buf, [3, 4], 0, pack_rows(torch.zeros(2, 2, 2, 16)))
    with pytest.raises(RuntimeError, match="page 1 is BAD_PAGE_INDEX"):
        scatter_packed_rows(buf, [3, -1], 2, pack_rows(torch.zeros(4, 2, 2, 16, dtype=torch.bfloat16)))
    assert torch.equal(bits(buf), bits(before))


# ---- the reference runtime's pool ---------------------------------------------------------


def filled_pool(gen: torch.Generator, rows: int, device: str = "cpu") -> DrafterKVPool:
    pool = DrafterKVPool(8, 4, 2, 16, RopeConfig(16, 4, 1e6), dtype=torch.bfloat16, device=device)
    pool.allocate_sequence(1)
    k = torch.randn(rows, 2, 16, generator=gen).to(torch.bfloat16).to(device)
    v = torch.randn(rows, 2, 16, generator=gen).to(torch.bfloat16).to(device)
    pool.append_rows(1, torch.arange(rows), k, v)
    pool.move_to_carried(1, 99)
    return pool


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_pack_blocks_packs_only_live_rows_as_the_gathered_rows(kernel, fp8_tk, gen, device) -> None:
    pool = filled_pool(gen, 10, device)  # 3 blocks, the last with 2 live rows
    pool.k_cache[pool.carried(99).block_table[2], 2:] = float("nan")  # a dead tail is never read
    entry = pool.carried(99)
    packed = pack_blocks(pool.k_cache, pool.v_cache, entry.block_table, entry.rows, kernel=kernel)
    k, v, _ = pool.gather_carried(99)  # [rows, Hkv, D] each
    plain = pack_rows(torch.stack((k, v), dim=1), kernel="torch")
    assert packed.shape == (10, 2, 2, 16)
    assert torch.equal(bits(packed.payload), bits(plain.payload))
    assert torch.equal(bits(packed.scales), bits(plain.scales))
    assert packed.nbytes == packed_nbytes(10 * 2 * 2, 16)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_unpack_blocks_imports_into_fresh_blocks_as_the_rows_unpacked(kernel, fp8_tk, gen, device) -> None:
    pool = filled_pool(gen, 10, device)
    entry = pool.carried(99)
    packed = pack_blocks(pool.k_cache, pool.v_cache, entry.block_table, entry.rows)
    runs = pool.export_carried(99).runs
    pool.free_carried(99)
    k, v = unpack_blocks(packed, pool.block_size, kernel=kernel)
    assert k.shape == v.shape == (3, 4, 2, 16)
    assert int(k[2, 2:].abs().sum()) == 0 and int(v[2, 2:].abs().sum()) == 0  # the tail is zeros
    pool.import_carried(7, HostRows(k, v, 10, runs))
    gk, gv, keys = pool.gather_carried(7)
    rows = unpack_rows(packed)
    assert torch.equal(bits(gk), bits(rows[:, 0])) and torch.equal(bits(gv), bits(rows[:, 1]))
    assert keys.tolist() == list(range(10))
    pool.check()


def test_pack_blocks_refuses_more_rows_than_its_blocks_hold(gen) -> None:
    pool = filled_pool(gen, 10)
    with pytest.raises(ValueError, match=r"rows must be an int in \[0, 8\] for 2 blocks of 4, got 9"):
        pack_blocks(pool.k_cache, pool.v_cache, [0, 1], 9)


# ---- the Triton kernels (interpreted on CPU without a GPU) against the torch path ---------

KERNELS = ["torch", "triton"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_pack_equals_torch_pack_bit_for_bit(dtype, fp8_tk, gen, device) -> None:
    rows = mixed_rows(gen, 9, 2, 3, 64, dtype=dtype).to(device)
    a, b = pack_rows(rows, kernel="torch"), pack_rows(rows, kernel="triton")
    assert torch.equal(bits(a.payload), bits(b.payload)) and torch.equal(bits(a.scales), bits(b.scales))
    assert b.dtype == dtype and b.shape == rows.shape and b.scales.shape == rows.shape[:-1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_unpack_equals_torch_unpack_bit_for_bit(dtype, fp8_tk, gen, device) -> None:
    packed = pack_rows(mixed_rows(gen, 9, 2, 3, 64, dtype=dtype)).to(device)
    a, b = unpack_rows(packed, kernel="torch"), unpack_rows(packed, kernel="triton")
    assert torch.equal(bits(a), bits(b))


def test_triton_rounds_every_e4m3_tie_and_carry_as_torch(fp8_tk, device) -> None:
    # every code's value, the midpoints between neighbours (ties) and just either side of them,
    # as one vector of amax 448 (scale 1): carries across exponents, subnormals, signs
    codes = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()  # 0 .. 448
    mids = (codes[1:] + codes[:-1]) / 2
    vals = torch.cat([codes, mids, mids.nextafter(torch.tensor(0.0, dtype=torch.float64)),
                      mids * (1 + 2.0**-20), torch.tensor([FP8_MAX])])
    vals = torch.cat([vals, -vals]).float()
    rows = torch.stack([vals, vals / 3, vals * 2.0**-120])  # scales 1, 1/3, the floor
    a, b = pack_rows(rows.to(device), kernel="torch"), pack_rows(rows.to(device), kernel="triton")
    assert torch.equal(bits(a.payload), bits(b.payload)) and torch.equal(bits(a.scales), bits(b.scales))


def test_triton_packs_and_unpacks_strided_views(fp8_tk, gen, device) -> None:
    wide = mixed_rows(gen, 6, 3, 80, dtype=torch.bfloat16).to(device)
    rows = wide[:, 1:, 8:72]  # vectors at row stride 240, head stride 80
    a, b = pack_rows(rows, kernel="torch"), pack_rows(rows, kernel="triton")
    assert torch.equal(bits(a.payload), bits(b.payload)) and torch.equal(bits(a.scales), bits(b.scales))
    out = poison(gen, 6, 3, 80, device=device)
    before = out.clone()
    unpack_rows(b, out=out[:, 1:, 8:72], kernel="triton")
    expect = before.clone()
    expect[:, 1:, 8:72] = unpack_rows(a, kernel="torch")
    assert torch.equal(bits(out), bits(expect))


def test_triton_non_finite_vectors_get_a_nan_scale_and_unpack_to_nan(fp8_tk, device) -> None:
    rows = torch.tensor([[1.0, float("inf"), 2.0], [float("nan"), 1.0, 0.0], [-float("inf"), 0.0, 0.0],
                         [1.0, 2.0, 4.0]], dtype=torch.bfloat16, device=device)
    for kernel in KERNELS:
        packed = pack_rows(rows, kernel=kernel)
        assert bool(torch.isnan(packed.scales[:3]).all()), kernel
        for unpack_kernel in KERNELS:
            out = unpack_rows(packed, kernel=unpack_kernel)
            assert bool(torch.isnan(out[:3]).all()) and out[3].tolist() == [1.0, 2.0, 4.0]


@pytest.mark.parametrize("nan_bits", [0x7FC00000, 0x7FFFFFFF, -1])  # x86's NaN, a GPU's, 0xFFFFFFFF
def test_a_nan_scale_of_any_encoding_unpacks_to_all_nan_in_every_output_dtype(fp8_tk, device,
                                                                            nan_bits) -> None:
    # A GPU's canonical NaN (0x7FFFFFFF, what `q * scale` gives there with a NaN scale) once
    # overflowed the int32 round-to-bf16 trick to 0x80007FFF, unpacking as -0.0 (seen on an H200).
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        rows = torch.tensor([[1.0, -2.0, 0.0, 4.0], [1.0, 2.0, 4.0, 8.0]], dtype=dtype, device=device)
        packed = pack_rows(rows, kernel="torch")
        scales = packed.scales.clone()
        scales.view(torch.int32)[0] = nan_bits
        packed = PackedRows(packed.payload, scales, dtype)
        for kernel in KERNELS:
            out = unpack_rows(packed, kernel=kernel)
            assert bool(torch.isnan(out[0]).all()), (kernel, dtype, out[0].tolist())
            assert out[1].tolist() == [1.0, 2.0, 4.0, 8.0], (kernel, dtype)


def test_triton_gather_packed_rows_equals_torch_bit_for_bit(fp8_tk, gen, device) -> None:
    buf = hnd_buf(gen)
    scatter_rows(buf, [7, 5, 2, 0], 3, mixed_rows(gen, 11, 2, 2, 16, dtype=torch.bfloat16))
    buf = buf.to(device)
    a = gather_packed_rows(buf, [7, 5, 2, 0], 3, 14, kernel="torch")
    b = gather_packed_rows(buf, [7, 5, 2, 0], 3, 14, kernel="triton")
    assert torch.equal(bits(a.payload), bits(b.payload)) and torch.equal(bits(a.scales), bits(b.scales))


def test_triton_scatter_packed_rows_equals_torch_and_writes_only_the_named_slots(fp8_tk, gen, device) -> None:
    buf = hnd_buf(gen).to(device)
    before = buf.clone()
    packed = pack_rows(mixed_rows(gen, 11, 2, 2, 16, dtype=torch.bfloat16))
    scatter_packed_rows(buf, [7, 5, 2, 0], 3, packed, kernel="triton")  # packed on CPU: moved
    expect = before.clone()
    scatter_packed_rows(expect, [7, 5, 2, 0], 3, packed, kernel="torch")
    assert torch.equal(bits(buf), bits(expect))
    written = torch.zeros(8, 4, dtype=torch.bool)
    written[7, 3] = written[5, :] = written[2, :] = True
    written[0, :2] = True
    keep = ~written[:, None, None, :, None].expand(buf.shape).to(device)
    assert torch.equal(bits(buf[keep]), bits(before[keep]))


def test_bench_row_format_prints_every_operation_against_the_copy() -> None:
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_row_format.py"
    proc = subprocess.run([sys.executable, str(script), "--keys", "40", "--reps", "3", "--warmup", "1",
                           "--tokens-per-block", "8", "--pool-block-size", "16", "--entry-rows", "512"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "rows [40, 2, 2, 256] bf16 = 0.08 MiB; packed 0.04 MiB (0.508x)" in lines[1]
    table = lines[3:lines.index("")]
    ops = [line.split()[0] for line in table]
    assert ops == ["copy", "pack_rows", "unpack_rows", "gather_rows", "gather_packed", "scatter_rows",
                   "scatter_packed", "select_blocks", "pack_blocks", "unpack_blocks"]
    assert lines[3].endswith("1.00 [1.00, 1.00]")  # the copy against itself
    entry = lines[lines.index("") + 1:]
    assert entry[0].startswith("reference runtime fp8 entry of 512 rows (1.00 MiB bf16)")
    assert [line.split()[0] for line in entry[2:5]] == ["copy", "deposit", "adoption"]
    figures = [line.split("\t") for line in lines if line.startswith("FIGURE\t")]
    assert [f[1] for f in figures] == [f"fp8 {op}/copy at 40 keys" for op in (
        "pack_rows", "unpack_rows", "gather_packed", "scatter_packed", "pack_blocks", "unpack_blocks")] + [
        "fp8 deposit at 512 rows", "fp8 adoption at 512 rows"]
    assert all(len(f) == 5 and f[4] == "INFO" for f in figures)  # CPU: the targets are a GPU's
    assert [f[3] for f in figures] == ["<= 2.0x copy"] * 6 + ["<= 0.1 ms"] * 2
    assert not [line for line in lines if line.startswith("CHECK\t")]  # no Triton FP8 kernels on a CPU


def test_bench_row_format_checks_pass_for_the_triton_kernels_against_torch(fp8_tk, device) -> None:
    # the CHECK lines the script prints on a GPU, run here under the interpreter
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_row_format.py"
    spec = importlib.util.spec_from_file_location("bench_row_format", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lines = bench.bit_checks(torch.device(device), 2, 16)
    assert len(lines) == 9
    assert all(line.split("\t")[0] == "CHECK" and line.split("\t")[2] == "PASS" for line in lines), lines


def test_bench_row_format_extent_checks_pass_and_fail_on_a_corrupt_row_or_a_byte_outside(device, monkeypatch) -> None:
    # the extent CHECK lines the script prints on a GPU (every codec's gather into an arena extent),
    # run here on this process's device; then two gathers that go wrong must each FAIL their line
    from trtllm_mtp_carry.dataplane.row_codec import Nvfp4KvPagesCodec, PoolRowsCodec

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_row_format.py"
    spec = importlib.util.spec_from_file_location("bench_row_format", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    lines = bench.extent_checks(torch.device(device), 2, 32)
    names = [line.split("\t")[1] for line in lines]
    assert names == [f"{c} gather_pages into an arena extent" for c in
                     ("bf16", "fp8", "nvfp4", "fp8_kv", "nvfp4_kv", "nvfp4+position+index_k", "latent bf16",
                      "latent fp8_kv", "fp8_ds_mla", "fp8_ds_mla, writer pages of tpb / 4")] + \
        [f"{c} gather_blocks into an arena extent" for c in ("bf16", "fp8", "nvfp4", "fp8_kv")]
    assert all(line.split("\t")[2] == "PASS" for line in lines), lines

    kv_gather, rows_gather = Nvfp4KvPagesCodec.gather_pages, PoolRowsCodec.gather_blocks

    def corrupt_row(self, buf, pages, lo, hi, out=None):  # one payload byte of row 5 flipped
        rows = kv_gather(self, buf, pages, lo, hi, out=out)
        if out is not None:
            out.payload[5, 1, 0, 3] ^= 0x10
        return rows

    def stray_byte(self, k_cache, v_cache, block_ids, rows, out=None):  # the byte before the extent written
        got = rows_gather(self, k_cache, v_cache, block_ids, rows, out=out)
        if out is not None:
            whole = torch.empty(0, dtype=torch.uint8, device=out.device).set_(out.untyped_storage())
            whole[out.storage_offset() * out.element_size() - 1] ^= 1
        return got

    monkeypatch.setattr(Nvfp4KvPagesCodec, "gather_pages", corrupt_row)
    monkeypatch.setattr(PoolRowsCodec, "gather_blocks", stray_byte)
    verdicts = {line.split("\t")[1]: line.split("\t")[2] for line in bench.extent_checks(torch.device(device), 2, 32)}
    failed = {name for name, verdict in verdicts.items() if verdict == "FAIL"}
    assert failed == {"nvfp4_kv gather_pages into an arena extent", "bf16 gather_blocks into an arena extent",
                      "fp8_kv gather_blocks into an arena extent"}, verdicts


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_packed_gather_and_scatter_follow_a_permuted_page_view(kernel, fp8_tk, gen, device) -> None:
    # pages stored [pages, tpb, 2, Hkv, D] and viewed HND: strides no longer row-major
    store = poison(gen, 8, 4, 2, 2, 16, device=device)
    buf = store.permute(0, 2, 3, 1, 4)
    assert buf.shape == (8, 2, 2, 4, 16) and not buf.is_contiguous()
    rows = mixed_rows(gen, 6, 2, 2, 16, dtype=torch.bfloat16).to(device)
    before = store.clone()
    packed = pack_rows(rows, kernel="torch")
    scatter_packed_rows(buf, [6, 1, 3], 2, packed, kernel=kernel)  # keys 2..7: page 6 slots 2-3, page 1
    expect = before.permute(0, 2, 3, 1, 4).clone()
    scatter_rows(expect, [6, 1, 3], 2, unpack_rows(packed, kernel="torch"))
    assert torch.equal(bits(buf), bits(expect))
    again = gather_packed_rows(buf, [6, 1, 3], 2, 8, kernel=kernel)
    plain = pack_rows(gather_rows(buf, [6, 1, 3], 2, 8), kernel="torch")
    assert torch.equal(bits(again.payload), bits(plain.payload))
    assert torch.equal(bits(again.scales), bits(plain.scales))


# ---- division as CUDA computes it: the scale is `amax / 448` correctly rounded everywhere ----
#
# aten's CUDA true division, when the divisor is a CPU scalar (a Python number or a 0-dim CPU
# tensor; `TensorIterator::is_cpu_scalar`), computes `a * (1 / b)` with the reciprocal rounded
# first (`div_true_kernel_cuda` in aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu); by any
# other tensor it is IEEE division, one rounding. CPU always divides. So a CPU run cannot see a
# `t.div_(448.0)` that is an ulp off on a GPU; `CudaScalarDivision` makes a CPU run compute
# every division by a scalar the way CUDA's kernel does, and `ScalarDivisions` lists them.

_DIVISIONS = {"div", "div_", "true_divide", "true_divide_", "__truediv__", "__itruediv__"}


def _scalar_divisor(func, args, kwargs) -> float | None:
    """The divisor of a true division by a CPU scalar (CUDA's reciprocal path), else None."""
    if getattr(func, "__name__", "") not in _DIVISIONS or kwargs.get("rounding_mode") is not None:
        return None
    a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other")
    if not isinstance(a, torch.Tensor) or not a.is_floating_point():
        return None
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        return float(b)
    if isinstance(b, torch.Tensor) and b.dim() == 0 and b.device.type == "cpu":
        return float(b)
    return None


class CudaScalarDivision(torch.overrides.TorchFunctionMode):
    """On CPU tensors, divide by a CPU scalar as CUDA does: `a * inv_b`, `inv_b = opmath(1) / opmath(b)`."""

    def __init__(self) -> None:
        super().__init__()
        self.emulated = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        b = _scalar_divisor(func, args, kwargs)
        if b is None:
            return func(*args, **kwargs)
        a = args[0]
        opmath = torch.float64 if a.dtype == torch.float64 else torch.float32
        inv_b = torch.ones((), dtype=opmath) / torch.tensor(b, dtype=opmath)  # rounded once, as on the host
        out = (a.to(opmath) * inv_b).to(a.dtype)
        self.emulated += 1
        if getattr(func, "__name__", "").endswith("_"):
            return a.copy_(out)
        return out


class ScalarDivisions(torch.overrides.TorchFunctionMode):
    """Records every true division of a floating tensor by a CPU scalar (what CUDA computes as a product)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        b = _scalar_divisor(func, args, kwargs)
        if b is not None:
            self.seen.append(f"{func.__name__}(..., {b})")
        return func(*args, **kwargs)


def reciprocal_trap_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 rows `[n, 2, 1, 4]` whose amax `a` has `a * fl(1/448) != fl(a / 448)`, and those
    exact scales (float64 quotient rounded once to float32: exact, 53 >= 2 * 24 + 2 bits)."""
    a = (1.0 + torch.arange(1, 4097, dtype=torch.float64) * 2.0**-12).float()  # 4,096 mantissas
    a = torch.cat([a * 2.0**e for e in (-40, -3, 0, 7, 60)])
    inv = torch.ones((), dtype=torch.float32) / torch.tensor(FP8_MAX, dtype=torch.float32)
    exact = (a.double() / FP8_MAX).float()
    trap = (a * inv) != exact
    assert int(trap.sum()) > 1000, "the reciprocal product must differ from the quotient for many amaxes"
    a = a[trap][:512]
    rows = torch.zeros(a.numel(), 2, 1, 4)
    rows[:, 0, 0, 1] = -a  # amax on a negative value
    rows[:, 0, 0, 2] = a / 3
    rows[:, 1, 0, 0] = a
    rows[:, 1, 0, 3] = -a / 7
    return rows, (a.double() / FP8_MAX).float().unsqueeze(-1).expand(-1, 2).reshape(-1, 2, 1)


def test_cuda_scalar_division_stand_in_differs_from_the_quotient_on_the_trap_rows() -> None:
    # guards the stand-in itself: without a difference here the next test could not fail
    rows, exact = reciprocal_trap_rows()
    amax = rows.abs().amax(-1)
    with CudaScalarDivision() as mode:
        product = amax / FP8_MAX
    assert mode.emulated == 1
    assert bool((product != exact).all())
    assert torch.equal(amax / FP8_MAX, exact)  # CPU divides: the quotient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_pack_scales_are_the_correctly_rounded_quotient_under_cuda_division(dtype) -> None:
    # guards issue 36's trap: `scales.div_(448.0)` is `amax * fl(1/448)` on CUDA; the torch path
    # must divide by a tensor on the rows' device so its scales are the header's on a GPU too
    rows, _ = reciprocal_trap_rows()
    rows = rows.to(dtype)  # bf16: amaxes of 8 mantissa bits, half of which hit the trap too
    exact = (rows.double().abs().amax(-1) / FP8_MAX).float()
    assert int(((rows.float().abs().amax(-1) * (1 / torch.tensor(FP8_MAX))) != exact).sum()) > 0
    with CudaScalarDivision():
        packed = pack_rows(rows, kernel="torch")
    assert torch.equal(bits(packed.scales), bits(exact))
    assert torch.equal(bits(packed.payload), bits(pack_rows(rows, kernel="torch").payload))


def test_triton_pack_scales_are_the_correctly_rounded_quotient(fp8_tk, device) -> None:
    # the same rows through the Triton kernel (div_rn): the exact quotient, as the torch path gives
    rows, exact = reciprocal_trap_rows()
    a, b = pack_rows(rows.to(device), kernel="torch"), pack_rows(rows.to(device), kernel="triton")
    assert torch.equal(bits(b.scales.cpu()), bits(exact)) and torch.equal(bits(a.scales.cpu()), bits(exact))
    assert torch.equal(bits(a.payload), bits(b.payload))


def test_the_fp8_paths_never_divide_by_a_cpu_scalar(gen) -> None:
    # guards every torch path of the row format (and the pages and blocks around it) against a
    # new `t / float` or `div_(scalar)`: each would be one rounding off on CUDA
    rows = mixed_rows(gen, 9, 2, 2, 16, dtype=torch.bfloat16)
    buf = hnd_buf(gen)
    pool = filled_pool(gen, 10)
    entry = pool.carried(99)
    with ScalarDivisions() as mode:
        packed = pack_rows(rows, kernel="torch")
        unpack_rows(packed, kernel="torch")
        unpack_rows(packed, out=torch.empty_like(rows), kernel="torch")
        scatter_packed_rows(buf, [7, 5, 2, 0], 3, packed, kernel="torch")
        gather_packed_rows(buf, [7, 5, 2, 0], 3, 12, kernel="torch")
        blocks = pack_blocks(pool.k_cache, pool.v_cache, entry.block_table, entry.rows, kernel="torch")
        unpack_blocks(blocks, pool.block_size, kernel="torch")
    assert mode.seen == []
    with ScalarDivisions() as mode:  # the recorder sees what the trap looks like
        _ = rows.float() / FP8_MAX
        rows.float().div_(torch.tensor(FP8_MAX))
    assert mode.seen == [f"div(..., {FP8_MAX})", f"div_(..., {FP8_MAX})"]


# ---- one launch a call: K and V together, addresses computed in the kernel ---------------


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_unpack_into_blocks_writes_the_rows_into_the_named_blocks_only(kernel, fp8_tk, gen, device) -> None:
    k_cache = poison(gen, 8, 4, 2, 16, device=device)
    v_cache = poison(gen, 8, 4, 2, 16, device=device)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    packed = pack_rows(mixed_rows(gen, 10, 2, 2, 16, dtype=torch.bfloat16), kernel="torch").to(device)
    blocks = torch.tensor([5, 2, 7], device=device)  # rows 0-3, 4-7, 8-9 (block 7's slots 2-3 untouched)
    unpack_into_blocks(packed, k_cache, v_cache, blocks, kernel=kernel)
    rows = unpack_rows(packed, kernel="torch")
    expect_k, expect_v = before_k.clone(), before_v.clone()
    for i, b in enumerate([5, 2, 7]):
        n = min(4, 10 - 4 * i)
        expect_k[b, :n], expect_v[b, :n] = rows[4 * i:4 * i + n, 0], rows[4 * i:4 * i + n, 1]
    assert torch.equal(bits(k_cache), bits(expect_k)) and torch.equal(bits(v_cache), bits(expect_v))


def test_carry_in_then_unpack_into_blocks_carries_what_unpack_blocks_then_import_carried_would(gen) -> None:
    pool = filled_pool(gen, 10)
    entry = pool.carried(99)
    packed = pack_blocks(pool.k_cache, pool.v_cache, entry.block_table, entry.rows)
    runs = pool.book.carried_runs(99)
    pool.free_carried(99)
    pool.import_carried(7, HostRows(*unpack_blocks(packed, pool.block_size), 10, runs))
    want = pool.gather_carried(7)
    pool.free_carried(7)
    ids = pool.carry_in(8, 10, runs)
    unpack_into_blocks(packed, pool.k_cache, pool.v_cache, ids)
    held = pool.carried(8)
    got = pool.gather_carried(8)
    assert ids.dtype == torch.int64 and tuple(ids.tolist()) == held.block_table
    assert held.rows == 10 and len(held.block_table) == 3 and pool.book.carried_runs(8) == runs
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got[:2], want[:2], strict=True))
    assert torch.equal(got[2], want[2])
    pool.check()


def test_carry_in_refuses_bad_runs_a_carried_key_and_a_full_pool_and_leaves_the_pool_unchanged(gen) -> None:
    pool = filled_pool(gen, 10)  # 3 of 8 blocks held
    stats = pool.stats()
    with pytest.raises(ValueError, match=r"key runs \[\(0, 5\)\] do not count the 6 rows"):
        pool.carry_in(5, 6, ((0, 5),))
    with pytest.raises(ValueError, match="strictly increasing"):
        pool.carry_in(5, 6, ((0, 3), (2, 3)))
    with pytest.raises(RuntimeError, match="carried entry 99 exists already"):
        pool.carry_in(99, 6, ((0, 6),))
    pool.allocate_sequence(1)
    pool.append_rows(1, range(12), *torch.zeros(2, 12, 2, 16, dtype=torch.bfloat16))  # 3 more blocks
    stats = pool.stats()
    with pytest.raises(PoolExhaustedError, match="needs 6 more blocks.*only 2 of 8 blocks are free and 3 are carried"):
        pool.carry_in(5, 24, ((0, 24),))  # evicting entry 99 would not be enough: nothing is evicted
    assert pool.stats() == stats and pool.carried(5) is None and pool.carried_keys() == (99,)
    pool.check()


def test_triton_packs_a_view_whose_leading_dims_do_not_merge_as_torch(fp8_tk, gen, device) -> None:
    wide = mixed_rows(gen, 3, 4, 3, 5, 24, dtype=torch.bfloat16).to(device)
    rows = wide[:, 1:, 1:, ::2, 4:20]  # four leading dims no two of which merge: a compact copy packs
    assert plain_layout(rows) is None
    a, b = pack_rows(rows, kernel="torch"), pack_rows(rows, kernel="triton")
    assert torch.equal(bits(a.payload), bits(b.payload)) and torch.equal(bits(a.scales), bits(b.scales))
    out = poison(gen, 3, 4, 3, 5, 24, device=device)
    expect = out.clone()
    unpack_rows(b, out=out[:, 1:, 1:, ::2, 4:20], kernel="triton")
    expect[:, 1:, 1:, ::2, 4:20] = unpack_rows(a, kernel="torch")
    assert torch.equal(bits(out), bits(expect))


def test_plain_layout_merges_contiguous_leading_dims() -> None:
    t = torch.empty(5, 2, 3, 64)
    assert plain_layout(t) == VectorLayout(30, 1, 1, 64, 64, 0, 0, 1)
    assert plain_layout(t[:, 1]) == VectorLayout(5, 3, 1, 64, 384, 64, 0, 1)  # [5, 3] at (384, 64)
    assert plain_layout(torch.empty(64)) == VectorLayout(1, 1, 1, 64, 0, 0, 0, 1)


class _Launches:
    """Counts launches of a Triton kernel (`kernel[grid](...)`), delegating to it."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def test_each_packed_move_is_one_launch_with_no_offsets_built_on_the_host(fp8_tk, gen, device,
                                                                          monkeypatch) -> None:
    # guards the per-call overhead issue 36 measured: K and V in one launch, no per-vector offset
    # tensors (arange/index/stack on the host side) built for the kernels
    pack, unpack = _Launches(fp8_tk.fp8_pack_kernel), _Launches(fp8_tk.fp8_unpack_kernel)
    monkeypatch.setattr(fp8_tk, "fp8_pack_kernel", pack)
    monkeypatch.setattr(fp8_tk, "fp8_unpack_kernel", unpack)
    pool = filled_pool(gen, 10, device)
    entry = pool.carried(99)
    buf = hnd_buf(gen).to(device)
    with ScalarDivisions(), _TorchCalls() as calls:
        packed = pack_blocks(pool.k_cache, pool.v_cache, entry.block_table, entry.rows, kernel="triton")
        unpack_blocks(packed, pool.block_size, kernel="triton")
        unpack_into_blocks(packed, pool.k_cache, pool.v_cache, torch.tensor([0, 1, 2], device=device),
                           kernel="triton")
        scatter_packed_rows(buf, [7, 5, 2, 0], 3, packed, kernel="triton")
        gather_packed_rows(buf, [7, 5, 2, 0], 3, 13, kernel="triton")
        pack_rows(packed.payload.float(), kernel="triton")
    assert len(pack.grids) == 3 and len(unpack.grids) == 3
    assert not {"arange", "index_select", "stack", "cat", "repeat_interleave"} & set(calls.names)


class _TorchCalls(torch.overrides.TorchFunctionMode):
    """Names of the torch functions called (host-side work around the kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))
