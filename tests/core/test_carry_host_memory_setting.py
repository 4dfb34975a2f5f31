"""The carry store's host tier budget: pinned like the other settings, on the CLI and in `info`."""

import json

import pytest
from test_cli import run_cli
from test_settings import run_py

from trtllm_mtp_carry.core.settings import parse_carry_host_memory


def test_carry_host_memory_defaults_to_no_host_tier_and_env_or_setter_pins_it():
    code = ("import trtllm_mtp_carry as t\n"
            "print(t.carry_host_memory(), t.set_carry_host_memory('8GiB'), t.carry_host_memory())")
    assert run_py(code).stdout.split() == ["0", "False", "0"]
    assert run_py(code, TRTLLM_MTP_CARRY_HOST_MEMORY="2GiB").stdout.split() == [
        str(2 << 30), "False", str(2 << 30)]
    code = "import trtllm_mtp_carry as t\nprint(t.set_carry_host_memory(4096), t.carry_host_memory())"
    assert run_py(code, TRTLLM_MTP_CARRY_HOST_MEMORY="2GiB").stdout.split() == ["True", "4096"]


def test_info_reports_the_host_tier_and_its_source():
    report = json.loads(run_cli("info", "--json").stdout)
    assert (report["carry_host_memory"], report["carry_host_memory_source"]) == (0, "default")
    report = json.loads(run_cli("info", "--json", "--carry-host-memory", "8GiB",
                                TRTLLM_MTP_CARRY_HOST_MEMORY="1GiB").stdout)
    assert (report["carry_host_memory"], report["carry_host_memory_source"]) == (8 << 30, "--carry-host-memory")
    report = json.loads(run_cli("info", "--json", TRTLLM_MTP_CARRY_HOST_MEMORY="512MiB").stdout)
    assert (report["carry_host_memory"], report["carry_host_memory_source"]) == (
        512 << 20, "env TRTLLM_MTP_CARRY_HOST_MEMORY")
    lines = run_cli("info", "--carry-host-memory", "8GiB").stdout.splitlines()
    row = next(line for line in lines if line.startswith("carry host tier"))
    assert row.split()[-2:] == ["8GiB", "--carry-host-memory"]
    row = next(line for line in run_cli("info").stdout.splitlines() if line.startswith("carry host tier"))
    assert row.split()[-2:] == ["none", "default"]


def test_a_malformed_carry_host_memory_is_one_error_naming_it():
    out = run_cli("info", "--carry-host-memory", "0.5")
    assert out.returncode == 2 and out.stderr.strip() == (
        "trtllm-mtp-carry: error: argument --carry-host-memory: '0.5': host memory is bytes with a unit "
        "(8GiB, 512MiB), or 0 for no host tier; it is no fraction of the drafter pool "
        "(see trtllm-mtp-carry info --help)")
    out = run_cli("info", TRTLLM_MTP_CARRY_HOST_MEMORY="lots")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "trtllm-mtp-carry: error: environment variable TRTLLM_MTP_CARRY_HOST_MEMORY='lots' is not a size: "
        "use bytes with a unit (8GiB, 512MiB, 1000000B), or 0 for no host tier")
    out = run_py("import trtllm_mtp_carry as t; t.set_carry_host_memory(-1)")
    assert "ValueError: carry_host_memory must be" in out.stderr
    out = run_py("import trtllm_mtp_carry as t; t.set_carry_host_memory(True)")
    assert "TypeError: carry_host_memory must be a str like '8GiB' or an int of bytes, got True" in out.stderr


@pytest.mark.parametrize(("text", "message"), [
    ("2", "carry_host_memory='2': host memory is bytes with a unit (8GiB, 512MiB), or 0 for no host tier; "
          "it is no fraction of the drafter pool"),
    (0.25, "carry_host_memory=0.25: host memory is bytes with a unit (8GiB, 512MiB), or 0 for no host tier; "
           "it is no fraction of the drafter pool"),
    ("8 parsecs", "carry_host_memory='8 parsecs' is not a size: use bytes with a unit (8GiB, 512MiB, "
                  "1000000B), or 0 for no host tier"),
])
def test_a_host_budget_error_never_offers_a_fraction(text: object, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_carry_host_memory(text)
    assert str(exc.value) == message


def test_host_budgets_parse_to_bytes() -> None:
    assert [parse_carry_host_memory(v) for v in ("8GiB", "512MiB", 1000, 0, "0", 0.0)] == [
        8 << 30, 512 << 20, 1000, 0, 0, 0]
