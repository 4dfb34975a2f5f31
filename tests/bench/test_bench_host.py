"""`bench --policies carry,carry-host --interleave`: every warm turn of `carry-host` adopts rows
restored from the carry store's host tier, paired turn by turn with `carry`'s device hits, so the
report's `carry-host/carry` ttft ratio is the host tier's cost (issue 36's <= 1.05x target, on a GPU)."""

import json

from trtllm_mtp_carry.bench.replay import BenchPolicy
from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.runtime.policy import DrafterPolicy


def test_carry_host_is_the_carry_with_its_entries_in_the_host_tier():
    assert BenchPolicy.parse("carry-host") == BenchPolicy("carry-host", DrafterPolicy.CARRY, None, host_only=True)
    assert BenchPolicy.parse("carry").host_only is False


def test_carry_host_adopts_every_warm_turn_from_host_memory_beside_carry_from_the_device(tmp_path, capsys):
    out = tmp_path / "host.json"
    rc = main(["bench", "--sessions", "2", "--turns", "3", "--history", "300", "--new-span", "32",
               "--max-new-tokens", "8", "--repeat", "1", "--policies", "carry,carry-host", "--interleave",
               "--no-progress", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["outputs_identical"] is True
    host = data["summary"]["carry-host"]["host_tier"]
    assert (host["hits_device"], host["hits_host"]) == (0, 4)  # 2 sessions x 2 warm turns, all from host
    assert "host_tier" not in data["summary"]["carry"]  # carry: every hit from the device
    # (the suite pins one carry slot, so `carry` here misses its interleaved sessions; a bench run's
    # carry is bounded by memory and adopts them from the device)
    ratio = data["summary"]["ratios"]["carry-host/carry"]
    assert ratio["pairs"] == 4 and ratio["ttft_paired_median"] > 0
    text = capsys.readouterr().out
    assert "carry-host/carry (4 paired warm turns): ttft x" in text
    assert "carry-host: host tier of 4MiB: adopted from device 0, from host 4" in text
