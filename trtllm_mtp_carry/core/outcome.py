"""`CarryOutcome`: the result of one carry attempt, for logging, metrics and tests.

Variants are frozen dataclasses reached as `CarryOutcome.Adopted(...)` and so
on; they compare equal by fields, and `str()` gives the log text. `kind` is a
stable snake_case name for counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


class CarryOutcome:
    """Base of the six outcome variants; never instantiated itself."""

    __slots__ = ()
    kind: ClassVar[str]
    Adopted: ClassVar[type[Adopted]]
    NoCarry: ClassVar[type[NoCarry]]
    PrefixMismatch: ClassVar[type[PrefixMismatch]]
    ForeignSession: ClassVar[type[ForeignSession]]
    ForeignHiddens: ClassVar[type[ForeignHiddens]]
    NoHiddens: ClassVar[type[NoHiddens]]

    @property
    def adopted(self) -> bool:
        """Whether the carried rows were adopted."""
        return False


@dataclass(frozen=True, slots=True)
class Adopted(CarryOutcome):
    """Kept `rows` carried rows and appended `appended` rows starting at key `first_key`."""

    rows: int
    appended: int
    first_key: int
    kind: ClassVar[str] = "adopted"

    @property
    def adopted(self) -> bool:
        return True

    def __str__(self) -> str:
        return f"adopted rows={self.rows} appended={self.appended} first_key={self.first_key}"


@dataclass(frozen=True, slots=True)
class NoCarry(CarryOutcome):
    """Nothing was carried (the store was empty)."""

    kind: ClassVar[str] = "no_carry"

    def __str__(self) -> str:
        return "no carried state"


@dataclass(frozen=True, slots=True)
class PrefixMismatch(CarryOutcome):
    """The prompt shares only `common` tokens with the entry: no row survives."""

    common: int
    entry_rows: int
    kind: ClassVar[str] = "prefix_mismatch"

    def __str__(self) -> str:
        return f"prefix mismatch (common={self.common} entry_rows={self.entry_rows})"


@dataclass(frozen=True, slots=True)
class ForeignSession(CarryOutcome):
    """The store holds only other sessions' rows (or the prompt has no session)."""

    entry_session: int
    prompt_session: int
    kind: ClassVar[str] = "foreign_session"

    def __str__(self) -> str:
        return (
            f"foreign session (entry=0x{self.entry_session:016x} "
            f"prompt=0x{self.prompt_session:016x})"
        )


@dataclass(frozen=True, slots=True)
class ForeignHiddens(CarryOutcome):
    """The hidden store holds rows of ticket `owner`, not of the reader `expected`."""

    owner: int
    expected: int
    kind: ClassVar[str] = "foreign_hiddens"

    def __str__(self) -> str:
        return f"hidden rows belong to sequence gen {self.owner}, not {self.expected}"


@dataclass(frozen=True, slots=True)
class NoHiddens(CarryOutcome):
    """The hidden store does not cover the keys the append needs."""

    kind: ClassVar[str] = "no_hiddens"

    def __str__(self) -> str:
        return "hidden store does not cover the append span"


CarryOutcome.Adopted = Adopted
CarryOutcome.NoCarry = NoCarry
CarryOutcome.PrefixMismatch = PrefixMismatch
CarryOutcome.ForeignSession = ForeignSession
CarryOutcome.ForeignHiddens = ForeignHiddens
CarryOutcome.NoHiddens = NoHiddens

OUTCOME_KINDS: tuple[str, ...] = tuple(
    v.kind for v in (Adopted, NoCarry, PrefixMismatch, ForeignSession, ForeignHiddens, NoHiddens)
)
"""Every variant's `kind`, in SPEC order (for counters that list zeros too)."""
