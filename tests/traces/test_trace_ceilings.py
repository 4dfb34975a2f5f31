"""scripts/trace_ceilings.py and the seam it uses: a `CarryStore` of policy `returns` ranking by an
estimate it is given (`return_odds`) instead of the one it learns."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from trtllm_mtp_carry import CarriedDrafter, CarryStore
from trtllm_mtp_carry.core.eviction import ReturnOdds
from trtllm_mtp_carry.traces.reader import read_trace
from trtllm_mtp_carry.traces.replay import ReplayConfig, next_use

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "trace_ceilings.py"
SLICE = Path(__file__).parent / "data" / "mooncake-slice.jsonl"


def load_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("trace_ceilings", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["trace_ceilings"] = module
    spec.loader.exec_module(module)
    return module


def test_return_odds_is_for_the_returns_policy_only():
    with pytest.raises(TypeError, match="return_odds must be a ReturnOdds or None, got dict"):
        CarryStore(None, 100, "returns", 600, return_odds={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="return_odds is the `returns` policy's estimate, but the policy is 'lrd'"):
        CarryStore(None, 100, "lrd", 600, return_odds=ReturnOdds(600.0, 10))


def test_a_store_given_an_oracle_keeps_the_deposit_it_says_returns():
    ceilings = load_script()
    now = [0.0]
    # requests 0, 1, 2 deposit keys 1, 2, 3 at t = 0, 1, 2; only request 1 (key 2) comes back
    deposits = {(1, 0.0): 0, (2, 1.0): 1, (3, 2.0): 2}
    oracle = ceilings.HindsightOdds(deposits, np.array([0.0, 1.0, 0.0]), None, 600.0)
    store = CarryStore(None, 100, "returns", 600, lambda: now[0], return_odds=oracle)
    for key in (1, 2, 3):
        now[0] = float(key - 1)
        evicted = store.admit(key, 60, key)
        if evicted is not None:
            store.put(CarriedDrafter((), 0, None, (), key), 60, key)
    # key 2 pushed out key 1 (worth 0); key 3, worth 0 too, may not push out key 2
    assert [e.session_hash for e in store.entries()] == [2]
    assert store.miss_reason(1) == "memory" and store.miss_reason(3) == "not_admitted"


def test_the_slice_prints_each_estimate_with_the_figures_it_gave(capsys):
    ceilings = load_script()
    assert ceilings.main([str(SLICE), "--workers", "2", "--carry-memory", "256MiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("400 requests, 43 follow-ups; 2 worker(s) x 256MiB, idle TTL 600 s; "
                        "adopted within the TTL: 43 deposits")
    figures = {line[:48].strip(): line[48:].split("%")[0].strip() for line in lines[2:]}
    assert figures == {  # of 43 follow-ups: 12, 11, 11, 11, 12, 11, 11, 35, 16 and 32
        "learned online (the returns policy)": "27.9",  # trace-replay's figure for returns
        "hindsight: turn class": "25.6",
        "hindsight: turn class x size band": "25.6",
        "hindsight: turn class x previous gap": "25.6",
        "hindsight: turn class x size band x previous gap": "27.9",
        "hindsight: turn class x new span band": "25.6",
        "hindsight: all four": "25.6",
        "oracle: told which deposits are adopted": "81.4",
        "what-if: the shared first block held once": "37.2",
        "clairvoyant bound (every next arrival known)": "74.4",
    }


def test_a_group_rate_leaves_the_deposit_itself_out():
    ceilings = load_script()
    group = np.array([0, 0, 0, 1])
    adopted = np.array([True, True, False, True])  # trace-wide rate 3/4, one pseudo-deposit at it
    rate = ceilings.left_one_out_rate(group, adopted)
    assert rate.tolist() == [(1 + 0.75) / 3, (1 + 0.75) / 3, (2 + 0.75) / 3, (0 + 0.75) / 1]


def test_a_missing_trace_is_one_error_line(capsys):
    ceilings = load_script()
    assert ceilings.main(["nope.jsonl"]) == 2
    assert capsys.readouterr().err == "trace_ceilings: error: trace 'nope.jsonl' is not a file\n"


def test_given_chances_rank_as_the_tables_do_and_the_oracle_is_one_of_them(tmp_path, capsys):
    ceilings = load_script()
    trace = read_trace(SLICE)
    adopted = ~np.isnan(next_use(trace, ReplayConfig(256 << 20, workers=2)))
    np.save(tmp_path / "oracle.npy", adopted.astype(np.float64))
    np.save(tmp_path / "flat.npy", np.full(len(trace), 0.5))
    assert ceilings.main([str(SLICE), "--workers", "2", "--carry-memory", "256MiB",
                          "--chances", str(tmp_path / "oracle.npy"), "--chances", str(tmp_path / "flat.npy")]) == 0
    lines = capsys.readouterr().out.splitlines()
    figures = {line[:48].strip(): line[48:].split("%")[0].strip() for line in lines[2:]}
    assert figures["given: oracle.npy"] == figures["oracle: told which deposits are adopted"] == "81.4"
    assert figures["given: flat.npy"] == "27.9"  # one chance for all (12 of 43): sizes and ages decide


@pytest.mark.parametrize(("saved", "what"), [
    (np.zeros(3), "expected 400 numbers (one a request), got shape (3,) of float64"),
    (np.full(400, 1.5), "every chance must be a number in [0, 1]"),
    (np.array(["x"] * 400), "expected 400 numbers (one a request), got shape (400,) of <U1"),
])
def test_bad_chances_are_one_error_line(tmp_path, capsys, saved, what):
    ceilings = load_script()
    path = tmp_path / "c.npy"
    np.save(path, saved)
    assert ceilings.main([str(SLICE), "--chances", str(path)]) == 2
    assert capsys.readouterr().err == f"trace_ceilings: error: --chances {str(path)!r}: {what}\n"
