"""trace-replay with `--after-miss full` and no `--move` prints, bit for bit, what it printed before
either existed (tests/traces/data/replay-figures-11606e6.json, taken at commit 11606e6), and its
JSON holds every figure it held then, unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trtllm_mtp_carry.cli import main

DATA = Path(__file__).parent / "data"
SLICE = DATA / "mooncake-slice.jsonl"
GOLDEN = json.loads((DATA / "replay-figures-11606e6.json").read_text())


def _contains(before: Any, now: Any, where: str = "") -> None:
    """Every key `before` has, `now` has with the same value (new keys may be added)."""
    if isinstance(before, dict):
        assert isinstance(now, dict), where
        for key, value in before.items():
            assert key in now, f"{where}.{key} is gone"
            _contains(value, now[key], f"{where}.{key}")
    else:
        assert now == before, f"{where}: {now!r} != {before!r}"


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: " ".join(c["args"]))
def test_the_first_model_without_moves_prints_what_it_printed_before(tmp_path, capsys, case):
    out = tmp_path / "r.json"
    assert main(["trace-replay", str(SLICE), *case["args"], "--after-miss", "full", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("replayed in ")  # the one line that varies: the run time
    assert "\n".join(lines[:-1]) == case["stdout"].replace("{trace}", str(SLICE))
    figures = json.loads(out.read_text())
    figures["trace"]["path"] = "{trace}"
    _contains(case["json"], figures)
    for p in figures["policies"].values():  # the new figures say nothing moved and nothing was blind
        assert p["moves"]["restarts"] == p["moves"]["moved_follow_ups"] == 0
        assert p["adopted_by_source"] == {"local": p["adopted"], "remote": 0}
        assert p["after_miss"]["valid_runs"] == p["after_miss"]["gaps"] == 0
