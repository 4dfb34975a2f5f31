"""Collect the TensorRT-LLM names the package's code touches (an AST walk), and the conformance table.

Package code names TensorRT-LLM objects by a fixed set of variable names
(`RECEIVERS`: `request` is an `LlmRequest`, `draft` a `KVCacheManagerV2`, ...);
every `receiver.name`, and every `getattr` / `hasattr` / `_attr(receiver, "name", ...)`
with a literal name, is a TensorRT-LLM name the code relies on. The table is the
one in docs/TRTLLM-CONFORMANCE.md (rows `| module | class | name | ...`).
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
    "executor": "PyExecutor", "engine": "PyExecutor",
    "llm": "LLM", "self._llm": "LLM",
    "proxy": "GenerationExecutor",
    "rm": "ResourceManager", "resource_manager": "ResourceManager",
    "probe.resource_manager": "ResourceManager",
    "scheduled_batch": "ScheduledRequests", "batch": "ScheduledRequests",
    "mapping": "Mapping",
    "params": "ConversationParams",
    "tensorrt_llm": "tensorrt_llm",
}
"""Variable name (or `self.x`) -> the TensorRT-LLM class its value is, in package code."""

FILES = [
    "trtllm_mtp_carry/trtllm/__init__.py", "trtllm_mtp_carry/trtllm/probe.py",
    "trtllm_mtp_carry/trtllm/manager.py", "trtllm_mtp_carry/trtllm/identity.py",
    "trtllm_mtp_carry/trtllm/worker.py", "trtllm_mtp_carry/trtllm/carried.py",
]
"""The adapter: code that runs inside TensorRT-LLM's executor and must lean on nothing else."""

_ACCESSORS = {"getattr", "hasattr", "_attr", "delattr"}


def _receiver(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


def touched(path: Path) -> set[tuple[str, str, int]]:
    """`(class, name, line)` of every TensorRT-LLM name `path` reads, calls or probes."""
    out: set[tuple[str, str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            cls = RECEIVERS.get(_receiver(node.value) or "")
            if cls is not None and not isinstance(node.ctx, ast.Store):
                out.add((cls, node.attr, node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _ACCESSORS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            cls = RECEIVERS.get(_receiver(node.args[0]) or "")
            if cls is not None:
                out.add((cls, node.args[1].value, node.lineno))
    return out


def table() -> set[tuple[str, str]]:
    """`(class, name)` of every row of docs/TRTLLM-CONFORMANCE.md's tables."""
    rows = set()
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[1].startswith("`") and cells[2].startswith("`"):
            cls = cells[1].strip("`")
            name = re.sub(r"\(.*", "", cells[2].strip("`"))
            rows.add((cls, name))
    return rows
