"""scripts/bench_lockstep.py end to end at TP 2 (two gloo rank processes): a warm turn costs the
carry exactly four agreements, and a bad TP size is one error line."""

from __future__ import annotations

import subprocess

from script_runs import run_script


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script("bench_lockstep.py", *args, timeout=240)


def test_a_warm_turn_makes_four_agreements_on_every_rank() -> None:
    r = _run("--tp", "2", "--turns", "5", "--warmup", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    row = r.stdout.strip().splitlines()[-1].split("|")
    assert row[1].strip() == "2"
    assert row[3].strip() == "24"  # 4 agreements x (1 warm-up + 5 timed) turns


def test_a_tensor_parallel_size_below_two_is_one_error_line() -> None:
    r = _run("--tp", "1")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("--tp 1: the lockstep runs at 2 ranks or more")
