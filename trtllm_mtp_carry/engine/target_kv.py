"""The target's attention KV in paged blocks, and one sequence's view of it.

What it is for: the reference engine keeps every full-attention layer's K/V in
`[num_blocks, block_size, num_kv_heads, head_dim]` tensors whose block ids the
torch-free `TargetBlockManager` hands out (prefix caching shares them across
turns). `SequenceKV` is the `TargetCache` the model runs on: it reads and
writes rows through the sequence's block table and holds the sequence's SSM
states (one `[Hl, Dk, Dv]` tensor per linear layer). `BatchKV` shows several
sequences' `SequenceKV`s to one batched verify forward as a padded batch.

Invariants:
- Writes are indexed by position, so a rejected draft needs no rollback of
  KV: `truncate` only moves `num_tokens` back. SSM states are not
  position-indexed; the engine restores the state of the accepted position.
- During one forward every layer appends at the same positions
  `[num_tokens, num_tokens + T)`; `advance(T)` then commits them.
- A sequence writes only blocks of its own table; the block manager guarantees
  that no other sequence can write them (copy-on-write of shared partial blocks).
  In a batch, only each row's real new tokens are written; padding never is,
  and a row's attention sees only its own sequence's past (a per-row mask).
"""

from __future__ import annotations

import torch

from .model import HybridConfig, SsmStates


class PagedTargetKV:
    """Paged K/V tensors for every full-attention layer of the target."""

    def __init__(
        self, cfg: HybridConfig, num_blocks: int, block_size: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        self.cfg = cfg
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        full = [i for i, t in enumerate(cfg.layer_types) if t == "full"]
        # k[layer], v[layer]: [num_blocks, block_size, Hkv, D]
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in full}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in full}

    def slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Flat slot ids of positions `[start, end)` through block `table` (int64 `[end - start]`)."""
        pos = torch.arange(start, end, device=table.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's rows in every layer (copy-on-write of a shared partial block)."""
        for i in self.k:
            self.k[i][dst].copy_(self.k[i][src])
            self.v[i][dst].copy_(self.v[i][src])


class SequenceKV(SsmStates):
    """One sequence's `TargetCache`: paged attention rows plus its SSM states."""

    def __init__(self, kv: PagedTargetKV, block_table: list[int], num_tokens: int) -> None:
        self.kv = kv
        # fixed for the sequence's life: admission reserves the answer's slots
        device = next(iter(kv.k.values())).device if kv.k else "cpu"
        self.table = torch.as_tensor(block_table, dtype=torch.int64, device=device)
        self._num_tokens = num_tokens
        self._linear = [i for i, t in enumerate(kv.cfg.layer_types) if t == "linear"]
        self._ssm: dict[int, torch.Tensor] = {}
        self._trace: dict[int, torch.Tensor] = {}

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def attn_past(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k, v: [num_tokens, Hkv, D] (k roped)
        slots = self.kv.slots(self.table, 0, self._num_tokens)
        k = self.kv.k[layer_idx].flatten(0, 1).index_select(0, slots)
        v = self.kv.v[layer_idx].flatten(0, 1).index_select(0, slots)
        return k, v

    def attn_append(self, layer_idx: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        # k_new, v_new: [T, Hkv, D] at positions [num_tokens, num_tokens + T)
        t = k_new.shape[0]
        needed = -(-(self._num_tokens + t) // self.kv.block_size)
        if needed > len(self.table):
            raise RuntimeError(
                f"positions up to {self._num_tokens + t} need {needed} blocks, "
                f"the sequence holds {len(self.table)}: reserve slots at admission"
            )
        slots = self.kv.slots(self.table, self._num_tokens, self._num_tokens + t)
        self.kv.k[layer_idx].flatten(0, 1).index_copy_(0, slots, k_new.to(self.kv.k[layer_idx].dtype))
        self.kv.v[layer_idx].flatten(0, 1).index_copy_(0, slots, v_new.to(self.kv.v[layer_idx].dtype))

    def ssm_state(self, layer_idx: int) -> torch.Tensor | None:
        return self._ssm.get(layer_idx)

    def set_ssm_state(self, layer_idx: int, state: torch.Tensor) -> None:
        # state: [Hl, Dk, Dv]
        self._ssm[layer_idx] = state

    def set_ssm_trace(self, layer_idx: int, states: torch.Tensor) -> None:
        """States after each token of the last forward (`[T, Hl, Dk, Dv]`), for verify."""
        self._trace[layer_idx] = states

    def advance(self, num_new: int) -> None:
        """Commit the positions the last forward wrote."""
        self._num_tokens += num_new

    def rewind(self, num_tokens: int, trace_index: int | None = None) -> None:
        """Keep positions `[0, num_tokens)`; take the SSM state after trace step `trace_index`."""
        if not 0 <= num_tokens <= self._num_tokens:
            raise ValueError(f"rewind to {num_tokens} outside [0, {self._num_tokens}]")
        self._num_tokens = num_tokens
        if trace_index is not None:
            self._ssm = {i: s[trace_index].clone() for i, s in self._trace.items()}
        self._trace = {}

    def ssm_nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._ssm.values())


class BatchKV:
    """B sequences' `SequenceKV`s as one padded batch (`BatchTargetCache`) for one forward.

    Each sequence `b` runs `lengths[b]` real tokens from its own `num_tokens`;
    only those are written, so padding never lands in any block. After the
    forward the engine calls `advance`/`rewind` on each `SequenceKV` as usual.
    """

    def __init__(self, seqs: list[SequenceKV], lengths: list[int]) -> None:
        if not seqs or len(seqs) != len(lengths):
            raise ValueError(f"need one length per sequence, got {len(seqs)} and {len(lengths)}")
        self.seqs = seqs
        self.kv = seqs[0].kv
        device = self.kv.k[next(iter(self.kv.k))].device if self.kv.k else torch.device("cpu")
        self.lengths = torch.tensor(lengths, dtype=torch.int64, device=device)
        self._starts = torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64, device=device)
        bs = self.kv.block_size
        S = int(self._starts.max())
        pos = torch.arange(S, device=device)
        self._valid = pos[None, :] < self._starts[:, None]  # [B, S]
        # padded slot ids [B, S]: each sequence's table, padding (masked) at slot 0
        width = max(len(s.table) for s in seqs)
        tables = torch.zeros(len(seqs), width, dtype=torch.int64, device=device)
        for b, s in enumerate(seqs):  # bookkeeping over sequences, not tokens
            tables[b, : len(s.table)] = s.table
        blk = (pos // bs).clamp(max=width - 1)
        self._past_slots = torch.where(self._valid, tables[:, blk] * bs + pos % bs, 0)
        T = max(lengths)
        new_pos = self._starts[:, None] + torch.arange(T, device=device)  # [B, T]
        self._new_real = torch.arange(T, device=device)[None, :] < self.lengths[:, None]
        p = new_pos[self._new_real]
        rows = torch.arange(len(seqs), device=device)[:, None].expand(-1, T)[self._new_real]
        if bool((p // bs >= torch.tensor([len(s.table) for s in seqs], device=device)[rows]).any()):
            raise RuntimeError("a sequence's new positions run past its block table: "
                               "reserve slots at admission")
        self._new_slots = tables[rows, p // bs] * bs + p % bs
        self._linear = seqs[0]._linear

    @property
    def starts(self) -> torch.Tensor:
        return self._starts

    def attn_past_padded(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = self._past_slots.flatten()
        B, S = self._past_slots.shape
        k = self.kv.k[layer_idx].flatten(0, 1).index_select(0, flat).view(B, S, *self.kv.k[layer_idx].shape[2:])
        v = self.kv.v[layer_idx].flatten(0, 1).index_select(0, flat).view(B, S, *self.kv.v[layer_idx].shape[2:])
        return k, v, self._valid

    def attn_write(self, layer_idx: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        kc, vc = self.kv.k[layer_idx], self.kv.v[layer_idx]
        kc.flatten(0, 1).index_copy_(0, self._new_slots, k_new[self._new_real].to(kc.dtype))
        vc.flatten(0, 1).index_copy_(0, self._new_slots, v_new[self._new_real].to(vc.dtype))

    def ssm_states(self, layer_idx: int) -> torch.Tensor:
        states = [s.ssm_state(layer_idx) for s in self.seqs]
        ref = next((x for x in states if x is not None), None)
        if ref is None:
            raise RuntimeError(f"no sequence holds a state for linear layer {layer_idx}")
        return torch.stack([x if x is not None else torch.zeros_like(ref) for x in states])

    def set_ssm_traces(self, layer_idx: int, states: torch.Tensor) -> None:
        for b, s in enumerate(self.seqs):
            s.set_ssm_trace(layer_idx, states[b])
