"""The carry installed in the worker process (`trtllm.worker`), on the TensorRT-LLM STAND-IN.

The stand-in's default `LLM` builds its PyExecutor "in a worker" (as TensorRT-LLM's
default `LLM`, trtllm-serve and Dynamo's worker do): no `attach`, only the
`TRTLLM_MTP_CARRY_WORKER` hook wrapping `create_py_executor_instance`. No
TensorRT-LLM is run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from standin_helpers import user_tokens

from trtllm_mtp_carry.service import SKIP_REASONS
from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, worker
from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG
from trtllm_mtp_carry.trtllm.standin import ConversationParams, DataType, LlmRequest, StandinLLM

from standin_helpers import model  # isort: skip

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 256
HISTORY = 4096  # a long history: 16 prefill chunks deep (8k cost 4x the time and tested nothing more)


@pytest.fixture
def carry_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    config = tmp_path / "carry.yaml"
    config.write_text("mtp_carry: {carry_slots: 8}\n")
    monkeypatch.setenv(worker.ENV, str(config))
    return config


def _manager(llm: StandinLLM) -> Any:
    return llm.executor.resource_manager.resource_managers.get(CARRY_MANAGER_KEY)


def _run(llm: StandinLLM, sessions: int, turns: int, max_new: int) -> tuple[list[list[LlmRequest]],
                                                                           dict[int, Any]]:
    """`sessions` conversations of `turns` turns, interleaved; the first turn is HISTORY tokens.

    Returns the requests and, per request id, its draft rows at free (keys [0, N - 1)).
    """
    at_free: dict[int, Any] = {}
    rm = llm.executor.resource_manager
    free = rm.free_resources
    paged = llm.executor.paged

    def capture(request: LlmRequest) -> None:
        n = len(request.get_tokens(0)) - 1
        # every byte of each key (an NVFP4 pool: its payload and its block scales)
        at_free[request.py_request_id] = paged.key_bytes(request.py_request_id, 0, n)
        free(request)

    rm.free_resources = capture  # type: ignore[method-assign]
    prompts = [user_tokens(3000 * i, HISTORY) for i in range(sessions)]
    done: list[list[LlmRequest]] = [[] for _ in range(sessions)]
    for t in range(turns):
        reqs = [llm.generate_async(prompts[i], max_new,
                                   conversation_params=ConversationParams(conversation_id=f"s{i}"))
                for i in range(sessions)]
        llm.run_until_done()
        for i, req in enumerate(reqs):
            done[i].append(req)
            # the next user message, padded so the prompt is a multiple of CHUNK: R (the last
            # prompt's length) is chunk-aligned, so the warm turn computes keys >= R in the
            # same chunks as a rebuild does, and every row matches bit for bit
            history = req.get_tokens(0)
            prompts[i] = history + user_tokens(500 * t + 77 * i,
                                               CHUNK // 2 + (-(len(history) + CHUNK // 2)) % CHUNK)
    return done, at_free


def _llm(**options: Any) -> StandinLLM:
    return StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=CHUNK, max_batch=3, num_pages=4096, **options)


@pytest.mark.parametrize("kv_dtype", [DataType.BF16, DataType.FP8, DataType.NVFP4])
def test_worker_install_adopts_every_warm_turn_at_4k_history_bit_equal_to_a_rebuild(
        carry_env, kv_dtype: DataType) -> None:
    # the default LLM: the executor lives in the worker, the hook installs the carry
    carry = _llm(kv_dtype=kv_dtype)
    assert worker.messages()[-1].startswith(
        f"mtp carry: installed in the worker's PyExecutor as {CARRY_MANAGER_KEY} (TensorRT-LLM stand-in")
    os.environ.pop(worker.ENV)
    rebuild = _llm(enable_block_reuse=False, kv_dtype=kv_dtype)  # TensorRT-LLM as is, every turn prefilled from 0
    assert _manager(rebuild) is None
    sessions, turns = 3, 4
    got, got_rows = _run(carry, sessions, turns, 24)
    want, want_rows = _run(rebuild, sessions, turns, 24)
    assert [[r.output for r in s] for s in got] == [[r.output for r in s] for s in want]
    stats = _manager(carry).stats()
    warm = sessions * (turns - 1)
    assert stats.outcomes["adopted"] == warm and stats.no_carry_reasons["never_carried"] == sessions
    assert sum(stats.outcomes.values()) == sessions * turns  # every turn judged; first turns miss
    assert stats.deposits == sessions * turns
    assert stats.skipped == dict.fromkeys(SKIP_REASONS, 0)
    for s_got, s_want in zip(got, want, strict=True):
        assert all(r.reused >= HISTORY for r in s_got[1:])  # every warm turn reused its history
        for r_got, r_want in zip(s_got, s_want, strict=True):
            # every row of [0, N - 1), bytes compared (bf16, FP8 and NVFP4 pages alike)
            assert torch.equal(got_rows[r_got.py_request_id], want_rows[r_want.py_request_id])
    # an FP8 or NVFP4 pool carries its own bytes (one byte an element; D/2 + D/16 a vector), never
    # re-scaled: held and charged so
    cfg = carry.executor.model.cfg
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    vector = {DataType.BF16: 2 * d, DataType.FP8: d, DataType.NVFP4: d // 2 + d // 16}[kv_dtype]
    assert stats.row_dtype == {DataType.BF16: "bf16", DataType.FP8: "fp8_kv", DataType.NVFP4: "nvfp4_kv"}[kv_dtype]
    assert stats.bytes_held == stats.rows_held * 2 * hkv * vector
    acc_carry = sum(r.accepted for s in got for r in s[1:])
    acc_rebuild = sum(r.accepted for s in want for r in s[1:])
    assert acc_carry == acc_rebuild
    carry.executor.check()


@pytest.mark.parametrize(("options", "line"), [
    ({"version": "main+19303"},
     "mtp carry: stands aside: paired: the draft pool publishes and reuses its own blocks"),
    ({"version": "pr18843"},  # #18843's layout: the hybrid inherits _supports_reuse_match_backoff = True
     "mtp carry: stands aside: paired: the draft pool publishes and reuses its own blocks"),
    ({"kv_dtype": DataType.HALF},
     "mtp carry: stands aside: FP16 KV stands aside: the carry moves BF16, FP8 or NVFP4 draft pages only"),
    ({"version": "1.2.1"},
     "mtp carry: stands aside: the target KV cache manager is CppMambaHybridCacheManager (KV "
     "cache manager V1"),
    ({"enable_block_reuse": False}, "mtp carry: stands aside: block reuse is off"),
    ({"topology": "folded"}, "mtp carry: stands aside: folded: no separate draft KV cache manager"),
])
def test_worker_install_prints_one_line_of_why_it_stands_aside_and_installs_nothing(
        carry_env, options: dict[str, Any], line: str) -> None:
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64, **options)
    assert worker.messages()[-1].startswith(line) and "\n" not in worker.messages()[-1]
    assert _manager(llm) is None


def test_the_worker_install_runs_after_the_draft_manager_in_prepare_and_before_it_in_free(
        carry_env) -> None:
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64)
    names = [getattr(k, "name", k) for k in llm.executor.resource_manager.resource_managers]
    # CROSS_KV_CACHE_MANAGER: always set by build_managers (None: decoder-only; _util.py @ 0004396)
    assert names == ["DRAFT_KV_CACHE_MANAGER", "CROSS_KV_CACHE_MANAGER", CARRY_MANAGER_KEY, "SEQ_SLOT_MANAGER",
                     "KV_CACHE_MANAGER"]
    req = llm.generate_async(user_tokens(0, 64), 4,
                             conversation_params=ConversationParams(conversation_id="o"))
    llm.run_until_done()
    calls = [(m, op) for m, op, rid in llm.executor.resource_manager.calls if rid == req.py_request_id]
    assert [m for m, op in calls if op == "prepare"][:2] == ["DRAFT_KV_CACHE_MANAGER", CARRY_MANAGER_KEY]
    assert [m for m, op in calls if op == "free"][-2:] == [CARRY_MANAGER_KEY, "DRAFT_KV_CACHE_MANAGER"]
    assert _manager(llm).stats().deposits == 1


def test_with_kv_cache_estimation_the_served_executor_gets_a_carry_bound_to_its_own_draft_pool(
        carry_env) -> None:
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=256,
                     estimate_kv_cache=True)
    executor = llm.executor
    manager = _manager(llm)
    assert manager is not None and manager.draft is executor.draft
    assert executor.draft is not executor.estimation_draft
    names = [getattr(k, "name", k) for k in executor.resource_manager.resource_managers]
    # teardown_managers deleted the KV managers and the second build appended them after the
    # sequence slot manager the first build left: what is guaranteed is the carry after the
    # draft manager (prepare) and before it (free)
    assert names == ["SEQ_SLOT_MANAGER", "DRAFT_KV_CACHE_MANAGER", "CROSS_KV_CACHE_MANAGER", CARRY_MANAGER_KEY,
                     "KV_CACHE_MANAGER"]
    assert sum(m.startswith("mtp carry: installed") for m in worker.messages()[-2:]) == 2


def test_a_disabled_carry_stands_aside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "carry.yaml"
    config.write_text("mtp_carry: {enable: false}\n")
    monkeypatch.setenv(worker.ENV, str(config))
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64)
    assert worker.messages()[-1] == "mtp carry: stands aside: not configured (mtp_carry.enable is false)"
    assert _manager(llm) is None


@pytest.mark.parametrize(("text", "why"), [
    ("mtp_carry: {carry_slots: 0}\n", "mtp_carry.carry_slots must be >= 1, got 0"),
    ("mtp_carry: {}\nkv_cache_config: {}\n",
     "{env}={path}: the file holds ['kv_cache_config'] besides mtp_carry; keep TensorRT-LLM's own "
     "options in their own file (LLM(**options) refuses an unknown key)"),
])
def test_a_bad_carry_file_stands_aside_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     text: str, why: str) -> None:
    config = tmp_path / "carry.yaml"
    config.write_text(text)
    monkeypatch.setenv(worker.ENV, str(config))
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64)
    assert worker.messages()[-1] == "mtp carry: stands aside: " + why.format(env=worker.ENV, path=config)
    assert _manager(llm) is None


def test_without_the_variable_nothing_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(worker.ENV, raising=False)
    before = worker.messages()
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, num_pages=64)
    assert _manager(llm) is None and worker.messages() == before


def test_the_pth_line_wraps_tensorrt_llms_creator_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """A fresh interpreter (a TensorRT-LLM worker) with the .pth line in a site dir and the
    variable set: importing TensorRT-LLM's creator module wraps create_py_executor_instance,
    which then prints its one line before the executor is built. The creator here is a
    two-line fake module at TensorRT-LLM's path (TensorRT-LLM is not installed)."""
    site = tmp_path / "site"
    site.mkdir()
    assert worker.install_pth(site) == site / worker.PTH_NAME
    fake = tmp_path / "fake" / "tensorrt_llm" / "_torch" / "pyexecutor"
    fake.mkdir(parents=True)
    for d in (fake, fake.parent, fake.parent.parent):
        (d / "__init__.py").write_text("")
    (fake / "py_executor_creator.py").write_text(textwrap.dedent("""
        def create_py_executor_instance(**kwargs):
            return "executor"
    """))
    code = textwrap.dedent(f"""
        import site
        site.addsitedir({str(site)!r})
        from tensorrt_llm._torch.pyexecutor import py_executor_creator as m
        print(getattr(m.create_py_executor_instance, "_mtp_carry_wrapped", False))
        print(m.create_py_executor_instance(resources={{}}))
    """)
    env = {**os.environ, worker.ENV: "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "fake")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["True", "executor"]
    assert out.stderr.strip().splitlines()[-1] == (
        "mtp carry: stands aside: the executor has no KV_CACHE_MANAGER resource manager")
    env.pop(worker.ENV)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["False", "executor"] and "mtp carry" not in out.stderr


def test_the_install_command_writes_the_pth_line(tmp_path: Path) -> None:
    assert worker.main(["install", str(tmp_path)]) == 0
    assert (tmp_path / worker.PTH_NAME).read_text() == worker.PTH_LINE
    assert worker.main(["bogus"]) == 2


@pytest.mark.parametrize("argv, line", [
    (["bogus"], "trtllm-mtp-carry: error: got 'bogus'; usage: python -m trtllm_mtp_carry.trtllm.worker "
                "{install,uninstall} [SITE_DIR]"),
    ([], "trtllm-mtp-carry: error: no command given; usage: python -m trtllm_mtp_carry.trtllm.worker "
         "{install,uninstall} [SITE_DIR]"),
    (["uninstall", "/nonexistent/site"],
     "trtllm-mtp-carry: error: SITE_DIR '/nonexistent/site' is not a directory"),
    (["install", "/nonexistent/site"], "trtllm-mtp-carry: error: SITE_DIR '/nonexistent/site' is not a directory"),
])
def test_a_bad_install_command_is_one_error_line(argv: list[str], line: str, capsys) -> None:
    assert worker.main(argv) == 2
    assert capsys.readouterr().err == line + "\n"


def test_stats_every_prints_the_worker_carrys_counters_every_n_freed_requests_and_at_shutdown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a worker-installed carry has no stats() the parent can call: these lines are how it shows
    config = tmp_path / "carry.yaml"
    config.write_text("mtp_carry: {carry_slots: 8, stats_every: 2}\n")
    monkeypatch.setenv(worker.ENV, str(config))
    llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=32, max_batch=2, num_pages=512)
    before = len(worker.messages())
    conv = [ConversationParams(conversation_id=f"s{i}") for i in range(2)]
    first = [llm.generate_async(user_tokens(100 * i, 96), 4, conversation_params=c) for i, c in enumerate(conv)]
    llm.run_until_done()
    second = [llm.generate_async(r.get_tokens(0) + user_tokens(7 + i, 32), 4, conversation_params=c)
              for i, (r, c) in enumerate(zip(first, conv, strict=True))]
    llm.run_until_done()
    manager = _manager(llm)
    lines = worker.messages()[before:]
    assert [line.split(":")[1] for line in lines] == [" after 2 freed requests", " after 4 freed requests"]
    assert lines[1] == manager.stats_line()
    assert lines[1].startswith("mtp carry: after 4 freed requests: turns cold 2, warm 2; outcomes: adopted 2, no_carry 2; ")
    assert all(r.is_finished for r in second)
    manager.shutdown()
    assert worker.messages()[-1].startswith("mtp carry: after 4 freed requests: turns cold 2, warm 2")
