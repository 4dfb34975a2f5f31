"""The carry service (layer 3): one carry beneath every executor.

`CarryService` owns the carry store, where rows live (a device home and one host tier), the
lock, the fault ledger and the counters; the reference engine's glue (`runtime/`) and
TensorRT-LLM's resource manager (`trtllm/manager.py`) translate their events into its calls.
"""

from .ledger import FAULT_STEPS, FaultLedger, guarded
from .service import CarryService, DepositPlan
from .stats import SKIP_REASONS, TURN_KINDS, VETO_STEPS, CarryStats, TurnCounters

__all__ = ["FAULT_STEPS", "SKIP_REASONS", "TURN_KINDS", "VETO_STEPS", "CarryService", "CarryStats", "DepositPlan",
           "FaultLedger", "TurnCounters", "guarded"]
