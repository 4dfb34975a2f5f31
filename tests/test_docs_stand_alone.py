"""The repository stands alone: its user documents link only to files inside it, and
never to the notes the project was built from, which users do not have (issue 32)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "DECISIONS.md", ROOT / "BENCHMARKS.md", ROOT / "builders" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
OUTSIDE = ("../shared", "/work/", "TRTLLM-NOTES", "DYNAMO-NOTES", "SPEC.md", "ARCHITECTURE.md", "STYLE.md",
           "TensorRT-LLM notes", "seed/mtp_carry")
"""Names of what the project was built from, outside the repository."""


def anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown text."""
    out = set()
    for line in text.splitlines():
        m = re.match(r"^#{1,6} (.*)$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Each link of `path` that leaves the repository, names a missing file or a missing heading."""
    text = path.read_text()
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^(https?|mailto):", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if root not in (dest, *dest.parents):
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            bad.append(f"{target}: no such heading")
    return bad


def test_the_checker_finds_links_out_of_the_repository_missing_files_and_headings(tmp_path):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "A.md").write_text("# Title\n## Two words\n")
    doc = root / "README.md"
    doc.write_text("[a](docs/A.md#two-words) [b](docs/A.md#three) [c](docs/B.md) [d](../shared/x.md) "
                   "[e](https://example.org/x) [f](#title)\n# Title\n")
    assert broken_links(doc, root) == ["docs/A.md#three: no such heading", "docs/B.md: no such file",
                                       "../shared/x.md: outside the repository"]
    assert anchors("## Serve with Triton\n### `trtllm-mtp-carry chat`\n## TensorRT plugins and ahead-of-time kernels\n") == {
        "serve-with-triton", "trtllm-mtp-carry-chat", "tensorrt-plugins-and-ahead-of-time-kernels"}


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_every_link_resolves_inside_the_repository(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_no_document_sends_readers_to_the_projects_own_notes(path):
    text = " ".join(path.read_text().split())
    assert [name for name in OUTSIDE if name in text] == []


def test_no_source_script_or_document_names_a_path_outside_the_repository():
    files = [p for pattern in ("*.py", "*.md", "*.sh", "*.toml") for p in ROOT.rglob(pattern)
             if not any(part.startswith(".") for part in p.relative_to(ROOT).parts) and p != Path(__file__)]
    files.append(ROOT / ".ci" / "run")
    assert [str(p.relative_to(ROOT)) for p in files if any(s in p.read_text() for s in ("../shared", "/work/"))] == []


SUBPACKAGES = {p.name for p in (ROOT / "trtllm_mtp_carry").iterdir() if p.is_dir() and not p.name.startswith("_")}
TOP_LEVEL = {p.name for p in ROOT.iterdir() if not p.name.startswith(".git")}
REPO_PATH = re.compile(r"(?<![\w./:-])((?:[\w.-]+/)+[\w.-]*)")
MANUAL = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "TRTLLM-CONFORMANCE.md")]
"""The README and the manual's pages (the conformance table names TensorRT-LLM's own files, not ours)."""


def repo_paths_named(text: str) -> list[str]:
    """Each path in `text` that starts at one of the repository's top-level entries or at one of the
    package's subpackages (`engine/x.py`: a path a reader would look for from the root)."""
    found = []
    for m in REPO_PATH.finditer(text):
        path = m.group(1).rstrip(".")
        if path.split("/")[0] in TOP_LEVEL | SUBPACKAGES:
            found.append(path)
    return found


def test_the_path_finder_reads_root_and_subpackage_paths_and_leaves_urls_alone():
    text = ("see `engine/paired_drafts.py` and trtllm_mtp_carry/engine/paired_drafts.py, tests/, "
            "https://github.com/x/engine/y.py and tensorrt_llm/_torch/pyexecutor/py_executor.py.")
    assert repo_paths_named(text) == ["engine/paired_drafts.py", "trtllm_mtp_carry/engine/paired_drafts.py", "tests/"]


@pytest.mark.parametrize("path", MANUAL, ids=[str(p.relative_to(ROOT)) for p in MANUAL])
def test_every_repository_path_a_document_names_exists(path):
    missing = sorted({p for p in repo_paths_named(path.read_text()) if not (ROOT / p).exists()})
    assert missing == [], f"{path.relative_to(ROOT)} names paths that are not in the repository"
