"""The ABI kernels' math (Triton, interpreted on CPU without a GPU) against the torch references.

They are launched exactly as TensorRT would: ABI parameter order, row offsets
in one-element int32 tensors, the launch rule's grid. Outputs are poisoned
first; every byte outside the written rows must come back unchanged, and rows
whose destination is out of range are skipped.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_mtp_carry.dataplane.reference import (
    drafter_row_append_reference,
    hidden_row_copy_reference,
)
from trtllm_mtp_carry.dataplane.rope import rope_inv_freq
from trtllm_mtp_carry.kernels import abi


def rand(gen, *shape, dtype=torch.bfloat16, device="cpu"):
    x = torch.randn(*shape, generator=gen).to(dtype)
    x[x == 0] = 0.5
    return x.to(device)


def poison(gen, *shape, dtype=torch.bfloat16, device="cpu"):
    bits = torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16)
    return bits.view(dtype).to(device)


def raw(t):
    return t.contiguous().cpu().view(torch.int16)


def run_copy(ak, src, dst, dst_row, device):
    n, hidden = src.shape
    launch = abi.copy_launch(n, hidden)
    row = torch.tensor([dst_row], dtype=torch.int32, device=device)
    ak.hidden_row_copy_abi[launch.grid](
        src, row, dst, src.stride(0), dst.stride(0), hidden, dst.shape[0], dst,
        BLOCK=abi.COPY_BLOCK)


@pytest.mark.parametrize("hidden", [40, 1100])  # one partial tile; two tiles, the last partial
def test_copy_abi_kernel_is_bit_exact_and_leaves_other_rows(ak, gen, device, hidden):
    src = rand(gen, 5, hidden, device=device)
    dst = poison(gen, 11, hidden, device=device)
    ref = dst.cpu().clone()
    hidden_row_copy_reference(src.cpu(), 0, ref, 4, 5)
    run_copy(ak, src, dst, 4, device)
    assert torch.equal(raw(dst), raw(ref))


def test_copy_abi_kernel_skips_rows_past_capacity_and_negative_offsets(ak, gen, device):
    src = rand(gen, 4, 24, device=device)
    dst = poison(gen, 6, 24, device=device)
    before = dst.cpu().clone()
    run_copy(ak, src, dst, 4, device)  # rows 4, 5 written; 6, 7 would run past capacity
    assert torch.equal(raw(dst[4:]), raw(src[:2]))
    assert torch.equal(raw(dst[:4]), raw(before[:4]))
    dst2 = poison(gen, 6, 24, device=device)
    before2 = dst2.cpu().clone()
    run_copy(ak, src, dst2, -1, device)
    assert torch.equal(raw(dst2), raw(before2))


def run_append(ak, k_new, v_new, keys, k_cache, v_cache, table, start_row, rd, theta, device):
    n, hkv, hd = k_new.shape
    num_blocks, page = k_cache.shape[:2]
    inv = rope_inv_freq(rd, theta, device) if rd else torch.zeros(1, device=device)
    bh, bd = abi.append_block_shape(hkv, hd)
    launch = abi.append_launch(n)
    start = torch.tensor([start_row], dtype=torch.int32, device=device)
    ak.drafter_row_append_abi[launch.grid](
        k_new, v_new, keys.to(torch.int32), table, inv, start, k_cache, v_cache,
        hkv, hd, page, rd, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        table.shape[0], num_blocks, k_cache, v_cache, BLOCK_H=bh, BLOCK_D=bd)


def close_16bit(out, ref):
    rtol = 2.0**-7 if out.dtype == torch.bfloat16 else 2.0**-10
    err = (out.double().cpu() - ref.double().cpu()).abs()
    return bool((err <= rtol * ref.double().cpu().abs() + 2e-3).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [
    # (n, hkv, head_dim, rotary_dim, page, start_row): n not a multiple of page, mid-block start
    (7, 2, 32, 8, 4, 3),
    (5, 3, 40, 40, 8, 0),  # padded heads (4) and columns (64); full rotary
    (3, 1, 16, 0, 2, 5),   # no rotary
])
def test_append_abi_kernel_matches_reference_on_a_scattered_table(ak, gen, device, dtype, case):
    n, hkv, hd, rd, page, start = case
    num_blocks = 9
    k_new, v_new = rand(gen, n, hkv, hd, dtype=dtype), rand(gen, n, hkv, hd, dtype=dtype)
    keys = torch.randint(1, 4, (n,), generator=gen).cumsum(0) + 10
    table = torch.randperm(num_blocks, generator=gen)[:6].to(torch.int32)
    k_cache = poison(gen, num_blocks, page, hkv, hd, dtype=dtype)
    v_cache = poison(gen, num_blocks, page, hkv, hd, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    drafter_row_append_reference(k_new, v_new, keys, k_ref, v_ref, table, start, rd, 1e4)
    dev = [t.to(device) for t in (k_new, v_new, keys, k_cache, v_cache, table)]
    run_append(ak, *dev[:5], dev[5], start, rd, 1e4, device)
    k_out, v_out = dev[3].cpu(), dev[4].cpu()
    assert torch.equal(raw(v_out), raw(v_ref))  # V rows and every untouched slot
    assert torch.equal(raw(k_out[..., rd:]), raw(k_ref[..., rd:]))
    rows = torch.arange(start, start + n)
    slots = table.long()[rows // page] * page + rows % page
    kf, kr = k_out.view(-1, hkv, hd), k_ref.view(-1, hkv, hd)
    assert close_16bit(kf[slots, :, :rd], kr[slots, :, :rd])
    other = torch.ones(kf.shape[0], dtype=torch.bool)
    other[slots] = False
    assert torch.equal(raw(kf[other]), raw(kr[other]))


def test_append_abi_kernel_skips_rows_with_bad_blocks_or_past_the_table(ak, gen, device):
    n, hkv, hd, page = 6, 1, 16, 2
    k_new, v_new = rand(gen, n, hkv, hd), rand(gen, n, hkv, hd)
    keys = torch.arange(n)
    table = torch.tensor([1, 7, 0], dtype=torch.int32)  # block 7 does not exist (num_blocks 3)
    k_cache, v_cache = poison(gen, 3, page, hkv, hd), poison(gen, 3, page, hkv, hd)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    dev = [t.to(device) for t in (k_new, v_new, keys, k_cache, v_cache, table)]
    run_append(ak, *dev[:5], dev[5], 1, 0, 1e4, device)  # rows 1..6: table covers rows < 6
    v_out = dev[4].cpu()
    # row 1 -> block 1 slot 1; rows 2, 3 -> block 7 (skipped); rows 4, 5 -> block 0; row 6 past table
    assert torch.equal(raw(v_out[1, 1]), raw(v_new[0]))
    assert torch.equal(raw(v_out[0, 0]), raw(v_new[3])) and torch.equal(raw(v_out[0, 1]), raw(v_new[4]))
    assert torch.equal(raw(v_out[1, 0]), raw(before_v[1, 0]))
    assert torch.equal(raw(v_out[2]), raw(before_v[2]))
    assert torch.equal(raw(dev[3].cpu()[2]), raw(before_k[2]))
