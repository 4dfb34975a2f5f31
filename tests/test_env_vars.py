"""Every command that takes a carry option honours its `TRTLLM_MTP_CARRY_*` variable and
rejects a malformed one with the one error line, before it prints anything (issue 32).

The commands: `info`, `bench`, `chat` (the process settings), `trace-replay` (its own
stores), `triton-repo` and `serve` (the served model's parameters, `serve --dynamo` the
workers' flags). `COMMANDS` says which variables each takes; every command rejects every
malformed variable. A variable added to `core.settings.CARRY_VARIABLES` must get a row in
`VALUES`, or `test_every_settings_variable_has_a_good_and_a_bad_value` fails.

Commands that only read `os.environ` run in this process; those whose settings are pinned
process-wide (`info`, `bench`, `chat`) run in a subprocess with a clean environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trtllm_mtp_carry.cli import build_parser, main
from trtllm_mtp_carry.core import settings

ROOT = Path(__file__).resolve().parents[1]

VALUES: dict[str, tuple[str, str]] = {
    # variable: (a valid value other than the default, a malformed value)
    "TRTLLM_MTP_CARRY_MARCONI_MIN_TOKENS": ("99", "-3"),
    "TRTLLM_MTP_CARRY_MAX_SEQS": ("3", "0"),
    "TRTLLM_MTP_CARRY_SLOTS": ("5", "many"),
    "TRTLLM_MTP_CARRY_MEMORY": ("3MiB", "lots"),
    "TRTLLM_MTP_CARRY_HOST_MEMORY": ("2MiB", "0.5"),
    "TRTLLM_MTP_CARRY_ROW_DTYPE": ("fp8", "int4"),
    "TRTLLM_MTP_CARRY_EVICTION": ("lrd", "fifo"),
    "TRTLLM_MTP_CARRY_IDLE_S": ("7", "soon"),
    "TRTLLM_MTP_CARRY_SHARE": ("off", "maybe"),
}

ALL = tuple(VALUES)
COMMANDS: dict[str, tuple[str, ...]] = {
    # command: the variables whose carry option it takes
    "info": ALL,
    "bench": ALL,  # MAX_SEQS as --mtp-max-seqs: it must equal --concurrency
    "chat": ALL,
    "trace-replay": ("TRTLLM_MTP_CARRY_MEMORY", "TRTLLM_MTP_CARRY_HOST_MEMORY", "TRTLLM_MTP_CARRY_ROW_DTYPE",
                     "TRTLLM_MTP_CARRY_EVICTION", "TRTLLM_MTP_CARRY_IDLE_S"),
    "triton-repo": ("TRTLLM_MTP_CARRY_MARCONI_MIN_TOKENS", "TRTLLM_MTP_CARRY_SLOTS", "TRTLLM_MTP_CARRY_MEMORY",
                    "TRTLLM_MTP_CARRY_HOST_MEMORY", "TRTLLM_MTP_CARRY_ROW_DTYPE", "TRTLLM_MTP_CARRY_EVICTION", "TRTLLM_MTP_CARRY_IDLE_S",
                    "TRTLLM_MTP_CARRY_SHARE"),
}
COMMANDS["serve"] = COMMANDS["triton-repo"]

TRACE = ('{"timestamp": 0, "input_length": 1500, "output_length": 100, "hash_ids": [0, 1, 2]}\n'
         '{"timestamp": 60000, "input_length": 2100, "output_length": 80, "hash_ids": [0, 1, 2, 3, 4]}\n')


def _argv(command: str, tmp_path: Path) -> list[str]:
    """The command with the arguments it needs to get as far as running."""
    if command == "trace-replay":
        trace = tmp_path / "chat.jsonl"
        trace.write_text(TRACE)
        return [command, str(trace), "--json", str(tmp_path / "replay.json")]
    if command == "triton-repo":
        return [command, str(tmp_path / "models")]
    return [command]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRTLLM_MTP_CARRY_")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return {**env, **extra}


def test_every_settings_variable_has_a_good_and_a_bad_value():
    assert {s.env_var for s in settings.CARRY_VARIABLES} == set(VALUES)
    # a new ENV_* setting belongs in CARRY_VARIABLES (checked by every command) and in VALUES
    declared = {v for k, v in vars(settings).items() if k.startswith("ENV_") and k != "ENV_DEBUG"}
    assert declared == set(VALUES)
    for var, (good, _) in VALUES.items():
        setting = next(s for s in settings.CARRY_VARIABLES if s.env_var == var)
        assert setting._parse(var, good) != setting.default, var  # the test can tell it was read


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("var", ALL)
def test_a_malformed_variable_is_one_error_line_before_anything_is_printed(
        command, var, tmp_path, monkeypatch, capsys):
    for other in ALL:
        monkeypatch.delenv(other, raising=False)
    bad = VALUES[var][1]
    monkeypatch.setenv(var, bad)
    monkeypatch.chdir(tmp_path)
    assert main(_argv(command, tmp_path)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"trtllm-mtp-carry: error: environment variable {var}={bad!r}")
    assert err.count("\n") == 1
    assert not (tmp_path / "models").exists() and not (tmp_path / "replay.json").exists()


def test_info_reports_every_variable_it_was_given():
    env = _clean_env(**{v: good for v, (good, _) in VALUES.items()})
    done = subprocess.run([sys.executable, "-m", "trtllm_mtp_carry.cli", "info", "--json"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert {k: report[k] for k in ("marconi_min_tokens", "mtp_max_seqs", "carry_slots", "carry_memory",
                                   "carry_host_memory", "carry_eviction", "carry_idle_s", "carry_share")} == {
        "marconi_min_tokens": 99, "mtp_max_seqs": 3, "carry_slots": 5, "carry_memory": "3MiB",
        "carry_host_memory": 2 << 20, "carry_eviction": "lrd", "carry_idle_s": 7, "carry_share": False}
    for var in COMMANDS["info"]:
        name = next(s.name for s in settings.CARRY_VARIABLES if s.env_var == var)
        assert report[f"{name}_source"] == f"env {var}"


def test_bench_runs_under_every_variable_and_records_them(tmp_path):
    env = _clean_env(**{v: good for v, (good, _) in VALUES.items()})
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "trtllm_mtp_carry.cli", "bench", "--sessions", "1", "--turns", "2",
         "--history", "64", "--new-span", "16", "--max-new-tokens", "4", "--repeat", "1",
         "--policies", "carry", "--concurrency", "3", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    config = json.loads(out.read_text())["config"]
    assert {k: config[k] for k in ("marconi_min_tokens", "mtp_max_seqs", "carry_slots", "carry_memory",
                                   "carry_host_memory", "carry_eviction", "carry_idle_s", "carry_share")} == {
        "marconi_min_tokens": 99, "mtp_max_seqs": 3, "carry_slots": 5, "carry_memory": "3MiB",
        "carry_host_memory": 2 << 20, "carry_eviction": "lrd", "carry_idle_s": 7, "carry_share": False}


def test_bench_holds_the_dispatch_cap_variable_to_the_flags_rule(tmp_path):
    done = subprocess.run([sys.executable, "-m", "trtllm_mtp_carry.cli", "bench", "--concurrency", "2"],
                          env=_clean_env(TRTLLM_MTP_CARRY_MAX_SEQS="3"), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("trtllm-mtp-carry: error: environment variable TRTLLM_MTP_CARRY_MAX_SEQS='3' "
                           "differs from --concurrency 2: the bench sets the MTP dispatch cap from --concurrency\n")


def test_chat_starts_with_the_settings_its_variables_gave():
    env = _clean_env(**{v: good for v, (good, _) in VALUES.items() if v != "TRTLLM_MTP_CARRY_MAX_SEQS"})
    done = subprocess.run([sys.executable, "-m", "trtllm_mtp_carry.cli", "chat"], input="/quit\n", env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = next(s for s in done.stdout.splitlines() if s.startswith("carry settings:"))
    assert line.startswith("carry settings: memory 3MiB, host tier 2MiB, eviction lrd, idle TTL 7 s, "
                           "slots 5, sharing off, restore threshold 99, MTP dispatch cap ")


def test_trace_replay_takes_each_carry_option_from_its_variable(tmp_path, monkeypatch, capsys):
    for var in ALL:
        monkeypatch.delenv(var, raising=False)
    for var in COMMANDS["trace-replay"]:
        monkeypatch.setenv(var, VALUES[var][0])
    assert main(_argv("trace-replay", tmp_path)) == 0
    capsys.readouterr()
    figures = json.loads((tmp_path / "replay.json").read_text())
    assert {k: figures["config"][k] for k in ("carry_memory_bytes", "host_memory_bytes", "idle_s", "row_dtype")} == {
        "carry_memory_bytes": 3 << 20, "host_memory_bytes": 2 << 20, "idle_s": 7, "row_dtype": "fp8"}
    assert list(figures["policies"]) == ["lrd"]


def test_trace_replay_refuses_a_pool_fraction_in_its_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRTLLM_MTP_CARRY_MEMORY", "0.5")
    assert main(_argv("trace-replay", tmp_path)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("trtllm-mtp-carry: error: environment variable TRTLLM_MTP_CARRY_MEMORY='0.5': a replay has "
                   "no drafter pool to take a fraction of; give bytes with a unit (1GiB, 512MiB)\n")


def test_a_flag_wins_over_its_variable_in_trace_replay(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRTLLM_MTP_CARRY_MEMORY", "3MiB")
    assert main([*_argv("trace-replay", tmp_path), "--carry-memory", "5MiB"]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "replay.json").read_text())["config"]["carry_memory_bytes"] == 5 << 20


_PARAMETERS = {"TRTLLM_MTP_CARRY_MARCONI_MIN_TOKENS": "marconi_min_tokens", "TRTLLM_MTP_CARRY_SLOTS": "carry_slots",
               "TRTLLM_MTP_CARRY_MEMORY": "carry_memory", "TRTLLM_MTP_CARRY_HOST_MEMORY": "carry_host_memory",
               "TRTLLM_MTP_CARRY_EVICTION": "carry_eviction", "TRTLLM_MTP_CARRY_IDLE_S": "carry_idle_s",
               "TRTLLM_MTP_CARRY_SHARE": "carry_share", "TRTLLM_MTP_CARRY_ROW_DTYPE": "carry_row_dtype"}


def test_triton_repo_writes_each_variable_into_the_models_parameters(tmp_path, monkeypatch, capsys):
    for var in ALL:
        monkeypatch.delenv(var, raising=False)
    for var in COMMANDS["triton-repo"]:
        monkeypatch.setenv(var, VALUES[var][0])
    assert main([*_argv("triton-repo", tmp_path), "--carry-slots", "9"]) == 0  # a flag wins
    capsys.readouterr()
    config = (tmp_path / "models" / "mtp_carry" / "config.pbtxt").read_text()
    for var in COMMANDS["triton-repo"]:
        value = "9" if var == "TRTLLM_MTP_CARRY_SLOTS" else VALUES[var][0]
        assert f'{{ key: "{_PARAMETERS[var]}" value {{ string_value: "{value}" }} }}' in config, var


def test_serve_and_serve_dynamo_take_each_variable_for_the_served_model(monkeypatch):
    from trtllm_mtp_carry.serve.cli import _spec
    from trtllm_mtp_carry.serve.dynamo.launcher import DynamoSpec
    from trtllm_mtp_carry.serve.options import ServeOptions, carry_options

    for var in ALL:
        monkeypatch.delenv(var, raising=False)
    for var in COMMANDS["serve"]:
        monkeypatch.setenv(var, VALUES[var][0])
    args = build_parser().parse_args(["serve"])
    options = _spec(args).options
    assert isinstance(options, ServeOptions)
    assert {_PARAMETERS[v]: str(getattr(options, _PARAMETERS[v])) for v in COMMANDS["serve"]} == {
        _PARAMETERS[v]: VALUES[v][0] for v in COMMANDS["serve"]}
    dynamo_args = build_parser().parse_args(["serve", "--dynamo"])
    worker = DynamoSpec(options=ServeOptions(**carry_options(dynamo_args))).worker_args("model")
    flags = {"marconi_min_tokens": "--restore-threshold"}  # the setting's one flag on every command
    for var in COMMANDS["serve"]:
        flag = flags.get(_PARAMETERS[var], "--" + _PARAMETERS[var].replace("_", "-"))
        assert worker[worker.index(flag) + 1] == VALUES[var][0], flag
