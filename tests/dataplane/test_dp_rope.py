"""RoPE reference: the module's formula against a float64 evaluation of the convention."""

from __future__ import annotations

import pytest
import torch
from dp_helpers import rand

from trtllm_mtp_carry.dataplane.rope import RopeConfig, apply_rope_reference, rope_inv_freq


def rope_f64(x: torch.Tensor, pos: torch.Tensor, rd: int, theta: float) -> torch.Tensor:
    """The convention in float64: x [n, H, D], pos [n]."""
    xd = x.double()
    out = xd.clone()
    if rd == 0:
        return out
    i = torch.arange(rd // 2, dtype=torch.float64)
    inv = theta ** (-(2 * i) / rd)
    ang = pos.double()[:, None, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    xr = xd[..., :rd]
    rot = torch.cat([-xr[..., rd // 2 :], xr[..., : rd // 2]], -1)
    out[..., :rd] = xr * cos + rot * sin
    return out


def assert_rope_close(out: torch.Tensor, ref64: torch.Tensor) -> None:
    """Within one 16-bit-float ulp (relative) plus a small absolute slack for float32 angles."""
    rtol = 2.0**-7 if out.dtype == torch.bfloat16 else 2.0**-10
    err = (out.double().cpu() - ref64).abs()
    bound = rtol * ref64.abs() + 2e-3
    assert bool((err <= bound).all()), f"max err {float(err.max())}"


@pytest.mark.parametrize("rd", [0, 8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_matches_float64(gen, rd, dtype):
    x = rand(gen, 9, 2, 32, dtype=dtype)
    pos = torch.randint(0, 4000, (9,), generator=gen)
    out = apply_rope_reference(x, pos, rd, 1e7)
    assert out.dtype == dtype and out.shape == x.shape
    assert_rope_close(out, rope_f64(x, pos, rd, 1e7))
    assert torch.equal(out[..., rd:], x[..., rd:])  # pass-through dims are untouched


def test_reference_is_pure_and_per_head_positions(gen):
    x = rand(gen, 3, 2, 16)
    before = x.clone()
    pos = torch.tensor([[1, 2], [3, 4], [5, 6]])
    out = apply_rope_reference(x, pos, 16, 1e4)
    assert torch.equal(x, before)
    for h in range(2):
        assert torch.equal(out[:, h], apply_rope_reference(x[:, h : h + 1], pos[:, h], 16, 1e4)[:, 0])


def test_qwen3_next_config():
    cfg = RopeConfig.for_qwen3_next(256)
    assert (cfg.rotary_dim, cfg.rope_theta) == (64, 1e7)
    inv = rope_inv_freq(64, 1e7)
    assert inv.dtype == torch.float32 and inv.shape == (32,)
    assert float(inv[0]) == 1.0
    assert abs(float(inv[1]) - 1e7 ** (-2 / 64)) < 1e-7


@pytest.mark.parametrize("rd,theta,what", [(3, 1e4, "rotary_dim"), (40, 1e4, "rotary_dim"),
                                           (-2, 1e4, "rotary_dim"), (8, 0.5, "rope_theta")])
def test_bad_rope_settings(rd, theta, what):
    with pytest.raises(ValueError, match=what):
        RopeConfig(32, rd, theta)
    with pytest.raises(ValueError, match=what):
        apply_rope_reference(torch.ones(1, 1, 32), torch.zeros(1, dtype=torch.long), rd, theta)


def test_float_positions_refused():
    with pytest.raises(ValueError, match="positions"):
        apply_rope_reference(torch.ones(1, 1, 8), torch.zeros(1), 8, 1e4)
