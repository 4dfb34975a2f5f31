"""The reference engine's carry (layer 4 glue over the carry service): its events, the service's calls.

`CarryRuntime` keeps the sequence tickets and the drafter policies and builds this engine's rows
per prefill chunk; the carry itself (store, homes, host tier, faults, stats) is `service.CarryService`.
`DrafterPolicy` names what a warm turn does about the drafter.
"""

from ..service import CarryStats
from .backend import CarryBackend
from .carry_runtime import CarryRuntime, DrafterPrep
from .policy import ALL_POLICIES, DrafterPolicy

__all__ = ["ALL_POLICIES", "CarryBackend", "CarryRuntime", "CarryStats", "DrafterPolicy", "DrafterPrep"]
