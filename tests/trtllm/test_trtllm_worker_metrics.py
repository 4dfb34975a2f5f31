"""The worker-installed carry where users run it: faults in the install, the carry file at
interpreter start, `uninstall`, and Prometheus metrics scraped over HTTP on 127.0.0.1.

On the TensorRT-LLM STAND-IN (no TensorRT-LLM ran); the interpreter-start tests run a
fresh interpreter with the `.pth` line in a temporary site dir.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from standin_helpers import make_llm, user_tokens

from trtllm_mtp_carry.serve.dynamo.launcher import free_port
from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, attach, metrics, worker
from trtllm_mtp_carry.trtllm.standin import ConversationParams, StandinLLM

ROOT = Path(__file__).resolve().parents[2]


def _manager(llm: StandinLLM) -> Any:
    return llm.executor.resource_manager.resource_managers.get(CARRY_MANAGER_KEY)


def _carry_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> Path:
    config = tmp_path / "carry.yaml"
    config.write_text(text)
    monkeypatch.setenv(worker.ENV, str(config))
    return config


def _serve_one(llm: StandinLLM) -> list[int]:
    req = llm.generate_async(user_tokens(0, 64), 6, conversation_params=ConversationParams(conversation_id="x"))
    llm.run_until_done()
    return req.output



@pytest.fixture
def no_endpoint() -> Iterator[None]:
    metrics.close_worker_metrics()
    yield
    metrics.close_worker_metrics()


# ---- nothing leaves the install ---------------------------------------------------------


@pytest.mark.parametrize("where", ["probe", "manager"])
@pytest.mark.parametrize("kind", [AttributeError, KeyError, torch.OutOfMemoryError, TypeError])
def test_an_unexpected_exception_in_the_install_is_one_stand_aside_line_and_no_carry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, kind: type[Exception]) -> None:
    _carry_file(tmp_path, monkeypatch, "mtp_carry: {carry_slots: 4}\n")
    reference = _serve_one(make_llm("blind")[0])

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise kind("the build has no such name")

    if where == "probe":  # e.g. the probe reads an attribute this TensorRT-LLM build lacks
        monkeypatch.setattr("trtllm_mtp_carry.trtllm.probe.probe_managers", boom)
    else:  # the carry manager's construction fails (e.g. out of memory)
        monkeypatch.setattr("trtllm_mtp_carry.trtllm.manager.carry_manager_class", lambda base: boom)
    before = len(worker.messages())
    llm, _ = make_llm("blind", single_process=False)  # built "in a worker": the hook runs
    lines = worker.messages()[before:]
    assert lines == [f"mtp carry: stands aside: {kind.__name__} while installing the carry "
                     f"({kind('the build has no such name')}); the executor is built without it"]
    assert _manager(llm) is None
    assert _serve_one(llm) == reference  # the executor serves, as TensorRT-LLM without the carry
    llm.executor.check()


# ---- the carry file at interpreter start ------------------------------------------------

FAKE_CREATOR = textwrap.dedent("""
    def create_py_executor_instance(**kwargs):
        return "executor"
""")


def _fresh(tmp_path: Path, value: str, code: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter with the `.pth` line in a site dir, `TRTLLM_MTP_CARRY_WORKER=value`,
    and TensorRT-LLM's creator module faked at its path (TensorRT-LLM is not installed)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    worker.install_pth(site)
    fake = tmp_path / "fake" / "tensorrt_llm" / "_torch" / "pyexecutor"
    fake.mkdir(parents=True, exist_ok=True)
    for d in (fake, fake.parent, fake.parent.parent):
        (d / "__init__.py").write_text("")
    (fake / "py_executor_creator.py").write_text(FAKE_CREATOR)
    program = f"import site; site.addsitedir({str(site)!r})\nprint('started', flush=True)\n" + code
    env = {**os.environ, worker.ENV: value,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "fake")])}
    return subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True,
                          timeout=120, check=True)


@pytest.mark.parametrize(("text", "why"), [
    (None, "cannot read extra_llm_api_options {path}: No such file or directory"),
    ("mtp_carry: [unclosed\n", "{path} is not valid YAML: while parsing a flow sequence"),
    ("mtp_carry: {metrics_port: 70000}\n", "mtp_carry.metrics_port must be <= 65535, got 70000"),
    ("mtp_carry: {carry_slot: 4}\n",
     "mtp_carry.carry_slot: unknown key (known: carry_host_memory, carry_memory, carry_row_dtype, "
     "carry_slots, enable, metrics_port, stats_every)"),
])
def test_a_missing_or_invalid_carry_file_is_one_line_at_interpreter_start(
        tmp_path: Path, text: str | None, why: str) -> None:
    path = tmp_path / "carry.yaml"
    if text is not None:
        path.write_text(text)
    code = textwrap.dedent("""
        from tensorrt_llm._torch.pyexecutor import py_executor_creator as m
        print(getattr(m.create_py_executor_instance, "_mtp_carry_wrapped", False))
        print(m.create_py_executor_instance(resources={}))
    """)
    out = _fresh(tmp_path, str(path), code)
    # the line comes at the site dir's .pth (interpreter start), before the program runs,
    # and nothing more when the executor is built: the hook was never installed
    assert out.stderr.splitlines() == ["mtp carry: stands aside: " + why.format(path=path)]
    assert out.stdout.split() == ["started", "False", "executor"]


def test_a_valid_carry_file_prints_nothing_at_interpreter_start(tmp_path: Path) -> None:
    path = tmp_path / "carry.yaml"
    path.write_text("mtp_carry: {carry_slots: 4, metrics_port: 9400}\n")
    out = _fresh(tmp_path, str(path), "pass\n")
    assert out.stderr == "" and out.stdout.split() == ["started"]


def test_uninstall_removes_the_pth_line_and_leaves_other_lines(tmp_path: Path, capsys) -> None:
    site = tmp_path / "site"
    site.mkdir()
    assert worker.main(["install", str(site)]) == 0
    pth = site / worker.PTH_NAME
    assert pth.read_text() == worker.PTH_LINE
    assert worker.main(["uninstall", str(site)]) == 0
    assert not pth.exists()
    assert worker.main(["uninstall", str(site)]) == 0  # again: nothing to remove, not an error
    out = capsys.readouterr().out.splitlines()
    assert out[-2] == f"removed the carry's line from {pth}: TensorRT-LLM workers start without the hook"
    assert out[-1] == f"no {worker.PTH_NAME} line in {site}: nothing to remove"
    pth.write_text("import other_hook\n" + worker.PTH_LINE)  # someone else's line shares the file
    assert worker.main(["uninstall", str(site)]) == 0
    assert pth.read_text() == "import other_hook\n"


def test_after_uninstall_a_fresh_interpreter_never_installs_the_hook(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        from tensorrt_llm._torch.pyexecutor import py_executor_creator as m
        print(getattr(m.create_py_executor_instance, "_mtp_carry_wrapped", False))
    """)
    assert _fresh(tmp_path, "1", code).stdout.split() == ["started", "True"]
    assert worker.uninstall_pth(tmp_path / "site") == tmp_path / "site" / worker.PTH_NAME
    env = {**os.environ, worker.ENV: "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "fake")])}
    program = f"import site; site.addsitedir({str(tmp_path / 'site')!r})\n" + code
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["False"] and out.stderr == ""


# ---- Prometheus metrics -----------------------------------------------------------------


def _scrape(port: int, path: str = "/metrics") -> tuple[str, dict[str, float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        assert response.status == 200
        ctype = response.headers["Content-Type"]
        body = response.read().decode()
    series = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return ctype, series


def test_a_worker_carry_serves_the_triton_models_families_scraped_over_http(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_endpoint: None) -> None:
    port = free_port()
    _carry_file(tmp_path, monkeypatch, f"mtp_carry: {{carry_slots: 4, metrics_port: {port}}}\n")
    before = len(worker.messages())
    llm, _ = make_llm("blind", single_process=False, max_batch=2)  # the worker hook installs the carry
    assert worker.messages()[before + 1] == (
        f"mtp carry: metrics on http://0.0.0.0:{port}/metrics (metrics_port {port} + rank 0)")
    conv = [ConversationParams(conversation_id=f"m{i}") for i in range(2)]
    first = [llm.generate_async(user_tokens(100 * i, 96), 4, conversation_params=c) for i, c in enumerate(conv)]
    llm.run_until_done()
    second = [llm.generate_async(r.get_tokens(0) + user_tokens(7 + i, 32), 4, conversation_params=c)
              for i, (r, c) in enumerate(zip(first, conv, strict=True))]
    llm.run_until_done()
    stats = _manager(llm).stats()
    ctype, series = _scrape(port)
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"
    label = 'model="tensorrt_llm",instance="rank0"'
    assert series[f'mtp_carry_outcomes_total{{{label},kind="adopted"}}'] == 2
    assert series[f'mtp_carry_outcomes_total{{{label},kind="no_carry"}}'] == 2  # the first turns
    assert series[f'mtp_carry_drafter_rows_total{{{label},source="adopted"}}'] == stats.rows_adopted > 0
    assert series[f'mtp_carry_drafter_rows_total{{{label},source="computed"}}'] == stats.rows_computed
    assert series[f'mtp_carry_runtime{{{label},field="deposits"}}'] == 4
    assert series[f'mtp_carry_runtime{{{label},field="turns.warm"}}'] == 2
    assert series[f'mtp_carry_runtime{{{label},field="entries_held"}}'] == 2
    assert f'mtp_carry_errors_total{{{label},reason="KeyError"}}' not in series
    # counters only grow: a fault and a session end show at the next scrape
    llm.executor.draft.get_batch_cache_indices = lambda *a, **k: (_ for _ in ()).throw(KeyError(1))
    third = llm.generate_async(second[0].get_tokens(0) + user_tokens(3, 32), 4, conversation_params=conv[0])
    llm.run_until_done()
    freed = _manager(llm).forget_conversation("m1")
    _, later = _scrape(port)
    assert later[f'mtp_carry_errors_total{{{label},reason="KeyError"}}'] == 1
    assert later[f'mtp_carry_outcomes_total{{{label},kind="adopted"}}'] == 3
    assert later[f'mtp_carry_sessions_ended_total{{{label},cause="end"}}'] == 1
    assert later[f'mtp_carry_rows_freed_total{{{label}}}'] == freed > 0
    assert _manager(llm).turn(third.py_request_id)["skipped"] == "fault"
    with pytest.raises(urllib.error.HTTPError) as err:
        _scrape(port, "/")
    assert err.value.code == 404


def test_each_worker_rank_serves_on_its_own_port(no_endpoint: None) -> None:
    llm, _ = make_llm("blind")
    real = attach(llm, {"carry_slots": 2}).manager
    base = free_port()
    lines: list[str] = []
    rank2 = SimpleNamespace(draft=SimpleNamespace(mapping=SimpleNamespace(rank=2)), stats=real.stats)
    endpoint = metrics.export_worker_metrics(rank2, base - 2, lines.append, host="127.0.0.1")
    assert endpoint is not None and endpoint.rank == 2
    assert lines == [f"mtp carry: metrics on http://127.0.0.1:{base}/metrics (metrics_port {base - 2} + rank 2)"]
    _, series = _scrape(base)
    assert series['mtp_carry_outcomes_total{model="tensorrt_llm",instance="rank2",kind="adopted"}'] == 0
    metrics.close_worker_metrics()
    assert metrics.worker_rank(SimpleNamespace(mapping=SimpleNamespace(rank=5))) == 5
    assert metrics.worker_rank(llm.executor.draft) == 0  # the stand-in's Mapping has no rank


def test_a_port_in_use_or_past_65535_is_one_line_and_the_carry_runs_without_metrics(
        no_endpoint: None) -> None:
    llm, _ = make_llm("blind")
    manager = attach(llm, {"carry_slots": 2}).manager
    lines: list[str] = []
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert metrics.export_worker_metrics(manager, port, lines.append, host="127.0.0.1") is None
    assert lines == [f"mtp carry: metrics: stands aside: cannot serve on 127.0.0.1:{port} "
                     "(Address already in use)"]
    far = SimpleNamespace(draft=SimpleNamespace(mapping=SimpleNamespace(rank=3)), stats=manager.stats)
    assert metrics.export_worker_metrics(far, 65534, lines.append) is None
    assert lines[-1] == "mtp carry: metrics: stands aside: mtp_carry.metrics_port 65534 + rank 3 = 65537 is past 65535"
    assert _serve_one(llm)  # the carry and the executor go on


# ---- the trtllm extra -------------------------------------------------------------------


def test_the_trtllm_extra_pins_a_tensorrt_llm_the_carry_arms_on() -> None:
    """`pip install ".[trtllm]"` gets one version, and the stand-in's profile of that
    version (its target manager class and pairing markers, from the version table) arms."""
    import tomllib
    from packaging.requirements import Requirement

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["trtllm"]
    (req,) = [Requirement(r) for r in extra]
    (spec,) = list(req.specifier)
    assert (req.name, spec.operator) == ("tensorrt_llm", "==")
    assert spec.version == "1.3.0rc29" and req.specifier.contains("1.3.0rc29") and not req.specifier.contains("1.2.1")
    llm, _ = make_llm("blind", version=spec.version)
    carry = attach(llm)
    assert (carry.topology, carry.armed) == ("unpaired", True)
