"""trace-replay --after-miss: what a follow-up that ran blind over its reused prefix deposits
(valid-run: keys [R, N), the prefix known invalid; nothing: a gap; full: all its rows), each held
entry's first valid key, and how much of the reused prefix adopted rows cover. Each trace is small
enough that every count is derived by hand in the test's comment.

The traces carry conversation ids (16-token hash blocks); the service model is made exact:
prefill 10^6 tokens/s (a 48-token prompt takes 48 us) and 1 s an output token, so a turn
finishes `output` seconds (plus microseconds) after it arrives. Rows are 1 byte, so bytes are rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.traces.reader import read_trace
from trtllm_mtp_carry.traces.replay import ReplayConfig, ServiceModel, replay

SERVICE = ServiceModel(prefill_tokens_per_s=1e6, decode_s_per_token=1.0)


def turn(chat: str, parent: str | None, t: float, blocks: int, out: int, first_block: int = 1) -> dict[str, object]:
    """One request: hash ids first_block .. first_block + blocks - 1, so 16 x blocks prompt tokens."""
    return {"chat_id": chat, "parent_chat_id": parent, "timestamp": t, "turn": 0,
            "hash_ids": list(range(first_block, first_block + blocks)), "output_length": out}


def write(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


# One conversation, X. Prompt P, output O, rows N = P + O; R = the prompt shared with the parent.
# Each turn finishes 16 s after it arrives, before the next arrives.
#   X1 t=0    P 48  O 16  N  64  R   0                    deposits [0, 64)
#   X2 t=20   P 80  O 16  N  96  R  48 (3 blocks)         adopts [0, 64): covers 48 of 48
#   X3 t=200  P 112 O 16  N 128  R  80 (5 blocks)         misses: X2's entry (deposited at 36)
#                                                          idled out (TTL 100)
#   X4 t=220  P 144 O 16  N 160  R 112 (7 blocks)
#   X5 t=240  P 176 O 16  N 192  R 144 (9 blocks)
IDLE_MISS = [turn("x1", None, 0, 3, 16), turn("x2", "x1", 20, 5, 16), turn("x3", "x2", 200, 7, 16),
             turn("x4", "x3", 220, 9, 16), turn("x5", "x4", 240, 11, 16)]


def config(after_miss: str, **kw: object) -> ReplayConfig:
    return ReplayConfig(None, row_bytes=1, idle_s=100.0, service=SERVICE, after_miss=after_miss, **kw)  # type: ignore[arg-type]


def test_the_reader_gives_each_follow_up_the_prompt_it_shares_with_its_parent(tmp_path):
    trace = read_trace(write(tmp_path, IDLE_MISS))
    assert trace.input_tokens.tolist() == [48, 80, 112, 144, 176]
    assert trace.reused_tokens.tolist() == [0, 48, 80, 112, 144]


def test_a_mooncake_follow_up_reuses_the_blocks_it_shares_capped_by_both_prompts(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1, 2]},  # A1
        {"timestamp": 1, "input_length": 2000, "output_length": 10, "hash_ids": [0, 7, 8, 9]},  # B1
        {"timestamp": 2, "input_length": 3000, "output_length": 10, "hash_ids": [0, 1, 2, 3, 4, 5]},  # A2
        {"timestamp": 3, "input_length": 3000, "output_length": 10, "hash_ids": [0, 7, 8, 6, 6, 6]},  # B2
        {"timestamp": 4, "input_length": 1200, "output_length": 10, "hash_ids": [0, 1, 2]},  # A3
    ]
    trace = read_trace(write(tmp_path, rows))
    assert trace.conversation.tolist() == [0, 1, 0, 1, 0]
    # A2: 3 blocks (1536) capped by A1's prompt, 1000; B2: 3 blocks of B1's 4, 1536 of B1's 2000;
    # A3: all 3 of its blocks with A2 (1536), capped by its own prompt less its last token, 1199
    assert trace.reused_tokens.tolist() == [0, 0, 1000, 1536, 1199]


def test_valid_run_deposits_the_keys_a_blind_turn_computed_and_the_next_turns_adopt_them(tmp_path):
    r = replay(read_trace(write(tmp_path, IDLE_MISS)), "lrd", config("valid-run"))
    # X3 ran blind over [0, 80): deposits [80, 128), 48 rows. X4 adopts it: of its R = 112 the run
    # holds [80, 112), 32 keys, and it keeps first key 80: deposits [80, 160). X5 adopts that:
    # [80, 144), 64 keys of 144. Three deposits start above 0 (X3, X4, X5).
    assert (r.follow_ups, r.adopted, r.misses) == (4, 3, {"idle": 1})
    a = r.after_miss
    assert (a.valid_runs, a.replaced_fuller, a.gaps, a.blind_after_gap) == (3, 0, 0, 0)
    assert (a.covered_keys, a.reused_keys_adopted, a.reused_keys) == (48 + 32 + 64, 48 + 112 + 144, 48 + 80 + 112 + 144)
    assert a.coverage_adopted == 144 / 304
    # held: X1 64, X2 96, X3 48, X4 80, X5 112 rows (one at a time): the peak is X5's run
    assert r.peak_bytes["device"] == 112 and r.deposits == 5


def test_nothing_leaves_a_gap_and_the_conversation_stays_blind(tmp_path):
    r = replay(read_trace(write(tmp_path, IDLE_MISS)), "lrd", config("nothing"))
    # X3 misses (idle) and deposits nothing; X4 and X5 find nothing either (the store still
    # remembers X2's entry idling out), run blind and deposit nothing: three gaps, two misses
    # after one; only X2 adopted
    assert (r.adopted, r.misses, r.deposits) == (1, {"idle": 3}, 2)
    a = r.after_miss
    assert (a.valid_runs, a.gaps, a.blind_after_gap) == (0, 3, 2)
    assert (a.covered_keys, a.reused_keys_adopted, a.reused_keys) == (48, 48, 384)


def test_full_deposits_every_row_as_if_valid(tmp_path):
    r = replay(read_trace(write(tmp_path, IDLE_MISS)), "lrd", config("full"))
    # X3 misses but deposits [0, 128) as if it had rebuilt its prefix: X4 and X5 cover all of R
    assert (r.adopted, r.misses) == (3, {"idle": 1})
    a = r.after_miss
    assert (a.valid_runs, a.gaps, a.covered_keys, a.reused_keys_adopted) == (0, 0, 48 + 112 + 144, 304)
    assert r.peak_bytes["device"] == 192  # X5's 176 + 16 rows


# Conversation Y: Y3 arrives while Y2 runs (in_use), runs blind and finishes after Y2 deposited.
#   Y1 t=0   P 32 O 2   N 34  R  0   finishes at 2
#   Y2 t=10  P 48 O 2   N 50  R 32   adopts [0, 34): covers 32 of 32; finishes at 12, deposits [0, 50)
#   Y3 t=11  P 64 O 10  N 74  R 48   in_use: blind over [0, 48); finishes at 21
#   Y4 t=30  P 80 O 1   N 81  R 64
OVERLAP = [turn("y1", None, 0, 2, 2), turn("y2", "y1", 10, 3, 2), turn("y3", "y2", 11, 4, 10),
           turn("y4", "y3", 30, 5, 1)]


@pytest.mark.parametrize(("after_miss", "covered", "counts"), [
    # Y3's run [48, 74) replaces Y2's fuller [0, 50); Y4 adopts it: [48, 64), 16 of its 64
    ("valid-run", 32 + 16, (2, 1, 0)),
    # Y3 leaves a gap, so Y2's [0, 50) stays; Y4 adopts it: [0, 50), 50 of 64, but [50, 64) is
    # a hole, so Y4 ran blind below R and leaves a gap too
    ("nothing", 32 + 50, (0, 0, 2)),
    # Y3 deposits [0, 74) as if valid; Y4 covers all 64
    ("full", 32 + 64, (0, 0, 0)),
])
def test_a_blind_turns_run_replaces_the_fuller_entry_an_overlapping_turn_left(tmp_path, after_miss, covered,
                                                                             counts):
    r = replay(read_trace(write(tmp_path, OVERLAP)), "lrd", config(after_miss))
    assert (r.follow_ups, r.adopted, r.misses) == (3, 2, {"in_use": 1})
    a = r.after_miss
    assert (a.valid_runs, a.replaced_fuller, a.gaps) == counts
    assert (a.covered_keys, a.reused_keys_adopted, a.reused_keys) == (covered, 32 + 64, 32 + 48 + 64)


def test_the_command_line_prints_what_a_miss_left_and_the_coverage(tmp_path, capsys):
    out = tmp_path / "r.json"
    p = write(tmp_path, IDLE_MISS)
    args = ["trace-replay", str(p), "--carry-eviction", "lrd", "--row-bytes", "1", "--carry-idle-s", "100",
            "--prefill-tokens-per-s", "1000000", "--decode-s-per-token", "1"]
    assert main([*args, "--json", str(out)]) == 0  # valid-run is the default
    text = capsys.readouterr().out
    assert ("after a miss: valid-run (a blind turn deposits the keys it computed, [R, N); the next turn "
            "adopts them, blind below R)") in text
    assert ("after a miss: 3 valid runs deposited (0 replacing a fuller entry), 0 gaps (0 misses blind after "
            "one); adopted rows cover 47.4% of the adopting turns' reused prefix keys (37.5% of every "
            "follow-up's)") in text
    figures = json.loads(out.read_text())
    assert figures["config"]["after_miss"] == "valid-run"
    assert figures["policies"]["lrd"]["after_miss"] == {
        "valid_runs": 3, "replaced_fuller": 0, "gaps": 0, "blind_after_gap": 0, "covered_keys": 144,
        "reused_keys_adopted": 304, "reused_keys": 384, "coverage_adopted": round(144 / 304, 6),
        "coverage": 0.375}
    assert main([*args, "--after-miss", "nothing"]) == 0
    assert "after a miss: 0 valid runs deposited (0 replacing a fuller entry), 3 gaps (2 misses blind" in (
        capsys.readouterr().out)
    assert main([*args, "--after-miss", "full"]) == 0
    assert "after a miss" not in capsys.readouterr().out  # the first model prints what it printed


def test_a_bad_after_miss_value_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's own check: it exits
        main(["trace-replay", str(write(tmp_path, IDLE_MISS)), "--after-miss", "sometimes"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "trtllm-mtp-carry: error: argument --after-miss: invalid choice: 'sometimes'")
    with pytest.raises(ValueError, match="after_miss must be one of valid-run, nothing, full, got 'some'"):
        ReplayConfig(None, after_miss="some")
