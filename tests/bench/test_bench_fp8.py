"""`bench --policies carry,carry-fp8,...`: carry with FP8 rows beside carry in one lockstep run, its
ratios over carry, adoption where carry adopted, pack/unpack time (issue 31)."""

import json

import pytest

from trtllm_mtp_carry.bench import report
from trtllm_mtp_carry.bench.driver import PolicyRun, TurnRecord
from trtllm_mtp_carry.bench.replay import BenchPolicy
from trtllm_mtp_carry.cli import main
from trtllm_mtp_carry.runtime.policy import DrafterPolicy


def test_bench_policies_name_a_row_format_variant_of_carry():
    assert BenchPolicy.parse("carry-fp8") == BenchPolicy("carry-fp8", DrafterPolicy.CARRY, "fp8")
    assert BenchPolicy.parse("carry-nvfp4") == BenchPolicy("carry-nvfp4", DrafterPolicy.CARRY, "nvfp4")
    assert BenchPolicy.parse("blind") == BenchPolicy("blind", DrafterPolicy.BLIND, None)
    assert BenchPolicy.parse(DrafterPolicy.CARRY) == BenchPolicy("carry", DrafterPolicy.CARRY, None)
    with pytest.raises(ValueError) as exc:
        BenchPolicy.parse("blind-fp8")
    assert str(exc.value) == ("unknown drafter policy 'blind-fp8'; expected one of carry, carry-bf16, "
                              "carry-fp8, carry-nvfp4, carry-host, rebuild, blind, paired, off")


def turn(session, n, acceptance, ttft, kind="adopted", accepted=4, steps=4):
    stats = {"ttft_ms": ttft, "acceptance": acceptance, "drafter_prep_ms": 1.0, "outcome_kind": kind,
             "accepted": accepted, "verify_steps": steps}
    return TurnRecord(session, n, stats, [1, 2], 0)


def test_a_variant_is_paired_over_its_base_and_counts_adoption_where_the_base_adopted():
    carry = PolicyRun("carry", [turn("s0", 1, 0.8, 10.0), turn("s1", 1, 0.6, 10.0)])
    fp8 = PolicyRun("carry-fp8", [turn("s0", 1, 0.8, 9.0), turn("s1", 1, 0.6, 11.0, kind="no_carry")])
    ratios = report.paired([carry, fp8], 0)
    assert list(ratios) == ["carry-fp8/carry"]
    r = ratios["carry-fp8/carry"]
    assert (r["pairs"], r["base_adopted"], r["adopted_where_base_adopted"]) == (2, 2, 1)
    assert (r["acceptance_paired_median"], r["ttft_paired_median"]) == (1.0, 1.0)  # ttft: 0.9 and 1.1
    assert r["accepted_per_step_paired_median"] == 1.0
    assert "adopted 1 of the 2 warm turns carry adopted" in report.ratio_lines(ratios)[0]


def test_carry_fp8_runs_beside_carry_with_identical_outputs_and_reports_pack_times(tmp_path, capsys):
    out = tmp_path / "fp8.json"
    rc = main(["bench", "--sessions", "1", "--turns", "3", "--history", "300", "--new-span", "32",
               "--max-new-tokens", "8", "--repeat", "1", "--policies", "carry,carry-fp8,off",
               "--no-progress", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["outputs_identical"] is True  # off: plain greedy
    ratio = data["summary"]["ratios"]["carry-fp8/carry"]
    assert (ratio["base_adopted"], ratio["adopted_where_base_adopted"]) == (2, 2)
    fp8 = data["summary"]["carry-fp8"]
    assert fp8["row_format"]["row_dtype"] == "fp8"
    assert (fp8["row_format"]["packs"], fp8["row_format"]["unpacks"]) == (3, 2)
    assert fp8["row_format"]["pack_ms_median"] > 0 and fp8["row_format"]["unpack_ms_median"] > 0
    assert "row_format" not in data["summary"]["carry"]
    assert "carry-fp8: rows stored fp8: 3 deposits packed" in capsys.readouterr().out


def test_carry_fp8_through_a_server_is_refused_with_one_line(capsys):
    assert main(["bench", "--server", "127.0.0.1:9", "--policies", "carry,carry-fp8", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        "trtllm-mtp-carry: error: --policies carry-fp8 with --server 127.0.0.1:9: the server stores carried "
        "rows in its own carry_row_dtype (set it when serving); compare row formats in process")


def test_carry_host_through_a_server_is_refused_naming_the_host_tier(capsys):
    # not the row-format reason carry-fp8 gets: what carry-host varies is where entries live
    assert main(["bench", "--openai", "http://127.0.0.1:9/v1", "--policies", "carry,carry-host",
                 "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        "trtllm-mtp-carry: error: --policies carry-host with --openai http://127.0.0.1:9/v1: the server's "
        "carry store decides which entries live in its host tier (its carry_memory and carry_host_memory, "
        "set when serving); compare host and device hits in process")
