"""What a turn returns: its output and its statistics (times in milliseconds)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class DraftRates:
    """`acceptance` and `accepted_per_step` of a turn's `drafted`, `accepted` and `verify_steps`
    (every executor's turn statistics report them the same way)."""

    drafted: int
    accepted: int
    verify_steps: int

    @property
    def acceptance(self) -> float:
        """Accepted drafts / drafted tokens (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accepted_per_step(self) -> float:
        """Accepted draft tokens per verify step (0 before the first step)."""
        return self.accepted / self.verify_steps if self.verify_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Every field, with `acceptance` and `accepted_per_step` (the turn statistics' JSON)."""
        return {**self.__dict__, "acceptance": self.acceptance, "accepted_per_step": self.accepted_per_step}


@dataclass
class TurnStats(DraftRates):
    """What one turn cost and bought (times in milliseconds)."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    snapshot_restored: bool = False
    policy: str = ""
    outcome: str = ""  # the drafter preparation, as a log line
    outcome_kind: str = ""  # decided at admission: the CarryOutcome's kind, else the mode ("": not admitted)
    no_carry_reason: str = ""  # a no_carry outcome's reason (NO_CARRY_REASONS), else ""
    fault_step: str = ""  # where a fault cost the turn its carry, else "" (outcome_kind `fault`: at prepare)
    drafter_rows_kept: int = 0
    drafter_rows_computed: int = 0
    keys_skipped: int = 0
    drafter_prep_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    output_tokens: int = 0
    # `paired` only (0 otherwise): the drafter tree's match, the target-held depth it
    # lacked, and the target tokens recomputed because the resume was capped at it
    drafter_tree_tokens: int = 0
    drafter_depth_lost: int = 0
    recomputed_for_cap: int = 0


@dataclass(frozen=True)
class TurnResult:
    """A finished (or cancelled) request: output tokens, text and statistics."""

    request_id: int
    session_id: str | int | None
    prompt: list[int]
    output: list[int]
    text: str
    finish_reason: str  # "stop" (end of turn), "length" or "cancelled"
    stats: TurnStats
