"""A small Qwen3-Next-shaped hybrid causal LM with an MTP drafter, in plain torch.

What it is for: the reference engine's model and the oracle for GPU paths. The
target repeats `cfg.layer_types` (e.g. linear, linear, full): "linear" layers
are gated delta rule recurrences (after a short causal conv) with a fixed-size
flat state (`GatedDeltaNet.state_size()`), "full" layers are GQA attention with
qk-norm and partial RoPE. RMSNorm, SwiGLU MLP, tied embeddings. The MTP drafter is the Qwen3-Next kind: `fc` over
`[norm(embed(t_{k+1})); norm(hidden_k)]`, one full-attention decoder layer,
final norm, shared head.

Invariants:
- Positions are absolute: `forward_target(tokens, start_pos, cache)` needs
  `cache.num_tokens == start_pos` and leaves the cache at `start_pos + T`.
- A recurrent layer's chunked form (T > 1, a loop over chunks only) and step
  form (T == 1) compute the same function; so do one chunk of T tokens and T
  single-token calls. In float64 they agree to rounding (~1e-12); in float32
  the last bits may differ.
- Drafter pair key `k` is computed from `(t_{k+1}, hidden_k)`; its K is roped at
  position `k + 1` and query key `k` sees rows whose key is `<= k`.
- `hidden` handed to the drafter is the last target layer's output before the
  final norm.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..dataplane.rope import apply_rope_reference
from .tokenizer import ChatTokenizer


@dataclass
class HybridConfig:
    """Model shape; `to_json`/`from_json` round-trip it exactly."""

    vocab_size: int = 264
    hidden_size: int = 128
    num_layers: int = 6
    layer_types: list[str] = field(
        default_factory=lambda: ["linear", "linear", "full", "linear", "linear", "full"])
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    partial_rotary_factor: float = 0.25
    rope_theta: float = 1e7
    intermediate_size: int = 384
    linear_num_heads: int = 4
    linear_key_dim: int = 32
    linear_value_dim: int = 32
    linear_chunk_size: int = 64
    linear_conv_kernel: int = 4
    rms_eps: float = 1e-6
    max_position: int = 4096

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries, "
                             f"num_layers={self.num_layers}")
        bad = [t for t in self.layer_types if t not in ("linear", "full")]
        if bad:
            raise ValueError(f"layer_types entries must be 'linear' or 'full', got {bad}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim={self.rotary_dim} (head_dim={self.head_dim} * "
                             f"partial_rotary_factor={self.partial_rotary_factor}) must be even "
                             f"and in (0, head_dim]")

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head: int(head_dim * partial_rotary_factor), even."""
        return int(self.head_dim * self.partial_rotary_factor)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> HybridConfig:
        return cls(**json.loads(text))


# ----------------------------------------------------------------------------- RoPE

def _rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
          rope_theta: float) -> torch.Tensor:
    """HF rotate-half RoPE on the first `rotary_dim` dims; the rest pass unchanged.

    Below float64 this is the data plane's `apply_rope_reference`, the one
    formula the drafter-row append kernel also applies to K (so drafter Q and
    K agree to the bit on frequencies). float64 input rotates in float64, so
    the float64 equality tests compare exact paths.
    """
    if x.dtype != torch.float64:  # positions per token, shared by heads: [..., T]
        return apply_rope_reference(x, positions.expand(x.shape[:-2]), rotary_dim, rope_theta)
    # x: [T, H, D] (or [B, T, H, D]); positions: [T] (or [B, T]) absolute positions
    rd = rotary_dim
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = rope_theta ** (-torch.arange(0, rd, 2, dtype=cdt, device=x.device) / rd)
    angle = positions.to(cdt)[..., None] * inv_freq  # [..., T, rd/2]
    cos = torch.cat([angle.cos(), angle.cos()], -1)[..., None, :]  # [..., T, 1, rd]
    sin = torch.cat([angle.sin(), angle.sin()], -1)[..., None, :]
    xr = x[..., :rd].to(cdt)
    rot = torch.cat([-xr[..., rd // 2:], xr[..., : rd // 2]], -1)
    out = (xr * cos + rot * sin).to(x.dtype)
    return torch.cat([out, x[..., rd:]], -1)


# ----------------------------------------------------------------------------- blocks

class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, computed in float32 (float64 kept)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        xf = x.float() if x.dtype not in (torch.float32, torch.float64) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(g) * u)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with GQA; `mask` True where a query may see a key (None: causal)."""
    # q: [B, T, Hq, D]; k, v: [B, S, Hkv, D]; mask: [T, S] bool or None -> [B, T, Hq*D]
    B, T, Hq, D = q.shape
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if mask is None:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)
    return o.transpose(1, 2).reshape(B, T, Hq * D)


class FullAttention(nn.Module):
    """GQA attention with per-head qk RMSNorm and partial RoPE."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, D = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, cfg.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_eps)
        self.k_norm = RMSNorm(D, cfg.rms_eps)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected, qk-normed, un-roped q, k, v."""
        # x: [B, T, H] -> q [B, T, Hq, D], k/v [B, T, Hkv, D]
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_norm(self.q_proj(x).view(B, T, c.num_heads, c.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim))
        v = self.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (out, k_new roped, v_new); queries see `past` plus new tokens causally."""
        # x: [B, T, H]; positions: [T]; past k/v: [B, S, Hkv, D] (k roped)
        c = self.cfg
        q, k, v = self.qkv(x)
        q = _rope(q, positions, c.rotary_dim, c.rope_theta)
        k = _rope(k, positions, c.rotary_dim, c.rope_theta)
        if past is None or past[0].shape[1] == 0:
            kk, vv, mask = k, v, None
        else:
            kk, vv = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
            S, T = past[0].shape[1], x.shape[1]
            mask = torch.ones(T, S + T, dtype=torch.bool, device=x.device)
            mask[:, S:] = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        return self.o_proj(attend(q, kk, vv, mask)), k, v


# ----------------------------------------------------------------------------- gated delta rule

def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule: S' = e^g S; S = S' + b k (v - S'^T k)^T; o = S^T q."""
    # q, k: [B, Hl, Dk]; v: [B, Hl, Dv]; g, beta: [B, Hl]; state: [B, Hl, Dk, Dv]
    s = state * g.exp()[..., None, None]
    err = v - torch.einsum("bhkv,bhk->bhv", s, k)
    s = s + (beta[..., None] * k)[..., :, None] * err[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor, chunk: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence over T tokens in parallel within chunks (loop over chunks only).

    Within a chunk with cumulative log-decay G_t, the delta-rule writes W solve
    (I + L) W = diag(b) (V - diag(e^G) K S0), L[t, j] = b_t e^(G_t - G_j) k_t.k_j
    for j < t; outputs are diag(e^G) Q S0 + (mask * e^(G_t - G_j) * Q K^T) W.
    """
    # q, k: [B, T, Hl, Dk]; v: [B, T, Hl, Dv]; g, beta: [B, T, Hl]; state: [B, Hl, Dk, Dv]
    B, T, Hh, Dk = k.shape
    Dv = v.shape[-1]
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:  # padded tokens: k = v = 0, b = 0, g = 0 leave the state unchanged
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))

    def split(t: torch.Tensor) -> torch.Tensor:  # [B, n*C, Hl, ...] -> [B, Hl, n, C, ...]
        t = t.reshape(B, n, chunk, Hh, *t.shape[3:])
        return t.permute(0, 3, 1, 2, *range(4, t.dim()))

    q, k, v, g, beta = (split(t) for t in (q, k, v, g, beta))
    G = g.cumsum(-1)  # [B, Hl, n, C]
    diff = G[..., :, None] - G[..., None, :]
    ones = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device)
    strict, incl = ones.tril(-1), ones.tril()
    decay_strict = diff.masked_fill(~strict, float("-inf")).exp()
    decay_incl = diff.masked_fill(~incl, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)  # [B, Hl, n, C, C]
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    A = eye + beta[..., :, None] * decay_strict * kk
    rhs = torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], -1)
    sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    U, Kw = sol[..., :Dv], sol[..., Dv:]  # W = U - Kw @ S0
    qk = (q @ k.transpose(-1, -2)) * decay_incl
    eG = G.exp()
    tail = (G[..., -1:] - G).exp()  # decay from each token to the chunk end
    outs = []
    s = state
    for i in range(n):
        w = U[:, :, i] - Kw[:, :, i] @ s  # [B, Hl, C, Dv]
        outs.append(eG[:, :, i, :, None] * (q[:, :, i] @ s) + qk[:, :, i] @ w)
        s = eG[:, :, i, -1, None, None] * s + (k[:, :, i] * tail[:, :, i, :, None]).transpose(-1, -2) @ w
    o = torch.stack(outs, 2).reshape(B, Hh, n * chunk, Dv).transpose(1, 2)
    return o[:, :T], s


class GatedDeltaNet(nn.Module):
    """Linear-attention layer (Qwen3-Next's gated DeltaNet).

    q, k, v pass a causal depthwise conv of `linear_conv_kernel` taps and SiLU
    (0 taps: none); q, k are L2-normalised, q scaled by 1/sqrt(Dk); decay
    g = -exp(A_log) * softplus(a + dt_bias); write strength b = sigmoid(b);
    output is RMSNorm(o) * silu(z), then out_proj. One sequence's state is a
    flat `[state_size()]` tensor: the recurrent matrix `[Hl, Dk, Dv]` then the
    conv window `[K - 1, C]` (the last K - 1 conv inputs), so caches can treat
    it as opaque and of fixed size.
    """

    force_form: str | None = None  # "chunked" or "step" forces a form (tests)

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        Hh, Dk, Dv = cfg.linear_num_heads, cfg.linear_key_dim, cfg.linear_value_dim
        self.in_proj = nn.Linear(cfg.hidden_size, Hh * (2 * Dk + 2 * Dv + 2), bias=False)
        self.conv_channels = Hh * (2 * Dk + Dv)
        if cfg.linear_conv_kernel:
            self.conv_weight = nn.Parameter(torch.zeros(self.conv_channels, cfg.linear_conv_kernel))
        self.A_log = nn.Parameter(torch.zeros(Hh))
        self.dt_bias = nn.Parameter(torch.zeros(Hh))
        self.norm = RMSNorm(Dv, cfg.rms_eps)
        self.out_proj = nn.Linear(Hh * Dv, cfg.hidden_size, bias=False)

    def state_size(self) -> int:
        """Elements of one sequence's flat state (recurrent matrix + conv window)."""
        c = self.cfg
        return (c.linear_num_heads * c.linear_key_dim * c.linear_value_dim
                + max(c.linear_conv_kernel - 1, 0) * self.conv_channels)

    def _unpack(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # state: [B, state_size] -> matrix [B, Hl, Dk, Dv], conv window [B, K-1, C]
        c = self.cfg
        if state.shape[-1] != self.state_size():
            raise ValueError(f"state has {state.shape[-1]} elements, expected {self.state_size()}")
        B, n = state.shape[0], c.linear_num_heads * c.linear_key_dim * c.linear_value_dim
        mat = state[:, :n].view(B, c.linear_num_heads, c.linear_key_dim, c.linear_value_dim)
        return mat, state[:, n:].view(B, max(c.linear_conv_kernel - 1, 0), self.conv_channels)

    @staticmethod
    def _pack(mat: torch.Tensor, win: torch.Tensor) -> torch.Tensor:
        # mat: [B, Hl, Dk, Dv]; win: [B, K-1, C] -> [B, state_size]
        return torch.cat([mat.flatten(1), win.flatten(1)], 1)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None,
                form: str | None = None, trace: list[torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (out, new state); `form` None picks step for T == 1, chunked otherwise.

        With `trace` (a list to fill), runs the step form and appends the state
        after every token: speculative verify keeps the accepted position's state.
        """
        # x: [B, T, H]; state: [B, state_size] or None (zeros) -> out [B, T, H], [B, state_size]
        B, T, _ = x.shape
        c = self.cfg
        Hh, Dk, Dv, K = c.linear_num_heads, c.linear_key_dim, c.linear_value_dim, c.linear_conv_kernel
        if state is None:
            state = x.new_zeros(B, self.state_size())
        mat, win = self._unpack(state)
        p = self.in_proj(x).view(B, T, Hh, 2 * Dk + 2 * Dv + 2)
        qkv, z, b, a = p.split([2 * Dk + Dv, Dv, 1, 1], -1)
        xs = torch.cat([win, qkv.reshape(B, T, self.conv_channels)], 1)  # [B, K-1+T, C]
        if K:  # causal depthwise conv: tap K-1 multiplies the current token
            acc = self.conv_weight[:, 0] * xs[:, 0:T]
            for i in range(1, K):  # K conv taps (4), not tokens
                acc = acc + self.conv_weight[:, i] * xs[:, i:i + T]
            qkv = F.silu(acc)
            qkv = qkv.view(B, T, Hh, 2 * Dk + Dv)
        q, k, v = qkv.split([Dk, Dk, Dv], -1)
        q = F.normalize(q, dim=-1) / math.sqrt(Dk)
        k = F.normalize(k, dim=-1)
        beta = torch.sigmoid(b[..., 0])
        g = -self.A_log.exp() * F.softplus(a[..., 0] + self.dt_bias)
        form = "step" if trace is not None else form or self.force_form or (
            "step" if T == 1 else "chunked")
        if form == "step":
            outs = []
            for t in range(T):  # decode and verify: T is 1 + draft length (at most 4)
                o, mat = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], mat)
                outs.append(o)
                if trace is not None:
                    trace.append(self._pack(mat, xs[:, t + 1:t + K]))
            o = torch.stack(outs, 1)
        elif form == "chunked":
            o, mat = gated_delta_chunked(q, k, v, g, beta, mat, c.linear_chunk_size)
        else:
            raise ValueError(f"form must be 'step' or 'chunked', got {form!r}")
        o = self.norm(o) * F.silu(z)
        return self.out_proj(o.reshape(B, T, Hh * Dv)), self._pack(mat, xs[:, T:])


class DecoderLayer(nn.Module):
    """Pre-norm block: h += mixer(norm(h)); h += mlp(norm(h)); the mixer is `kind`."""

    def __init__(self, cfg: HybridConfig, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mixer = FullAttention(cfg) if kind == "full" else GatedDeltaNet(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)


# ----------------------------------------------------------------------------- caches

class TargetCache(Protocol):
    """What `forward_target` needs from a cache; `layer_idx` is the model's layer index."""

    @property
    def num_tokens(self) -> int: ...

    def attn_past(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Past (k roped, v) of a full-attention layer, each `[S, Hkv, D]`."""
        ...

    def attn_append(self, layer_idx: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Append `[T, Hkv, D]` rows (k roped) after the past of a full-attention layer."""
        ...

    def ssm_state(self, layer_idx: int) -> torch.Tensor | None:
        """Flat recurrent state `[state_size]` of a linear layer, or None before any token."""
        ...

    def set_ssm_state(self, layer_idx: int, state: torch.Tensor) -> None: ...

    def set_ssm_trace(self, layer_idx: int, states: torch.Tensor) -> None:
        """Per-token states `[T, state_size]`; called only by `forward_target(ssm_trace=True)`."""
        ...


class BatchTargetCache(Protocol):
    """What `forward_target_batch` needs: B sequences' caches seen as one padded batch."""

    @property
    def starts(self) -> torch.Tensor:
        """`[B]` int64: each sequence's first new position (its cached token count)."""
        ...

    def attn_past_padded(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Past (k roped, v) `[B, S, Hkv, D]` padded to the longest, and `valid` `[B, S]` bool."""
        ...

    def attn_write(self, layer_idx: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """Write each sequence's real new rows (`[B, T, Hkv, D]`, k roped) at its positions."""
        ...

    def ssm_states(self, layer_idx: int) -> torch.Tensor:
        """`[B, state_size]` recurrent states of a linear layer (zeros where unset)."""
        ...

    def set_ssm_traces(self, layer_idx: int, states: torch.Tensor) -> None:
        """Per-token states `[B, T, state_size]` of a linear layer, for verify."""
        ...


class SsmStates:
    """One sequence's linear layers' states (`_ssm`, by layer index; `_linear` the linear layers
    in order), snapshotted and restored whole (the target caches share it)."""

    _linear: list[int]
    _ssm: dict[int, torch.Tensor]

    def snapshot_ssm(self) -> list[torch.Tensor | None]:
        """Clones of every linear layer's state, in layer order (None where unset)."""
        return [None if i not in self._ssm else self._ssm[i].clone() for i in self._linear]

    def restore_ssm(self, states: list[torch.Tensor | None]) -> None:
        """Install clones of a `snapshot_ssm()` result."""
        if len(states) != len(self._linear):
            raise ValueError(f"got {len(states)} states for {len(self._linear)} linear layers")
        self._ssm = {i: s.clone() for i, s in zip(self._linear, states, strict=True) if s is not None}


class DenseTargetCache(SsmStates):
    """Contiguous per-layer cache for one sequence; `num_tokens` = cached K rows."""

    def __init__(self, cfg: HybridConfig) -> None:
        self.cfg = cfg
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}
        self._ssm: dict[int, torch.Tensor] = {}
        self.ssm_traces: dict[int, torch.Tensor] = {}
        self._full = [i for i, t in enumerate(cfg.layer_types) if t == "full"]
        self._linear = [i for i, t in enumerate(cfg.layer_types) if t == "linear"]
        self._count = 0  # used only when the model has no full-attention layer

    @property
    def num_tokens(self) -> int:
        if not self._full:
            return self._count
        k = self._k.get(self._full[0])
        return 0 if k is None else k.shape[0]

    def _check_full(self, layer_idx: int) -> None:
        if layer_idx not in self._full:
            raise ValueError(f"layer {layer_idx} is not a full-attention layer ({self._full})")

    def attn_past(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_full(layer_idx)
        if layer_idx not in self._k:
            c = self.cfg
            w = torch.empty(0, c.num_kv_heads, c.head_dim)
            return w, w
        return self._k[layer_idx], self._v[layer_idx]

    def attn_append(self, layer_idx: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        # k_new, v_new: [T, Hkv, D]
        self._check_full(layer_idx)
        if layer_idx in self._k:
            self._k[layer_idx] = torch.cat([self._k[layer_idx], k_new], 0)
            self._v[layer_idx] = torch.cat([self._v[layer_idx], v_new], 0)
        else:
            self._k[layer_idx], self._v[layer_idx] = k_new, v_new
        if not self._full:
            self._count += k_new.shape[0]

    def ssm_state(self, layer_idx: int) -> torch.Tensor | None:
        if layer_idx not in self._linear:
            raise ValueError(f"layer {layer_idx} is not a linear layer ({self._linear})")
        return self._ssm.get(layer_idx)

    def set_ssm_state(self, layer_idx: int, state: torch.Tensor) -> None:
        # state: [state_size] (see GatedDeltaNet)
        if layer_idx not in self._linear:
            raise ValueError(f"layer {layer_idx} is not a linear layer ({self._linear})")
        self._ssm[layer_idx] = state

    def set_ssm_trace(self, layer_idx: int, states: torch.Tensor) -> None:
        """Keep the per-token states of the last `forward_target(..., ssm_trace=True)`."""
        # states: [T, state_size]
        self.ssm_traces[layer_idx] = states

    def truncate(self, num_tokens: int) -> None:
        """Drop attention rows at positions >= num_tokens (SSM states are not rewound)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"truncate to {num_tokens} outside [0, {self.num_tokens}]")
        for i in list(self._k):
            self._k[i], self._v[i] = self._k[i][:num_tokens], self._v[i][:num_tokens]


# ----------------------------------------------------------------------------- MTP drafter

class MTPDrafter(nn.Module):
    """Qwen3-Next MTP block: pair key k reads (embed(t_{k+1}), hidden_k), predicts t_{k+2}.

    The engine splits a step into `project` -> `qkv` -> (rope k at key+1, write
    rows to its pool) -> `finish`; `forward_dense` runs all three for training.
    """

    _embed: nn.Embedding  # the target's embedding, shared (not a submodule here)

    def __init__(self, cfg: HybridConfig, embed: nn.Embedding) -> None:
        super().__init__()
        self.cfg = cfg
        object.__setattr__(self, "_embed", embed)  # shared with the target, not re-registered
        H = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = RMSNorm(H, cfg.rms_eps)
        self.self_attn = FullAttention(cfg)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_eps)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.norm = RMSNorm(H, cfg.rms_eps)

    def project(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """x = fc([pre_fc_norm_embedding(embed(t_{k+1})); pre_fc_norm_hidden(hidden_k)])."""
        # next_tokens: [n] (t_{k+1}); hidden: [n, H] (hidden_k) -> [n, H]
        if next_tokens.shape[0] != hidden.shape[0]:
            raise ValueError(f"next_tokens has {next_tokens.shape[0]} rows, hidden "
                             f"{hidden.shape[0]}")
        e = self.pre_fc_norm_embedding(self._embed(next_tokens))
        return self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], -1))

    def qkv(self, x: torch.Tensor, keys: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q roped at keys + 1, k NOT roped (the pool ropes it at key + 1), v."""
        # x: [n, H]; keys: [n] -> q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D]
        c = self.cfg
        q, k, v = self.self_attn.qkv(self.input_layernorm(x)[None])
        q = _rope(q[0], keys + 1, c.rotary_dim, c.rope_theta)
        return q, k[0], v[0]

    def finish(self, x: torch.Tensor, q: torch.Tensor, k_rows: torch.Tensor,
               v_rows: torch.Tensor, row_keys: torch.Tensor, query_keys: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Query key k attends rows with row_key <= k; returns (h_out before final norm, logits)."""
        # x: [n, H]; q: [n, Hq, D]; k_rows (roped), v_rows: [R, Hkv, D];
        # row_keys: [R]; query_keys: [n] -> h_out [n, H], logits [n, V]
        mask = row_keys[None, :] <= query_keys[:, None]  # [n, R]
        if not bool(mask.any(-1).all()):
            bad = query_keys[~mask.any(-1)].tolist()
            raise ValueError(f"query keys {bad} see no drafter row (row keys "
                             f"{row_keys.min().item() if row_keys.numel() else None}..)")
        a = attend(q[None], k_rows[None], v_rows[None], mask)[0]
        h = x + self.self_attn.o_proj(a)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, self.norm(h) @ self._embed.weight.t()

    def finish_batch(self, x: torch.Tensor, q: torch.Tensor,
                     rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                     query_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`finish` for B sequences at once: query b attends only its own `rows[b]`.

        Attention runs per sequence (each over its own rows, no padding copies);
        everything after it runs batched. Each row equals `finish` on that row alone.
        """
        # x: [B, H]; q: [B, Hq, D]; rows[b] = (k roped [R_b, Hkv, D], v, row_keys [R_b]);
        # query_keys: [B] -> h_out [B, H], logits [B, V]
        outs = []
        for b, (k_rows, v_rows, row_keys) in enumerate(rows):  # one attention per sequence
            mask = row_keys[None, :] <= query_keys[b:b + 1, None]  # [1, R_b]
            outs.append(attend(q[b:b + 1][None], k_rows[None], v_rows[None], mask)[0])
        h = x + self.self_attn.o_proj(torch.cat(outs))
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, self.norm(h) @ self._embed.weight.t()

    def forward_dense(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for pair keys 0..L-2 (row k predicts t_{k+2}), every key seeing keys <= it."""
        # tokens: [L]; hidden: [L, H] -> [L-1, V]
        c = self.cfg
        keys = torch.arange(tokens.shape[0] - 1, device=tokens.device)
        x = self.project(tokens[1:], hidden[:-1])
        q, k, v = self.qkv(x, keys)
        k = _rope(k, keys + 1, c.rotary_dim, c.rope_theta)
        return self.finish(x, q, k, v, keys, keys)[1]

    def forward_train(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Batched causal `forward_dense` for training."""
        # tokens: [B, L]; hidden: [B, L, H] -> [B, L-1, V]
        c = self.cfg
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(self._embed(tokens[:, 1:])),
                               self.pre_fc_norm_hidden(hidden[:, :-1])], -1))
        pos = torch.arange(1, tokens.shape[1], device=tokens.device)
        q, k, v = self.self_attn.qkv(self.input_layernorm(x))
        q = _rope(q, pos, c.rotary_dim, c.rope_theta)
        k = _rope(k, pos, c.rotary_dim, c.rope_theta)
        h = x + self.self_attn.o_proj(attend(q, k, v, None))
        h = h + self.mlp(self.post_attention_layernorm(h))
        return self.norm(h) @ self._embed.weight.t()


# ----------------------------------------------------------------------------- target

class HybridLM(nn.Module):
    """Target model plus `drafter`; tied embeddings shared by the target head and the drafter."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.drafter = MTPDrafter(cfg, self.embed_tokens)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """The target's layers, typed (an `nn.ModuleList` is untyped)."""
        return cast("list[DecoderLayer]", list(self.layers))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [T] -> [T, H]
        return self.embed_tokens(tokens)

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm then the tied head."""
        # h: [..., H] -> [..., V]
        return self.norm(h) @ self.embed_tokens.weight.t()

    def forward_target(self, tokens: torch.Tensor, start_pos: int, cache: TargetCache,
                       ssm_trace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run tokens at positions start_pos.. on a cache holding [0, start_pos); update it.

        With `ssm_trace`, recurrent layers run the step form and hand the cache
        the state after every token (`cache.set_ssm_trace(i, [T, state_size])`).
        Returns (hidden [T, H] before the final norm, logits [T, V]). One call over
        T tokens equals T calls of one token (to rounding: exact-ish in float64,
        last bits in float32).
        """
        # tokens: [T]
        T = tokens.shape[0]
        if cache.num_tokens != start_pos:
            raise ValueError(f"start_pos={start_pos} but the cache holds {cache.num_tokens} tokens")
        if start_pos + T > self.cfg.max_position:
            raise ValueError(f"positions up to {start_pos + T} exceed max_position="
                             f"{self.cfg.max_position}")
        positions = torch.arange(start_pos, start_pos + T, device=tokens.device)
        h = self.embed_tokens(tokens)[None]
        for i, layer in enumerate(self.decoder_layers):
            x = layer.input_layernorm(h)
            if layer.kind == "full":
                k_past, v_past = cache.attn_past(i)
                out, k_new, v_new = layer.mixer(x, positions, (k_past[None], v_past[None]))
                cache.attn_append(i, k_new[0], v_new[0])
            else:
                st = cache.ssm_state(i)
                trace: list[torch.Tensor] | None = [] if ssm_trace else None
                out, st = layer.mixer(x, None if st is None else st[None], trace=trace)
                cache.set_ssm_state(i, st[0])
                if trace is not None:  # the state after each token, for verify ([T, state_size])
                    cache.set_ssm_trace(i, torch.stack(trace, 0)[:, 0])
            h = h + out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h[0], self.lm_head(h[0])

    def forward_target_batch(self, tokens: torch.Tensor, cache: BatchTargetCache
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_target(..., ssm_trace=True)` for B sequences in one forward.

        Row b holds `cache.lengths[b]` real tokens at positions `cache.starts[b]..`,
        then padding. Padding never reaches a real token (attention is causal within
        the new tokens and padding comes last; recurrences run left to right), so each
        real row equals that sequence's own `forward_target` (to rounding: float64
        ~1e-12). Returns (hidden [B, T, H], logits [B, T, V]); padded rows are junk.
        """
        # tokens: [B, T] int64
        B, T = tokens.shape
        c = self.cfg
        starts = cache.starts  # [B] int64
        positions = starts[:, None] + torch.arange(T, device=tokens.device)  # [B, T]
        if int(positions[:, -1].max()) >= c.max_position:
            raise ValueError(f"positions up to {int(positions[:, -1].max()) + 1} exceed "
                             f"max_position={c.max_position}")
        causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
        h = self.embed_tokens(tokens)
        for i, layer in enumerate(self.decoder_layers):
            x = layer.input_layernorm(h)
            if layer.kind == "full":
                attn = cast(FullAttention, layer.mixer)
                q, k, v = attn.qkv(x)
                q = _rope(q, positions, c.rotary_dim, c.rope_theta)
                k = _rope(k, positions, c.rotary_dim, c.rope_theta)
                k_past, v_past, valid = cache.attn_past_padded(i)  # [B, S, Hkv, D], [B, S]
                kk, vv = torch.cat([k_past, k], 1), torch.cat([v_past, v], 1)
                S = k_past.shape[1]
                mask = torch.cat([valid[:, None, :].expand(B, T, S), causal.expand(B, T, T)], -1)
                o = F.scaled_dot_product_attention(
                    q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                    attn_mask=mask[:, None], enable_gqa=True)
                out = attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))
                cache.attn_write(i, k, v)
            else:
                trace: list[torch.Tensor] = []
                out, _ = layer.mixer(x, cache.ssm_states(i), trace=trace)
                cache.set_ssm_traces(i, torch.stack(trace, 1))  # [B, T, state_size]
            h = h + out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, self.lm_head(h)

    def forward_train(self, tokens: torch.Tensor) -> torch.Tensor:
        """Batched full-sequence forward from position 0 without a cache; returns hidden."""
        # tokens: [B, T] -> hidden [B, T, H] (before the final norm)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed_tokens(tokens)
        for layer in self.decoder_layers:
            x = layer.input_layernorm(h)
            if layer.kind == "full":
                out = layer.mixer(x, positions, None)[0]
            else:
                out = layer.mixer(x, None, "chunked")[0]
            h = h + out
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h


# ----------------------------------------------------------------------------- construction

WEIGHTS_PACKAGE = "trtllm_mtp_carry.engine"  # files under weights/


def init_random(cfg: HybridConfig, seed: int = 0, qk_norm_init: float = 1.0) -> HybridLM:
    """A deterministic randomly initialised model (std 0.02 linears, unit norms).

    `qk_norm_init` > 1 starts the qk-norm weights larger so that attention can be
    sharp at a small head_dim (logits are bounded by qk_norm_init^2 * sqrt(D)).
    """
    g = torch.Generator().manual_seed(seed)
    model = HybridLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.0, 1.0, generator=g).log())
            elif name.endswith("conv_weight"):  # near identity: tap K-1 is the current token
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                p[:, -1] += 1.0
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-3.0, 0.0, generator=g))
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(qk_norm_init)
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def load_reference(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                   path: str | Path | None = None) -> tuple[HybridLM, ChatTokenizer]:
    """Load the shipped trained weights (`reference.safetensors` + `reference.json`).

    `path` is a directory holding both files; None means the package's weights.
    No network is touched. Returns the model in eval mode and the tokenizer.
    """
    from safetensors.torch import load_file

    if path is None:
        root = resources.files(WEIGHTS_PACKAGE)
        cfg_text = root.joinpath("weights/reference.json").read_text()
        with resources.as_file(root.joinpath("weights/reference.safetensors")) as f:
            state = load_file(str(f))
    else:
        p = Path(path)
        cfg_text = (p / "reference.json").read_text()
        state = load_file(str(p / "reference.safetensors"))
    cfg = HybridConfig.from_json(cfg_text)
    model = HybridLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"weights do not match the config: missing={missing} "
                         f"unexpected={unexpected}")
    return model.to(device=device, dtype=dtype).eval(), ChatTokenizer()


def save_reference(model: HybridLM, directory: str | Path) -> None:
    """Write `reference.safetensors` (float32) and `reference.json` into `directory`."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(d / "reference.safetensors"))
    (d / "reference.safetensors").chmod(0o644)
    (d / "reference.json").write_text(model.cfg.to_json() + "\n")
