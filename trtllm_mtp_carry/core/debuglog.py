"""The carry's debug log: one line per carry store and per adopt decision.

Lines go to the standard `logging` logger `trtllm_mtp_carry` at INFO, and only
when `mtp_carry_debug()` is on, so production logs stay quiet by default.
"""

from __future__ import annotations

import logging

from .drafter import CarriedDrafter
from .outcome import CarryOutcome
from .settings import mtp_carry_debug

logger = logging.getLogger("trtllm_mtp_carry")


def log_adopt(outcome: CarryOutcome, session_hash: int, ticket: int, prompt_len: int) -> None:
    """Log one adopt decision (its outcome text) when the debug switch is on."""
    if mtp_carry_debug():
        logger.info(
            "mtp carry adopt: session=0x%016x ticket=%d prompt_len=%d: %s",
            session_hash,
            ticket,
            prompt_len,
            outcome,
        )


def log_store(entry: CarriedDrafter, ticket: int) -> None:
    """Log one carry store (a finished sequence's rows entering the carry store) when debug is on."""
    if mtp_carry_debug():
        logger.info(
            "mtp carry store: session=0x%016x ticket=%d rows=%d last_pair_key=%s blocks=%d tokens=%d",
            entry.session_hash,
            ticket,
            entry.rows,
            entry.last_pair_key,
            len(entry.block_table),
            len(entry.tokens),
        )
