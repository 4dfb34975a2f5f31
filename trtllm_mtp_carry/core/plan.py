"""The warm-turn append plan, and where a hidden row lives in memory.

A warm turn keeps the carried rows and computes only the missing pair keys,
reading target hidden states the prefill stored by absolute position:

```
  | carried rows (kept) | skipped keys | appended rows |
  0              last_pair_key   hidden_lo        L - 2
```

Keys below the store's floor (`hidden_lo`) are skipped, not left as holes:
rows are compacted while RoPE stays in sequence space.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import check_non_negative, check_optional_key

BF16_BYTES = 2


@dataclass(frozen=True, slots=True)
class AppendPlan:
    """Append `rows` drafter rows for pair keys `first_key ..= first_key + rows - 1`."""

    first_key: int
    rows: int

    @property
    def last_key(self) -> int:
        """Key of the last appended row."""
        return self.first_key + self.rows - 1


def plan_append(
    last_pair_key: int | None, prompt_len: int, hidden_lo: int, hidden_hi: int
) -> AppendPlan | None:
    """The append after `last_pair_key` for a prompt of `prompt_len` tokens.

    Reads hidden rows `[hidden_lo, hidden_hi)`. `first_key` is
    `max(last_pair_key + 1, hidden_lo)` (`last_pair_key=None` means no rows
    yet), and the plan covers keys `first_key ..= prompt_len - 2`. `None` when
    no key is missing, when `prompt_len < 2`, or when the store does not cover
    `[first_key, prompt_len - 2]` (`hidden_hi` is exclusive).
    """
    check_optional_key("last_pair_key", last_pair_key)
    check_non_negative("prompt_len", prompt_len)
    check_non_negative("hidden_lo", hidden_lo)
    check_non_negative("hidden_hi", hidden_hi)
    if hidden_lo > hidden_hi:
        raise ValueError(f"hidden interval needs lo <= hi, got [{hidden_lo}, {hidden_hi})")
    if prompt_len < 2:
        return None
    last_needed = prompt_len - 2
    first_key = max(0 if last_pair_key is None else last_pair_key + 1, hidden_lo)
    if first_key > last_needed or hidden_hi <= last_needed:
        return None
    return AppendPlan(first_key, last_needed - first_key + 1)


def chunk_keys(seq_id: int, next_key: int | None, start: int, end: int,
               prompt_len: int) -> tuple[int, int] | None:
    """The pair keys `(first, last)` (inclusive) that the prefill chunk of positions
    `[start, end)` lets sequence `seq_id` build, `next_key` being the next key it
    still needs (None: nothing left); None when the chunk holds none of them.

    A chunk's forward writes the hidden rows of keys `[start, end)`, and keys stop
    at `prompt_len - 2`. RuntimeError when the chunk starts past `next_key`:
    chunks must run in order, or a key would never be built.
    """
    if next_key is None:
        return None
    first, last = max(next_key, start), min(end - 1, prompt_len - 2)
    if first > last:
        return None
    if first != next_key:
        raise RuntimeError(f"sequence {seq_id}: chunk [{start}, {end}) skips key "
                           f"{next_key} (chunks must run in order)")
    return first, last


def hidden_row_offset(base: int, pos: int, hidden_size: int) -> int:
    """Byte address of hidden row `pos` in a `[capacity, hidden_size]` BF16 store at `base`."""
    check_non_negative("base", base)
    check_non_negative("pos", pos)
    check_non_negative("hidden_size", hidden_size)
    return base + pos * hidden_size * BF16_BYTES
