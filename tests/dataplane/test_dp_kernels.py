"""The two kernels: Triton (interpreted on CPU without a GPU) against the plain-torch reference.

Every run draws fresh random inputs; outputs are poisoned first and every byte
outside the written rows must come back unchanged.
"""

from __future__ import annotations

import pytest
import torch
from dp_helpers import IMPLS, append_impl, bits, copy_impl, increasing_keys, poison, rand
from test_dp_rope import assert_rope_close, rope_f64

from trtllm_mtp_carry.dataplane import ops
from trtllm_mtp_carry.dataplane.reference import (
    drafter_row_append_reference,
    hidden_row_copy_reference,
)


def impl_device(name: str, device: str) -> str:
    return "cpu" if name == "reference" else device


# ---- hidden_row_copy ----------------------------------------------------------------------

COPY_CASES = [
    # (src_rows, dst_rows, hidden, src_row, dst_row, n)
    (8, 12, 40, 2, 5, 3),
    (5, 5, 16, 0, 0, 5),  # whole buffer
    (6, 9, 24, 5, 8, 1),  # n = 1, last row of both
    (4, 6, 1100, 1, 2, 2),  # wider than one program's BLOCK
    (12, 14, 1100, 1, 2, 9),  # three row tiles of ROWS=4 (the last holds one row) x two column tiles
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", COPY_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_hidden_row_copy_bit_exact(impl, case, dtype, tk, gen, device):
    dev = impl_device(impl, device)
    s_rows, d_rows, h, s0, d0, n = case
    src = rand(gen, s_rows, h, dtype=dtype, device=dev)
    dst = (torch.randn(d_rows, h, generator=gen) * 1e3).to(dtype).to(dev)  # poison
    before = dst.clone()
    copy_impl(impl, tk)(src, s0, dst, d0, n)
    assert torch.equal(bits(dst[d0 : d0 + n]), bits(src[s0 : s0 + n]))
    assert torch.equal(bits(dst[:d0]), bits(before[:d0]))
    assert torch.equal(bits(dst[d0 + n :]), bits(before[d0 + n :]))


@pytest.mark.parametrize("impl", IMPLS)
def test_hidden_row_copy_strided_rows(impl, tk, gen, device):
    """Row stride larger than the width (views into wider buffers), on both sides."""
    dev = impl_device(impl, device)
    src_big = rand(gen, 7, 64, device=dev)
    dst_big = poison(gen, 9, 50, device=dev)
    before = dst_big.clone()
    src, dst = src_big[:, 8:40], dst_big[:, 3:35]
    copy_impl(impl, tk)(src, 1, dst, 4, 5)
    expect = before.clone()
    expect[4:9, 3:35] = src_big[1:6, 8:40]
    assert torch.equal(bits(dst_big), bits(expect))


def test_hidden_row_copy_triton_equals_reference(tk, gen, device):
    src = rand(gen, 10, 48)
    a = poison(gen, 16, 48)
    b = a.clone().to(device)
    hidden_row_copy_reference(src, 3, a, 7, 6)
    tk.hidden_row_copy_triton(src.to(device), 3, b, 7, 6)
    assert torch.equal(bits(a), bits(b))


# ---- drafter_row_append -------------------------------------------------------------------

APPEND_CASES = [
    # (num_blocks, block_size, hkv, head_dim, rotary_dim, start_row, n, table)
    (6, 4, 2, 32, 8, 3, 7, [4, 1, 3, 0]),  # crosses two block boundaries, partial rotary
    (6, 4, 2, 32, 32, 3, 1, [5, 2]),  # n = 1 into the last slot of a block, full rotary
    (6, 4, 2, 32, 8, 7, 1, [5, 2, 0]),  # n = 1, last slot of the second block
    (5, 4, 3, 16, 0, 0, 4, [2, 4]),  # exactly one block, no rotary, Hkv not a power of two
    (8, 2, 1, 24, 12, 1, 6, [7, 0, 6, 1, 5]),  # head_dim not a power of two
    (4, 8, 2, 256, 64, 6, 3, [1, 3]),  # Qwen3-Next drafter shape: Hkv 2, D 256, rotary 64
    (8, 8, 2, 256, 64, 6, 19, [1, 3, 7, 0]),  # three tiles of ROWS=8 rows, the last partial (3 rows)
]


def _append_inputs(gen, case, dtype, dev, layout="contiguous"):
    nb, bs, hkv, d, rd, start, n, table = case
    if layout == "contiguous":
        k = rand(gen, n, hkv, d, dtype=dtype, device=dev)
        v = rand(gen, n, hkv, d, dtype=dtype, device=dev)
    elif layout == "head_major":  # [Hkv, n, D] transposed: non-contiguous rows
        k = rand(gen, hkv, n, d, dtype=dtype, device=dev).transpose(0, 1)
        v = rand(gen, hkv, n, d, dtype=dtype, device=dev).transpose(0, 1)
    else:  # strided last dim
        k = rand(gen, n, hkv, 2 * d, dtype=dtype, device=dev)[..., ::2]
        v = rand(gen, n, hkv, d + 5, dtype=dtype, device=dev)[..., 5:]
    keys = increasing_keys(gen, n).to(dev)
    k_cache = poison(gen, nb, bs, hkv, d, dtype=dtype, device=dev)
    v_cache = poison(gen, nb, bs, hkv, d, dtype=dtype, device=dev)
    bt = torch.tensor(table, dtype=torch.int32, device=dev)
    return k, v, keys, k_cache, v_cache, bt


def _check_append(case, k, v, keys, k_cache, v_cache, k_before, v_before, theta):
    nb, bs, hkv, d, rd, start, n, table = case
    rows = torch.arange(start, start + n)
    slots = torch.tensor(table)[rows // bs] * bs + rows % bs
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots] = True
    kf, vf = k_cache.cpu().reshape(nb * bs, hkv, d), v_cache.cpu().reshape(nb * bs, hkv, d)
    # No stray writes: every other slot keeps its poison bytes.
    assert torch.equal(bits(kf[~written]), bits(k_before.reshape(nb * bs, hkv, d)[~written]))
    assert torch.equal(bits(vf[~written]), bits(v_before.reshape(nb * bs, hkv, d)[~written]))
    # V and K's pass-through dims are copied bit for bit.
    assert torch.equal(bits(vf[slots]), bits(v.cpu()))
    assert torch.equal(bits(kf[slots][..., rd:]), bits(k.cpu()[..., rd:]))
    # K's rotary dims: within 16-bit-float tolerance of float64 RoPE at key + 1.
    assert_rope_close(kf[slots], rope_f64(k.cpu(), keys.cpu() + 1, rd, theta))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", APPEND_CASES)
def test_drafter_row_append(impl, case, tk, gen, device):
    dev = impl_device(impl, device)
    theta = 1e7
    k, v, keys, kc, vc, bt = _append_inputs(gen, case, torch.bfloat16, dev)
    kb, vb = kc.clone().cpu(), vc.clone().cpu()
    append_impl(impl, tk)(k, v, keys, kc, vc, bt, case[5], case[4], theta)
    _check_append(case, k, v, keys, kc, vc, kb, vb, theta)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("layout", ["head_major", "strided_last"])
def test_drafter_row_append_non_contiguous_inputs(impl, layout, tk, gen, device):
    dev = impl_device(impl, device)
    case = APPEND_CASES[0]
    k, v, keys, kc, vc, bt = _append_inputs(gen, case, torch.bfloat16, dev, layout)
    assert not k.is_contiguous() and not v.is_contiguous()
    kb, vb = kc.clone().cpu(), vc.clone().cpu()
    append_impl(impl, tk)(k, v, keys.int(), kc, vc, bt, case[5], case[4], 1e4)
    _check_append(case, k, v, keys, kc, vc, kb, vb, 1e4)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_drafter_row_append_fp16(impl, tk, gen, device):
    dev = impl_device(impl, device)
    case = APPEND_CASES[1]
    k, v, keys, kc, vc, bt = _append_inputs(gen, case, torch.float16, dev)
    kb, vb = kc.clone().cpu(), vc.clone().cpu()
    append_impl(impl, tk)(k, v, keys, kc, vc, bt, case[5], case[4], 1e6)
    _check_append(case, k, v, keys, kc, vc, kb, vb, 1e6)


def test_triton_append_matches_reference_closely(tk, gen, device):
    """Same inputs through both: V bit-exact, K within one bf16 ulp of each other."""
    case = (8, 4, 2, 64, 16, 2, 9, [3, 7, 1, 0, 6])
    k, v, keys, kc, vc, bt = _append_inputs(gen, case, torch.bfloat16, "cpu")
    kc2, vc2 = kc.clone().to(device), vc.clone().to(device)
    drafter_row_append_reference(k, v, keys, kc, vc, bt, 2, 16, 1e7)
    to = [t.to(device) for t in (k, v, keys)]
    tk.drafter_row_append_triton(*to, kc2, vc2, bt.to(device), 2, 16, 1e7)
    assert torch.equal(bits(vc), bits(vc2))
    kc, kc2 = kc.float(), kc2.float().cpu()
    same = (kc == kc2) | (torch.isnan(kc) & torch.isnan(kc2))
    close = (kc - kc2).abs() <= 2.0**-7 * kc.abs()
    assert bool((same | close).all())


def test_ops_are_registered():
    assert hasattr(torch.ops.trtllm_mtp_carry, "hidden_row_copy")
    assert hasattr(torch.ops.trtllm_mtp_carry, "drafter_row_append")
    assert ops.hidden_row_copy is not None


def test_triton_append_without_data_checks_skips_rows_of_out_of_range_blocks(tk, gen, device):
    """check_data=False reads no block ids on the host: the kernel itself skips a row whose
    block id is outside [0, num_blocks), so a bad table never becomes a stray write."""
    case = (6, 4, 2, 32, 8, 3, 7, [4, 9, 3, -2])  # rows 3..9: block ids 4 | 9 (bad) | 3 (row 9)
    k, v, keys, kc, vc, bt = _append_inputs(gen, case, torch.bfloat16, device)
    kb, vb = kc.clone().cpu(), vc.clone().cpu()
    tk.drafter_row_append_triton(k, v, keys, kc, vc, bt, 3, 8, 1e7, False)
    kf, vf = kc.cpu().view(-1, 2, 32), vc.cpu().view(-1, 2, 32)
    good_rows = [3, 8, 9]  # row 3 -> block 4 slot 3; rows 8, 9 -> block 3 slots 0, 1
    slots = [4 * 4 + 3, 3 * 4 + 0, 3 * 4 + 1]
    written = torch.zeros(6 * 4, dtype=torch.bool)
    written[slots] = True
    assert torch.equal(bits(vf[slots]), bits(v.cpu()[[r - 3 for r in good_rows]]))
    assert torch.equal(bits(vf[~written]), bits(vb.view(-1, 2, 32)[~written]))
    assert torch.equal(bits(kf[~written]), bits(kb.view(-1, 2, 32)[~written]))


def test_rope_table_is_cached_per_device_not_rebuilt_per_call(device):
    from trtllm_mtp_carry.dataplane.rope import rope_inv_freq, rope_kernel_table

    a = rope_inv_freq(64, 1e7, device)
    assert rope_inv_freq(64, 1e7, device) is a
    assert rope_kernel_table(64, 1e7, device) is a
    z = rope_kernel_table(0, 1e7, device)
    assert z is rope_kernel_table(0, 1e7, device) and z.tolist() == [0.0]
