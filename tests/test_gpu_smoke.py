"""The one GPU check (scripts/gpu_smoke.sh) on a CPU: its shell parses, it calls python3 only,
it refuses a machine without CUDA in one line, and its table (scripts/gpu_smoke_table.py)
collects every step's CHECK/FIGURE lines and sets the exit status."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "scripts" / "gpu_smoke.sh"
TABLE = ROOT / "scripts" / "gpu_smoke_table.py"


def test_gpu_smoke_parses_as_bash():
    proc = subprocess.run(["bash", "-n", str(SMOKE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_gpu_smoke_calls_python3_never_bare_python():
    code = [line.split("#", 1)[0] for line in SMOKE.read_text().splitlines()]
    bare = [line for line in code if re.search(r"(?<![\w/.-])python(?![\w.])", line)]
    assert bare == []
    assert any("python3 -m pytest tests" in line for line in code)


def test_gpu_smoke_never_aborts_on_a_failed_step_nor_tails_a_pipe():
    text = SMOKE.read_text()
    assert re.search(r"^set -[a-z]*e", text, re.M) is None
    assert "| tail" not in text.replace("tail -n 4 \"$log\"", "")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_smoke_refuses_a_machine_without_cuda_in_one_line(tmp_path):
    proc = subprocess.run(["bash", str(SMOKE), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == ("gpu_smoke: error: no CUDA device (torch.cuda.is_available() is False "
                           "in python3): this check needs an NVIDIA GPU\n")
    assert not (tmp_path / "out").exists()


def _run(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TABLE), str(out)], capture_output=True, text=True,
                          timeout=60)


def _fake_run(tmp_path: Path, rows: list[tuple[str, str, str]], logs: dict[str, str]) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    (out / "steps.tsv").write_text(
        "".join(f"{name}\t{kind}\t{rc}\t12\t{name}.log\n" for name, kind, rc in rows))
    for name, text in logs.items():
        (out / f"{name}.log").write_text(text)
    return out


GOOD_LOGS = {
    "aot-check": "PASS copy-exact ...\nCHECK\taot copy-exact\tPASS\tall cases equal the reference\n"
                 "FIGURE\taot hidden_row_copy 64k rows kernel BW\t0.91 of D2D (IQR 0.90-0.92)"
                 "\t>= 0.85 of D2D\tPASS\n",
    "kernels": "table...\nFIGURE\tkernels drafter_row_append triton 512 rows per call\tx1.90 index_copy_"
               "\t<= 1.5x index_copy_\tMISS\nnot a FIGURE\tline\n",
    "tests": "1400 passed in 60s\nCHECK\ttest suite on CUDA\tPASS\t1400 passed in 60s\n",
}


def test_table_lists_steps_checks_figures_and_passes_with_a_missed_figure_and_a_failed_speed_step(
        tmp_path):
    out = _fake_run(tmp_path, [("tests", "correctness", "0"), ("aot-check", "correctness", "0"),
                               ("kernels", "speed", "1"), ("trt-engine", "correctness", "skip")],
                    GOOD_LOGS | {"trt-engine": "SKIP: tensorrt.plugin does not import here\n"})
    proc = _run(out)
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    assert any(re.fullmatch(r"kernels\s+speed\s+1\s+12\s+FAILED\s+kernels\.log", ln) for ln in lines)
    assert any(re.fullmatch(r"trt-engine\s+correctness\s+skip\s+12\s+SKIP\s+trt-engine\.log", ln)
               for ln in lines)
    assert any(re.fullmatch(r"aot copy-exact\s+PASS\s+all cases equal the reference \(aot-check\)", ln)
               for ln in lines)
    assert any(re.fullmatch(r"kernels drafter_row_append triton 512 rows per call\s+x1\.90 index_copy_"
                            r"\s+<= 1\.5x index_copy_\s+MISS \(kernels\)", ln) for ln in lines)
    assert lines[-1] == "4 steps, 2 checks, 2 figures (1 MISS); 0 correctness failure(s)"


def test_table_exits_1_on_a_check_fail(tmp_path):
    logs = dict(GOOD_LOGS)
    logs["aot-check"] += "CHECK\taot op-aot\tFAIL\tAttributeError: no hidden_row_copy\n"
    out = _fake_run(tmp_path, [("tests", "correctness", "0"), ("aot-check", "correctness", "0")], logs)
    proc = _run(out)
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1] == "2 steps, 3 checks, 1 figures (0 MISS); 1 correctness failure(s)"


@pytest.mark.parametrize("rc,status", [("124", "TIMEOUT"), ("137", "TIMEOUT"), ("2", "FAILED")])
def test_table_exits_1_when_a_correctness_step_fails_or_times_out(tmp_path, rc, status):
    out = _fake_run(tmp_path, [("tests", "correctness", "0"), ("aot-check", "correctness", rc)],
                    GOOD_LOGS)
    proc = _run(out)
    assert proc.returncode == 1
    assert any(re.fullmatch(rf"aot-check\s+correctness\s+{rc}\s+12\s+{status}\s+aot-check\.log", ln)
               for ln in proc.stdout.splitlines())


def test_table_counts_a_malformed_check_line_and_a_missing_steps_file_as_failures(tmp_path):
    out = _fake_run(tmp_path, [("tests", "correctness", "0")],
                    {"tests": "CHECK\tsomething\tMAYBE\tdetail\n"})
    proc = _run(out)
    assert proc.returncode == 1 and "malformed CHECK line" in proc.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _run(empty)
    assert proc.returncode == 1 and "no steps recorded" in proc.stdout


def test_step_check_adds_pytest_summary_once_and_json_check_reads_outputs_identical(tmp_path):
    log = tmp_path / "tests.log"
    log.write_text("....\n===== 3 failed, 1393 passed, 49 skipped in 69.1s =====\n")
    subprocess.run([sys.executable, str(TABLE), "step-check", "test suite on CUDA", "1", str(log)],
                   check=True)
    subprocess.run([sys.executable, str(TABLE), "step-check", "test suite on CUDA", "1", str(log)],
                   check=True)  # the log has a CHECK line now: nothing added
    checks = [ln for ln in log.read_text().splitlines() if ln.startswith("CHECK\t")]
    assert checks == ["CHECK\ttest suite on CUDA\tFAIL\t3 failed, 1393 passed, 49 skipped in 69.1s (exit 1)"]

    for identical, verdict in ((True, "PASS"), (False, "FAIL")):
        js, blog = tmp_path / f"b{identical}.json", tmp_path / f"b{identical}.log"
        js.write_text(json.dumps({"outputs_identical": identical}))
        blog.write_text("bench table\n")
        subprocess.run([sys.executable, str(TABLE), "json-check", "bench identical", str(js), str(blog)],
                       check=True)
        assert blog.read_text().splitlines()[-1] == (
            f"CHECK\tbench identical\t{verdict}\toutputs_identical={identical} in {js.name}")
    missing, mlog = tmp_path / "none.json", tmp_path / "none.log"
    mlog.write_text("")
    subprocess.run([sys.executable, str(TABLE), "json-check", "bench identical", str(missing), str(mlog)],
                   check=True)
    assert mlog.read_text() == "CHECK\tbench identical\tFAIL\tno outputs_identical in none.json: FileNotFoundError\n"
