"""trace-replay --move: sessions leaving their worker (a drain, a crash, least-loaded overflow), and
--pull: a moved session's rows following it, counted as bytes moved. Each trace is small enough
that every count is derived by hand in the test's comment.

Two workers. Conversations get dense ids in order of first arrival, and the hash split
(`worker_of`) puts conversations 0, 1 and 3 on worker 1 and 2 and 4 on worker 0; with two
workers a restarting worker's sessions all go to the other one. The service model is exact:
prefill 10^6 tokens/s and 1 s an output token, so a turn finishes `output` seconds (plus
microseconds) after it arrives. Rows are 1 byte, so bytes are rows; no idle TTL.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.traces.reader import read_trace
from trtllm_mtp_carry.traces.replay import Moves, ReplayConfig, ServiceModel, replay, worker_of

SERVICE = ServiceModel(prefill_tokens_per_s=1e6, decode_s_per_token=1.0)


def turn(chat: str, parent: str | None, t: float, hashes: list[int], out: int) -> dict[str, object]:
    return {"chat_id": chat, "parent_chat_id": parent, "timestamp": t, "turn": 0, "hash_ids": hashes,
            "output_length": out}


def write(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def config(moves: Moves, budget: int | None = None) -> ReplayConfig:
    return ReplayConfig(budget, workers=2, row_bytes=1, idle_s=None, service=SERVICE, moves=moves)


def test_the_hash_split_the_comments_rely_on():
    assert worker_of(np.arange(5), 2).tolist() == [1, 1, 0, 1, 0]


# A drain or crash every minute: worker 0 restarts at 60 s (the next, worker 1 at 120 s, never
# comes: the trace ends at 84 s). P prompt tokens, O output, N = P + O rows, R reused.
#   conv  turn  t    P   O   N   worker  finishes
#   A 0   A1    0    32  4   36  1       4
#   B 1   B1    1    32  4   36  1       5
#   C 2   C1    2    32  4   36  0       6     held by worker 0 at 60
#   D 3   D1    3    32  4   36  1       7
#   E 4   E1    50   32  20  52  0       70    running at 60
#   C     C2    65   48  4   52  R 32, on worker 1 (C moved at 60)
#   A     A2    66   48  4   52  R 32, on worker 1 (never moved)
#   E     E2    80   48  4   52  R 32, on worker 1 (E moved at 60)
DRAIN = [turn("a1", None, 0, [1, 2], 4), turn("b1", None, 1, [3, 4], 4), turn("c1", None, 2, [5, 6], 4),
         turn("d1", None, 3, [7, 8], 4), turn("e1", None, 50, [9, 10], 20),
         turn("c2", "c1", 65, [5, 6, 11], 4), turn("a2", "a1", 66, [1, 2, 12], 4),
         turn("e2", "e1", 80, [9, 10, 13], 4)]


def test_a_drain_with_pull_offers_its_entries_and_running_turns_to_each_sessions_new_worker(tmp_path):
    r = replay(read_trace(write(tmp_path, DRAIN)), "lrd", config(Moves("drain", every_s=60.0, pull=True)))
    # at 60 worker 0 holds C1's 36 rows: offered to worker 1 (C's worker now), taken; E1, running,
    # finishes at 70 and its 52 rows are offered there too. C2, A2 and E2 all adopt on worker 1.
    assert (r.follow_ups, r.adopted, r.misses) == (3, 3, {})
    assert r.adopted_by_source == {"local": 3, "remote": 0}
    m = r.moves
    assert (m.restarts, m.session_moves, m.moved_follow_ups, m.moved_adopted) == (1, 2, 2, 2)
    assert (m.entries_moved, m.bytes_moved) == ({"handoff": 2, "pull": 0}, {"handoff": 36 + 52, "pull": 0})
    assert (m.handoff_refused, m.lost_entries, m.lost_bytes, m.lost_in_flight) == (0, 0, 0, 0)
    assert r.after_miss.covered_keys == 3 * 32


@pytest.mark.parametrize("moves", [Moves("drain", every_s=60.0), Moves("crash", every_s=60.0),
                                   Moves("crash", every_s=60.0, pull=True)], ids=str)
def test_without_pull_or_after_a_crash_the_moved_sessions_miss(tmp_path, moves):
    r = replay(read_trace(write(tmp_path, DRAIN)), "lrd", config(moves))
    # C1's entry goes with worker 0 and E1's deposit with its turn; C2 and E2 find nothing on
    # worker 1 (never carried there) and deposit their valid runs, [32, 52): A2 alone adopts
    assert (r.adopted, r.misses) == (1, {"never_carried": 2})
    m = r.moves
    assert (m.restarts, m.session_moves, m.moved_follow_ups, m.moved_adopted) == (1, 2, 2, 0)
    assert (m.entries_moved, m.bytes_moved) == ({"handoff": 0, "pull": 0}, {"handoff": 0, "pull": 0})
    assert (m.handoff_refused, m.lost_entries, m.lost_bytes, m.lost_in_flight) == (0, 1, 36, 1)
    assert r.after_miss.valid_runs == 2


def test_a_handed_off_entry_must_pass_the_peers_admission(tmp_path):
    r = replay(read_trace(write(tmp_path, DRAIN)), "incumbent",
               config(Moves("drain", every_s=60.0, pull=True), budget=40))
    # 40 bytes a worker, `incumbent`: worker 1 keeps A1 (36) and refuses B1 and D1. At 60 C1's 36
    # rows do not fit beside A1: refused, lost. C2 misses (worker 1 remembers the refusal), A2
    # adopts, C2's run [32, 52) fits the room A2's lease left; E1's 52 rows exceed the budget
    # (too_large), so E2 misses too
    assert (r.adopted, r.misses) == (1, {"not_admitted": 1, "too_large": 1})
    m = r.moves
    assert (m.entries_moved["handoff"], m.handoff_refused, m.lost_entries, m.lost_bytes) == (0, 2, 1, 36)


# Least-loaded soft affinity, threshold 0: a turn whose worker runs anything goes to one running
# less (the first among equals), and its session stays there.
#   conv  turn  t   P   O    worker (loads w0, w1 at arrival)       finishes
#   A 0   A1    0   32  5    1 (0, 0)                                5
#   B 1   B1    1   32  2    1 is running A1 (0, 1): moves to 0     3, deposits on 0
#   C 2   C1    8   32  100  0 (0, 0)                                108
#   B     B2    10  48  4    0 is running C1 (1, 0): moves to 1     14; R 32
#   A     A2    12  48  4    1 is running B2 (1, 1): none runs less, stays; adopts A1 on 1
OVERFLOW = [turn("a1", None, 0, [1, 2], 5), turn("b1", None, 1, [3, 4], 2), turn("c1", None, 8, [5, 6], 100),
            turn("b2", "b1", 10, [3, 4, 7], 4), turn("a2", "a1", 12, [1, 2, 8], 4)]


@pytest.mark.parametrize(("pull", "adopted", "remote", "misses"), [
    (True, 2, 1, {}),  # B2 reads B1's 34 rows from worker 0, which still holds them
    (False, 1, 0, {"never_carried": 1}),  # B2 finds nothing on worker 1
])
def test_overflow_sends_a_session_to_the_least_loaded_worker_and_pull_brings_its_rows(tmp_path, pull, adopted,
                                                                                    remote, misses):
    r = replay(read_trace(write(tmp_path, OVERFLOW)), "lrd", config(Moves("overflow", load=0, pull=pull)))
    assert (r.follow_ups, r.adopted, r.misses) == (2, adopted, misses)
    assert r.adopted_by_source == {"local": 1, "remote": remote}
    m = r.moves
    assert (m.restarts, m.session_moves, m.moved_follow_ups, m.moved_adopted) == (0, 2, 1, remote)
    assert (m.entries_moved["pull"], m.bytes_moved["pull"]) == (remote, 34 * remote)
    assert m.lost_entries == m.lost_in_flight == 0


def test_the_command_line_prints_the_moves_and_their_bytes(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["trace-replay", str(write(tmp_path, DRAIN)), "--workers", "2", "--carry-eviction", "lrd",
            "--row-bytes", "1", "--carry-idle-s", "0", "--prefill-tokens-per-s", "1000000",
            "--decode-s-per-token", "1", "--move", "drain", "--move-every", "1"]
    assert main([*args, "--pull", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert ("moves: drain: every 1 min one worker (round-robin) stops gracefully and restarts empty; pull (its "
            "entries are offered to each session's new worker)") in text
    assert "clairvoyant bound: 3 of 3 follow-ups adopted (100.0%; no moves)" in text
    assert ("moves: 1 restarts, 2 session moves; 2 follow-ups on another worker, 2 adopted (remote 0); moved 2 "
            "entries, 88B (handoff 2, 88B; pull 0, 0B); refused by a peer 0; lost 0 entries, 0B, and 0 running "
            "turns' deposits") in text
    figures = json.loads(out.read_text())
    assert figures["config"]["moves"] == {"model": "drain", "every_min": 1.0, "load": None, "pull": True}
    assert figures["policies"]["lrd"]["moves"]["bytes_moved"] == {"handoff": 88, "pull": 0}
    assert main(args) == 0
    assert "lost 1 entries, 36B, and 1 running turns' deposits" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "message"), [
    (["--move", "drain"], "--move drain needs --move-every MIN (minutes between restarts)"),
    (["--move-every", "5"], "--move-every 5 applies to --move drain or crash, not --move none"),
    (["--move", "overflow"], "--move overflow needs --move-load N (requests in flight above which a session "
                             "leaves)"),
    (["--move", "crash", "--move-every", "1", "--move-load", "3"],
     "--move-load 3 applies to --move overflow, not --move crash"),
    (["--pull"], "--pull needs --move drain, crash or overflow (with --move none no session moves)"),
    (["--move", "crash", "--move-every", "1", "--workers", "1"],
     "--move crash needs --workers >= 2 (a session moves to another worker), got --workers 1"),
])
def test_a_move_flag_without_its_model_is_one_error_line(tmp_path, capsys, flags, message):
    assert main(["trace-replay", str(write(tmp_path, DRAIN)), "--workers", "2", *flags]) == 2
    assert capsys.readouterr().err == f"trtllm-mtp-carry: error: {message}\n"


@pytest.mark.parametrize(("flags", "message"), [
    (["--move-every", "0"], "argument --move-every: must be a positive number, got 0"),
    (["--move-load", "-1"], "argument --move-load: must be non-negative, got -1"),
    (["--move", "teleport"], "argument --move: invalid choice: 'teleport'"),
])
def test_a_bad_move_value_is_one_error_line(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:  # argparse's own checks: they exit
        main(["trace-replay", str(write(tmp_path, DRAIN)), *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"trtllm-mtp-carry: error: {message}")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"model": "drain"}, "moves model 'drain' needs every_s > 0 seconds, got None"),
    ({"model": "crash", "every_s": float("inf")}, "moves model 'crash' needs every_s > 0 seconds, got inf"),
    ({"model": "overflow", "load": -1}, "moves model 'overflow' needs load, an int >= 0, got -1"),
    ({"model": "none", "pull": True}, "pull needs a moves model other than 'none'"),
    ({"model": "fly"}, "moves model must be one of none, drain, crash, overflow, got 'fly'"),
])
def test_moves_refuse_what_their_model_cannot_use(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Moves(**kwargs)


def test_moves_need_two_workers():
    with pytest.raises(ValueError, match="moves model 'drain' needs workers >= 2"):
        ReplayConfig(None, workers=1, moves=Moves("drain", every_s=60.0))
