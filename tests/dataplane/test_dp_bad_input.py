"""Bad input to the kernels: a ValueError naming the argument, and nothing written.

Run over every implementation: the reference, the Triton launcher and the
custom op (CPU: reference; meta-device arguments: the fake implementation).
"""

from __future__ import annotations

import re

import pytest
import torch
from dp_helpers import IMPLS, append_impl, bits, copy_impl, poison, rand

from trtllm_mtp_carry.dataplane.reference import hidden_row_copy_reference

# Each mutation: (id, function(args dict) -> None mutating it, message fragment).
COPY_BAD = [
    ("dst_dtype", lambda a: a.update(dst=a["dst"].half()), "dtype"),
    ("src_device", lambda a: a.update(src=torch.empty(8, 16, dtype=torch.bfloat16, device="meta")), "device"),
    ("dst_width", lambda a: a.update(dst=a["dst"][:, :12]), "hidden_size"),
    ("src_3d", lambda a: a.update(src=a["src"].view(8, 4, 4)), "src must be 2-D"),
    ("src_cols_strided", lambda a: a.update(src=a["src"].t().contiguous().t()), "src rows must be contiguous"),
    ("src_rows_past", lambda a: a.update(src_row=6), "src rows [6, 9) run past src capacity 8"),
    ("dst_rows_past", lambda a: a.update(dst_row=9), "dst rows [9, 12) run past dst capacity 10"),
    ("neg_src_row", lambda a: a.update(src_row=-1), "src_row must be >= 0"),
    ("neg_dst_row", lambda a: a.update(dst_row=-2), "dst_row must be >= 0"),
    ("neg_n", lambda a: a.update(n=-1), "n must be >= 0"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", COPY_BAD, ids=[b[0] for b in COPY_BAD])
def test_hidden_row_copy_refuses(impl, bad, tk, gen):
    args = {"src": rand(gen, 8, 16), "src_row": 2, "dst": poison(gen, 10, 16), "dst_row": 1, "n": 3}
    _, mutate, msg = bad
    mutate(args)
    dst_before = bits(args["dst"]) if args["dst"].device.type != "meta" else None
    with pytest.raises(ValueError, match=re.escape(msg)):
        copy_impl(impl, tk)(args["src"], args["src_row"], args["dst"], args["dst_row"], args["n"])
    if dst_before is not None:
        assert torch.equal(bits(args["dst"]), dst_before)


def test_hidden_row_copy_refuses_overlap(gen):
    buf = rand(gen, 10, 16)
    with pytest.raises(ValueError, match="overlap"):
        hidden_row_copy_reference(buf, 0, buf, 2, 4)


def _append_args(gen):
    nb, bs, hkv, d = 4, 4, 2, 16
    n = 5
    return {
        "k_new": rand(gen, n, hkv, d), "v_new": rand(gen, n, hkv, d),
        "keys": torch.tensor([3, 4, 7, 8, 20]),
        "k_cache": poison(gen, nb, bs, hkv, d), "v_cache": poison(gen, nb, bs, hkv, d),
        "block_table": torch.tensor([2, 0, 3], dtype=torch.int32),
        "start_row": 2, "rotary_dim": 8, "rope_theta": 1e7,
    }


APPEND_BAD = [
    ("k_dtype", lambda a: a.update(k_new=a["k_new"].half()), "k_new dtype"),
    ("v_shape", lambda a: a.update(v_new=a["v_new"][:, :1]), "v_new must have shape"),
    ("k_rows", lambda a: a.update(k_new=a["k_new"][:4]), "v_new must have shape [n"),
    ("cache_dtype", lambda a: a.update(k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float()),
     "k_cache dtype"),
    ("cache_noncontig", lambda a: a.update(v_cache=a["v_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
     "v_cache must be contiguous"),
    ("keys_float", lambda a: a.update(keys=a["keys"].float()), "keys dtype"),
    ("keys_len", lambda a: a.update(keys=a["keys"][:3]), "keys must have shape [n=5]"),
    ("keys_device", lambda a: a.update(keys=torch.empty(5, dtype=torch.long, device="meta")), "keys device"),
    ("keys_not_increasing", lambda a: a.update(keys=torch.tensor([3, 4, 4, 8, 20])), "strictly increasing"),
    ("keys_decreasing", lambda a: a.update(keys=torch.tensor([9, 4, 5, 8, 20])), "strictly increasing"),
    ("keys_negative", lambda a: a.update(keys=torch.tensor([-1, 4, 5, 8, 20])), "keys must be >= 0"),
    ("table_dtype", lambda a: a.update(block_table=a["block_table"].long()), "block_table must be 1-D int32"),
    ("rows_past_table", lambda a: a.update(start_row=8), "rows [8, 13) run past the block table"),
    ("block_id_range", lambda a: a.update(block_table=torch.tensor([2, 9, 3], dtype=torch.int32)),
     "block id 9"),
    ("neg_start", lambda a: a.update(start_row=-1), "start_row must be >= 0"),
    ("rotary_odd", lambda a: a.update(rotary_dim=7), "rotary_dim"),
    ("rotary_wide", lambda a: a.update(rotary_dim=18), "rotary_dim"),
    ("theta", lambda a: a.update(rope_theta=float("nan")), "rope_theta"),
    # no columns at all (rotary_dim 0 fits): refused as the slow path refuses it, also on the fast one
    ("head_dim_zero", lambda a: a.update({k: a[k][..., :0] for k in ("k_new", "v_new", "k_cache", "v_cache")},
                                         rotary_dim=0), "head_dim must be positive"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", APPEND_BAD, ids=[b[0] for b in APPEND_BAD])
def test_drafter_row_append_refuses(impl, bad, tk, gen):
    args = _append_args(gen)
    _, mutate, msg = bad
    mutate(args)
    before = (bits(args["k_cache"]), bits(args["v_cache"]))
    with pytest.raises(ValueError, match=re.escape(msg)):
        append_impl(impl, tk)(*args.values())
    assert torch.equal(bits(args["k_cache"]), before[0])
    assert torch.equal(bits(args["v_cache"]), before[1])


def test_valid_baseline_args_are_accepted(tk, gen, device):
    """The unmutated arguments above work, so each refusal is due to its one mutation."""
    args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
            for k, v in _append_args(gen).items()}
    tk.drafter_row_append_triton(*args.values())
    tk.hidden_row_copy_triton(rand(gen, 8, 16, device=device), 2, poison(gen, 10, 16, device=device), 1, 3)


@pytest.mark.parametrize("impl", IMPLS)
def test_check_data_false_still_checks_metadata(impl, tk, gen, device):
    """check_data=False skips only content checks (keys, block ids); layout errors still raise."""
    args = _append_args(gen)
    args["k_new"] = args["k_new"].half()
    with pytest.raises(ValueError, match="k_new dtype"):
        append_impl(impl, tk)(*args.values(), False)
    args = _append_args(gen)
    args["start_row"] = 8
    with pytest.raises(ValueError, match="past the block table"):
        append_impl(impl, tk)(*args.values(), False)
    dev = "cpu" if impl == "reference" else device
    args = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in _append_args(gen).items()}
    args["keys"] = torch.tensor([9, 4, 5, 8, 20], device=dev)  # not increasing, but not read
    append_impl(impl, tk)(*args.values(), False)
