"""scripts/bench_after_miss.py end to end in its quick mode: the turns after a forced miss on the
reference engine and on the TensorRT-LLM stand-in, under valid-run, nothing, rebuild and blind.

Acceptance depends on tokens and the drafter's arithmetic, not on time, so the quick mode's
counts are exact (the same on every run of one machine): the test pins the invariants (outputs
identical, what each behaviour adopted and deposited, `nothing` drafting exactly as `blind`
after the miss) and the order of the behaviours that holds on each executor."""

from __future__ import annotations

import json
import subprocess

import pytest
from script_runs import run_script


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script("bench_after_miss.py", *args)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("after_miss") / "quick.json"
    r = _run("--quick", "--json", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout, json.loads(out.read_text())


def test_outputs_are_identical_across_the_four_behaviours_on_both_executors(quick) -> None:
    stdout, data = quick
    assert stdout.count("outputs identical across rebuild, valid-run, nothing, blind") == 2
    for ex in ("reference", "standin"):
        outputs = {}
        for r in data["records"]:
            if r["executor"] == ex:
                outputs.setdefault(r["behaviour"], []).append((r["session"], r["turn"], r["output"]))
        assert set(outputs) == {"rebuild", "valid-run", "nothing", "blind"}
        assert all(o == outputs["rebuild"] for o in outputs.values())
        assert len(outputs["rebuild"]) == 2 * 4 and all(out for _, _, out in outputs["rebuild"])


def test_valid_run_adopts_every_turn_after_the_miss_and_nothing_adopts_none(quick) -> None:
    _, data = quick
    for ex in ("reference", "standin"):
        recs = {(r["behaviour"], r["session"], r["turn"]): r for r in data["records"] if r["executor"] == ex}
        for (b, _, t), r in recs.items():
            if b in ("valid-run", "nothing") and t == 1:  # the forced miss: blind over its reused prefix
                assert r["outcome"] == "no_carry (session_end)" and r["rows_adopted"] == 0 and r["reused"] > 0
            if t > 1:
                assert r["reused"] > 0 or b == "rebuild"
                if b == "valid-run":  # the blind turn's run: keys from its own R, never [0, R)
                    assert r["outcome"] == "adopted" and 0 < r["rows_adopted"] < r["reused"]
                if b == "nothing":  # no deposit since the forget: the store's word on the key stands
                    assert r["outcome"] == "no_carry (session_end)" and r["rows_adopted"] == 0
        counters = data["counters"]
        # nothing withholds the miss turn's deposit and every one after it (2 sessions x 3 turns)
        assert counters[f"{ex}/nothing"]["withheld"] == 6 and counters[f"{ex}/nothing"]["deposits"] == 2
        assert counters[f"{ex}/valid-run"]["withheld"] == 0 and counters[f"{ex}/valid-run"]["deposits"] == 8


def test_nothing_drafts_exactly_as_blind_after_the_miss(quick) -> None:
    # with nothing deposited, every later turn of the conversation is a blind turn
    _, data = quick
    for ex in ("reference", "standin"):
        s = data["summaries"][ex]
        assert (s["nothing"]["accepted"], s["nothing"]["drafted"], s["nothing"]["verify_steps"]) == (
            s["blind"]["accepted"], s["blind"]["drafted"], s["blind"]["verify_steps"])


def test_valid_run_accepts_at_least_what_nothing_accepts_after_the_miss(quick) -> None:
    # the order that holds at this size on both executors; rebuild >= valid-run does not (a partial
    # context accepted more than the full one on these few turns of the tiny reference drafter)
    _, data = quick
    for ex in ("reference", "standin"):
        s = data["summaries"][ex]
        assert s["valid-run"]["accepted"] >= s["nothing"]["accepted"] == s["blind"]["accepted"]
        assert "accepted drafts rebuild >= valid-run >= nothing >= blind: " in quick[0]


@pytest.mark.parametrize(("args", "message"), [
    (("--miss-turn", "0"), "--miss-turn must be in 1..4 (a warm turn, and one after it), got 0"),
    (("--turns", "3", "--miss-turn", "2"), "--miss-turn must be in 1..1 (a warm turn, and one after it), got 2"),
    (("--executors", "vllm"), "--executors: unknown executor 'vllm' (reference, standin)"),
    (("--chunk", "40"), "--chunk must be a positive multiple of 16, got 40"),
    (("--draft-len", "4"), "--draft-len must be in 1..3, got 4"),
])
def test_a_bad_argument_is_one_error_line_and_exit_2(args: tuple[str, ...], message: str) -> None:
    r = _run(*args)
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"bench_after_miss.py: error: {message}\n"
