"""The carry service (layer 3): one carry beneath every executor.

`CarryService` owns the carry store, where rows live (a device home and one host tier), the
lock, the fault ledger and the counters; the reference engine's glue (`runtime/`) and
TensorRT-LLM's resource manager (`trtllm/manager.py`) translate their events into its calls.

Importing this package loads no torch: the fault ledger and `CarryStats` are read by front ends
that never touch rows (the adapter's `attach` module, the metrics exporters); `CarryService` and
`DepositPlan` (and the homes, the host tier) load torch when first named.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .ledger import FAULT_STEPS, FaultLedger, guarded
from .stats import SKIP_REASONS, TURN_KINDS, VETO_STEPS, CarryStats, TurnCounters

if TYPE_CHECKING:
    from .service import CarryService, DepositPlan

__all__ = ["FAULT_STEPS", "SKIP_REASONS", "TURN_KINDS", "VETO_STEPS", "CarryService", "CarryStats", "DepositPlan",
           "FaultLedger", "TurnCounters", "guarded"]


def __getattr__(name: str) -> Any:
    if name in ("CarryService", "DepositPlan"):  # torch: loaded on first use only
        from . import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
