"""The host tier pins exactly its budget: on a GPU its host copies are ranges of one arena of
`carry_host_memory` bytes registered once, so `pinned_bytes` is the budget (torch's pinned allocator
would round each copy up to a power of two and keep freed blocks pinned). On CPU through the seams:
`host_tier.host_arena` builds the GPU's arena (pinned) for the CPU pool, `pinned._cudart` records
every registration."""

from __future__ import annotations

import gc

import pytest
import torch
from engine_factories import engine, greedy_oracle, random_prompt, tiny_model

from trtllm_mtp_carry import EVICTION_CAUSES, session_hash
from trtllm_mtp_carry.core import CarriedDrafter
from trtllm_mtp_carry.dataplane import pinned
from trtllm_mtp_carry.dataplane.arena import Arena
from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool
from trtllm_mtp_carry.dataplane.rope import RopeConfig
from trtllm_mtp_carry.runtime import CarryRuntime
from trtllm_mtp_carry.service import host_tier
from trtllm_mtp_carry.service.homes import PoolHome


class FakeCudart:
    class cudaError:  # noqa: N801 (torch's binding's name)
        success = 0

    def __init__(self) -> None:
        self.sizes: list[int] = []  # registered, in order
        self.unregistered = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.sizes.append(size)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered += 1
        return 0


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11)


@pytest.fixture
def gpu_slab(monkeypatch):
    """The CUDA host tier's arena on the CPU pool: pinned (recorded), its device sync a no-op."""
    fake = FakeCudart()
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)

    def arena_for(budget: int, device: torch.device, allocate=None) -> Arena | None:
        return Arena(pinned.pinned_empty(budget), pinned=True) if budget > 0 else None

    monkeypatch.setattr(host_tier, "host_arena", arena_for)
    yield fake
    gc.collect()  # this test's registrations end while the recorder is in place


def runtime(eng, device_bytes, host_bytes, row_dtype="bf16"):
    eng.runtime = CarryRuntime(eng, eng.config.policy, slots=None, memory=device_bytes, eviction="lrd",
                               host_memory=host_bytes, share=False, row_dtype=row_dtype)
    return eng


def zeros(**counts):
    return {cause: counts.get(cause, 0) for cause in EVICTION_CAUSES}


def inside(arena: Arena, tensors) -> bool:
    lo, hi = arena.storage.data_ptr(), arena.storage.data_ptr() + arena.nbytes
    return all(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for t in tensors)


def check_all(eng):
    eng.check()
    eng.runtime.check()
    eng.drafter_pool.check()


def test_a_full_host_tier_pins_exactly_its_budget_once_and_keeps_demoting_into_it(model, gpu_slab):
    eng = engine(model)
    nb = eng.drafter_pool.block_nbytes
    runtime(eng, 3 * nb, 3 * nb)  # one 45-row entry (3 blocks) on the device, one in host memory
    gen = torch.Generator().manual_seed(23)
    prompts = {s: random_prompt(gen, 40) for s in "abc"}
    for s in "abc":
        eng.generate(s, prompts[s], max_new_tokens=6)
        check_all(eng)
    stats = eng.runtime.stats()
    # c's deposit demoted b into the full host tier, dropping a (its victim): a demotion, not an eviction
    assert (stats.demotions, stats.evictions) == (2, zeros(memory=1))
    assert [e.session_hash for e in eng.runtime.service.store.host_entries] == [session_hash("b")]
    host = eng.runtime.service.host
    assert gpu_slab.sizes == [3 * nb]  # the budget, registered once: no per-copy registration
    assert stats.pinned_bytes == stats.carry_host_memory_bytes == sum(gpu_slab.sizes) == 3 * nb
    assert host.outside_keys() == [] and session_hash("b") in host.arena
    assert stats.host_bytes_held == host.arena.held_bytes == 3 * nb
    b2 = prompts["b"] + random_prompt(gen, 4)
    r = eng.generate("b", b2, max_new_tokens=6)  # adopted from the slab
    assert r.stats.outcome_kind == "adopted" and r.output == greedy_oracle(model, b2, 6)
    assert eng.runtime.stats().hits_host == 1 and gpu_slab.sizes == [3 * nb]
    check_all(eng)


def test_a_pressure_victim_demoted_while_its_adopter_is_restored_ends_in_the_slab(model, gpu_slab):
    # 45 rows a turn: 3 blocks of 16; 7 pool blocks hold two carried turns and one live one
    eng = engine(model, num_drafter_blocks=7)
    nb = eng.drafter_pool.block_nbytes
    runtime(eng, 7 * nb, 3 * nb)
    gen = torch.Generator().manual_seed(9)
    first = {s: eng.generate(s, random_prompt(gen, 40), max_new_tokens=6) for s in ("a", "b")}
    eng.generate("c", random_prompt(gen, 40), max_new_tokens=6)  # pool pressure: a staged, demoted
    assert [e.session_hash for e in eng.runtime.service.store.host_entries] == [session_hash("a")]
    assert gpu_slab.sizes == [3 * nb]  # a was staged into the slab's free room
    a2 = first["a"].prompt + first["a"].output + random_prompt(gen, 4)
    # a's copy back presses b out to host memory: b's copy ends in the slab, nothing else stays pinned
    r = eng.generate("a", a2, max_new_tokens=6)
    assert r.stats.outcome_kind == "adopted" and r.output == greedy_oracle(model, a2, 6)
    stats = eng.runtime.stats()
    assert (stats.hits_host, stats.demotions, stats.evictions) == (1, 2, zeros())
    host = eng.runtime.service.host
    assert host.keys() == [session_hash("b")] and session_hash("b") in host.arena
    registered = gpu_slab.sizes
    assert registered[0] == 3 * nb and all(size == 3 * nb for size in registered[1:])  # staged: exact
    assert stats.pinned_bytes == 3 * nb and host.outside_keys() == []
    check_all(eng)


def test_fp8_host_copies_are_ranges_of_the_pinned_budget(model, gpu_slab):
    eng = engine(model)
    runtime(eng, 1 << 20, 0, "fp8")  # sizes one entry's packed bytes
    gen = torch.Generator().manual_seed(5)
    prompts = {s: random_prompt(gen, 40) for s in "ab"}
    eng.generate("a", prompts["a"], max_new_tokens=6)
    one = eng.runtime.stats().bytes_held
    runtime(eng, one, 2 * one, "fp8")
    for s in "ab":
        eng.generate(s, prompts[s], max_new_tokens=6)
    stats = eng.runtime.stats()
    assert stats.demotions == 1 and gpu_slab.sizes == [2 * one] and stats.pinned_bytes == 2 * one
    host = eng.runtime.service.host
    (key,) = host.keys()
    assert inside(host.arena, [host.arena.view(key)]) and host.arena.held_bytes == one
    a2 = prompts["a"] + random_prompt(gen, 4)
    r = eng.generate("a", a2, max_new_tokens=6)
    assert r.stats.outcome_kind == "adopted" and r.output == greedy_oracle(model, a2, 6)
    assert eng.runtime.stats().hits_host == 1 and host.arena.held_bytes == 0 and gpu_slab.sizes == [2 * one]
    check_all(eng)


def test_without_a_gpu_the_host_tier_pins_nothing():
    eng = runtime(engine(tiny_model(seed=11)), 1 << 20, 1 << 20)
    assert not eng.runtime.service.host.arena.pinned and eng.runtime.stats().pinned_bytes == 0


def carried_pool(entries: int, rows: int = 40):
    """A CPU pool of 16-row blocks holding `entries` carried entries of `rows` rows (keys 1, 2, ...)."""
    pool = DrafterKVPool(entries * 3 + 1, 16, 2, 8, RopeConfig.for_qwen3_next(8))
    gen = torch.Generator().manual_seed(3)
    for key in range(1, entries + 1):
        pool.allocate_sequence(key)
        k, v = torch.randn(2, rows, 2, 8, generator=gen).to(torch.bfloat16)
        pool.append_rows(key, torch.arange(rows), k, v)
        pool.move_to_carried(key, key)
    return pool


def entry(pool, key):
    held = pool.carried(key)
    return CarriedDrafter(held.block_table, held.rows, held.rows - 1, list(range(held.rows + 1)), key)


def test_a_victim_staged_while_the_slab_is_full_is_pinned_exactly_then_moves_in_when_a_range_frees(gpu_slab):
    pool = carried_pool(2)
    nbytes = pool.export_nbytes(1)
    moves = host_tier.HostTier(PoolHome(pool), host_tier.host_arena(nbytes, torch.device("cuda")))  # one entry
    a, b = entry(pool, 1), entry(pool, 2)
    truth = [t.clone() for t in pool.gather_carried(2)]
    assert moves.demote(a) and gpu_slab.sizes == [nbytes]
    moves.stage(2)  # the arena is full: b's copy is memory of exactly its bytes
    assert gpu_slab.sizes == [nbytes, nbytes] and moves.pinned_bytes == 2 * nbytes
    pool.free_carried(2)  # the pool releases it (pressure); the store demotes it
    assert moves.demote(b) and moves.outside_keys() == [2] and moves.pinned_bytes == 2 * nbytes
    moves.drop(a)  # a left the store: b moves into its range
    assert moves.outside_keys() == [] and moves.pinned_bytes == nbytes
    gc.collect()
    assert gpu_slab.unregistered == 1  # the staged copy's registration ended, the arena's stays
    assert moves.arena.view(2).data_ptr() == moves.arena.storage.data_ptr()
    b2 = moves.restore(b)
    assert [torch.equal(x, y) for x, y in zip(pool.gather_carried(2), truth, strict=True)] == [True] * 3
    assert b2.rows == b.rows and moves.arena.held_bytes == 0 and moves.keys() == []
