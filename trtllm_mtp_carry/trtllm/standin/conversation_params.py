"""Stand-in for `tensorrt_llm/conversation_params.py` (read at 38198e34, notes section 0).

`@dataclass(slots=True, kw_only=True) class ConversationParams: conversation_id: str`,
stripped; empty is a ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, kw_only=True)
class ConversationParams:
    """Stand-in for `tensorrt_llm.conversation_params.ConversationParams` (stripped, non-empty)."""

    conversation_id: str

    def __post_init__(self) -> None:
        self.conversation_id = self.conversation_id.strip()
        if not self.conversation_id:
            raise ValueError("conversation_id must be a non-empty string")
