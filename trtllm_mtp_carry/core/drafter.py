"""The drafter KV of a finished turn, held in the carry store under its session hash.

`CarriedDrafter` is bookkeeping only: the block ids it names hold the drafter
rows in the data plane's pool, moved out of the finished sequence so that
freeing the sequence does not release them.

Invariants:
- Row `r` holds pair key `k` (`(embed(t_{k+1}), hidden_k)` at RoPE `k + 1`);
  rows are compacted, keys strictly increasing, so `rows <= last_pair_key + 1`.
- Pair key `k` consumed `tokens[0 ..= k + 1]`, so `last_pair_key <= len(tokens) - 2`.
- Identity is the non-zero session hash, never a shared token prefix: two
  sessions agree on hundreds of chat-template tokens.
- `token_buffer` holds the same tokens as `tokens`, as contiguous int64
  (`array('q')`), built once at deposit, so a prompt given as a buffer is
  compared in typed memory (None only if a token does not fit int64).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from ._checks import check_non_negative, check_optional_key, check_u64
from .tokens import Tokens, as_token_buffer, as_token_list, common_prefix_len, token_buffer


@dataclass(frozen=True, slots=True)
class CarriedDrafter:
    """Drafter rows of a finished turn, kept for the next turn of `session_hash`."""

    block_table: tuple[int, ...]
    rows: int
    last_pair_key: int | None
    tokens: list[int] = field(repr=False)
    session_hash: int
    token_buffer: array[int] | None = field(repr=False, compare=False)

    def __init__(
        self,
        block_table: Sequence[int],
        rows: int,
        last_pair_key: int | None,
        tokens: Tokens,
        session_hash: int,
    ) -> None:
        object.__setattr__(self, "block_table", tuple(block_table))
        object.__setattr__(self, "rows", check_non_negative("rows", rows))
        object.__setattr__(
            self, "last_pair_key", check_optional_key("last_pair_key", last_pair_key)
        )
        object.__setattr__(self, "tokens", list(as_token_list(tokens)))
        object.__setattr__(self, "session_hash", check_u64("session_hash", session_hash))
        object.__setattr__(self, "token_buffer", token_buffer(self.tokens))
        if self.last_pair_key is None:
            if self.rows != 0:
                raise ValueError(f"rows={self.rows} with last_pair_key=None: rows need keys")
        else:
            if self.rows > self.last_pair_key + 1:
                raise ValueError(
                    f"rows={self.rows} exceeds last_pair_key + 1 = {self.last_pair_key + 1}"
                    " (rows are compacted keys)"
                )
            if self.last_pair_key > len(self.tokens) - 2:
                raise ValueError(
                    f"last_pair_key={self.last_pair_key} past the tokens "
                    f"(len {len(self.tokens)}): key k consumes tokens[0 ..= k + 1]"
                )

    def with_block_table(self, block_table: Sequence[int]) -> CarriedDrafter:
        """This entry with its rows in other blocks (moved between tiers): the same rows, keys
        and tokens, shared, nothing rebuilt (the token buffer is O(tokens) to build)."""
        new = object.__new__(CarriedDrafter)
        for name in ("rows", "last_pair_key", "tokens", "session_hash", "token_buffer"):
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(new, "block_table", tuple(block_table))
        return new

    def common_prefix_len(self, prompt: Tokens) -> int:
        """Length of the common prefix of `tokens` and `prompt`.

        A prompt given as a buffer (`array('q')`, numpy, tensor) is compared with
        `token_buffer`; anything else as a list with `tokens`.
        """
        buffer = as_token_buffer(prompt)
        if buffer is not None and self.token_buffer is not None:
            return common_prefix_len(self.token_buffer, buffer)
        return common_prefix_len(self.tokens, as_token_list(prompt))

    def session_matches(self, session_hash: int) -> bool:
        """`session_hash != 0 and session_hash == self.session_hash`."""
        return session_hash != 0 and session_hash == self.session_hash

    def usable_by(self, prompt: Tokens, session_hash: int) -> tuple[int, int] | None:
        """`(rows_kept, key)` this session's `prompt` can adopt, or `None`.

        The kept key is `min(last_pair_key, common - 2)`; each key dropped from
        the top drops one row from the tail. Never a count below one.
        """
        if not self.session_matches(session_hash):
            return None
        return self.usable_at(self.common_prefix_len(prompt))

    def usable_at(self, common: int) -> tuple[int, int] | None:
        """`usable_by` for a prompt sharing `common` tokens, session already matched."""
        if self.last_pair_key is None or self.rows == 0 or common < 2:
            return None
        key = min(self.last_pair_key, common - 2)
        rows_kept = self.rows - (self.last_pair_key - key)
        if rows_kept <= 0:
            return None
        return (rows_kept, key)
