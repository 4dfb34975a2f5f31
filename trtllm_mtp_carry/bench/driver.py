"""The bench's drivers: one interface, one implementation per target (torch-free).

What it is for: `trtllm-mtp-carry bench` replays the same sessions under
every policy on one of three targets, and reports them with the same code.
A `Driver` takes the sessions and the policy names and gives back the
bench's records, one `PolicyRun` per policy:

- `replay.LocalDriver`: in process, a fresh reference engine per policy and replay;
- `triton_driver.TritonDriver`: a running Triton server (`bench --server`),
  through `serve.triton.client`;
- `openai_driver.OpenAIDriver`: Dynamo's OpenAI API (`bench --openai`),
  through `serve.dynamo.openai_client`.

Shared here, once: the records (`TurnRecord`, `PolicyRun`), the lockstep
schedule of the remote drivers (`lockstep_batches`: turn round by turn round,
the policies' order rotating every round and replay) and the final order of
the records (`sort_turns`). The in-process driver keeps its own lockstep
(`replay.replay_lockstep`): each policy has its own engine there, stepped
one finished turn at a time, so its sessions run concurrently inside an
engine rather than in client batches.

Invariants every driver keeps: `replay` yields the runs so far, in the
policies' order, after every finished turn (or batch of turns) and once
more at the end, so an interrupted caller keeps what finished; turns are
tagged with their replay, and replay 0 of `repeat > 1` is the warm-up the
report leaves out; a turn the target refuses raises RuntimeError (or
TimeoutError) naming session, turn and message; generated tokens are the
target's own (the report's `outputs_identical` compares them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .sessions import BenchSession


@dataclass
class TurnRecord:
    """One replayed turn: which replay, session and turn, its statistics and output."""

    session: str
    turn: int
    stats: dict[str, Any]
    output: list[int]
    replay: int = 0

    @property
    def key(self) -> tuple[int, str, int]:
        """What pairs this turn with the same turn under another policy."""
        return (self.replay, self.session, self.turn)


@dataclass
class PolicyRun:
    """All turns of one policy, with its engine's busy time and counters per replay."""

    policy: str
    turns: list[TurnRecord] = field(default_factory=list)
    busy_s: dict[int, float] = field(default_factory=dict)  # replay -> seconds in submit/step
    runtime: dict[int, dict[str, Any]] = field(default_factory=dict)  # replay -> runtime stats


class Driver(Protocol):
    """Replays the bench's sessions on one target (see the module header's invariants)."""

    def replay(self, sessions: Sequence[BenchSession], policies: Sequence[Any]) -> Iterator[list[PolicyRun]]:
        """Replay `sessions` under each policy (a DrafterPolicy or its name), every policy
        in lockstep; yields one `PolicyRun` per policy, in `policies`' order, so far."""
        ...

    def report_lines(self, runs: Sequence[PolicyRun]) -> list[str]:
        """Lines this target adds after the report (none, or where its router placed the turns)."""
        ...


def policy_names(policies: Sequence[Any]) -> list[str]:
    """The names of `policies` (DrafterPolicy members or their names), in order."""
    return [str(getattr(p, "value", p)) for p in policies]


def check_counts(concurrency: int, repeat: int) -> None:
    """ValueError naming a concurrency or repeat count below 1."""
    if concurrency <= 0:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if repeat <= 0:
        raise ValueError(f"repeat must be >= 1, got {repeat}")


def replay_all(driver: Driver, sessions: Sequence[BenchSession], policies: Sequence[Any]) -> list[PolicyRun]:
    """`driver.replay` run to the end: one `PolicyRun` per policy, in `policies`' order."""
    last: list[PolicyRun] = []
    for runs in driver.replay(sessions, policies):
        last = runs
    return last


def lockstep_batches(sessions: Sequence[BenchSession], names: Sequence[str], turns: int,
                     concurrency: int, replay_index: int) -> Iterator[tuple[int, str, list[BenchSession]]]:
    """The remote drivers' schedule of one replay: `(turn, policy, batch)` in order.

    Turn by turn; within a turn every policy in an order rotated by
    `replay_index + turn` (no policy always runs first), each policy's
    sessions that still have that turn in batches of `concurrency`.
    """
    for t in range(turns):
        k = (replay_index + t) % len(names)
        for policy in [*names[k:], *names[:k]]:
            live = [s for s in sessions if t <= len(s.followups)]
            for lo in range(0, len(live), concurrency):
                yield t, policy, live[lo:lo + concurrency]


def sort_turns(runs: Iterable[PolicyRun], sessions: Sequence[BenchSession]) -> None:
    """Sort each run's turns by (replay, turn, session in `sessions`' order)."""
    order = {s.name: i for i, s in enumerate(sessions)}
    for run in runs:
        run.turns.sort(key=lambda rec: (rec.replay, rec.turn, order[rec.session]))
