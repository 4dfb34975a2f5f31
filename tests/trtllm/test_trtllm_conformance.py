"""Every TensorRT-LLM name the package touches is in docs/TRTLLM-CONFORMANCE.md, and the
stand-ins answer package code for exactly those names (AttributeError for any other):
the executor stand-in (`trtllm/standin/`, `TRTLLM_NAMES`) and the LLM API stand-in
the Triton model's tests run on (`tests/serve/trtllm_standin.py`, `LLMAPI_NAMES`)."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

import pytest
from trtllm_names import (
    DEPLOYMENT,
    FILES,
    LLMAPI_RECEIVERS,
    ROOT,
    calls,
    receivers_for,
    table,
    touched,
)

from trtllm_mtp_carry.trtllm import manager as manager_module
from trtllm_mtp_carry.trtllm.standin import TRTLLM_NAMES, VERSIONS, LlmRequest

SCRIPTS = ["scripts/trtllm_smoke.py"]


def llmapi_standin() -> ModuleType:
    """tests/serve/trtllm_standin.py (the module the serve tests import by that name)."""
    if "trtllm_standin" not in sys.modules:
        spec = importlib.util.spec_from_file_location("trtllm_standin", ROOT / "tests" / "serve" / "trtllm_standin.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["trtllm_standin"] = module
        spec.loader.exec_module(module)
    return sys.modules["trtllm_standin"]


def _code_files() -> list[str]:
    return [f for f in FILES + DEPLOYMENT + SCRIPTS if (ROOT / f).exists()]


def test_the_walk_covers_the_adapter_the_triton_model_and_the_smoke_script() -> None:
    assert set(_code_files()) == set(FILES + DEPLOYMENT + SCRIPTS)


@pytest.mark.parametrize("path", FILES + DEPLOYMENT + SCRIPTS)
def test_every_tensorrt_llm_name_the_code_touches_is_in_the_conformance_table(path: str) -> None:
    rows = table() | table(absent=True)  # a name probed with a default may be one the source lacks
    missing = sorted({(c, n, line) for c, n, line in touched(ROOT / path, receivers_for(path))
                      if (c, n) not in rows})
    assert missing == [], f"{path}: TensorRT-LLM names not in docs/TRTLLM-CONFORMANCE.md: {missing}"


def test_the_llm_api_stand_in_answers_for_exactly_the_tables_names() -> None:
    rows = table()
    names = llmapi_standin().LLMAPI_NAMES
    for cls, found in names.items():
        assert found == {n for c, n in rows if c == cls}, cls
    assert names["LLM"] == TRTLLM_NAMES["LLM"]  # one TensorRT-LLM class, one set of names
    # every class the deployment receivers name is one the stand-in plays
    assert {c for r in LLMAPI_RECEIVERS.values() for c in r.values() if c} <= set(names)


def test_the_walk_finds_what_the_triton_model_and_its_glue_read() -> None:
    """Not vacuous: the model's and the glue's known reads are found."""
    found = {(c, n) for f in DEPLOYMENT for c, n, _ in touched(ROOT / f, receivers_for(f))}
    assert {("LLM", "generate_async"), ("RequestOutput", "request_id"), ("RequestOutput", "finished"),
            ("CompletionOutput", "token_ids_diff"), ("CompletionOutput", "text_diff"),
            ("CompletionOutput", "request_perf_metrics"), ("SpeculativeDecodingMetrics", "total_draft_tokens"),
            ("KvCacheMetrics", "num_reused_blocks"), ("RequestOutput", "decoding_iter"),
            ("ConversationParams", "conversation_id"), ("tensorrt_llm", "SamplingParams"),
            ("tensorrt_llm.llmapi.llm_utils", "update_llm_args_with_extra_dict"),
            ("TransformersTokenizer", "tokenizer"), ("PreTrainedTokenizerBase", "apply_chat_template")} <= found


def test_the_keywords_the_model_passes_to_generate_async_are_the_sources_and_the_stand_ins() -> None:
    standin = llmapi_standin()
    passed = {kw for f in DEPLOYMENT for c, m, kw in calls(ROOT / f, receivers_for(f))
              if (c, m) == ("LLM", "generate_async")}
    assert passed == {"streaming", "conversation_params", "cache_salt"}
    assert passed <= set(standin.GENERATE_ASYNC_PARAMETERS)
    for llm in (standin.LLM, standin.ExecutorLLM):
        assert passed <= set(inspect.signature(llm.generate_async).parameters), llm


def test_the_stand_in_answers_for_exactly_the_tables_names() -> None:
    rows = table()
    for cls, names in TRTLLM_NAMES.items():
        assert names == {n for c, n in rows if c == cls}, cls


def test_the_walk_finds_what_the_adapter_reads() -> None:
    """Not vacuous: the adapter's known reads are found (a renamed receiver would hide them)."""
    found = {(c, n) for f in FILES for c, n, _ in touched(ROOT / f)}
    assert {("LlmRequest", "context_current_position"), ("LlmRequest", "context_chunk_size"),
            ("LlmRequest", "cache_salt_id"), ("KVCacheManagerV2", "_can_publish_block_reuse"),
            ("KVCacheManagerV2", "enable_joint_kv_cache_reuse"), ("GenerationExecutor", "engine"),
            ("ScheduledRequests", "context_requests")} <= found


def test_package_code_reading_a_name_tensorrt_llm_lacks_gets_attribute_error() -> None:
    req = LlmRequest(1, [1, 2, 3], 4)
    assert req.prompt == [1, 2, 3]  # the stand-in's own bookkeeping, for tests
    code = compile("request.prompt", manager_module.__file__, "eval")
    with pytest.raises(AttributeError, match=r"TensorRT-LLM's LlmRequest has no 'prompt' in "
                                             r"docs/TRTLLM-CONFORMANCE.md"):
        eval(code, vars(manager_module), {"request": req})
    assert eval(compile("request.prompt_len", manager_module.__file__, "eval"),
                vars(manager_module), {"request": req}) == 3
    assert eval(compile("getattr(request, 'is_dummy', 'absent')", manager_module.__file__, "eval"),
                vars(manager_module), {"request": req}) == "absent"


def test_the_version_table_is_the_stand_ins_profiles() -> None:
    """One row per `VERSIONS` profile, with its target class, markers, the capability its creator
    reads and the hybrid class's value of it, the topology that gives, snapshot options and the
    source it was read at, exactly as the stand-in plays that version."""
    text = (ROOT / "docs" / "TRTLLM-CONFORMANCE.md").read_text()
    section = text[text.index("### Versions"):text.index("## 4. The LLM API")]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[0] in VERSIONS:
            rows[cells[0]] = cells
    assert set(rows) == set(VERSIONS)
    for version, profile in VERSIONS.items():
        _, target, markers, reads, value, topology, options, read_at, _ = rows[version]
        assert target.split()[0] == f"`{profile['target_class']}`", version
        assert markers == ("present" if profile["markers"] else "absent"), version
        assert reads == ("(no pairing)" if profile["pairing_reads"] is None else f"`{profile['pairing_reads']}`")
        assert value == str(profile["supports"]), version
        assert topology == profile["topology"], version
        want = "not read" if profile["snapshot_options"] is None else ", ".join(profile["snapshot_options"])
        assert options == want, version
        assert read_at, version
    assert "0004396720054fd8e205cbf616f21f0b57c6b412" in rows["main"][7]
    assert "003f8d08" in rows["main"][7]
    assert "28295084972c5ab61ef010a050a18f53f5d72810" in rows["pr18843"][7]
    assert "38198e34582cf777ecc72062f477987284ba9999" in rows["main+19303"][7]
    assert "38198e34582cf777ecc72062f477987284ba9999" in rows["main+19303:qsa"][7]
    assert "6ff2801f55462b926cc837a7f230fae63bc62fdc" in rows["main:qsa"][7]
    assert "two trees" in rows["main"][7]  # the reader and the value were read on different trees


def test_the_commits_table_says_what_llm_request_passes_at_002f3cc3() -> None:
    """`llm_request.py` @ 002f3cc3 passes only `cache_salt=executor_request.cache_salt`; no row
    of the document says it passes `cache_salt_id` (issue 37)."""
    text = (ROOT / "docs" / "TRTLLM-CONFORMANCE.md").read_text()
    (row,) = [line for line in text.splitlines()
              if line.startswith("| `tensorrt_llm/_torch/pyexecutor/llm_request.py` | 002f3cc3 |")]
    assert "only `cache_salt=executor_request.cache_salt`" in row
    assert "cache_salt_id=executor_request" not in text


def test_the_doc_cites_the_commits_it_read() -> None:
    text = (ROOT / "docs" / "TRTLLM-CONFORMANCE.md").read_text()
    for commit in ("00e9b8a7", "cc8cd5af", "000429d5", "002f3cc3", "38198e34", "28295084", "bab0f2e6",
                   "0076e939", "00022b04"):
        assert commit in text
    assert Path(ROOT / "docs" / "TRTLLM-CONFORMANCE.md").exists()


def test_the_adapter_depends_on_nothing_above_it() -> None:
    """One room per layer: `trtllm/` (the executor-level adapter) imports no front end."""
    import ast

    above = ("trtllm_mtp_carry.serve", "trtllm_mtp_carry.bench", "trtllm_mtp_carry.cli",
             "trtllm_mtp_carry.chat")
    found = []
    for path in sorted((ROOT / "trtllm_mtp_carry" / "trtllm").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                level = "trtllm_mtp_carry.trtllm".split(".")[: 2 - node.level + 1] if node.level else []
                name = ".".join([*level, node.module or ""]) if node.level else (node.module or "")
                if name.startswith(above):
                    found.append((path.name, name))
            elif isinstance(node, ast.Import):
                found += [(path.name, a.name) for a in node.names if a.name.startswith(above)]
    assert found == []


def test_every_test_the_llm_api_rows_name_exists() -> None:
    """Section 4's "pinned by" column names tests that exist (a function or a test file)."""
    text = (ROOT / "docs" / "TRTLLM-CONFORMANCE.md").read_text()
    section = text[text.index("## 4. The LLM API"):]
    named = set()
    for line in section.splitlines():
        cells = [c.strip() for c in line.replace("\\|", "/").strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[1].startswith("`"):
            named |= {t.strip() for t in cells[7].replace(";", ",").split(",") if t.strip().startswith("test_")}
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    files = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    missing = sorted(n for n in named if f"def {n}(" not in sources and n not in files)
    assert len(named) >= 15 and missing == []
