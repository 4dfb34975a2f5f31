"""The carry's one fault ledger: every executor counts, logs and recovers from faults here.

What it is for: no exception inside the carry may leave a call an executor makes
(the reference engine's glue, TensorRT-LLM's resource-manager protocol). A fault
costs the turn it belongs to its carry (it adopts and deposits nothing more) and
nothing else; the executor serves the next step. The ledger counts each fault by
exception class (`faults`) and by step (`fault_steps`, the steps of `FAULT_STEPS`),
logs the first fault of each (step, class) pair once, marks the turn, and keeps an
ended turn's fault until the executor reads it (`take`). `guarded` wraps an
executor's method so a fault is recorded and a recovery callable answers instead.

Invariants:
- One vocabulary: every executor records its faults at one of `FAULT_STEPS`.
- A turn is counted in `turns_faulted` once, at its first fault; later faults of the
  same turn are counted by class and step only.
- Each (step, class) pair is logged once per ledger; later ones are counted, not logged.
- An ended turn's fault is kept until `take` or until `TURN_FAULT_LOG` newer turns ended.
- Thread-safe: counters may be read while an executor thread records.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar, cast

from ..core.carry_store import remember
from ..core.outcome import Fault

logger = logging.getLogger("trtllm_mtp_carry")

FAULT_STEPS: tuple[str, ...] = (
    "prepare",  # admission: expiry, the adopt decision, the take (a host restore), the rows into the turn's pages
    "build",  # rows the executor builds for a prefill chunk (the reference engine builds its own)
    "append",  # the reference engine's decode-step row appends
    "deposit",  # the turn's end: the deposit plan, the rows out of its pages, host demotions, the put
    "release",  # a turn that deposits nothing: its rows freed, its lease ended
    "other",  # calls outside a turn: reporting, shutdown, an executor's bookkeeping
)
"""Where a fault was caught, in the order `CarryStats.fault_steps` lists them."""

TURN_FAULT_LOG = 4096
"""How many ended turns' faults the ledger keeps until `take` reads them (oldest dropped first)."""

F = TypeVar("F", bound=Callable[..., Any])


class FaultLedger:
    """Faults counted by class and step, logged once per (step, class), and marked per turn."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.faults: Counter[str] = Counter()  # by exception class name
        self.steps: Counter[str] = Counter()  # by FAULT_STEPS
        self.turns_faulted = 0
        self._logged: set[tuple[str, str]] = set()
        self._live: dict[Hashable, Fault] = {}  # turn -> its first fault (live turns)
        self._ended: OrderedDict[Hashable, Fault] = OrderedDict()  # ended turns' faults, until taken

    def record(self, step: str, exc: BaseException, turn: Hashable | None = None) -> Fault:
        """Count `exc` caught at `step`, log it if its (step, class) is new, and mark `turn`
        (None: no turn) as faulted. Returns the turn's first fault (this one if it is the first).
        ValueError for a step outside `FAULT_STEPS` (a caller bug)."""
        if step not in FAULT_STEPS:
            raise ValueError(f"fault step must be one of {FAULT_STEPS}, got {step!r}")
        error = type(exc).__name__
        fault = Fault(step, error)
        with self._lock:
            self.faults[error] += 1
            self.steps[step] += 1
            first = (step, error) not in self._logged
            self._logged.add((step, error))
            if turn is not None:
                if turn in self._live:
                    fault = self._live[turn]
                else:
                    self._live[turn] = fault
                    self.turns_faulted += 1
        if first:
            logger.warning("mtp carry: %s raised %s (%s): that turn runs without the carry and the "
                           "executor goes on; later %s faults at %s are counted, not logged",
                           step, error, exc, error, step)
        return fault

    def faulted(self, turn: Hashable) -> Fault | None:
        """The first fault of live turn `turn`, or None."""
        with self._lock:
            return self._live.get(turn)

    def end_turn(self, turn: Hashable) -> None:
        """`turn` ended: its fault, if any, waits for `take`."""
        with self._lock:
            fault = self._live.pop(turn, None)
            if fault is not None:
                remember(self._ended, turn, fault, TURN_FAULT_LOG)

    def take(self, turn: Hashable) -> Fault | None:
        """The fault that cost `turn` its carry (None: none), removed: each is read once."""
        with self._lock:
            fault = self._ended.pop(turn, None)
            return self._live.get(turn) if fault is None else fault

    def counts(self) -> tuple[dict[str, int], dict[str, int], int]:
        """`(faults by class, faults by step in FAULT_STEPS order, turns faulted)`: a snapshot."""
        with self._lock:
            return (dict(sorted(self.faults.items())), {s: self.steps.get(s, 0) for s in FAULT_STEPS},
                    self.turns_faulted)


def guarded(step: str, recover: Callable[..., Any] | None = None, *, turn: bool = True, ends: bool = False,
            passthrough: tuple[type[BaseException], ...] = ()) -> Callable[[F], F]:
    """Wrap an executor method so no exception (other than `passthrough`) leaves it.

    The instance's `ledger` records the fault at `step`; with `turn`, the method's first
    argument names the turn. `recover(self, *args, **kwargs)` then answers instead (None
    returns None). With `ends` (the turn's end), a turn that faulted earlier goes straight
    to `recover`, and the turn ends in the ledger whatever happens. The wrapped method is
    the executor's own: its public caller checks the arguments first, so a caller's bad
    argument raises its ValueError and is never counted as a fault."""
    if step not in FAULT_STEPS:
        raise ValueError(f"fault step must be one of {FAULT_STEPS}, got {step!r}")

    def answer(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return None if recover is None else recover(self, *args, **kwargs)

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            ledger: FaultLedger = self.ledger
            who = args[0] if turn and args else None
            try:
                if ends and who is not None and ledger.faulted(who) is not None:
                    return answer(self, args, kwargs)
                return method(self, *args, **kwargs)
            except passthrough:
                raise
            except Exception as exc:
                ledger.record(step, exc, who)
                return answer(self, args, kwargs)
            finally:
                if ends and who is not None:
                    ledger.end_turn(who)
        return cast(F, run)
    return wrap
