"""Collect the TensorRT-LLM names the package's code touches (an AST walk), and the conformance table.

Package code names TensorRT-LLM objects by a fixed set of variable names
(`RECEIVERS`: `request` is an `LlmRequest`, `draft` a `KVCacheManagerV2`, ...;
the Triton model and its serving glue add `LLMAPI_RECEIVERS`, per file: `out` is a
`RequestOutput`, `completion` a `CompletionOutput`, ...); every `receiver.name`,
and every `getattr` / `hasattr` / `_attr` / `num(receiver, "name", ...)` with a
literal name, is a TensorRT-LLM name the code relies on, and so is every name
imported from a `tensorrt_llm` module (`(module, name)`) and every keyword given
to a class imported from one (`ConversationParams(conversation_id=...)`).
`calls` collects the keywords passed to a method of such an object
(`llm.generate_async(..., streaming=True)`). The table is the one in
docs/TRTLLM-CONFORMANCE.md (rows `| module | class | name | ...`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "TRTLLM-CONFORMANCE.md"

RECEIVERS = {
    "request": "LlmRequest", "req": "LlmRequest",
    "draft": "KVCacheManagerV2", "target": "KVCacheManagerV2", "self.draft": "KVCacheManagerV2",
    "qsa": "QSAMambaHybridCacheManagerV2", "dsv4": "DeepseekV4CacheManager",
    "impl": "KVCacheManagerPy", "v2": "tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2", "role": "Role",
    "executor": "PyExecutor", "engine": "PyExecutor",
    "llm": "LLM", "self._llm": "LLM",
    "proxy": "GenerationExecutor",
    "rm": "ResourceManager", "resource_manager": "ResourceManager",
    "probe.resource_manager": "ResourceManager",
    "scheduled_batch": "ScheduledRequests", "batch": "ScheduledRequests",
    "mapping": "Mapping",
    "dist": "Distributed", "self.dist": "Distributed",
    "params": "ConversationParams",
    "tensorrt_llm": "tensorrt_llm",
    "kv_cache_config": "KvCacheConfig", "state_config": "MambaStateConfig",
    "llm_args": "TorchLlmArgs", "spec_config": "DecodingBaseConfig",
}
"""Variable name (or `self.x`) -> the TensorRT-LLM class its value is, in package code."""

FILES = [
    "trtllm_mtp_carry/trtllm/__init__.py", "trtllm_mtp_carry/trtllm/probe.py",
    "trtllm_mtp_carry/trtllm/manager.py", "trtllm_mtp_carry/trtllm/identity.py",
    "trtllm_mtp_carry/trtllm/worker.py", "trtllm_mtp_carry/trtllm/reservation.py",
    "trtllm_mtp_carry/trtllm/metrics.py", "trtllm_mtp_carry/trtllm/draft_pages.py",
    "trtllm_mtp_carry/trtllm/lockstep.py", "trtllm_mtp_carry/trtllm/kv_formats.py",
]
"""The adapter: code that runs inside TensorRT-LLM's executor and must lean on nothing else."""

DEPLOYMENT = ["trtllm_mtp_carry/serve/trtllm/model.py", "trtllm_mtp_carry/serve/trtllm/serving.py"]
"""The Triton model and its serving glue: code on TensorRT-LLM's LLM API."""

LLMAPI_RECEIVERS: dict[str, dict[str, str]] = {
    "trtllm_mtp_carry/trtllm/kv_formats.py": {
        "kv_cache_config": "",  # here the llm-config file's kv_cache_config mapping, not a KvCacheConfig
    },
    "trtllm_mtp_carry/serve/trtllm/model.py": {
        "self.llm": "LLM", "self._engine.llm": "LLM",
        "out": "RequestOutput", "result": "RequestOutput",
        "completion": "CompletionOutput",
        "tokenizer": "TransformersTokenizer",  # LLM.tokenizer
        "llm_args": "",  # here the options dict it builds the LLM from, not a TorchLlmArgs
    },
    "trtllm_mtp_carry/serve/trtllm/serving.py": {
        "output": "CompletionOutput", "result": "RequestOutput",
        "perf": "RequestPerfMetrics", "spec": "SpeculativeDecodingMetrics", "kv": "KvCacheMetrics",
        "tokenizer": "PreTrainedTokenizerBase", "self.tokenizer": "PreTrainedTokenizerBase",
    },
}
"""Per deployment file: variable name -> the LLM API class its value is (on top of `RECEIVERS`;
"" drops a `RECEIVERS` name that holds something else in that file)."""

_ACCESSORS = {"getattr", "hasattr", "_attr", "delattr", "num"}


def receivers_for(path: str) -> dict[str, str]:
    """The receivers `touched` reads `path` (relative to the repository) with."""
    found = {**RECEIVERS, **LLMAPI_RECEIVERS.get(path, {})}
    return {name: cls for name, cls in found.items() if cls}  # "": not a TensorRT-LLM object there


def _receiver(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _imported(tree: ast.AST) -> dict[str, tuple[str, str]]:
    """local name -> (tensorrt_llm module, name) of every `from tensorrt_llm... import name`."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] == "tensorrt_llm":
            for alias in node.names:
                found[alias.asname or alias.name] = (node.module, alias.name)
    return found


def touched(path: Path, receivers: dict[str, str] | None = None) -> set[tuple[str, str, int]]:
    """`(class, name, line)` of every TensorRT-LLM name `path` reads, calls, probes or imports."""
    receivers = RECEIVERS if receivers is None else receivers
    tree = ast.parse(path.read_text())
    imported = _imported(tree)
    out: set[tuple[str, str, int]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] == "tensorrt_llm":
            out |= {(node.module, a.name, node.lineno) for a in node.names}
        elif isinstance(node, ast.Attribute):
            cls = receivers.get(_receiver(node.value) or "")
            if cls is not None and not isinstance(node.ctx, ast.Store):
                out.add((cls, node.attr, node.lineno))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
            cls = imported[node.func.id][1]  # a TensorRT-LLM class built with keywords
            out |= {(cls, k.arg, node.lineno) for k in node.keywords if k.arg is not None}
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _ACCESSORS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            cls = receivers.get(_receiver(node.args[0]) or "")
            if cls is not None:
                out.add((cls, node.args[1].value, node.lineno))
    return out


def calls(path: Path, receivers: dict[str, str]) -> set[tuple[str, str, str]]:
    """`(class, method, keyword)` of every keyword `path` passes to a method of a TensorRT-LLM object."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            cls = receivers.get(_receiver(node.func.value) or "")
            if cls is not None:
                out |= {(cls, node.func.attr, k.arg) for k in node.keywords if k.arg is not None}
    return out


def table(absent: bool = False) -> set[tuple[str, str]]:
    """`(class, name)` of every row of docs/TRTLLM-CONFORMANCE.md's tables the class has; with
    `absent`, the rows whose type is `absent` instead: names the source does not define on that
    class, which the code probes with a default (`getattr(obj, name, None)`) and the stand-in
    refuses (AttributeError), as TensorRT-LLM would."""
    rows = set()
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[1].startswith("`") and cells[2].startswith("`"):
            if (cells[3] == "absent") is absent:
                cls = cells[1].strip("`")
                rows.add((cls, re.sub(r"\(.*", "", cells[2].strip("`"))))
    return rows
