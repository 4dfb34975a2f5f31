"""The model-level hidden store: target hidden states indexed by absolute position.

What it is for: the drafter prompt prefill writes `hidden_i` at row `i`
(`mtp_prefill_hidden`, SPEC.md); a warm turn's carry reads the rows of the new
span back as the append input. The buffer is one `[capacity, hidden_size]`
tensor on one device; the sequence that wrote it is tracked by a `StoreRange`.

Invariants:
- `range` is updated with `stamped_merge` on every write, after the rows land.
- A read of rows `[a, b)` under ticket `t` is served only inside
  `range.visible_to(t)`; anything else raises `HiddenRowsNotVisible`.
- `row_address(pos) == hidden_row_offset(buffer.data_ptr(), pos, hidden_size)`:
  the address the TensorRT plugins compute agrees with the buffer.
- A refused write or read changes neither the buffer nor the range.
"""

from __future__ import annotations

import torch

from ..core._checks import check_u64
from ..core.plan import hidden_row_offset
from ..core.store_range import StoreRange, stamped_merge
from .ops import hidden_row_copy_direct as hidden_row_copy

__all__ = ["HiddenRowsNotVisible", "HiddenStore"]



class HiddenRowsNotVisible(RuntimeError):
    """A read asked for hidden rows its ticket did not write (a caller bug: plan first)."""


class HiddenStore:
    """A BF16 `[capacity, hidden_size]` buffer of hidden rows with its stamped `StoreRange`."""

    def __init__(
        self,
        capacity: int,
        hidden_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {hidden_size}")
        if dtype != torch.bfloat16:
            raise ValueError(f"the hidden store is BF16 (hidden_row_offset assumes it), got {dtype}")
        self.capacity = capacity
        self.hidden_size = hidden_size
        # buffer: [capacity, hidden_size] bf16
        self.buffer = torch.empty(capacity, hidden_size, dtype=dtype, device=device)
        self._range = StoreRange.EMPTY

    @property
    def range(self) -> StoreRange:
        """The rows written and the ticket that wrote them."""
        return self._range

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def visible_to(self, ticket: int) -> tuple[int, int]:
        """`(lo, hi)` readable by `ticket`, `(0, 0)` when it owns none."""
        return self._range.visible_to(ticket)

    def reset(self) -> None:
        """Forget every row (the range becomes `StoreRange.EMPTY`); the buffer is not cleared."""
        self._range = StoreRange.EMPTY

    def row_address(self, pos: int) -> int:
        """Byte address of row `pos`, equal to `hidden_row_offset(data_ptr, pos, hidden_size)`."""
        if not 0 <= pos < self.capacity:
            raise ValueError(f"pos must be in [0, capacity={self.capacity}), got {pos}")
        return hidden_row_offset(self.buffer.data_ptr(), pos, self.hidden_size)

    def write(
        self,
        ticket: int,
        start: int,
        rows: torch.Tensor,  # [n, hidden_size] bf16 on the store's device, unit column stride
    ) -> StoreRange:
        """Copy `rows` to store rows `[start, start + n)` for `ticket`; return the new range.

        The range is stamped with `stamped_merge(range, ticket, start, n)`.
        """
        check_u64("ticket", ticket)
        if rows.dim() != 2 or rows.shape[1] != self.hidden_size:
            raise ValueError(
                f"rows must have shape [n, hidden_size={self.hidden_size}], got {tuple(rows.shape)}"
            )
        if rows.dtype != self.buffer.dtype:
            raise ValueError(f"rows dtype must be {self.buffer.dtype}, got {rows.dtype}")
        if rows.device != self.buffer.device:
            raise ValueError(f"rows device {rows.device} differs from store device {self.buffer.device}")
        n = rows.shape[0]
        if start < 0 or start + n > self.capacity:
            raise ValueError(
                f"rows [start={start}, {start + n}) run past hidden store capacity {self.capacity}"
            )
        hidden_row_copy(rows, 0, self.buffer, start, n)
        self._range = stamped_merge(self._range, ticket, start, n)
        return self._range

    def read(
        self,
        ticket: int,
        a: int,
        b: int,
        out: torch.Tensor | None = None,  # [>= b - a, hidden_size] bf16, same device
    ) -> torch.Tensor:  # [b - a, hidden_size] bf16 (a view of `out` when given)
        """Copy rows `[a, b)` into a contiguous tensor; only inside `visible_to(ticket)`."""
        check_u64("ticket", ticket)
        if not 0 <= a <= b:
            raise ValueError(f"read needs 0 <= a <= b, got a={a} b={b}")
        lo, hi = self._range.visible_to(ticket)
        if a < b and not (lo <= a and b <= hi):
            raise HiddenRowsNotVisible(
                f"rows [{a}, {b}) are not visible to ticket {ticket}: it may read [{lo}, {hi}) "
                f"(store range owner={self._range.owner} [{self._range.lo}, {self._range.hi}))"
            )
        n = b - a
        if out is None:
            out = torch.empty(n, self.hidden_size, dtype=self.buffer.dtype, device=self.buffer.device)
        hidden_row_copy(self.buffer, a, out, 0, n)
        return out[:n]
