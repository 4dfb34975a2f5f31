"""The adopt decision a runtime takes on a warm turn, as a pure function.

Refusals are ordered so that identity is checked before content: a foreign
session is refused before its tokens are compared, and hidden rows of another
ticket are refused before their interval is read. On any refusal the turn runs
as it would without the carry; output is unchanged either way, because the
target verifies every draft (drafter rows cost acceptance, never correctness).
"""

from __future__ import annotations

from ._checks import check_u64
from .drafter import CarriedDrafter
from .outcome import (
    Adopted,
    CarryOutcome,
    ForeignHiddens,
    ForeignSession,
    NoCarry,
    NoHiddens,
    PrefixMismatch,
)
from .plan import plan_append
from .store_range import StoreRange
from .tokens import Tokens, as_token_buffer, as_token_list


def decide_adopt(
    entry: CarriedDrafter | None,
    prompt: Tokens,
    session_hash: int,
    ticket: int,
    store: StoreRange,
) -> CarryOutcome:
    """What sequence `ticket` of session `session_hash` may adopt for `prompt`.

    Call it only when the carry is armed. `Adopted(rows, appended, first_key)`
    means: keep the first `rows` carried rows, then compute `appended` rows for
    keys `first_key ..`; every other variant means "run without the carry".
    `prompt` may be a list of ints or a token buffer (`array('q')`, a numpy
    integer array, an integer tensor): a buffer is compared without a Python
    loop or a per-token int compare (`tokens.py`).
    """
    check_u64("session_hash", session_hash)
    check_u64("ticket", ticket)
    if entry is None:
        return NoCarry()
    if not entry.session_matches(session_hash):
        return ForeignSession(entry.session_hash, session_hash)
    buffer = as_token_buffer(prompt)
    tokens = buffer if buffer is not None else as_token_list(prompt)
    common = entry.common_prefix_len(tokens)
    usable = entry.usable_at(common)
    if usable is None:
        return PrefixMismatch(common, entry.rows)
    rows, key = usable
    prompt_len = len(tokens)
    if key >= prompt_len - 2:
        return Adopted(rows, 0, key + 1)
    if store.owner != 0 and store.owner != ticket:
        return ForeignHiddens(store.owner, ticket)
    plan = plan_append(key, prompt_len, *store.visible_to(ticket))
    if plan is None:
        return NoHiddens()
    return Adopted(rows, plan.rows, plan.first_key)
