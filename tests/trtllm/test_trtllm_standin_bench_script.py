"""scripts/trtllm_standin_bench.py end to end at a tiny size: the adapter's data path figures
and the scatter check, and `--device` refusals as one error line with exit 2."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
from script_runs import run_script


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script("trtllm_standin_bench.py", *args)


def test_a_tiny_cpu_run_prints_the_data_path_figures_and_the_scatter_check_passes():
    r = _run("--device", "cpu", "--history", "300", "--sessions", "1", "--turns", "2",
             "--max-new", "6", "--chunk", "64", "--fp8")
    assert r.returncode == 0, r.stderr[-2000:]
    tagged = [line.split("\t") for line in r.stdout.splitlines() if line.startswith(("FIGURE\t", "CHECK\t"))]
    assert [t[:2] for t in tagged] == [
        ["FIGURE", "adapter gather per warm turn"], ["FIGURE", "adapter scatter per warm turn"],
        ["FIGURE", "adapter data path / blind warm ttft"],
        ["FIGURE", "carried rows bit for bit"], ["FIGURE", "carried bytes per row"],
        ["FIGURE", "adapter gather per warm turn, fp8"], ["FIGURE", "adapter scatter per warm turn, fp8"],
        ["FIGURE", "adapter data path / blind warm ttft, fp8"],
        ["FIGURE", "carried rows bit for bit, fp8"], ["FIGURE", "carried bytes per row, fp8"],
        ["CHECK", "adapter scattered rows equal the gathered ones"]]
    for t in tagged[:10]:
        assert len(t) == 5 and t[3:] == ["-", "INFO"]
    for t in (tagged[0], tagged[1], tagged[5], tagged[6]):
        assert re.fullmatch(r"\d+\.\d{3} ms \[\d+\.\d{3}-\d+\.\d{3}\] over 1 warm turns \(carry(-fp8)?, cpu\)",
                            t[2]), t[2]
    # a BF16 pool: 2 x Hkv x D x 2 bytes a row as held; fp8 packs them (payload plus scales)
    assert re.fullmatch(r"(\d+) of \1 rows \(carry, torch.bfloat16 pages\)", tagged[3][2]), tagged[3][2]
    assert tagged[4][2] == "256 B (bf16, torch.bfloat16 pages)"
    assert tagged[8][2].startswith("n/a: fp8 packs the rows (")
    assert tagged[9][2] == "144 B (fp8, torch.bfloat16 pages)"
    # one warm turn per carry policy: one scatter each, of the rows the cold turn left
    check = tagged[10]
    assert check[2] == "PASS"
    assert re.fullmatch(r"2 scatters, \d+ rows read back from the pages equal the rows gathered at "
                        r"the previous turn's free", check[3]), check[3]
    assert "pages on cpu" in r.stdout


def test_an_fp8_kv_pool_reports_every_row_carried_bit_for_bit_at_one_byte_an_element():
    r = _run("--device", "cpu", "--history", "300", "--sessions", "1", "--turns", "2",
             "--max-new", "6", "--chunk", "64", "--fp8", "--kv-dtype", "fp8")
    assert r.returncode == 0, r.stderr[-2000:]
    figures = {t[1]: t[2] for t in (line.split("\t") for line in r.stdout.splitlines())
               if t[0] == "FIGURE"}
    for suffix, policy in (("", "carry"), (", fp8", "carry-fp8")):  # carry_row_dtype fp8: no second packing
        got = figures[f"carried rows bit for bit{suffix}"]
        assert re.fullmatch(rf"(\d+) of \1 rows \({policy}, torch.float8_e4m3fn pages\)", got), got
        assert figures[f"carried bytes per row{suffix}"] == "128 B (fp8_kv, torch.float8_e4m3fn pages)"
    assert "(fp8 KV); outputs identical" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_error_line_and_exit_2():
    r = _run("--device", "cuda", "--history", "300")
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr == ("trtllm_standin_bench.py: error: --device cuda: no CUDA device here "
                        "(torch.cuda.is_available() is False)\n")


def test_a_device_that_is_not_one_is_one_error_line_and_exit_2():
    r = _run("--device", "gpu0")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == ("trtllm_standin_bench.py: error: --device 'gpu0': not a torch device "
                        "(cpu, cuda or cuda:N)\n")


def test_the_race_check_reads_every_scattered_row_back_unsynced_and_prints_its_check_only():
    # on the CPU: no delay is queued, but the same read-backs run (truth from the pages at the
    # gather, rows read back after the adoption on the executor's stream); times are no figures
    r = _run("--device", "cpu", "--history", "300", "--sessions", "1", "--turns", "3",
             "--max-new", "6", "--chunk", "64", "--fp8", "--delay-cycles", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    tagged = [line.split("\t") for line in r.stdout.splitlines() if line.startswith(("FIGURE\t", "CHECK\t"))]
    assert [t[:3] for t in tagged] == [
        ["CHECK", "adapter scattered rows equal the gathered ones, 0 cycles of delay on both streams, "
                  "read back unsynced", "PASS"]]
    assert re.fullmatch(r"4 scatters, \d+ rows read back from the pages equal the rows gathered at "
                        r"the previous turn's free", tagged[0][3]), tagged[0][3]


def test_a_negative_delay_is_one_error_line_and_exit_2():
    r = _run("--delay-cycles", "-1")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "trtllm_standin_bench.py: error: --delay-cycles must be >= 0, got -1\n"


def test_an_nvfp4_kv_pool_reports_every_row_carried_bit_for_bit_at_its_payload_and_scale_bytes():
    from trtllm_mtp_carry.dataplane.nvfp4_kv import NVFP4_KV_DTYPE

    r = _run("--device", "cpu", "--history", "300", "--sessions", "1", "--turns", "2",
             "--max-new", "6", "--chunk", "64", "--fp8", "--kv-dtype", "nvfp4")
    assert r.returncode == 0, r.stderr[-2000:]
    figures = {t[1]: t[2] for t in (line.split("\t") for line in r.stdout.splitlines())
               if t[0] == "FIGURE"}
    for suffix, policy in (("", "carry"), (", fp8", "carry-fp8")):  # carry_row_dtype fp8: the pool's bytes
        got = figures[f"carried rows bit for bit{suffix}"]
        assert re.fullmatch(rf"([1-9]\d*) of \1 rows \({policy}, {re.escape(str(NVFP4_KV_DTYPE))} pages\)", got), got
        # the reference model's MTP layer: 2 x Hkv x (D/2 + D/16) bytes, no global scale
        assert figures[f"carried bytes per row{suffix}"] == f"72 B (nvfp4_kv, {NVFP4_KV_DTYPE} pages)"
    assert "(nvfp4 KV); outputs identical" in r.stdout
