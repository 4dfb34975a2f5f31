"""Faults inside the carry cost one turn its carry, never the engine's step (issue 37, item 8).

An exception injected at each call site the reference runtime makes into the carry store
(the adopt decision, the take, the put, the eviction ranking), the data plane (the
hidden-row read, the drafter-row append, the adoption, the free) and the host moves
(demote, restore): that turn's outcome is `fault` with the step named, it runs without
the carry and deposits nothing, the fault is counted by class and step and logged once
per (step, class), the engine's own pool checks pass (no block leaked or owned twice),
and the next turns, of the same session and of another, are served with plain greedy
output. The soak at the end is the issue's scenario in small: a store whose eviction
ranking raises every third call, under tight memory, across interleaved sessions.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter

import pytest
import torch
from engine_factories import engine, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry.core.outcome import Fault
from trtllm_mtp_carry.dataplane.kv_pool import PoolExhaustedError
from trtllm_mtp_carry.runtime import CarryRuntime
from trtllm_mtp_carry.service import FAULT_STEPS

NEW = 6  # tokens each turn answers


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=13)


def carry_engine(model, blocks=6, pool_blocks=256, host_memory=None, eviction="lrd", row_dtype="bf16",
                 clock=time.monotonic, **config):
    """A carry engine whose store holds `blocks` drafter blocks (two 40-token first turns)."""
    eng = engine(model, num_drafter_blocks=pool_blocks, **config)
    eng.runtime = CarryRuntime(eng, "carry", slots=None, memory=blocks * eng.drafter_pool.block_nbytes,
                               eviction=eviction, share=False, host_memory=host_memory, row_dtype=row_dtype,
                               clock=clock)
    return eng


def check_all(eng):
    """The engine's own checks: every block free or held by its owners, nothing live, store = pool."""
    eng.check()
    eng.runtime.check()
    eng.drafter_pool.check()


class Inject:
    """Replace `obj.name` so its `nth` call after `arm()` raises `exc` (once)."""

    def __init__(self, monkeypatch, obj, name, exc, nth=1):
        self.real = getattr(obj, name)
        self.exc, self.nth, self.calls, self.armed, self.raised = exc, nth, 0, False, 0

        def call(*args, **kwargs):
            if self.armed:
                self.calls += 1
                if self.calls == self.nth:
                    self.raised += 1
                    raise self.exc
            return self.real(*args, **kwargs)

        monkeypatch.setattr(obj, name, call)

    def arm(self):
        self.armed = True


class Turns:
    """Each session's conversation: its next prompt, and every answer checked against plain greedy."""

    def __init__(self, eng, model, sessions="ab", seed=5):
        self.eng, self.model = eng, model
        self.gen = torch.Generator().manual_seed(seed)
        self.prompts = {s: random_prompt(self.gen, 40) for s in sessions}

    def run(self, session, inject=None, in_decode=False):
        """One turn of `session`, `inject` armed at its start (or once it decodes)."""
        eng, prompt = self.eng, self.prompts[session]
        rid = eng.submit(session, prompt, max_new_tokens=NEW)
        if inject is not None and not in_decode:
            inject.arm()
        result = None
        while result is None:
            for r in eng.step():
                assert r.request_id == rid
                result = r
            eng.drafter_pool.check()
            eng.runtime.check()
            if inject is not None and in_decode and any(s.phase == "decode" for s in eng._running):
                inject.arm()
        assert result.output == greedy_oracle(self.model, prompt, NEW)  # the carry never changes tokens
        self.prompts[session] = prompt + result.output + random_prompt(self.gen, 5)
        return result


def first_turns(model, sessions="ba", **config):
    """A `carry_engine(model, **config)` and its `Turns`, once each of `sessions` ran its first turn."""
    eng = carry_engine(model, **config)
    turns = Turns(eng, model)
    for s in sessions:
        turns.run(s)
    return eng, turns


def assert_one_fault(eng, result, step, error, caplog):
    """`result`'s turn was the one fault: its outcome, the counters, one log line. Its kind is
    admission's, as the runtime counted it: `fault` only where the admission itself faulted."""
    assert result.stats.fault_step == step
    assert result.stats.outcome.endswith(f"({Fault(step, error)})")
    stats = eng.runtime.stats()
    assert (result.stats.outcome_kind == "fault") == (step == "prepare") == (stats.outcomes["fault"] == 1)
    assert stats.faults == {error: 1}
    assert stats.fault_steps == {s: int(s == step) for s in FAULT_STEPS}
    assert stats.turns_faulted == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mtp carry:")]
    assert len(lines) == 1 and lines[0].startswith(f"mtp carry: {step} raised {error} ")
    check_all(eng)


def then_served(turns, sessions="ab"):
    """The next turn of each session is served (greedy output, checks pass) and faults no more;
    returns their outcome kinds."""
    faults = turns.eng.runtime.stats().faults
    kinds = []
    for s in sessions:
        r = turns.run(s)
        kinds.append(r.stats.outcome_kind)
        check_all(turns.eng)
    assert turns.eng.runtime.stats().faults == faults and "fault" not in kinds
    return kinds


def test_a_fault_in_the_adopt_decision_runs_the_turn_without_the_carry_and_the_entry_waits(model, monkeypatch, caplog):
    eng, turns = first_turns(model)
    inject = Inject(monkeypatch, eng.runtime.service.store, "judge", KeyError("judge"))
    n = len(turns.prompts["a"])
    with caplog.at_level(logging.WARNING, "trtllm_mtp_carry"):
        r = turns.run("a", inject)
    assert_one_fault(eng, r, "prepare", "KeyError", caplog)
    # as without the carry: the prefill (from 0: no snapshot this shallow) builds every key's row
    assert r.stats.outcome == "prefill (fault at prepare: KeyError)"
    assert r.stats.drafter_rows_kept == 0 and r.stats.drafter_rows_computed == n - 1
    stats = eng.runtime.stats()
    assert stats.outcomes["fault"] == 1 and stats.outcomes["adopted"] == 0
    assert stats.deposits == 2  # the faulted turn deposits nothing; a's older entry stays held
    assert then_served(turns)[0] == "adopted"  # a's next turn adopts its first turn's rows


def test_a_fault_in_the_adoption_leaves_the_entry_for_the_next_turn(model, monkeypatch, caplog):
    eng, turns = first_turns(model)
    inject = Inject(monkeypatch, eng.drafter_pool, "adopt_carried", RuntimeError("adopt"))
    with caplog.at_level(logging.WARNING, "trtllm_mtp_carry"):
        r = turns.run("a", inject)
    assert_one_fault(eng, r, "prepare", "RuntimeError", caplog)
    stats = eng.runtime.stats()
    assert stats.outcomes["fault"] == 1 and stats.outcomes["adopted"] == 0
    assert stats.leases == 0 and stats.entries_held == 2  # the pool refused it: nothing was taken
    assert then_served(turns)[0] == "adopted"


@pytest.mark.parametrize(("site", "error"), [("read", TypeError), ("append_rows", RuntimeError)])
def test_a_fault_building_a_chunks_rows_costs_the_carry_and_no_block(model, monkeypatch, caplog, site, error):
    eng, turns = first_turns(model)
    target = eng.hidden_store if site == "read" else eng.drafter_pool
    inject = Inject(monkeypatch, target, site, error(site))
    with caplog.at_level(logging.WARNING, "trtllm_mtp_carry"):
        r = turns.run("a", inject)
    assert_one_fault(eng, r, "build", error.__name__, caplog)
    assert r.stats.outcome == f"carry (fault at build: {error.__name__})"
    stats = eng.runtime.stats()
    assert stats.outcomes["adopted"] == 1 and stats.deposits == 2  # adopted, then deposited nothing
    assert stats.entries_held == 1 and stats.leases == 0
    r = turns.run("a")
    assert (r.stats.outcome_kind, r.stats.no_carry_reason) == ("no_carry", "fault")
    check_all(eng)
    then_served(turns, "b")


def test_a_fault_in_the_eviction_ranking_of_a_pool_grow_is_the_growing_turns(model, monkeypatch, caplog):
    eng, turns = first_turns(model, pool_blocks=6)  # b and a hold all six: a's warm turn must evict b
    assert eng.drafter_pool.num_free_blocks == 0
    inject = Inject(monkeypatch, eng.runtime.service.store, "_victims", TypeError("ranking"))
    with caplog.at_level(logging.WARNING, "trtllm_mtp_carry"):
        r = turns.run("a", inject)
    assert_one_fault(eng, r, "build", "TypeError", caplog)
    assert inject.raised == 1
    then_served(turns)


def test_a_fault_in_a_decode_steps_row_append_drops_the_drafter_for_the_turn(model, monkeypatch, caplog):
    eng, turns = first_turns(model)
    inject = Inject(monkeypatch, eng.drafter_pool, "append_rows", KeyError("append"))
    with caplog.at_level(logging.WARNING, "trtllm_mtp_carry"):
        r = turns.run("a", inject, in_decode=True)
    assert_one_fault(eng, r, "append", "KeyError", caplog)
    assert eng.runtime.stats().outcomes["adopted"] == 1 and eng.runtime.stats().deposits == 2
    then_served(turns)


@pytest.mark.parametrize(("site", "error"), [("_victims", TypeError), ("put", RuntimeError)])
def test_a_fault_in_the_deposit_frees_the_rows_once(model, monkeypatch, caplog, site, error):
    eng, turns = first_turns(model)  # a's second-turn entry (4 blocks) must push b's (3) out of 6
    inject = Inject(monkeypatch, eng.runtime.service.store, site, error(site))
    with caplog.at_level(logging.WARNING, "trtllm_mtp_carry"):
        r = turns.run("a", inject)
    assert_one_fault(eng, r, "deposit", error.__name__, caplog)
    stats = eng.runtime.stats()
    assert stats.deposits == 2 and stats.leases == 0
    # the ranking faulted before b's entry left (it stays); the put after it had (a's rows freed too)
    assert eng.drafter_pool.num_carried_blocks == (3 if site == "_victims" else 0)
    r = turns.run("a")
    assert (r.stats.outcome_kind, r.stats.no_carry_reason) == ("no_carry", "fault")
    check_all(eng)
    then_served(turns, "b")


def test_a_fault_in_the_host_demotion_keeps_the_victim_where_it_was(model, monkeypatch, caplog):
    eng, turns = first_turns(model, "b", blocks=4, host_memory="1MiB")  # a's deposit demotes b's entry
    inject = Inject(monkeypatch, eng.runtime.service.host, "demote", RuntimeError("demote"))
    with caplog.at_level(logging.WARNING, "trtllm_mtp_carry"):
        r = turns.run("a", inject)
    assert_one_fault(eng, r, "deposit", "RuntimeError", caplog)
    stats = eng.runtime.stats()
    assert (stats.entries_held, stats.host_entries, stats.demotions) == (1, 0, 0)  # b stays on the device
    then_served(turns)
    assert eng.runtime.stats().outcomes["adopted"] == 1  # b adopts its rows; a deposited nothing


def test_a_fault_in_the_host_restore_costs_the_entry_and_the_turn_runs_without_it(model, monkeypatch, caplog):
    eng, turns = first_turns(model, "ab", blocks=4, host_memory="1MiB")  # a's entry waits in host memory
    assert eng.runtime.stats().host_entries == 1
    inject = Inject(monkeypatch, eng.runtime.service.host, "restore", KeyError("restore"))
    with caplog.at_level(logging.WARNING, "trtllm_mtp_carry"):
        r = turns.run("a", inject)
    assert_one_fault(eng, r, "prepare", "KeyError", caplog)
    assert r.stats.outcome == "prefill (fault at prepare: KeyError)"
    assert eng.runtime.stats().host_entries == 0
    then_served(turns)


def test_a_fault_freeing_a_dropped_drafter_is_retried_once_and_nothing_leaks(model, monkeypatch, caplog):
    eng, turns = first_turns(model)
    pool = eng.drafter_pool
    exhausted = Inject(monkeypatch, pool, "append_rows", PoolExhaustedError("the pool ran out"))
    free = Inject(monkeypatch, pool, "free_sequence", TypeError("free"))

    class Both:  # the decode step's append runs out; the release's free faults
        def arm(self):
            exhausted.arm()
            free.arm()

    with caplog.at_level(logging.WARNING, "trtllm_mtp_carry"):
        r = turns.run("a", Both(), in_decode=True)
    assert_one_fault(eng, r, "release", "TypeError", caplog)
    assert r.stats.outcome == "carry (fault at release: TypeError)"
    then_served(turns)


@pytest.mark.parametrize(("site", "error", "step"), [("carry_out", RuntimeError, "deposit"),
                                                     ("carry_in", KeyError, "prepare")])
def test_fp8_a_fault_packing_frees_the_rows_once_and_one_unpacking_keeps_them(model, monkeypatch, caplog, site, error, step):
    eng, turns = first_turns(model, row_dtype="fp8")
    inject = Inject(monkeypatch, eng.runtime.service.home, site, error(site))
    with caplog.at_level(logging.WARNING, "trtllm_mtp_carry"):
        r = turns.run("a", inject)
    assert_one_fault(eng, r, step, error.__name__, caplog)
    assert eng.drafter_pool.carried_keys() == ()  # fp8 entries never stay in the pool
    stats = eng.runtime.stats()
    # packing: b's only (a's rows freed, once); unpacking refused before any row moved: a's
    # entry stays where it was, for its next turn (as a pool adoption that fails)
    assert (stats.entries_held, stats.leases) == ((1, 0) if site == "carry_out" else (2, 0))
    assert then_served(turns)[0] == ("no_carry" if site == "carry_out" else "adopted")


def test_a_fault_after_the_decision_counts_the_admission_once_as_fault(model, monkeypatch, caplog):
    eng, turns = first_turns(model, "b")
    inject = Inject(monkeypatch, eng.drafter_pool, "allocate_sequence", RuntimeError("allocate"))
    with caplog.at_level(logging.WARNING, "trtllm_mtp_carry"):
        r = turns.run("a", inject)  # a's first turn: no_carry decided, then its sequence faults
    assert_one_fault(eng, r, "prepare", "RuntimeError", caplog)
    stats = eng.runtime.stats()
    assert sum(stats.outcomes.values()) == 2 and stats.outcomes["fault"] == 1  # b's turn, then a's once
    assert stats.outcomes["no_carry"] == 1  # b's only
    then_served(turns)


def test_a_callers_bad_argument_raises_its_value_error_and_is_no_fault(model):
    eng, turns = first_turns(model)
    runtime = eng.runtime
    for call in (lambda: runtime.prepare(99, 1, 5, [1, 2, 3, 4], 0, policy="bogus"),
                 lambda: runtime.finish(99, 5, [1, 2, 3], policy="bogus"),
                 lambda: runtime.cancel(99, 5, [1, 2, 3], policy="bogus"),
                 lambda: runtime.release(99, "bogus")):
        with pytest.raises(ValueError):
            call()
    stats = runtime.stats()
    assert (stats.faults, stats.turns_faulted, runtime.take_fault(99)) == ({}, 0, None)
    check_all(eng)
    then_served(turns)


def test_faults_show_in_the_metrics_with_the_stats_definition(model, monkeypatch):
    from trtllm_mtp_carry.metrics import CarryMetrics, MetricRegistry

    eng, turns = first_turns(model)
    inject = Inject(monkeypatch, eng.runtime.service.store, "judge", KeyError("judge"))
    registry = MetricRegistry()
    metrics = CarryMetrics(registry, "m", "0")
    metrics.record_turn(turns.run("a", inject).stats)
    metrics.refresh(eng.runtime.stats())
    text = registry.exposition()
    assert 'mtp_carry_outcomes_total{model="m",instance="0",kind="fault"} 1' in text
    assert 'mtp_carry_runtime{model="m",instance="0",field="faults.KeyError"} 1' in text
    assert 'mtp_carry_runtime{model="m",instance="0",field="fault_steps.prepare"} 1' in text
    assert 'mtp_carry_runtime{model="m",instance="0",field="turns_faulted"} 1' in text
    assert 'mtp_carry_runtime{model="m",instance="0",field="outcomes.fault"} 1' in text


def test_soak_a_store_whose_eviction_ranking_raises_every_second_call(model, monkeypatch, caplog):
    """The issue's soak in small: six interleaved sessions (four at a time), a tight store and
    pool (entries evicted for memory and for pool pressure, in prefill and in decode), and the
    `returns` ranking raising TypeError every second call (a deterministic clock: the run is the
    same each time): no step raises, every check passes after every step, no block leaks, and
    every turn is prepared and served with greedy output."""
    ticks = itertools.count()
    eng = carry_engine(model, blocks=6, pool_blocks=9, eviction="returns", max_num_seqs=4,
                       clock=lambda: float(next(ticks)))
    store = eng.runtime.service.store
    real, calls = store._ranked, [0]

    def ranked(tier):
        calls[0] += 1
        if calls[0] % 2 == 0:
            raise TypeError("'<' not supported between instances of 'NoneType' and 'float'")
        return real(tier)

    monkeypatch.setattr(store, "_ranked", ranked)
    gen = torch.Generator().manual_seed(9)
    sessions = [f"s{i}" for i in range(6)]
    prompts = {s: random_prompt(gen, 16 + 6 * i) for i, s in enumerate(sessions)}
    kinds, steps, faulted = [], 0, 0
    with caplog.at_level(logging.WARNING, "trtllm_mtp_carry"):
        for _ in range(4):
            pending = {eng.submit(s, prompts[s], max_new_tokens=4): s for s in sessions}
            while pending:
                steps += 1
                for r in eng.step():  # never raises
                    s = pending.pop(r.request_id)
                    assert r.output == greedy_oracle(model, prompts[s], 4)
                    kinds.append(r.stats.outcome_kind)
                    faulted += bool(r.stats.fault_step)
                    prompts[s] = prompts[s] + r.output + random_prompt(gen, 5)
                eng.drafter_pool.check()
                eng.runtime.check()
                assert steps < 400
    check_all(eng)  # nothing live, no block leaked: every held block is a carried entry's
    assert eng.drafter_blocks_held() == eng.drafter_pool.num_carried_blocks
    raised = calls[0] // 2
    stats = eng.runtime.stats()
    # what the seeded run does (the policy's choices, hence the ranking calls, follow the
    # deterministic clock): 13 rankings, 6 of them raising, in prefill, decode and deposit
    assert (steps, calls[0]) == (42, 13)
    assert stats.faults == {"TypeError": raised} == {"TypeError": 6}
    assert stats.fault_steps == {"prepare": 0, "build": 2, "append": 2, "deposit": 2, "release": 0, "other": 0}
    assert faulted == stats.turns_faulted == 5  # a turn faulted twice counts once
    # one definition of a turn's outcome: the turns' kinds are the runtime's admission counts
    assert Counter(kinds) == {k: n for k, n in stats.outcomes.items() if n} == {"adopted": 6, "no_carry": 18}
    assert stats.evictions["pool_pressure"] == 5 and stats.evictions["fault"] == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mtp carry:")]
    assert len(lines) == sum(1 for n in stats.fault_steps.values() if n)  # one per (step, kind)
    assert len(kinds) == 24 and "" not in kinds  # every turn was prepared and finished
