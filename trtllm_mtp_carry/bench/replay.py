"""The in-process driver: replay benchmark sessions on the reference engine, every policy in lockstep.

Every policy sees the same sessions in the same order; since the policies
never change generated tokens, the prompts of every turn are identical across
policies too, and `outputs_identical` checks exactly that.

Each replay of the session set gets a fresh engine per policy (so a replay's
first turns are really cold: no prefix cache or carried rows left over from
the one before), while torch's own first-call costs are paid once per
process. Replay 0 of a run with `repeat > 1` is the warm-up: it is recorded
but the summaries leave it out.

    replay 0 (warm-up)   replay 1            ...  replay repeat-1
    | s0 t0 t1 t2 | s1 ..| s0 t0 t1 t2 | s1 ..|    (t0 cold, t1.. warm)

A bench policy is a drafter policy, or `carry-<row dtype>` (`carry-fp8`): the
carry with its entries stored in that row format (`carry_row_dtype`), so the
formats run side by side in one lockstep run (`BenchPolicy`); or `carry-host`:
the carry with one device slot and a host tier holding every session
(`EngineConfig.carry_host_only`), so with two or more sessions interleaved every
warm turn adopts rows restored from host memory, paired with `carry`'s device hits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, is_dataclass, replace
from typing import Any

from ..core.row_format import ROW_DTYPES
from ..engine.engine import EngineConfig, ReferenceEngine
from ..engine.model import HybridLM
from ..engine.tokenizer import ChatTokenizer
from ..runtime.policy import DrafterPolicy
from .driver import PolicyRun, TurnRecord, check_counts
from .options import HOST_VARIANT
from .sessions import BenchSession


@dataclass(frozen=True)
class BenchPolicy:
    """A bench policy: its `name` in the report, the drafter `policy` it runs, and for a
    `carry-<row dtype>` variant the row format of its carried entries (None: the process's)."""

    name: str
    policy: DrafterPolicy
    row_dtype: str | None = None
    host_only: bool = False  # `carry-host`: one device slot, every other entry in the host tier

    @classmethod
    def parse(cls, value: BenchPolicy | DrafterPolicy | str) -> BenchPolicy:
        """The bench policy `value` names; ValueError listing the valid names otherwise."""
        if isinstance(value, BenchPolicy):
            return value
        if isinstance(value, DrafterPolicy):
            return cls(value.value, value)
        base, sep, dtype = str(value).partition("-")
        if str(value) == HOST_VARIANT:
            return cls(HOST_VARIANT, DrafterPolicy.CARRY, host_only=True)
        if sep and base == DrafterPolicy.CARRY.value and dtype in ROW_DTYPES:
            return cls(str(value), DrafterPolicy.CARRY, dtype)
        try:
            return cls(str(value), DrafterPolicy.parse(str(value)))
        except ValueError:
            names = [p.value for p in DrafterPolicy]
            names[1:1] = [f"carry-{d}" for d in ROW_DTYPES] + [HOST_VARIANT]
            raise ValueError(f"unknown drafter policy {value!r}; expected one of {', '.join(names)}") from None


def _engine_config(bench: BenchPolicy, config: EngineConfig) -> EngineConfig:
    """`config` for `bench`'s engine: its drafter policy, row format and host-only carry."""
    return replace(config, policy=bench.policy, carry_row_dtype=bench.row_dtype or config.carry_row_dtype,
                   carry_host_only=bench.host_only)


def replay(
    model: HybridLM, tokenizer: ChatTokenizer, sessions: Sequence[BenchSession],
    policy: BenchPolicy | DrafterPolicy, config: EngineConfig, max_new_tokens: int, concurrency: int,
    interleave: bool, run: PolicyRun, replay_index: int = 0,
) -> Iterator[PolicyRun]:
    """Run every session's turns under `policy` on a fresh engine, appending to `run`;
    yields after each finished turn.

    Up to `concurrency` sessions are in flight at once (one turn each);
    `interleave` starts sessions round-robin turn by turn instead of
    finishing the first session's turns first. The caller drives the
    generator, so several policies can advance in lockstep.
    """
    bench = BenchPolicy.parse(policy)
    policy = bench.policy
    engine = ReferenceEngine(model, tokenizer, _engine_config(bench, config))
    engine.generate(None, tokenizer.render_chat([{"role": "user", "content": "warm up"}]),
                    max_new_tokens=4, policy=policy)  # first-call costs stay out of the figures
    prompts = {s.name: tokenizer.render_chat(s.history) for s in sessions}
    next_turn = {s.name: 0 for s in sessions}
    by_name = {s.name: s for s in sessions}
    inflight: dict[int, str] = {}
    cursor = 0
    target_peak = 0  # target KV blocks held (live and cached), most after any step
    run.busy_s.setdefault(replay_index, 0.0)

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
        t0 = time.perf_counter()
        while len(inflight) < concurrency and (name := candidate()) is not None:
            rid = engine.submit(name, prompts[name], max_new_tokens=max_new_tokens, policy=policy)
            inflight[rid] = name
        if not inflight:
            break
        results = engine.step()
        run.busy_s[replay_index] += time.perf_counter() - t0
        blocks = engine.blocks.stats()
        target_peak = max(target_peak, blocks.num_blocks - blocks.num_free)
        for result in results:
            name = inflight.pop(result.request_id)
            run.turns.append(TurnRecord(name, next_turn[name], result.stats.as_dict(), result.output,
                                        replay_index))
            followups = by_name[name].followups
            if next_turn[name] < len(followups):
                prompts[name] = tokenizer.next_prompt(result.prompt, result.output,
                                                      followups[next_turn[name]])
            next_turn[name] += 1
            yield run
    engine.check()
    stats = engine.runtime.stats()  # a dataclass of counters (nested ones too), whatever it holds
    run.runtime[replay_index] = asdict(stats) if is_dataclass(stats) else dict(vars(stats))
    run.runtime[replay_index]["drafter_blocks_peak"] = engine.drafter_blocks_peak
    run.runtime[replay_index]["target_blocks_peak"] = target_peak
    run.runtime[replay_index]["target_blocks"] = config.num_target_blocks
    run.runtime[replay_index]["drafter_blocks"] = config.num_drafter_blocks
    pack_ms, unpack_ms = engine.runtime.pack_times()
    if pack_ms or unpack_ms:  # packed (fp8, nvfp4): each pack (deposit) and unpack (adoption)
        run.runtime[replay_index]["pack_ms_each"] = pack_ms
        run.runtime[replay_index]["unpack_ms_each"] = unpack_ms
    if policy is DrafterPolicy.PAIRED:
        run.runtime[replay_index]["paired"] = asdict(engine.paired.stats())
    yield run


def replay_lockstep(
    model: HybridLM, tokenizer: ChatTokenizer, sessions: Sequence[BenchSession],
    policies: Sequence[BenchPolicy | DrafterPolicy], config: EngineConfig, max_new_tokens: int,
    concurrency: int, interleave: bool, repeat: int = 1,
) -> Iterator[list[PolicyRun]]:
    """Replay the session set `repeat` times under every policy, one turn of each in turn;
    yields the runs so far after every finished turn (so an interrupted caller keeps them).

    Lockstep keeps slow drift of the machine (other load, allocator state,
    frequency) from favouring whichever policy happened to run first.
    """
    parsed = [BenchPolicy.parse(p) for p in policies]
    runs = [PolicyRun(p.name) for p in parsed]
    for r in range(repeat):
        runners = [replay(model, tokenizer, sessions, p, config, max_new_tokens, concurrency,
                          interleave, run, r) for p, run in zip(parsed, runs, strict=True)]
        active = list(range(len(runners)))
        while active:
            for i in list(active):
                try:
                    next(runners[i])
                except StopIteration:
                    active.remove(i)
                    continue
                yield runs
    yield runs


class LocalDriver:
    """The bench's in-process driver (`driver.Driver`): `replay_lockstep` over `model`,
    with engines sized by `config`, `repeat` replays, up to `concurrency` sessions in
    flight per engine (round-robin turn by turn with `interleave`)."""

    def __init__(self, model: HybridLM, tokenizer: ChatTokenizer, config: EngineConfig,
                 max_new_tokens: int, concurrency: int = 1, interleave: bool = False,
                 repeat: int = 1) -> None:
        check_counts(concurrency, repeat)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_new_tokens, self.concurrency = max_new_tokens, concurrency
        self.interleave, self.repeat = interleave, repeat

    def replay(self, sessions: Sequence[BenchSession], policies: Sequence[Any]) -> Iterator[list[PolicyRun]]:
        """Every policy (DrafterPolicy, BenchPolicy or name; ValueError naming an unknown one) on
        its own fresh engine per replay; yields the runs so far after every finished turn."""
        parsed = [BenchPolicy.parse(p) for p in policies]
        return replay_lockstep(self.model, self.tokenizer, sessions, parsed, self.config,
                               self.max_new_tokens, self.concurrency, self.interleave, self.repeat)

    def report_lines(self, runs: Sequence[PolicyRun]) -> list[str]:
        """Nothing: the report says all there is of an in-process run."""
        return []
