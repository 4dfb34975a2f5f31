"""The carry store's slot count: pinned like the other settings, on the CLI and in `info`."""

import json

from test_cli import run_cli
from test_settings import run_py


def test_carry_slots_default_is_no_cap_and_env_pins_it():
    code = "import trtllm_mtp_carry as t\nprint(t.carry_slots(), t.set_carry_slots(3), t.carry_slots())"
    assert run_py(code).stdout.split() == ["None", "False", "None"]
    assert run_py(code, TRTLLM_MTP_CARRY_SLOTS="4").stdout.split() == ["4", "False", "4"]


def test_set_carry_slots_before_read_wins_over_env():
    code = "import trtllm_mtp_carry as t\nprint(t.set_carry_slots(1), t.carry_slots())"
    assert run_py(code, TRTLLM_MTP_CARRY_SLOTS="4").stdout.split() == ["True", "1"]


def test_carry_slots_zero_or_malformed_is_a_clear_error():
    out = run_py("import trtllm_mtp_carry as t; t.carry_slots()", TRTLLM_MTP_CARRY_SLOTS="0")
    assert "environment variable TRTLLM_MTP_CARRY_SLOTS='0' must be at least 1" in out.stderr
    out = run_py("import trtllm_mtp_carry as t; t.carry_slots()", TRTLLM_MTP_CARRY_SLOTS="2x")
    assert "TRTLLM_MTP_CARRY_SLOTS='2x' is not a non-negative integer" in out.stderr
    out = run_py("import trtllm_mtp_carry as t; t.set_carry_slots(0)")
    assert "ValueError: carry_slots must be at least 1, got 0" in out.stderr
    out = run_py("import trtllm_mtp_carry as t; t.set_carry_slots(True)")
    assert "TypeError: carry_slots must be a non-negative int, got True" in out.stderr


def test_info_reports_slots_and_their_source():
    report = json.loads(run_cli("info", "--json").stdout)
    assert (report["carry_slots"], report["carry_slots_source"]) == (None, "default")  # null: no cap
    report = json.loads(run_cli("info", "--json", "--carry-slots", "1").stdout)
    assert (report["carry_slots"], report["carry_slots_source"]) == (1, "--carry-slots")
    report = json.loads(run_cli("info", "--json", TRTLLM_MTP_CARRY_SLOTS="5").stdout)
    assert (report["carry_slots"], report["carry_slots_source"]) == (5, "env TRTLLM_MTP_CARRY_SLOTS")
    assert "num_drafter_blocks x drafter_block_size" in report["drafter_pool_budget"]


def test_info_table_has_a_slots_row():
    lines = run_cli("info", "--carry-slots", "7").stdout.splitlines()
    row = next(line for line in lines if line.startswith("carry slots"))
    assert row.split()[-2:] == ["7", "--carry-slots"]


def test_carry_slots_flag_errors_name_the_flag():
    out = run_cli("info", "--carry-slots", "0")
    assert out.returncode == 2
    assert "--carry-slots: must be at least 1, got 0" in out.stderr
    out = run_cli("info", TRTLLM_MTP_CARRY_SLOTS="many")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "trtllm-mtp-carry: error: environment variable "
        "TRTLLM_MTP_CARRY_SLOTS='many' is not a non-negative integer"
    )


def test_info_reports_the_carry_stores_bounds_and_their_sources():
    report = json.loads(run_cli("info", "--json").stdout)
    assert [report[k] for k in ("carry_memory", "carry_eviction", "carry_idle_s")] == [
        "100% of the drafter pool", "returns", 600]
    report = json.loads(run_cli("info", "--json", "--carry-memory", "512MiB", "--carry-eviction", "lrd",
                                "--carry-idle-s", "0", TRTLLM_MTP_CARRY_MEMORY="1GiB").stdout)
    assert [(report[k], report[f"{k}_source"]) for k in ("carry_memory", "carry_eviction", "carry_idle_s")] == [
        ("512MiB", "--carry-memory"), ("lrd", "--carry-eviction"), (0, "--carry-idle-s")]
    report = json.loads(run_cli("info", "--json", TRTLLM_MTP_CARRY_MEMORY="0.25").stdout)
    assert (report["carry_memory"], report["carry_memory_source"]) == (
        "25% of the drafter pool", "env TRTLLM_MTP_CARRY_MEMORY")


def test_a_malformed_carry_memory_is_one_error_naming_it():
    out = run_cli("info", "--carry-memory", "2")
    assert out.returncode == 2 and out.stderr.startswith(
        "trtllm-mtp-carry: error: argument --carry-memory: '2': a bare number is a fraction")
    out = run_cli("info", TRTLLM_MTP_CARRY_MEMORY="4 gigs")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "trtllm-mtp-carry: error: environment variable TRTLLM_MTP_CARRY_MEMORY='4 gigs' is not a size: "
        "use bytes with a unit (4GiB, 512MiB, 1000000B) or a fraction of the drafter pool in [0, 1] (0.5)")


def test_carry_share_defaults_on_and_is_pinned_by_flag_env_or_setter():
    report = json.loads(run_cli("info", "--json").stdout)
    assert (report["carry_share"], report["carry_share_source"]) == (True, "default")
    report = json.loads(run_cli("info", "--json", "--carry-share", "off", TRTLLM_MTP_CARRY_SHARE="1").stdout)
    assert (report["carry_share"], report["carry_share_source"]) == (False, "--carry-share")
    report = json.loads(run_cli("info", "--json", TRTLLM_MTP_CARRY_SHARE=" Off ").stdout)
    assert (report["carry_share"], report["carry_share_source"]) == (False, "env TRTLLM_MTP_CARRY_SHARE")
    code = "import trtllm_mtp_carry.core as c\nprint(c.set_carry_share('no'), c.carry_share(), c.set_carry_share(True))"
    assert run_py(code).stdout.split() == ["True", "False", "False"]


def test_a_malformed_carry_share_is_one_error_naming_it():
    out = run_cli("info", TRTLLM_MTP_CARRY_SHARE="maybe")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "trtllm-mtp-carry: error: environment variable TRTLLM_MTP_CARRY_SHARE='maybe' is not on or off; "
        "use 1/0, on/off, true/false or yes/no")
    out = run_py("import trtllm_mtp_carry.core as c; c.set_carry_share(2)")
    assert "ValueError: carry_share=2 is not on or off" in out.stderr
