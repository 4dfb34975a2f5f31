"""One contract suite over every executor's carry (trio's generic tests, here over executors).

The same scripted turns run through every executor in `executors.EXECUTORS` (the reference
engine's glue and TensorRT-LLM's resource manager on the stand-in): cold turns, warm
adoptions, every miss reason, a miss followed by the adoption of what the missed turn
computed, a cancel, a turn that fails before its prefill finished, a fault at each step,
eviction under memory pressure, a host-tier round trip, and every row format and KV format an
executor has. Every expectation below is one value for every executor: the same outcomes and
reasons, the same counters, the same adopted keys, and the same rows bit for bit (the bytes the
turn's drafter holds after adoption equal the bytes the previous turn wrote, or their codec's
round trip for a packed format). `test_every_executor_gives_the_same_turns_and_counters` runs
all scripts on all executors and compares them whole.

Sizes: 2 KV heads of 32, 4 rows a block. A session's first turn is 12 prompt tokens answered
with 5 (17 tokens: keys 0..15, 16 rows); its next turn's prompt extends those 17 tokens, and
the target's prefix cache serves all but the newest (R = 16): the carried keys end at R - 1.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict

import pytest
import torch
from executors import EXECUTORS, Executor, Turn, synthetic_rows

from trtllm_mtp_carry.dataplane.row_codec import codec_for
from trtllm_mtp_carry.service import FAULT_STEPS

FORMATS = [  # (carry_row_dtype, KV format): the pool's bf16 rows as they are or packed; a KV pool's own bytes
    ("bf16", "bf16"), ("fp8", "bf16"), ("nvfp4", "bf16"), ("bf16", "fp8_kv"), ("bf16", "nvfp4_kv")]


def supported(name: str, kv_format: str) -> bool:
    """Whether executor `name` has pools of `kv_format` (the reference engine's pool is bf16)."""
    return kv_format == "bf16" or name != "reference"


CASES = [(name, row, kv) for name in EXECUTORS for row, kv in FORMATS if supported(name, kv)]


def make(name: str, row_dtype: str = "bf16", kv_format: str = "bf16", **bounds) -> Executor:
    return EXECUTORS[name](row_dtype=row_dtype, kv_format=kv_format, **bounds)


@pytest.fixture(params=list(EXECUTORS))
def name(request) -> str:
    return request.param


class Tokens:
    """Deterministic token ids (1..250), one stream per test."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 251) for _ in range(n)]


def expected_rows(tokens: list[int], lo: int, hi: int, row_dtype: str, kv_format: str) -> torch.Tensor:
    """The bytes keys `[lo, hi)` of `tokens` hold once carried and restored: the synthetic rows, or
    their codec's round trip (a packed format), as `[n, 2, HKV, bytes]`."""
    k, v = synthetic_rows(tokens, lo, hi)
    rows = torch.stack((k, v), dim=1)  # [n, 2, HKV, D] bf16
    if row_dtype != "bf16" and kv_format == "bf16":
        codec = codec_for(row_dtype, torch.bfloat16)
        rows = codec.decode(codec.encode(rows))
    return rows.contiguous().view(torch.uint8)


EXECUTOR_OWN = frozenset({
    "pool_blocks", "pool_block_size",  # the executor's own drafter pool (TensorRT-LLM's is not the carry's)
    "reserved_bytes", "bytes_held", "blocks_held", "peak_device_bytes",  # a pool home charges whole blocks
    "packs", "unpacks",  # an arena home's gathers and scatters (a pool home moves no row)
    "pack_ms", "unpack_ms", "share_ms", "demote_ms", "restore_ms", "restore_wait_ms",  # wall times
})
"""`CarryStats` fields only one executor observes: where its rows live and how long moves took."""


def contract_counters(ex: Executor) -> dict:
    """Every field of the executor's `stats()` that every executor must agree on: all but
    `EXECUTOR_OWN`, so a field added to `CarryStats` is compared unless it is named there."""
    return {k: v for k, v in asdict(ex.stats()).items() if k not in EXECUTOR_OWN}


def zeros(vocabulary: dict, **counts: int) -> dict:
    return {k: counts.get(k, 0) for k in vocabulary}


# ---- the scripts ------------------------------------------------------------------------


def cold_then_warm(ex: Executor, tok: Tokens) -> list[Turn]:
    p1, o1 = tok(12), tok(5)
    t1 = ex.turn("a", p1, 0, o1)
    p2 = p1 + o1 + tok(7)
    t2 = ex.turn("a", p2, 16, tok(5))
    return [t1, t2]


@pytest.mark.parametrize(("name", "row_dtype", "kv_format"), CASES)
def test_a_cold_turn_deposits_and_the_next_warm_turn_adopts_its_rows_bit_for_bit(name, row_dtype, kv_format):
    ex = make(name, row_dtype, kv_format)
    tok = Tokens(1)
    t1, t2 = cold_then_warm(ex, tok)
    assert (t1.kind, t1.reason, t1.rows_adopted, t1.deposited) == ("no_carry", "never_carried", 0, True)
    assert (t2.kind, t2.rows_adopted, t2.first_key, t2.deposited) == ("adopted", 16, 0, True)
    tok = Tokens(1)
    p1, o1 = tok(12), tok(5)
    if kv_format == "bf16":
        assert torch.equal(t2.adopted, expected_rows(p1 + o1, 0, 16, row_dtype, kv_format))
    s = ex.stats()
    assert (s.outcomes["adopted"], s.deposits, s.adoptions, s.rows_adopted, s.rows_deposited) == (1, 2, 1, 16, 16 + 28)
    assert s.row_dtype == codec_for(row_dtype, torch.bfloat16).name if kv_format == "bf16" else s.row_dtype == kv_format
    ex.check()


def test_a_kv_pools_own_bytes_come_back_exactly():
    """An FP8 or NVFP4 KV pool's rows are carried as its own bytes: the adopted keys hold exactly
    what the previous turn's pages held (the stand-in's pages, read before they were freed)."""
    for kv_format in ("fp8_kv", "nvfp4_kv"):
        ex = make("trtllm-standin", "bf16", kv_format)
        tok = Tokens(1)
        p1, o1 = tok(12), tok(5)
        pages = ex.paged
        written = []
        real_free = ex.draft.free_resources

        def keep(request, _real=real_free, _pages=pages, _written=written):  # freed after the carry deposited
            _written.append(_pages.key_bytes(request.py_request_id, 0, 16).clone())
            _real(request)

        ex.draft.free_resources = keep
        ex.turn("a", p1, 0, o1)
        t2 = ex.turn("a", p1 + o1 + tok(7), 16, tok(5))
        assert t2.rows_adopted == 16 and torch.equal(t2.adopted, written[0])
        ex.check()


def misses(ex: Executor, tok: Tokens) -> list[Turn]:
    """One session per miss reason (two slots, lrd, a logical clock with a 100 s time-to-live)."""
    turns = []
    a1, ao = tok(12), tok(5)
    turns.append(ex.turn("a", a1, 0, ao))  # never_carried
    turns.append(ex.turn("a", a1 + ao[:2] + tok(9), 13, tok(5)))  # diverges at 14: prefix_mismatch? adopted short
    b1, bo = tok(12), tok(5)
    turns.append(ex.turn("b", b1, 0, bo))
    turns.append(ex.turn("b", b1 + bo + tok(3), 16, tok(5), salt="other"))  # new_salt
    c1, co = tok(12), tok(5)
    turns.append(ex.turn("c", c1, 0, co))
    ex.forget("c")
    turns.append(ex.turn("c", c1 + co + tok(3), 16, tok(5)))  # session_end
    d1, do = tok(12), tok(5)
    turns.append(ex.turn("d", d1, 0, do))
    ex.now += 1000.0
    turns.append(ex.turn("d", d1 + do + tok(3), 16, tok(5)))  # idle
    e1, eo = tok(12), tok(5)
    turns.append(ex.turn("e", e1 + [0], 8, eo))  # a warm first turn of its session: never_carried
    turns.append(ex.turn("e", tok(4) + e1, 2, eo))  # a prompt that agrees on 0 tokens: prefix_mismatch
    return turns


def test_each_miss_names_its_reason_and_the_same_on_every_executor(name):
    ex = make(name, slots=4, idle_s=100.0)
    turns = misses(ex, Tokens(2))
    got = [(t.kind, t.reason, t.rows_adopted) for t in turns]
    assert got == [
        ("no_carry", "never_carried", 0), ("adopted", "", 13),  # keys 0..12: the prompt agrees on 14 tokens
        ("no_carry", "never_carried", 0), ("no_carry", "new_salt", 0),
        ("no_carry", "never_carried", 0), ("no_carry", "session_end", 0),
        ("no_carry", "never_carried", 0), ("no_carry", "idle", 0),
        ("no_carry", "never_carried", 0), ("prefix_mismatch", "", 0),
    ]
    s = ex.stats()
    assert s.no_carry_reasons == zeros(s.no_carry_reasons, never_carried=5, new_salt=1, session_end=1, idle=1)
    # d's first deposit is the fifth entry (capacity: a's goes); the clock jump expires the other
    # four; e's second deposit replaces its first (the mismatch took nothing)
    assert s.evictions == zeros(s.evictions, capacity=1, session_end=1, idle=4, replaced=1)
    assert s.sessions_ended == 1 and s.rows_freed == 16
    ex.check()


def test_a_foreign_sessions_rows_are_never_adopted_by_the_seeds_one_slot(name):
    ex = make(name, slots=1)
    tok = Tokens(3)
    a1, ao = tok(12), tok(5)
    ex.turn("a", a1, 0, ao)
    b = ex.turn("b", a1 + ao + tok(3), 16, tok(5))  # b sends a's very tokens: still not a's rows
    assert (b.kind, b.rows_adopted) == ("foreign_session", 0)
    assert ex.stats().outcomes["foreign_session"] == 1
    ex.check()


def test_a_missed_turn_deposits_the_run_it_computed_and_the_next_turn_adopts_it(name):
    """After a miss (here the entry expired) the turn's drafter has no rows below R; its pages hold
    valid rows for keys [R, N - 1) only, and that run is what it deposits: the next turn adopts
    keys [R, ...) and the prefix below R stays blind in both executors (a known-invalid prefix)."""
    ex = make(name, idle_s=100.0)
    tok = Tokens(4)
    p1, o1 = tok(12), tok(5)
    ex.turn("a", p1, 0, o1)
    ex.now += 1000.0
    p2, o2 = p1 + o1 + tok(7), tok(5)
    miss = ex.turn("a", p2, 16, o2)  # expired: keys 16..27 computed, deposited with no rows below 16
    assert (miss.kind, miss.reason, miss.deposited) == ("no_carry", "idle", True)
    p3 = p2 + o2 + tok(3)
    t3 = ex.turn("a", p3, 28, tok(5))
    assert (t3.kind, t3.rows_adopted, t3.first_key) == ("adopted", 12, 16)
    assert torch.equal(t3.adopted, expected_rows(p2 + o2, 16, 28, "bf16", "bf16"))
    s = ex.stats()
    assert (s.keys_skipped, s.rows_adopted, s.turns_blind) == (0, 12, 1)
    ex.check()


def test_a_cancelled_turn_deposits_what_it_holds_and_its_session_adopts_it(name):
    ex = make(name)
    tok = Tokens(5)
    p1, o1 = tok(12), tok(3)  # cancelled after three tokens: keys 0..13
    t1 = ex.turn("a", p1, 0, o1, end="cancel")
    t2 = ex.turn("a", p1 + o1 + tok(6), 14, tok(5))
    assert t1.deposited and (t2.kind, t2.rows_adopted) == ("adopted", 14)
    assert torch.equal(t2.adopted, expected_rows(p1 + o1, 0, 14, "bf16", "bf16"))
    assert ex.stats().turns_cancelled_kept == 1
    ex.check()


def test_a_turn_ended_before_its_prefill_finished_deposits_nothing_and_its_entry_stays_taken(name):
    ex = make(name)
    tok = Tokens(6)
    p1, o1 = tok(12), tok(5)
    ex.turn("a", p1, 0, o1)
    p2 = p1 + o1 + tok(7)
    failed = ex.turn("a", p2, 16, tok(5), end="fail")
    assert (failed.kind, failed.rows_adopted, failed.deposited) == ("adopted", 16, False)
    again = ex.turn("a", p2, 16, tok(5))
    assert (again.kind, again.reason) == ("no_carry", "not_deposited")
    ex.check()


# ---- faults -------------------------------------------------------------------------------

FAULTS: dict[str, tuple[str, Callable[[Executor], tuple[object, str]]]] = {
    # site -> (the step it is recorded at, (object, method) raising once)
    "decision": ("prepare", lambda ex: (ex.service.store, "judge")),
    "adoption": ("prepare", lambda ex: (ex.service.home, "carry_in")),
    "deposit-plan": ("deposit", lambda ex: (ex.service.store, "admit")),
    "deposit-gather": ("deposit", lambda ex: (ex.service.home, "carry_out")),
    "deposit-put": ("deposit", lambda ex: (ex.service.store, "put")),
}


@pytest.mark.parametrize("site", sorted(FAULTS))
@pytest.mark.parametrize("row_dtype", ["bf16", "fp8"])
def test_a_fault_at_each_step_costs_that_turn_its_carry_and_nothing_else(name, row_dtype, site, monkeypatch):
    ex = make(name, row_dtype)
    tok = Tokens(7)
    p1, o1 = tok(12), tok(5)
    ex.turn("a", p1, 0, o1)
    step, where = FAULTS[site]
    obj, method = where(ex)
    real, raised = getattr(obj, method), []

    def once(*args, **kwargs):
        if not raised:
            raised.append(1)
            raise KeyError(site)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, method, once)
    p2, o2 = p1 + o1 + tok(7), tok(5)
    faulted = ex.turn("a", p2, 16, o2)
    monkeypatch.setattr(obj, method, real)
    s = ex.stats()
    assert raised and s.faults == {"KeyError": 1} and s.turns_faulted == 1
    assert s.fault_steps == {k: int(k == step) for k in FAULT_STEPS}
    assert not faulted.deposited
    ex.check()
    following = ex.turn("a", p2 + o2 + tok(3), 28, tok(5))  # the session is served on
    b = ex.turn("b", tok(12), 0, tok(5))  # and another session carries as before
    assert b.deposited and following.kind in ("adopted", "no_carry")
    # a refused move keeps the entry where it was; a fault after the take loses it
    assert (following.kind, following.reason) == {
        "decision": ("adopted", ""), "adoption": ("adopted", ""),
        "deposit-plan": ("no_carry", "fault"), "deposit-gather": ("no_carry", "fault"),
        "deposit-put": ("no_carry", "fault")}[site]
    ex.check()


# ---- bounds ---------------------------------------------------------------------------------


def pressure(ex: Executor, tok: Tokens) -> list[Turn]:
    """Room for two entries of 16 rows (lrd): a third session's deposit evicts the oldest."""
    turns, first = [], {}
    for s in "abc":
        p, o = tok(12), tok(5)
        first[s] = p + o
        turns.append(ex.turn(s, p, 0, o))
    for s in "abc":
        turns.append(ex.turn(s, first[s] + tok(3), 16, tok(5)))
    return turns


@pytest.mark.parametrize("row_dtype", ["bf16", "fp8", "nvfp4"])
def test_memory_pressure_evicts_the_same_entries_on_every_executor(name, row_dtype):
    ex = make(name, row_dtype, room_rows=2 * 16)
    turns = pressure(ex, Tokens(8))
    # c's deposit pushes a out, a's (a miss: its run of 8 rows from R = 16) pushes b out, b's
    # (8 more) fits beside a's and c's: c's next turn adopts
    assert [(t.kind, t.reason) for t in turns[3:]] == [("no_carry", "memory"), ("no_carry", "memory"),
                                                        ("adopted", "")]
    assert [t.rows_adopted for t in turns] == [0, 0, 0, 0, 0, 16]
    s = ex.stats()
    assert (s.evictions["memory"], s.entries_held, s.rows_held) == (3, 2, 8 + 24)
    ex.check()


@pytest.mark.parametrize("row_dtype", ["bf16", "fp8", "nvfp4"])
def test_a_host_tier_round_trip_gives_the_rows_back_bit_for_bit(name, row_dtype):
    ex = make(name, row_dtype, room_rows=16, host_rows=2 * 16)
    tok = Tokens(9)
    pa, oa = tok(12), tok(5)
    ex.turn("a", pa, 0, oa)
    ex.turn("b", tok(12), 0, tok(5))  # a leaves the device budget for the host tier
    s = ex.stats()
    assert (s.demotions, s.host_entries, s.entries_held) == (1, 1, 1)
    t = ex.turn("a", pa + oa + tok(3), 16, tok(5))
    assert (t.kind, t.rows_adopted) == ("adopted", 16)
    assert torch.equal(t.adopted, expected_rows(pa + oa, 0, 16, row_dtype, "bf16"))
    s = ex.stats()  # a's own deposit (24 rows) is larger than the device budget: refused
    assert (s.hits_host, s.hits_device, s.host_entries, s.refusals["too_large"]) == (1, 0, 0, 1)
    ex.check()


def carry_outs(ex: Executor, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The carry keys the executor's home carries rows out for from now on (each gather, in order)."""
    home, carried = ex.service.home, []
    real = home.carry_out

    def spy(*args, **kwargs):
        carried.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(home, "carry_out", spy)
    return carried


@pytest.mark.parametrize("row_dtype", ["bf16", "fp8"])
def test_a_refused_deposit_moves_no_row(name, row_dtype, monkeypatch):
    """Plan, then act: the store refuses a deposit before the home carries any row out of the
    turn's pages (no gather, no move), on every executor."""
    ex = make(name, row_dtype, room_rows=16)
    carried = carry_outs(ex, monkeypatch)
    tok = Tokens(12)
    p1, o1 = tok(12), tok(5)
    t1 = ex.turn("a", p1, 0, o1)  # 16 rows: exactly the room
    assert t1.deposited and len(carried) == 1
    t2 = ex.turn("a", p1 + o1 + tok(7), 16, tok(5))  # adopts 16, then 28 rows: larger than the room
    assert (t2.rows_adopted, t2.deposited, len(carried)) == (16, False, 1)
    assert ex.stats().refusals["too_large"] == 1
    ex.check()


@pytest.mark.parametrize("row_dtype", ["bf16", "fp8"])
def test_a_deposit_both_tiers_refuse_moves_no_row(name, row_dtype, monkeypatch):
    """Plan, then act, for the host tier's second chance too: under `incumbent` a deposit the full
    device refuses goes to the host tier only if the host would take it, asked before the home
    carries any row out; a full host tier that keeps its incumbent refuses it with no gather."""
    ex = make(name, row_dtype, room_rows=16, host_rows=16, eviction="incumbent")
    carried = carry_outs(ex, monkeypatch)
    tok = Tokens(13)
    turns = [ex.turn(s, tok(12), 0, tok(5)) for s in "abc"]  # 16 rows each
    assert [t.deposited for t in turns] == [True, True, False]
    assert len(carried) == 2  # a (device) and b (host): c was refused before any row moved
    s = ex.stats()
    assert (s.entries_held, s.host_entries, s.host_deposits, s.refusals["not_admitted"]) == (1, 1, 1, 2)
    ex.check()


def test_detach_leaves_nothing_held_and_a_leaked_range_is_caught(name):
    ex = make(name, room_rows=16, host_rows=64)
    tok = Tokens(10)
    for s in "ab":
        ex.turn(s, tok(12), 0, tok(5))
    s = ex.stats()  # a's entry went to the host tier: both tiers hold rows when the carry detaches
    assert (s.entries_held, s.host_entries) == (1, 1)
    ex.service.detach()
    s = ex.stats()
    assert (s.entries_held, s.host_entries, s.bytes_held, s.host_bytes_held) == (0, 0, 0, 0)
    ex.check()
    ex.service.host.arena.take("leak", 64)  # held behind the service's back
    with pytest.raises(RuntimeError, match="holds rows after detaching"):
        ex.service.detach()


# ---- every executor alike -------------------------------------------------------------------

def host_round_trip(ex: Executor, tok: Tokens) -> list[Turn]:
    """Room for one entry of 16 rows and a host tier for two: a's entry is demoted, then adopted back."""
    pa, oa = tok(12), tok(5)
    turns = [ex.turn("a", pa, 0, oa), ex.turn("b", tok(12), 0, tok(5))]
    return turns + [ex.turn("a", pa + oa + tok(3), 16, tok(5))]


SCRIPTS = {"cold_then_warm": (cold_then_warm, {}), "misses": (misses, {"slots": 4, "idle_s": 100.0}),
           "pressure": (pressure, {"room_rows": 32}),
           "host_round_trip": (host_round_trip, {"room_rows": 16, "host_rows": 32})}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
@pytest.mark.parametrize("row_dtype", ["bf16", "fp8", "nvfp4"])
def test_every_executor_gives_the_same_turns_and_counters(script, row_dtype):
    run, bounds = SCRIPTS[script]
    results = {}
    for name in EXECUTORS:
        ex = make(name, row_dtype, **bounds)
        turns = run(ex, Tokens(11))
        ex.check()
        results[name] = ([{**asdict(t), "adopted": t.adopted.tolist()} for t in turns], contract_counters(ex))
    first, *others = results.values()
    # every script adopts rows once: two executors that both carried nothing would agree vacuously
    assert any(t["rows_adopted"] and t["adopted"] for t in first[0]) and first[1]["deposits"] > 0
    for name, got in zip(list(results)[1:], others, strict=True):
        assert got == first, f"{name} differs from {list(results)[0]}"
