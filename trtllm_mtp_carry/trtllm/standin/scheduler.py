"""Stand-in for `tensorrt_llm/_torch/pyexecutor/scheduler.py`: `ScheduledRequests` (notes section 0, 38198e34).

Invariant: one step's batch: context requests (one chunk each) and generation requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .conformant import Conformant


@dataclass
class ScheduledRequests(Conformant):
    """Stand-in for the scheduler's batch: context requests (one chunk each) and generation requests."""

    TRTLLM_CLASS = "ScheduledRequests"

    context_requests: list[Any] = field(default_factory=list)
    generation_requests: list[Any] = field(default_factory=list)

    def all_requests(self) -> list[Any]:
        return self.context_requests + self.generation_requests
