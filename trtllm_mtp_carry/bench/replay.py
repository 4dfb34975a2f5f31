"""Replay benchmark sessions on the reference engine, one fresh engine per policy.

Every policy sees the same sessions in the same order; since the policies
never change generated tokens, the prompts of every turn are identical across
policies too, and `outputs_identical` checks exactly that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.engine import EngineConfig, ReferenceEngine
from ..engine.model import HybridLM
from ..engine.tokenizer import ChatTokenizer
from ..runtime.policy import DrafterPolicy
from .sessions import BenchSession


@dataclass
class TurnRecord:
    """One replayed turn: where it sits, its statistics and its output tokens."""

    session: str
    turn: int
    stats: dict[str, Any]
    output: list[int]


@dataclass
class PolicyRun:
    """All turns of one policy, plus the runtime's counters at the end."""

    policy: str
    turns: list[TurnRecord] = field(default_factory=list)
    runtime: dict[str, Any] = field(default_factory=dict)


def next_prompt(tokenizer: ChatTokenizer, prompt: list[int], output: list[int], user: str) -> list[int]:
    """The next turn's prompt: this turn's prompt and answer, then the next user message."""
    closed = output if output and output[-1] == tokenizer.eos_id else [*output, tokenizer.eos_id]
    return [*prompt, *closed, *tokenizer.encode("\n"), *tokenizer.render_message("user", user),
            tokenizer.im_start_id, tokenizer.assistant_id]


def replay(
    model: HybridLM, tokenizer: ChatTokenizer, sessions: Sequence[BenchSession],
    policy: DrafterPolicy, config: EngineConfig, max_new_tokens: int, concurrency: int,
    interleave: bool,
) -> Iterator[PolicyRun]:
    """Run every session's turns under `policy`, yielding the growing run after each turn.

    `interleave` alternates sessions turn by turn; the caller drives the
    generator, so several policies can advance in lockstep.
    """
    engine = ReferenceEngine(model, tokenizer, config)
    engine.generate(None, tokenizer.render_chat([{"role": "user", "content": "warm up"}]),
                    max_new_tokens=4, policy=policy)  # first-call costs stay out of the figures
    run = PolicyRun(policy.value)
    prompts = {s.name: tokenizer.render_chat(s.history) for s in sessions}
    next_turn = {s.name: 0 for s in sessions}
    by_name = {s.name: s for s in sessions}
    inflight: dict[int, str] = {}
    cursor = 0

    def candidate() -> str | None:
        nonlocal cursor
        order = [s.name for s in sessions]
        start = cursor if interleave else 0
        for i in range(len(order)):
            name = order[(start + i) % len(order)]
            if name not in inflight.values() and next_turn[name] <= len(by_name[name].followups):
                cursor = (start + i + 1) % len(order)
                return name
        return None

    while True:
        while len(inflight) < concurrency and (name := candidate()) is not None:
            rid = engine.submit(name, prompts[name], max_new_tokens=max_new_tokens, policy=policy)
            inflight[rid] = name
        if not inflight:
            break
        for result in engine.step():
            name = inflight.pop(result.request_id)
            run.turns.append(TurnRecord(name, next_turn[name], result.stats.as_dict(), result.output))
            followups = by_name[name].followups
            if next_turn[name] < len(followups):
                prompts[name] = next_prompt(tokenizer, result.prompt, result.output,
                                            followups[next_turn[name]])
            next_turn[name] += 1
            yield run
    engine.check()
    run.runtime = engine.runtime.stats().__dict__
    yield run


def replay_lockstep(
    model: HybridLM, tokenizer: ChatTokenizer, sessions: Sequence[BenchSession],
    policies: Sequence[DrafterPolicy], config: EngineConfig, max_new_tokens: int,
    concurrency: int, interleave: bool, on_turn: Callable[[], None] | None = None,
) -> list[PolicyRun]:
    """Replay under every policy at once, one turn of each in turn.

    Lockstep keeps slow drift of the machine (other load, allocator state,
    frequency) from favouring whichever policy happened to run first.
    """
    runners = [replay(model, tokenizer, sessions, p, config, max_new_tokens, concurrency, interleave)
               for p in policies]
    runs: list[PolicyRun | None] = [None] * len(runners)
    active = list(range(len(runners)))
    while active:
        for i in list(active):
            before = runs[i]
            seen = len(before.turns) if before is not None else 0
            try:
                run = runs[i] = next(runners[i])
            except StopIteration:
                active.remove(i)
                continue
            if on_turn is not None and len(run.turns) > seen:
                on_turn()
    return [r for r in runs if r is not None]
