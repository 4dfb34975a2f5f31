"""One contract suite over the carry service's device homes (`service/homes.py`), on the reference engine.

Each home (rows left in the pool with prefix sharing, rows packed into the carry's arena) runs
the same turns, with and without a host tier: the bytes it really holds equal the bytes the
store charges in each tier, an adopted entry's rows are the deposited ones bit for bit where the
format is exact (the codec's deterministic round trip for fp8 and nvfp4), and `check` holds
after every step. A new home or codec joins by adding one entry to `HOMES`.
"""

from __future__ import annotations

import pytest
import torch
from engine_factories import engine, random_prompt, tiny_model

from trtllm_mtp_carry import session_hash
from trtllm_mtp_carry.dataplane.row_codec import codec_for
from trtllm_mtp_carry.runtime import CarryRuntime
from trtllm_mtp_carry.service.homes import ArenaHome, PoolHome

HOMES = {  # id -> (carry_row_dtype, home class, sharing)
    "pool": ("bf16", PoolHome, True),
    "arena-fp8": ("fp8", ArenaHome, False),
    "arena-nvfp4": ("nvfp4", ArenaHome, False),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=13)


@pytest.fixture(params=[(r, h) for r in sorted(HOMES) for h in (0, 1)],
                ids=lambda p: f"{p[0]}-{'host' if p[1] else 'device'}")
def setup(request, model):
    name, host = request.param
    row_dtype, cls, share = HOMES[name]
    eng = engine(model)
    pool = eng.drafter_pool
    # room for about one entry on the device, in the home's row format
    per_entry = 3 * pool.block_nbytes * codec_for(row_dtype, pool.k_cache.dtype).row_nbytes(
        pool.num_kv_heads, pool.head_dim) // codec_for("bf16", pool.k_cache.dtype).row_nbytes(
        pool.num_kv_heads, pool.head_dim)
    eng.runtime = CarryRuntime(eng, eng.config.policy, slots=None, memory=per_entry if host else None,
                               eviction="lrd", host_memory=16 * per_entry if host else 0, share=share,
                               row_dtype=row_dtype)
    assert isinstance(eng.runtime.service.home, cls)
    return eng, bool(host)


def held_nbytes(eng) -> tuple[int, int]:
    service = eng.runtime.service
    return service.home.held_nbytes(), 0 if service.host is None else service.host.host_bytes


def held_matches_charge(eng) -> None:
    device, host = held_nbytes(eng)
    stats = eng.runtime.stats()
    assert (device, host) == (stats.bytes_held, stats.host_bytes_held)
    eng.runtime.check()
    eng.drafter_pool.check()


def test_bytes_held_equal_bytes_charged_in_each_tier_after_every_turn(setup):
    eng, host = setup
    gen = torch.Generator().manual_seed(8)
    shared = random_prompt(gen, 32)  # a common prefix: the pool home shares its blocks
    for s in "abc":
        eng.generate(s, shared + random_prompt(gen, 9), max_new_tokens=4)
        held_matches_charge(eng)
    stats = eng.runtime.stats()
    assert stats.entries_held + stats.host_entries == 3
    assert stats.host_entries > 0 if host else stats.host_entries == 0
    if eng.runtime.service.home.shares and not host:  # the charge counted the shared prefix once
        assert stats.shared_blocks == 1  # keys 0..15: the one full block of the 32-token prefix
    eng.runtime.forget_session(session_hash("b"))
    held_matches_charge(eng)
    eng.runtime.clear_slot()
    assert held_nbytes(eng) == (0, eng.runtime.stats().host_bytes_held)


def test_adopted_rows_are_the_deposited_ones_exactly_where_the_format_is(setup):
    eng, host = setup
    gen = torch.Generator().manual_seed(9)
    home = eng.runtime.service.home
    eng.generate("a", random_prompt(gen, 40), max_new_tokens=5)
    a = session_hash("a")
    entry = eng.runtime.service.store.get(a)
    rows = entry.rows
    if isinstance(home, PoolHome):
        k0, v0, _ = eng.drafter_pool.gather_carried(a)
        want = torch.stack((k0, v0), dim=1)
    else:
        want = home.codec.decode(home.rows(a)).to(eng.drafter_pool.device)
    if host:  # a second session pushes `a` to the host tier first
        eng.generate("b", random_prompt(gen, 40), max_new_tokens=5)
        assert eng.runtime.service.store.tier(a) == "host"
        held_matches_charge(eng)
    eng.runtime._take(99, a, rows_kept=rows)
    k, v, _ = eng.drafter_pool.gather(99)
    got = torch.stack((k, v), dim=1)
    assert torch.equal(got, want)
    if not home.codec.exact:  # and that is the codec's round trip of the pool's rows
        assert torch.equal(got, home.codec.decode(home.codec.encode(got)))
    eng.runtime.release(99)
    held_matches_charge(eng)
