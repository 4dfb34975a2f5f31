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


def _bench_json(path: Path, turns: dict[str, list[tuple[int, int, int, int, int]]]) -> Path:
    """A bench JSON with per-turn (replay, session, turn, accepted, drafted) for each policy."""
    path.write_text(json.dumps({"outputs_identical": True, "policies": {
        p: {"turns": [{"replay": r, "session": s, "turn": t, "accepted": a, "drafted": d, "output": [1, 2]}
                      for r, s, t, a, d in rows]} for p, rows in turns.items()}}))
    return path


def test_the_table_fails_on_a_warm_turn_whose_acceptance_differs_though_outputs_are_identical(tmp_path):
    carry = [(0, 0, 0, 5, 9), (0, 0, 1, 30, 40), (0, 1, 1, 28, 40), (0, 0, 2, 33, 44)]
    host = [(0, 0, 0, 1, 9), (0, 0, 1, 30, 40), (0, 1, 1, 27, 40), (0, 0, 2, 33, 44)]  # s1 t1: 27 != 28
    out = _fake_run(tmp_path, [("tests", "correctness", "0"), ("host-hits", "correctness", "0")],
                    {"tests": GOOD_LOGS["tests"], "host-hits": "bench table\n"})
    js = _bench_json(tmp_path / "host-hits.json", {"carry": carry, "carry-host": host})
    name = "host-tier hits accepted/drafted equal carry's per warm turn"
    for _ in range(2):  # the second call finds the line and adds nothing
        subprocess.run([sys.executable, str(TABLE), "json-check", "host-tier hits outputs identical", str(js),
                        str(out / "host-hits.log")], check=True)
        subprocess.run([sys.executable, str(TABLE), "accept-check", name, str(js), str(out / "host-hits.log"),
                        "carry-host", "carry"], check=True)
    checks = [ln for ln in (out / "host-hits.log").read_text().splitlines() if ln.startswith("CHECK\t")]
    assert checks == [
        "CHECK\thost-tier hits outputs identical\tPASS\toutputs_identical=True in host-hits.json",
        f"CHECK\t{name}\tFAIL\t1 of 3 warm turns differ; first replay 0 session 1 turn 1: carry-host 27/40 "
        "accepted/drafted, carry 28/40"]
    proc = _run(out)
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[-1] == "2 steps, 3 checks, 0 figures (0 MISS); 1 correctness failure(s)"
    same = tmp_path / "same.log"
    same.write_text("")
    js2 = _bench_json(tmp_path / "same.json", {"carry": carry, "carry-host": carry})
    subprocess.run([sys.executable, str(TABLE), "accept-check", name, str(js2), str(same), "carry-host", "carry"],
                   check=True)
    assert same.read_text() == (f"CHECK\t{name}\tPASS\t3 warm turns: carry-host accepted/drafted equal "
                                "carry's exactly\n")


def test_the_check_runs_the_suite_per_file_the_engine_tests_on_the_gpu_and_the_new_checks():
    code = "\n".join(line.split("#", 1)[0] for line in SMOKE.read_text().splitlines())
    assert 'PAR=(-n "$CORES" --dist loadfile)' in code
    assert re.search(r"step tests correctness \d+ python3 -m pytest tests -q \$\{PAR", code)
    assert re.search(r"step engine-cuda correctness \d+ env MTP_CARRY_TEST_DEVICE=cuda python3 -m pytest "
                     r"tests/engine tests/runtime", code)
    assert re.search(r"step restore-check correctness \d+ python3 scripts/gpu_check_restore.py --device cuda "
                     r"--delay-cycles \d+", code)
    assert re.search(r'\$TABLE accept-check "[^"]+" "\$OUT/host-hits.json" \\\n\s+"\$OUT/host-hits.log" '
                     r"carry-host carry", code)
    assert re.search(r"step standin-race correctness \d+ python3 scripts/trtllm_standin_bench.py --device cuda "
                     r"--fp8 \\\n\s+--history \d+ --sessions \d+ --turns \d+ --delay-cycles \d+", code)
    assert code.rstrip().splitlines()[-2:] == ['$TABLE "$OUT" | tee "$OUT/summary.txt"',
                                               'exit "${PIPESTATUS[0]}"']  # it ends with its one table


def _restore_check(monkeypatch, capsys, argv):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_restore", ROOT / "scripts" / "gpu_check_restore.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(argv)
    return rc, [ln.split("\t") for ln in capsys.readouterr().out.splitlines()]


def test_the_restore_check_reads_every_path_back_and_fails_on_a_corrupt_copy_back(monkeypatch, capsys):
    rc, lines = _restore_check(monkeypatch, capsys, ["--device", "cpu", "--rows", "40"])
    assert rc == 0
    assert [ln[:3] for ln in lines] == [
        ["CHECK", f"{name}: read back after restore", "PASS"]
        for name in ("pool host restore", "adapter host restore bf16", "adapter host restore fp8")]
    from trtllm_mtp_carry.service.homes import ArenaHome

    def one_bit_off(real):  # the arena home's host copy lands one element wrong
        def export_into(home, key, raw):
            form = real(home, key, raw)
            raw.view(-1)[3] ^= 1
            return form
        return export_into

    monkeypatch.setattr(ArenaHome, "export_into", one_bit_off(ArenaHome.export_into))
    rc, lines = _restore_check(monkeypatch, capsys, ["--device", "cpu", "--rows", "40"])
    assert rc == 1
    assert [ln[2] for ln in lines] == ["PASS", "FAIL", "FAIL"]
    assert lines[1][3] == "rows read back differ (40 rows, bf16, cpu)"


@pytest.mark.parametrize("value", ["tpu", "cuda:x"])
def test_a_bad_test_device_variable_is_one_error_line(value):
    env = {**__import__("os").environ, "MTP_CARRY_TEST_DEVICE": value,
           "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    proc = subprocess.run([sys.executable, "-c", "import engine_factories"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        f"ValueError: MTP_CARRY_TEST_DEVICE must be cpu, cuda or cuda:N, got {value!r}")
