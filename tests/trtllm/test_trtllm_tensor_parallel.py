"""The carry on tensor-parallel ranks of the TensorRT-LLM STAND-IN: real rank processes (gloo).

Each rank is its own process with its own stand-in PyExecutor (requests submitted on rank 0,
broadcast by the executor), its own draft pool holding its KV-head shard, and its own carry
installed by the worker hook; every carry decision is agreed through the executor's
communicator (`trtllm/lockstep.py`). One process group per TP size runs every scenario
(`tp_ranks.py`); the single-rank run of the same turns is the reference. No TensorRT-LLM is run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tp_ranks import SESSIONS, TURNS, run_ranks, run_scenario

from trtllm_mtp_carry.trtllm import worker
from trtllm_mtp_carry.trtllm.standin.kv_cache_manager_v2 import shard_heads

LOCAL = {"faults", "fault_steps", "turns_faulted", "demote_ms", "restore_ms", "restore_wait_ms", "packs", "pack_ms",
         "unpacks", "unpack_ms", "share_ms", "pinned_bytes"}
"""Stats that are this rank's own diagnostics (which rank faulted, the rows it carried out of its
pages and back, its copy times); every other counter is the same on every rank."""

TP2 = ["turns", "adopt_fault", "deposit_fault", "arena_full", "slow_skewed_rank", "cancel", "install_fails"]
TP4 = ["turns", "adopt_fault", "deposit_fault", "arena_full"]
TP_SIZES = [2, pytest.param(4, marks=pytest.mark.slow)]
"""TP 4 runs four rank processes (about 30 s of CPU on this suite's 2 cores): `slow`, still run in CI."""


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The turns on one rank, in this process (the worker hook, TP=1)."""
    import os

    saved = os.environ.get(worker.ENV)
    try:
        return run_scenario("turns", 1, tmp_path_factory.mktemp("tp1"))
    finally:
        if saved is None:
            os.environ.pop(worker.ENV, None)
        else:
            os.environ[worker.ENV] = saved


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(2, TP2, tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="module")
def tp4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(4, TP4, tmp_path_factory.mktemp("tp4"))


def _agreed(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if k not in LOCAL}


def _record(record: dict[str, Any]) -> dict[str, Any]:
    """A turn record less `error` (the fault this rank saw, if any: its own diagnostic)."""
    return {k: v for k, v in record.items() if k != "error"}


def _same_on_every_rank(ranks: list[dict[str, Any]], scenario: str) -> dict[str, Any]:
    """Every rank's turn records and agreed counters are equal; returns rank 0's result."""
    results = [r[scenario] for r in ranks]
    first = results[0]
    for other in results[1:]:
        assert {rid: _record(rec) for rid, rec in other["records"].items()} == \
            {rid: _record(rec) for rid, rec in first["records"].items()}, (scenario, other["rank"])
        assert _agreed(other["stats"]) == _agreed(first["stats"]), (scenario, other["rank"])
        assert other["outputs"] == first["outputs"], (scenario, other["rank"])
    return first


@pytest.mark.parametrize("tp", TP_SIZES)
def test_every_rank_adopts_the_same_key_range_every_turn_and_each_shard_comes_back_bit_for_bit(
        tp: int, single: dict[str, Any], request: pytest.FixtureRequest) -> None:
    ranks = request.getfixturevalue(f"tp{tp}")
    first = _same_on_every_rank(ranks, "turns")
    # the single-rank run's turns, request by request: the same restores, outputs and drafts
    assert first["records"] == single["records"]
    assert first["outputs"] == single["outputs"]
    warm = [rec for rec in single["records"].values() if rec["reused"] > 0]
    assert len(warm) == SESSIONS * (TURNS - 1)
    assert all(rec["outcome"] == "adopted" and rec["rows_adopted"] == rec["reused"] for rec in warm)
    stats = first["stats"]
    assert stats["outcomes"]["adopted"] == SESSIONS * (TURNS - 1) and stats["deposits"] == SESSIONS * TURNS
    assert (single["stats"]["tp_size"], single["stats"]["agreements"]) == (1, 0)  # one rank: no collective
    for r, rank in enumerate(ranks):
        res = rank["turns"]
        # each rank's pool holds its shard: ceil(2 / tp) heads, a head repeated at TP 4
        assert res["heads"] == shard_heads(2, tp, r) == ([r] if tp == 2 else [r // 2])
        assert res["accepted"] == single["accepted"]  # the drafter attends every shard's rows
        for rid, rows in single["rows"].items():
            # every byte of keys [0, N - 1) this rank held at free, restored ones included, is the
            # single-rank run's rows of its heads
            assert torch.equal(res["rows"][rid], rows[:, :, res["heads"]]), (tp, r, rid)
        # one agreement per install, two per batch of first-seen requests (who judges, the rows),
        # three per freed request (the run, the room, the rows gathered): the same on every rank
        assert (res["stats"]["tp_size"], res["stats"]["agreements"]) == (tp, 1 + 2 * TURNS + 3 * SESSIONS * TURNS)
        assert res["stats"]["vetoed"] == {"key": 0, "adopt": 0, "deposit": 0}
        assert res["lines"][-1].endswith(f"; rank {r} of {tp}, decisions in lockstep")


@pytest.mark.parametrize("tp", TP_SIZES)
def test_a_rank_that_cannot_resolve_a_requests_pages_at_adoption_makes_every_rank_miss(
        tp: int, request: pytest.FixtureRequest) -> None:
    ranks = request.getfixturevalue(f"tp{tp}")
    first = _same_on_every_rank(ranks, "adopt_fault")
    stats = first["stats"]
    # turn 1's first adoption: judged on every rank, vetoed by the last rank's page fault, so no
    # rank restores; that turn's carry is dropped on every rank (it deposits nothing), the entry
    # stays taken, and the session's next turn misses (not_deposited) and deposits its run [R, N - 1)
    assert stats["vetoed"] == {"key": 0, "adopt": 1, "deposit": 0}
    assert stats["outcomes"]["adopted"] == 4 and stats["outcomes"]["no_carry"] == 2
    assert stats["skipped"]["fault"] == 1 and stats["rows_adopted"] == sum(
        rec["rows_adopted"] for rec in first["records"].values())
    vetoed = [rec for rec in first["records"].values() if rec["outcome"] == "adopted" and rec["rows_adopted"] == 0]
    assert len(vetoed) == 1 and vetoed[0]["skipped"] == "fault"
    assert [r["adopt_fault"]["stats"]["faults"] for r in ranks] == [{}] * (tp - 1) + [{"KeyError": 1}]


@pytest.mark.parametrize("tp", TP_SIZES)
def test_a_rank_that_cannot_gather_at_free_makes_every_rank_skip_that_deposit(
        tp: int, request: pytest.FixtureRequest) -> None:
    ranks = request.getfixturevalue(f"tp{tp}")
    first = _same_on_every_rank(ranks, "deposit_fault")
    stats = first["stats"]
    # the last rank's gather faults: no rank keeps the rows (refused oom), the session's next turn
    # misses and deposits the run its context computed
    assert stats["skipped"]["fault"] == 1 and stats["deposits"] == 2 * 3 - 1 and stats["refusals"]["oom"] == 1
    assert stats["outcomes"]["no_carry"] == 2 + 1 and stats["vetoed"] == {"key": 0, "adopt": 0, "deposit": 1}
    assert [r["deposit_fault"]["stats"]["fault_steps"]["deposit"] for r in ranks] == [0] * (tp - 1) + [1]


@pytest.mark.parametrize("tp", TP_SIZES)
def test_a_rank_whose_arena_is_full_makes_every_rank_refuse_the_deposit(
        tp: int, request: pytest.FixtureRequest) -> None:
    ranks = request.getfixturevalue(f"tp{tp}")
    first = _same_on_every_rank(ranks, "arena_full")
    stats = first["stats"]
    # turn 0's two deposits: room on every rank but the last, so refused on every rank; turn 1
    # misses (oom) and deposits the runs its context computed, keys [64, 107); turn 2 adopts the
    # 32 of them below its R
    assert stats["refusals"]["oom"] == 2 and stats["vetoed"]["deposit"] == 2
    assert stats["deposits"] == 4 and stats["entries_held"] == 2
    assert stats["outcomes"]["no_carry"] == 4 and stats["no_carry_reasons"]["oom"] == 2
    assert [rec["rows_adopted"] for rec in first["records"].values()] == [0, 0, 0, 0, 32, 32]
    assert [r["arena_full"]["stats"]["faults"] for r in ranks] == [{}] * tp  # a refusal, not a fault


def test_a_slow_rank_whose_clock_runs_far_ahead_takes_the_same_decisions(tp2: list[dict[str, Any]]) -> None:
    """Rank 1 sleeps in its prepare and free and its own clock jumps 10 000 s ahead after turn 0,
    past the idle TTL: the store reads rank 0's clock as agreed, so nothing expires on any rank."""
    first = _same_on_every_rank(tp2, "slow_skewed_rank")
    stats = first["stats"]
    assert stats["outcomes"]["adopted"] == 2 * 2 and stats["evictions"]["idle"] == 0
    assert stats["deposits"] == 2 * 3


def test_a_cancellation_rank_zero_takes_reaches_every_rank_at_the_same_iteration(
        tp2: list[dict[str, Any]]) -> None:
    """Cancelled after its first iteration (its context done, one token out): freed at the same
    iteration on every rank, it deposits its valid rows on every rank, and its next turn adopts."""
    first = _same_on_every_rank(tp2, "cancel")
    cancelled = [rid for rid, out in first["outputs"].items() if len(out) == 1]
    assert len(cancelled) == 1
    record = first["records"][cancelled[0]]
    # its prompt and the one token: keys [0, prompt_len), the reused R and the computed [R, L - 1) and L - 1
    assert (record["outcome"], record["skipped"]) == ("adopted", None)
    assert record["rows_deposited"] == record["reused"] + record["rows_computed"] + 1
    assert first["stats"]["outcomes"]["adopted"] == 4 and first["stats"]["deposits"] == 6
    assert first["stats"]["live_turns"] == 0 and first["stats"]["vetoed"] == {"key": 0, "adopt": 0, "deposit": 0}


def test_a_rank_that_cannot_reserve_its_arena_makes_every_rank_stand_aside(tp2: list[dict[str, Any]]) -> None:
    lines = [r["install_fails"]["lines"][-1] for r in tp2]
    assert lines[1].startswith("mtp carry: stands aside: OutOfMemoryError while installing the carry "
                               "(injected: no room for the carry's arena on this rank)")
    assert lines[0] == ("mtp carry: stands aside: tensor-parallel rank(s) 1 of 2 could not install it (their "
                        "line says why): every rank stands aside, so none carries its shard of the heads alone")
    assert [r["install_fails"]["installed"] for r in tp2] == [False, False]
    # the executor runs on without the carry, in step
    assert tp2[0]["install_fails"]["outputs"] == tp2[1]["install_fails"]["outputs"]


def test_the_stand_in_rank_refuses_requests_and_a_single_process_cannot_run_two_ranks(
        tmp_path: Path) -> None:
    from standin_helpers import model

    from trtllm_mtp_carry.trtllm.standin import StandinLLM

    with pytest.raises(RuntimeError, match="runs one process per rank: initialize torch.distributed"):
        StandinLLM(model(), tp_size=2, single_process=True)


def test_info_says_a_tensor_parallel_worker_carries_every_ranks_shard_in_lockstep(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from trtllm_mtp_carry.cli import main

    path = tmp_path / "llm.yaml"
    path.write_text("speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 3}\n"
                    "kv_cache_config:\n  enable_block_reuse: true\n"
                    "  mamba_state_config: {additional_snapshot_offsets_from_end: [0]}\n"
                    "tensor_parallel_size: 4\n")
    assert main(["info", "--json", "--llm-config", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["llm_config_stands_aside"] is None and report["carry_armed"]
    assert report["trtllm_tensor_parallel"] == (
        "TP=4: every rank carries its own shard of the MTP layer's KV heads (ceil(heads / 4) each); each "
        "carry decision is agreed across the ranks (two small all-gathers when requests start, three "
        "when one ends): trtllm/lockstep.py")
