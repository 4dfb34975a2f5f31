"""A turn whose chunk needs two entries' blocks evicts them in the store's victim order (issue 25).

Three 45-row entries hold 9 of the 10 drafter blocks; the fourth session's
100-token prompt needs 7 blocks in one grow, so two entries must go. Before the
fix the pool asked for one victim, evicted it, and from the second on fell back
to its own oldest entry: `incumbent` kept b instead of a.
"""

from __future__ import annotations

import random

import pytest

from trtllm_mtp_carry import session_hash
from trtllm_mtp_carry.engine.engine import ReferenceEngine
from trtllm_mtp_carry.runtime import CarryRuntime


@pytest.mark.parametrize(("eviction", "kept"), [
    ("incumbent", ["a", "d"]),  # newest first: c, then b
    ("returns", ["a", "d"]),  # nothing learned yet, equal worth: newest first too
    ("lrd", ["c", "d"]),  # oldest first: a, then b
    ("slru", ["c", "d"]),  # none adopted yet: oldest first
])
def test_one_grow_needing_two_victims_evicts_in_the_policy_order(eviction, kept):
    rng = random.Random(1)
    eng = ReferenceEngine.from_pretrained(policy="carry", dtype="float64", max_model_len=512, block_size=16,
                                          prefill_chunk=128, num_target_blocks=128, num_drafter_blocks=10,
                                          max_num_seqs=4)
    eng.runtime = CarryRuntime(eng, "carry", slots=None, eviction=eviction)
    for s in "abc":  # three 45-row entries: 9 of the 10 drafter blocks
        eng.generate(s, [rng.randint(32, 126) for _ in range(40)], max_new_tokens=6)
    eng.generate("d", [rng.randint(32, 126) for _ in range(100)], max_new_tokens=6)  # one grow of 7 blocks
    name = {session_hash(s): s for s in "abcd"}
    assert [name[e.session_hash] for e in eng.runtime.carried()] == kept
    assert eng.runtime.stats().evictions["pool_pressure"] == 2
