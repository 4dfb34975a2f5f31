"""The carry runtime (layer 3): engine-agnostic, talks to an engine through `CarryBackend`.

`CarryRuntime` keeps the carry store (`carry_slots()` sessions) and the sequence tickets between
requests; `DrafterPolicy` names what a warm turn does about the drafter.
"""

from .backend import CarryBackend
from .carry_runtime import CarryRuntime, CarryStats, DrafterPrep
from .policy import ALL_POLICIES, DrafterPolicy

__all__ = ["ALL_POLICIES", "CarryBackend", "CarryRuntime", "CarryStats", "DrafterPolicy", "DrafterPrep"]
