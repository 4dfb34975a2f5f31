"""HybridLM: recurrent forms agree, chunked target forward == token by token, drafter
split path == dense path, and the shipped weights load deterministically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trtllm_mtp_carry.engine import model as M
from trtllm_mtp_carry.engine.model import (
    DenseTargetCache,
    HybridConfig,
    _rope,
    gated_delta_chunked,
    gated_delta_step,
    init_random,
    load_reference,
)

F64 = torch.float64


def small_cfg(**kw) -> HybridConfig:
    base = dict(vocab_size=264, hidden_size=32, num_layers=4,
                layer_types=["linear", "full", "linear", "full"], num_heads=4, num_kv_heads=2,
                head_dim=16, intermediate_size=48, linear_num_heads=2, linear_key_dim=8,
                linear_value_dim=8, linear_chunk_size=8)
    base.update(kw)
    return HybridConfig(**base)


def small_model(seed: int = 0, **kw) -> M.HybridLM:
    m = init_random(small_cfg(**kw), seed).to(F64).eval()
    with torch.no_grad():  # larger weights than init so that every term matters
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(10)
    return m


def test_config_json_round_trip_and_errors():
    cfg = small_cfg()
    assert HybridConfig.from_json(cfg.to_json()) == cfg
    assert cfg.rotary_dim == 4
    with pytest.raises(ValueError, match="num_layers=3"):
        small_cfg(num_layers=3)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        small_cfg(num_kv_heads=3)
    with pytest.raises(ValueError, match="'mamba'"):
        small_cfg(layer_types=["linear", "mamba", "linear", "full"])


def test_rope_matches_the_reference_formula():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 16, generator=g, dtype=F64)
    pos = torch.tensor([0, 1, 7, 100, 4096])
    rd, theta = 4, 1e7
    out = _rope(x, pos, rd, theta)
    inv = theta ** (-(2 * torch.arange(rd // 2, dtype=F64)) / rd)
    ang = pos.to(F64)[:, None] * inv
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    y = x[..., :rd]
    rot = torch.cat([-y[..., rd // 2:], y[..., :rd // 2]], -1)
    torch.testing.assert_close(out[..., :rd], y * cos + rot * sin, rtol=0, atol=1e-12)
    assert torch.equal(out[..., rd:], x[..., rd:])
    assert torch.equal(out[0], x[0])  # position 0 is the identity
    assert _rope(x.float(), pos, rd, theta).dtype == torch.float32


@pytest.mark.parametrize("T,chunk", [(1, 4), (13, 4), (16, 8), (40, 64)])
def test_gated_delta_chunked_equals_step(T, chunk):
    g = torch.Generator().manual_seed(T)
    B, Hh, Dk, Dv = 2, 3, 8, 5
    q = torch.randn(B, T, Hh, Dk, generator=g, dtype=F64)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hh, Dk, generator=g, dtype=F64), dim=-1)
    v = torch.randn(B, T, Hh, Dv, generator=g, dtype=F64)
    gl = -torch.rand(B, T, Hh, generator=g, dtype=F64) * 2
    beta = torch.rand(B, T, Hh, generator=g, dtype=F64)
    s0 = torch.randn(B, Hh, Dk, Dv, generator=g, dtype=F64)
    o, s = gated_delta_chunked(q, k, v, gl, beta, s0, chunk)
    st, outs = s0, []
    for t in range(T):
        ot, st = gated_delta_step(q[:, t], k[:, t], v[:, t], gl[:, t], beta[:, t], st)
        outs.append(ot)
    torch.testing.assert_close(o, torch.stack(outs, 1), rtol=0, atol=1e-10)
    torch.testing.assert_close(s, st, rtol=0, atol=1e-10)


def test_linear_layer_forms_agree():
    m = small_model()
    layer = m.layers[0].mixer
    x = torch.randn(1, 21, 32, generator=torch.Generator().manual_seed(3), dtype=F64)
    assert layer.state_size() == 2 * 8 * 8 + 3 * 2 * (8 + 8 + 8)  # matrix + conv window
    s0 = torch.randn(1, layer.state_size(), generator=torch.Generator().manual_seed(4), dtype=F64)
    oc, sc = layer(x, s0, form="chunked")
    os_, ss = layer(x, s0, form="step")
    torch.testing.assert_close(oc, os_, rtol=0, atol=1e-10)
    torch.testing.assert_close(sc, ss, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="'loop'"):
        layer(x, s0, form="loop")


def test_no_conv_layer_forms_agree():
    m = small_model(linear_conv_kernel=0)
    layer = m.layers[0].mixer
    assert layer.state_size() == 2 * 8 * 8
    x = torch.randn(1, 11, 32, generator=torch.Generator().manual_seed(3), dtype=F64)
    oc, sc = layer(x, None, form="chunked")
    os_, ss = layer(x, None, form="step")
    torch.testing.assert_close(oc, os_, rtol=0, atol=1e-10)
    torch.testing.assert_close(sc, ss, rtol=0, atol=1e-10)


def test_ssm_trace_holds_the_state_after_each_token():
    m = small_model()
    tokens = torch.randint(0, 264, (15,), generator=torch.Generator().manual_seed(9))
    traced = DenseTargetCache(m.cfg)
    m.forward_target(tokens[:10], 0, traced)
    m.forward_target(tokens[10:], 10, traced, ssm_trace=True)
    for n in range(11, 16):
        ref = DenseTargetCache(m.cfg)
        m.forward_target(tokens[:n], 0, ref)
        for i in (0, 2):
            torch.testing.assert_close(traced.ssm_traces[i][n - 11], ref.ssm_state(i),
                                       rtol=0, atol=1e-9)


def _run(m, tokens, pieces):
    cache, hs, ls, pos = DenseTargetCache(m.cfg), [], [], 0
    for n in pieces:
        h, lg = m.forward_target(tokens[pos:pos + n], pos, cache)
        hs.append(h)
        ls.append(lg)
        pos += n
    return torch.cat(hs), torch.cat(ls), cache


def test_forward_target_whole_equals_pieces_equals_token_by_token():
    m = small_model()
    tokens = torch.randint(0, 264, (37,), generator=torch.Generator().manual_seed(5))
    h1, l1, c1 = _run(m, tokens, [37])
    h2, l2, c2 = _run(m, tokens, [5, 1, 17, 3, 11])
    h3, l3, c3 = _run(m, tokens, [1] * 37)
    for h, lg in ((h2, l2), (h3, l3)):
        torch.testing.assert_close(h, h1, rtol=0, atol=1e-9)
        torch.testing.assert_close(lg, l1, rtol=0, atol=1e-9)
    assert c1.num_tokens == c2.num_tokens == c3.num_tokens == 37
    for a, b in zip(c1.snapshot_ssm(), c3.snapshot_ssm(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
    # the batched training path computes the same function
    torch.testing.assert_close(m.forward_train(tokens[None])[0], h1, rtol=0, atol=1e-9)
    assert h1.shape == (37, 32) and l1.shape == (37, 264)


def test_forward_target_checks_start_pos_and_snapshot_restore():
    m = small_model()
    tokens = torch.randint(0, 264, (12,), generator=torch.Generator().manual_seed(6))
    cache = DenseTargetCache(m.cfg)
    m.forward_target(tokens[:8], 0, cache)
    with pytest.raises(ValueError, match="start_pos=3 but the cache holds 8"):
        m.forward_target(tokens[8:], 3, cache)
    snap = cache.snapshot_ssm()
    _, la = m.forward_target(tokens[8:], 8, cache)
    cache.truncate(8)
    cache.restore_ssm(snap)
    _, lb = m.forward_target(tokens[8:], 8, cache)
    assert torch.equal(la, lb)


def test_drafter_split_path_equals_dense_and_training_path():
    m = small_model()
    d, c = m.drafter, m.cfg
    L = 19
    tokens = torch.randint(0, 264, (L,), generator=torch.Generator().manual_seed(7))
    hidden, _ = m.forward_target(tokens, 0, DenseTargetCache(c))
    dense = d.forward_dense(tokens, hidden)
    assert dense.shape == (L - 1, 264)
    torch.testing.assert_close(d.forward_train(tokens[None], hidden[None])[0], dense,
                               rtol=0, atol=1e-9)
    # rows written one key at a time into a pool, each key finished over the rows so far
    k_rows, v_rows, out = [], [], []
    for key in range(L - 1):
        kt = torch.tensor([key])
        x = d.project(tokens[key + 1:key + 2], hidden[key:key + 1])
        q, k, v = d.qkv(x, kt)
        k_rows.append(_rope(k, kt + 1, c.rotary_dim, c.rope_theta))
        v_rows.append(v)
        _, lg = d.finish(x, q, torch.cat(k_rows), torch.cat(v_rows), torch.arange(key + 1), kt)
        out.append(lg)
    torch.testing.assert_close(torch.cat(out), dense, rtol=0, atol=1e-9)


def test_drafter_rows_are_compacted_and_masked_by_key():
    """Rows may skip keys (compacted); a query only sees rows with key <= its own."""
    m = small_model()
    d, c = m.drafter, m.cfg
    tokens = torch.randint(0, 264, (12,), generator=torch.Generator().manual_seed(8))
    hidden, _ = m.forward_target(tokens, 0, DenseTargetCache(c))
    keys = torch.tensor([0, 1, 5, 6, 7, 9])
    x = d.project(tokens[keys + 1], hidden[keys])
    q, k, v = d.qkv(x, keys)
    k = _rope(k, keys + 1, c.rotary_dim, c.rope_theta)
    h_all, l_all = d.finish(x, q, k, v, keys, keys)
    h_pre, l_pre = d.finish(x[:3], q[:3], k[:3], v[:3], keys[:3], keys[:3])
    torch.testing.assert_close(l_all[:3], l_pre, rtol=0, atol=1e-12)
    assert h_all.shape == (6, 32)
    with pytest.raises(ValueError, match=r"query keys \[0\]"):
        d.finish(x[:1], q[:1], k[2:], v[2:], keys[2:], keys[:1])


WEIGHTS = Path(M.__file__).parent / "weights"


def test_load_reference_is_deterministic_and_small():
    assert (WEIGHTS / "reference.safetensors").stat().st_size < 16 * 2**20
    m1, tok = load_reference()
    m2, _ = load_reference(path=WEIGHTS)
    assert not m1.training
    ids = torch.tensor(tok.render_chat([{"role": "user", "content": "def f(x):\n    return x"}]))
    h1, l1 = m1.forward_target(ids, 0, DenseTargetCache(m1.cfg))
    h2, l2 = m2.forward_target(ids, 0, DenseTargetCache(m2.cfg))
    assert torch.equal(l1, l2) and torch.equal(h1, h2)
    assert torch.isfinite(l1).all()
    # trained, not random: the answer opens with a likely byte, not noise
    assert l1[-1].softmax(-1).max() > 0.2
    m64, _ = load_reference(dtype=F64)
    _, l64 = m64.forward_target(ids, 0, DenseTargetCache(m64.cfg))
    torch.testing.assert_close(l64.float(), l1, rtol=1e-3, atol=1e-3)
