"""No Triton compile inside a timed turn: the warm-up launches every kernel variant a session
will use. On CPU: the variants it enumerates cover every `ROWS` the append launcher picks at
any row count; under the interpreter (`force`) each warm-up runs every packing codec (fp8,
nvfp4) on scratch tensors and leaves the session's own pool untouched; without a GPU nothing
is launched."""

from __future__ import annotations

import pytest
import torch
from dp_helpers import bits

from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool
from trtllm_mtp_carry.dataplane.rope import RopeConfig
from trtllm_mtp_carry.dataplane.row_codec import codec_for
from trtllm_mtp_carry.dataplane.warm import (
    append_rows_variants,
    warm_page_kernels,
    warm_pool_kernels,
)


@pytest.mark.parametrize(("heads", "dim", "rot"), [(1, 16, 4), (2, 64, 16), (2, 256, 64), (8, 128, 128)])
def test_the_append_variants_are_every_rows_the_launcher_picks_at_any_row_count(tk, heads, dim, rot):
    picked = {tk.append_blocks_for(n, heads, dim, rot)["ROWS"] for n in range(1, 70_000)}
    assert set(append_rows_variants(heads, dim, rot)) == picked


def test_warming_a_pool_launches_each_variant_on_scratch_blocks_and_leaves_the_pool_as_it_was(tk, gen):
    pool = DrafterKVPool(8, 16, 2, 32, RopeConfig(32, 8, 1e6))
    pool.allocate_sequence(5)
    pool.append_rows(5, torch.arange(20), torch.randn(20, 2, 32, generator=gen).bfloat16(),
                     torch.randn(20, 2, 32, generator=gen).bfloat16())
    before = (pool.k_cache.clone(), pool.v_cache.clone(), pool.num_free_blocks)
    bf16, fp8, nvfp4 = (codec_for(name, torch.bfloat16) for name in ("bf16", "fp8", "nvfp4"))
    assert warm_pool_kernels(pool, fp8) == 0  # the CPU: nothing to compile
    variants = append_rows_variants(2, 32, 8)
    assert warm_pool_kernels(pool, bf16, force=True) == len(variants)  # the appends only
    # each row count: the append, then a gather into and a scatter from each extent alignment
    assert warm_pool_kernels(pool, fp8, force=True) == 5 * len(variants)
    assert warm_pool_kernels(pool, nvfp4, force=True) == 5 * len(variants)
    assert torch.equal(bits(pool.k_cache), bits(before[0])) and torch.equal(bits(pool.v_cache), bits(before[1]))
    assert pool.num_free_blocks == before[2]
    pool.check()


def test_warming_pages_runs_each_packing_codecs_gather_and_scatter_at_both_extent_alignments(tk):
    buf = torch.zeros(6, 2, 2, 8, 32, dtype=torch.bfloat16)  # HND pages [pages, 2, Hkv, tpb, D]
    bf16, fp8, nvfp4 = (codec_for(name, torch.bfloat16) for name in ("bf16", "fp8", "nvfp4"))
    assert warm_page_kernels(buf, fp8) == 0  # the CPU: nothing to compile
    assert warm_page_kernels(buf, fp8, force=True) == 4
    assert warm_page_kernels(buf, nvfp4, force=True) == 4
    assert warm_page_kernels(buf, bf16, force=True) == 0  # torch indexing: nothing to compile
    assert bool((buf == 0).all())  # scratch pages only
