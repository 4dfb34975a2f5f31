"""The custom ops: registered under `trtllm_mtp_carry`, traceable by torch.compile, opcheck-clean."""

from __future__ import annotations

import pytest
import torch
from dp_helpers import bits, poison, rand

from trtllm_mtp_carry.dataplane import ops  # noqa: F401  (registers the ops)
from trtllm_mtp_carry.dataplane.rope import apply_rope_reference


def _append_args(gen):
    return (rand(gen, 3, 2, 16), rand(gen, 3, 2, 16), torch.tensor([4, 5, 9]),
            poison(gen, 3, 4, 2, 16), poison(gen, 3, 4, 2, 16),
            torch.tensor([1, 2], dtype=torch.int32), 2, 8, 1e7)


def test_torch_compile_traces_both_ops(gen):
    def step(src, dst, k, v, keys, kc, vc, bt):
        torch.ops.trtllm_mtp_carry.hidden_row_copy(src, 1, dst, 0, 2)
        torch.ops.trtllm_mtp_carry.drafter_row_append(k, v, keys, kc, vc, bt, 2, 8, 1e7)
        return dst.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    src, dst = rand(gen, 4, 8), poison(gen, 3, 8)
    k, v, keys, kc, vc, bt, *_ = _append_args(gen)
    compiled(src, dst, k, v, keys, kc, vc, bt)
    assert torch.equal(bits(dst[:2]), bits(src[1:3]))
    slots = torch.tensor([1 * 4 + 2, 1 * 4 + 3, 2 * 4 + 0])
    assert torch.equal(bits(vc.view(-1, 2, 16)[slots]), bits(v))
    assert torch.equal(bits(kc.view(-1, 2, 16)[slots]), bits(apply_rope_reference(k, keys + 1, 8, 1e7)))


def test_fake_impls_refuse_bad_shapes_when_tracing(gen):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        src, dst = torch.empty(4, 8, dtype=torch.bfloat16), torch.empty(3, 9, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="hidden_size"):
            torch.ops.trtllm_mtp_carry.hidden_row_copy(src, 0, dst, 0, 2)


def test_opcheck(gen):
    from torch.library import opcheck

    opcheck(torch.ops.trtllm_mtp_carry.hidden_row_copy.default,
            (rand(gen, 4, 8), 1, rand(gen, 3, 8), 0, 2),
            test_utils=("test_schema", "test_faketensor"))
    opcheck(torch.ops.trtllm_mtp_carry.drafter_row_append.default, _append_args(gen),
            test_utils=("test_schema", "test_faketensor"))
