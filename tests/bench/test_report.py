"""Summaries and paired ratios of synthetic benchmark runs (exact values, no engine)."""

import pytest

from trtllm_mtp_carry.bench.driver import PolicyRun, TurnRecord
from trtllm_mtp_carry.bench.report import (
    outputs_identical,
    paired,
    policy_summary,
    reuse_table,
    summary_scope,
    summary_table,
    turn_table,
)


def turn(replay, session, t, ttft, acc=(2, 4), kind="adopted", rows=128, prep=2.0, out=(1, 2)):
    accepted, drafted = acc
    stats = {"prompt_tokens": 1000 + t, "reused_tokens": 900 if t else 0, "ttft_ms": ttft,
             "drafter_prep_ms": prep, "drafter_rows_computed": rows, "drafted": drafted,
             "accepted": accepted, "acceptance": accepted / drafted if drafted else 0.0,
             "verify_steps": 2, "output_tokens": len(out), "outcome_kind": kind, "outcome": kind}
    return TurnRecord(session, t, stats, list(out), replay)


def carry_and_blind():
    carry = PolicyRun("carry", busy_s={0: 9.0, 1: 2.0, 2: 2.0})
    blind = PolicyRun("blind", busy_s={0: 9.0, 1: 1.0, 2: 1.0})
    for r in range(3):
        # replay 0 is the warm-up: its huge times must not reach any summary
        slow = 1000.0 if r == 0 else 0.0
        carry.turns += [turn(r, "s0", 0, 500.0 + slow, kind="no_carry", rows=999),
                        turn(r, "s0", 1, 10.0 * (r + 1) + slow, acc=(3, 4)),
                        turn(r, "s0", 2, 30.0 + slow, acc=(4, 4), kind="foreign_session")]
        blind.turns += [turn(r, "s0", 0, 400.0 + slow, kind="prefill", rows=999),
                        turn(r, "s0", 1, 20.0 + slow, acc=(2, 4), kind="blind", rows=0, prep=0.0),
                        turn(r, "s0", 2, 60.0 + slow, acc=(1, 4), kind="blind", rows=0, prep=0.0)]
    carry.runtime = {0: {"armed": True, "evictions": {"capacity": 5}},
                     1: {"armed": True, "evictions": {"capacity": 1, "pool_pressure": 2}},
                     2: {"armed": True, "evictions": {"capacity": 0}, "deposits": 4}}
    return carry, blind


def test_policy_summary_medians_spread_and_counts_exclude_the_warm_up():
    carry, _ = carry_and_blind()
    s = policy_summary(carry, first_measured=1)
    # warm ttfts of replays 1 and 2: 20, 30, 30, 30 -> median 30, p25 27.5
    assert (s["turns"], s["ttft_ms_median"], s["ttft_ms_p25"], s["ttft_ms_p75"]) == (4, 30.0, 27.5, 30.0)
    assert (s["acceptance_median"], s["acceptance_p25"], s["acceptance_p75"]) == (0.875, 0.75, 1.0)
    assert s["acceptance_pooled"] == 14 / 16
    assert s["drafter_rows_computed_median"] == 128
    assert s["outcomes"] == {"adopted": 2, "foreign_session": 2}
    assert s["adoption_rate"] == 0.5
    assert s["refusals"] == {"foreign_session": 2}
    assert s["cold"]["ttft_ms_median"] == 500.0 and s["cold"]["refusals"] == {"no_carry": 2}
    assert s["output_tokens_per_s"] == 12 / 4.0  # 6 turns x 2 tokens over replays 1-2's 4 s
    assert s["evictions"] == {"capacity": 1, "pool_pressure": 2}  # replay 0 is the warm-up: left out
    assert (s["policy"], s["carry_armed"]) == ("carry", True)


def test_off_has_no_acceptance_median():
    off = PolicyRun("off", turns=[turn(1, "s0", 1, 5.0, acc=(0, 0), kind="off", rows=0)])
    s = policy_summary(off, first_measured=1)
    assert (s["acceptance_median"], s["acceptance_pooled"], s["accepted_per_step"]) == (None, None, 0.0)


def test_paired_ratios_pair_the_same_replay_session_and_turn():
    carry, blind = carry_and_blind()
    r = paired([carry, blind], first_measured=1)
    assert list(r) == ["carry/blind"]
    entry = r["carry/blind"]
    # ttft pairs: 20/20, 30/60 (replay 1), 30/20, 30/60 (replay 2) -> 1, .5, 1.5, .5
    assert entry["pairs"] == 4
    assert (entry["ttft_paired_median"], entry["ttft_paired_p25"], entry["ttft_paired_p75"]) == (
        0.75, 0.5, 1.125)
    # acceptance pairs: .75/.5, 1/.25, .75/.5, 1/.25 -> 1.5, 4, 1.5, 4
    assert entry["acceptance_paired_median"] == 2.75
    assert entry["drafter_prep_paired_median"] is None
    assert entry["null_reasons"] == {
        "drafter_prep_paired_median": "blind has drafter_prep_ms at or near zero (<= 0.05) on 4 of 4 turns"}


def test_paired_ratios_of_an_interrupted_run_use_only_turns_both_policies_finished():
    carry, blind = carry_and_blind()
    blind.turns = blind.turns[:5]  # stopped after replay 1's first warm turn
    entry = paired([carry, blind], first_measured=1)["carry/blind"]
    assert entry["pairs"] == 1 and entry["ttft_paired_median"] == 1.0


def test_outputs_identical_compares_the_turns_every_policy_finished():
    carry, blind = carry_and_blind()
    assert outputs_identical([carry, blind])
    blind.turns = blind.turns[:4]
    assert outputs_identical([carry, blind])
    carry.turns[2] = turn(0, "s0", 2, 1.0, out=(9,))
    assert not outputs_identical([carry, blind])


def test_tables_mark_the_warm_up_and_name_refusals_and_evictions():
    carry, blind = carry_and_blind()
    table = turn_table([carry, blind], first_measured=1).splitlines()
    assert table[2].split()[:4] == ["0w", "s0", "0", "carry"]
    assert table[3].split()[:4] == ["0w", "s0", "0", "blind"]
    assert table[8].split()[:4] == ["1", "s0", "0", "carry"]
    text = summary_table({"carry": policy_summary(carry, 1), "blind": policy_summary(blind, 1)})
    assert "carry: refusals foreign_session=2" in text
    assert "carry: evictions capacity=1 pool_pressure=2" in text
    assert "30.0 [27.5-30.0]" in text


def test_plot_writes_a_png_of_every_measured_turn(tmp_path):
    pytest.importorskip("matplotlib")
    from trtllm_mtp_carry.bench.report import plot

    carry, blind = carry_and_blind()
    same = PolicyRun("same", turns=[turn(t.replay, t.session, t.turn, t.stats["ttft_ms"])
                                    for t in carry.turns])  # coincides with carry everywhere
    path = tmp_path / "ttft.png"
    plot([carry, blind, same], str(path), first_measured=1)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_turn_table_orders_sessions_naturally():
    run = PolicyRun("carry", turns=[turn(0, "s10", 0, 1.0), turn(0, "s2", 0, 1.0), turn(0, "s1", 1, 1.0)])
    rows = turn_table([run], first_measured=0).splitlines()[2:]
    assert [r.split()[1] for r in rows] == ["s1", "s2", "s10"]


def test_summary_says_when_the_carry_was_not_armed():
    carry, _ = carry_and_blind()
    carry.runtime = {1: {"armed": False}}
    text = summary_table({"carry": policy_summary(carry, 1)})
    assert "carry: not armed in this run" in text
    carry.runtime = {1: {"armed": True}}
    assert "not armed" not in summary_table({"carry": policy_summary(carry, 1)})


def test_a_turn_whose_drafter_was_off_counts_as_zero_acceptance_not_left_out():
    run = PolicyRun("carry", turns=[turn(1, "s0", 1, 5.0, acc=(3, 4)), turn(1, "s0", 2, 5.0, acc=(0, 0)),
                                    turn(1, "s0", 3, 5.0, acc=(1, 4))])
    s = policy_summary(run, first_measured=1)
    assert (s["acceptance_median"], s["acceptance_p25"], s["acceptance_p75"]) == (0.25, 0.125, 0.5)
    assert s["acceptance_pooled"] == 0.5


def test_memory_figures_take_the_peak_and_paired_counters_sum_over_measured_replays():
    carry, _ = carry_and_blind()
    counters = {"turns": 3, "warm_turns": 2, "tree_hits": 2, "rows_from_tree": 100, "depth_lost": 5,
                "tokens_recomputed_for_cap": 7, "rows_built": 9, "blocks_published": 4,
                "tree_evictions": 1, "tail_copies": 1, "tree_blocks": 4, "blocks_held": 4,
                "blocks_peak": 6, "pool_blocks": 8}
    for r, peak in ((0, 99), (1, 5), (2, 6)):  # replay 0 (the warm-up) is left out
        carry.runtime[r] |= {"drafter_blocks_peak": peak, "drafter_blocks": 8,
                             "paired": counters | {"blocks_peak": peak}}
    s = policy_summary(carry, 1)
    assert (s["drafter_blocks_peak"], s["drafter_blocks"], s["target_blocks_peak"]) == (6, 8, None)
    assert s["paired"]["tree_hits"] == 4 and s["paired"]["tokens_recomputed_for_cap"] == 14
    assert s["paired"]["blocks_peak"] == 6 and s["paired"]["pool_blocks"] == 8
    assert s["target_computed_total"] == 2 * (1001 - 900 + 1002 - 900)
    assert "drafter tree hits 4 of 4 warm turns (200 rows)" in reuse_table({"carry": s})


def test_no_carry_turns_are_counted_by_their_reason():
    run = PolicyRun("carry")
    run.turns = [turn(0, "s0", 1, 10.0, kind="no_carry"), turn(0, "s1", 1, 10.0, kind="no_carry"),
                 turn(0, "s2", 1, 10.0, kind="no_carry"), turn(0, "s3", 1, 10.0)]
    for t, why in zip(run.turns, ("memory", "not_admitted", "memory"), strict=False):
        t.stats["no_carry_reason"] = why
    s = policy_summary(run, first_measured=0)
    assert s["no_carry_reasons"] == {"memory": 2, "not_admitted": 1}
    assert "carry: no_carry by reason memory=2 not_admitted=1" in summary_table({"carry": s})


def test_adopted_turns_are_counted_by_where_their_rows_came_from():
    run = PolicyRun("carry")
    run.turns = [turn(0, "s0", 1, 10.0), turn(0, "s1", 1, 10.0), turn(0, "s2", 1, 10.0),
                 turn(0, "s3", 1, 10.0, kind="no_carry")]
    for t, source in zip(run.turns, ("remote", "local", "remote", ""), strict=True):
        t.stats["rows_source"] = source  # what a Dynamo worker reports (entry moves)
    s = policy_summary(run, first_measured=0)
    assert s["adopted_by_source"] == {"local": 1, "remote": 2}
    assert "carry: adopted by source local=1 remote=2" in summary_table({"carry": s})
    carry, _ = carry_and_blind()  # no front end said: every adopted row was local, and no line says so
    s = policy_summary(carry, first_measured=1)
    assert s["adopted_by_source"] == {"local": 2, "remote": 0} and not s["sources_reported"]
    assert "by source" not in summary_table({"carry": s})


def test_the_host_tier_line_sums_hits_bytes_and_copy_time_over_measured_replays():
    carry, _ = carry_and_blind()
    tier = {"carry_host_memory_bytes": 8 << 20, "hits_device": 1, "hits_host": 2, "demotions": 3,
            "host_deposits": 1, "bytes_demoted": 3 << 10, "bytes_restored": 2 << 10, "peak_device_bytes": 4 << 10,
            "peak_host_bytes": 3 << 10, "demote_ms": 0.5, "restore_ms": 0.25, "restore_wait_ms": 0.0}
    for r in range(3):  # replay 0 (the warm-up) is left out
        carry.runtime[r] |= tier | {"policy": "carry", "peak_host_bytes": (r + 1) << 10}
    s = policy_summary(carry, 1)
    assert s["host_tier"] == {"carry_host_memory_bytes": 8 << 20, "hits_device": 2, "hits_host": 4,
                              "demotions": 6, "host_deposits": 2, "bytes_demoted": 6 << 10, "bytes_restored": 4 << 10,
                              "peak_device_bytes": 4 << 10, "peak_host_bytes": 3 << 10, "demote_ms": 1.0,
                              "restore_ms": 0.5, "restore_wait_ms": 0.0}
    assert ("carry: host tier of 8MiB: adopted from device 2, from host 4; demoted 6, refused deposits kept "
            "there 2 (6KiB, 1.0 ms), "
            "restored 4KiB in 0.5 ms (0.12 ms per restored turn), GPU wait 0.0 ms; peak device 4KiB, "
            "host 3KiB") in reuse_table({"carry": s})
    for r in range(3):
        carry.runtime[r]["carry_host_memory_bytes"] = 0  # no host tier: no line
    assert "host_tier" not in policy_summary(carry, 1)


def test_a_faulted_turn_is_counted_as_a_fault_not_a_refusal():
    carry, _ = carry_and_blind()
    for r in range(3):
        carry.turns.append(turn(r, "s1", 1, 40.0, kind="fault"))
    s = policy_summary(carry, first_measured=1)
    assert s["outcomes"] == {"adopted": 2, "fault": 2, "foreign_session": 2}
    assert (s["faults"], s["refusals"]) == (2, {"foreign_session": 2})
    table = summary_table({"carry": s})
    assert "carry: faults 2 (turns a fault inside the carry ran without it)" in table.splitlines()


def test_the_reuse_table_shows_the_cap_column_only_where_paired_ran_and_names_it():
    carry, blind = carry_and_blind()
    plain = {"carry": policy_summary(carry, 1), "blind": policy_summary(blind, 1)}
    assert reuse_table(plain).splitlines()[0] == (
        "policy     target tokens computed    total  drafter blocks peak  target blocks peak")
    paired_run = PolicyRun("paired", turns=[turn(1, "s0", 1, 10.0, kind="paired")])
    paired_run.turns[0].stats["recomputed_for_cap"] = 7
    with_paired = plain | {"paired": policy_summary(paired_run, 1)}
    head, _, *rows = reuse_table(with_paired).splitlines()
    assert head == ("policy     target tokens computed    total recomputed for cap  drafter blocks peak  "
                    "target blocks peak")
    assert rows[-1].split()[-3:] == ["7", "-", "-"] and rows[0].split()[-3:] == ["0", "-", "-"]


def test_the_sharing_line_says_sharing_is_on_and_what_off_would_do():
    carry, _ = carry_and_blind()
    for r in range(3):
        carry.runtime[r] |= {"policy": "carry", "carry_share": True, "share_merges": 2, "share_mismatches": 0,
                             "shared_blocks": 3, "share_ms": 1.25, "deposits": 8}
    assert reuse_table({"carry": policy_summary(carry, 1)}).splitlines()[-1] == (
        "carry: common-prefix block sharing on (--carry-share off gives each entry its own copy): "
        "blocks merged into equal ones other entries hold 4 (bytes differed: 0), held by two or more "
        "entries at the end 3, sharing took 2.5 ms over 16 deposits")


def test_the_summary_scope_says_what_ran_whole_and_what_an_interrupt_cut():
    def runs(*replay_rows):  # one policy; rows per replay
        run = PolicyRun("carry")
        run.turns = [turn(r, "s0", i, 1.0) for r, n in enumerate(replay_rows) for i in range(n)]
        return [run]

    assert summary_scope(runs(8, 8, 8), 1, 3, 8, partial=False) == "replays 1..2, warm-up replay 0 excluded"
    assert summary_scope(runs(8), 0, 1, 8, partial=False) == "replays 0..0"
    assert summary_scope(runs(8, 1), 1, 5, 8, partial=True) == (
        "partial: interrupted; ran 1 of the 8 rows of replay 1, warm-up replay 0 excluded")
    assert summary_scope(runs(8, 8, 8, 5), 1, 5, 8, partial=True) == (
        "partial: interrupted; ran replays 1..2 whole and 5 of the 8 rows of replay 3, warm-up replay 0 excluded")
    assert summary_scope(runs(8, 8), 1, 5, 8, partial=True) == (
        "partial: interrupted; ran replay 1 whole, warm-up replay 0 excluded")
    assert summary_scope(runs(3), 0, 5, 8, partial=True) == (
        "partial: interrupted in the warm-up, replay 0, after 3 of its 8 rows; those are summarised, "
        "nothing after them ran")
    assert summary_scope(runs(3), 0, 1, 8, partial=True) == "partial: interrupted; ran 3 of the 8 rows of replay 0"
    assert summary_scope([PolicyRun("carry")], 0, 1, 8, partial=True) == (
        "partial: interrupted before any turn finished")


def test_every_policy_the_error_lists_is_documented_in_the_bench_page():
    from pathlib import Path

    from trtllm_mtp_carry.bench.replay import BenchPolicy

    with pytest.raises(ValueError) as err:
        BenchPolicy.parse("turbo")
    listed = str(err.value).split("expected one of ", 1)[1].split(", ")
    assert "carry-bf16" in listed and "carry-fp8" in listed
    page = (Path(__file__).resolve().parents[2] / "docs" / "BENCH.md").read_text()
    assert [name for name in listed if f"`{name}`" not in page] == []
