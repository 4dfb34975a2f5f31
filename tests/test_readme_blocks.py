"""Every ```bash and ```python block of README.md and of docs/*.md runs as written and exits.

The README's promise is that a newcomer can paste its commands, in order, into a
fresh shell after command 1, and the manual's pages (docs/) make the same promise,
each page on its own. So each fenced bash or python block is extracted
and run in a clean environment, not the developer's: only `PATH` (this
interpreter's `bin`, where command 1's `.venv/bin` would be, then the system's),
a fresh `HOME` and `PYTHONPATH` naming this checkout (what command 1's editable
install does) are set, as under `env -i`; every block of one document shares one
fresh working directory, as a newcomer's clone would, in the document's order. Bash runs
with `-e -o pipefail`, python as `python -c` from that `PATH`; each must exit 0.
(One fresh virtual environment per run was ruled out: CI's 2 cores have no
minutes for another torch install; DECISIONS.md, "README blocks".)

A block that needs something else is tagged by an HTML comment on the line
right before its fence:

    <!-- readme-test: triton -->          run here against a real tritonserver this
                                          test starts (the block's default endpoints,
                                          127.0.0.1:8000/8001/8002, are rewritten to
                                          the server's free ports)
    <!-- readme-test: dynamo -->          run by the Dynamo tests (tests/dynamo/)
    <!-- readme-test: skip: <reason> -->  not run; the reason says why

Any other tag, a tag without a fence below it, or a skip without a reason
fails. The tag is an HTML comment, invisible on a rendered page, so a block that
needs something before it runs as written (a `triton` or `dynamo` block, or a skip
whose reason names a GPU, TensorRT, a server, a deployment, an install, a download
or serving until Ctrl-C) says so to the reader in a visible line right above the
tag, `**Needs:** what`; one that needs a GPU, TensorRT or TensorRT-LLM names it
there (`test_a_skipped_block_that_needs_a_gpu_or_tensorrt_says_so_above_it`). A
block skipped only for its minutes needs no such line. A command block never goes
untyped (it would escape the run). The README's first block (the main bench
job and `bash scripts/test.sh`, the suite that runs this very test) must be a
skip: CI runs both anyway. Other test modules reuse `readme_blocks()`,
`document_blocks()` and `clean_env()`.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
"""The documents whose blocks run: the README, then each page of the manual."""
RUNNABLE = ("bash", "python")
TAG = re.compile(r"^\s*<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
OPEN = re.compile(r"^(\s*)```([\w+-]*)\s*$")
DEFAULT_ENDPOINTS = {"8000": "http", "8001": "grpc", "8002": "metrics"}


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts (1-based line of its fence), its language, code and tag."""

    line: int
    lang: str
    code: str
    tag: str | None  # "triton", "dynamo", "skip: <reason>", or whatever the README says
    doc: str = "README.md"  # the document, relative to the repository

    @property
    def kind(self) -> str:
        """`run`, `triton`, `dynamo` or `skip`; ValueError naming the block for a malformed tag."""
        if self.tag is None:
            return "run"
        if self.tag in ("triton", "dynamo"):
            return self.tag
        if self.tag.startswith("skip:"):
            if not self.tag[len("skip:"):].strip():
                raise ValueError(f"{self.doc}:{self.line}: a skip tag needs a reason (skip: <why>)")
            return "skip"
        raise ValueError(f"{self.doc}:{self.line}: unknown readme-test tag {self.tag!r} "
                         "(known: triton, dynamo, skip: <reason>)")


def readme_blocks(text: str | None = None, path: Path = README) -> list[Block]:
    """Every fenced block of `path` (default the README), in order; ValueError for a tag no fence follows."""
    doc = str(path.relative_to(ROOT))
    lines = (path.read_text() if text is None else text).splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        tag = TAG.match(lines[i])
        if tag and not (i + 1 < len(lines) and OPEN.match(lines[i + 1])):
            raise ValueError(f"{doc}:{i + 1}: a readme-test tag must be right above a fence")
        opening = OPEN.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, lang = opening.group(1), opening.group(2)
        body = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        previous = TAG.match(lines[i - 1]) if i > 0 else None
        blocks.append(Block(i + 1, lang, "\n".join(body) + "\n", previous.group(1) if previous else None, doc))
        i = j + 1
    return blocks


NEEDS = re.compile(r"^\s*\*\*Needs:\*\*\s+\S")
"""The visible note a block that needs something carries on the line right above its tag."""
NEEDING = ("needs", "gpu", "tensorrt", "server", "deployment", "install", "download", "serves")
"""Words of a skip's reason that say the block needs something besides time."""


def needs_something(block: Block) -> bool:
    """Whether `block` needs something before it runs as written: a server (`triton`,
    `dynamo`), or what its skip's reason names (`NEEDING`); not a skip for time alone."""
    if block.kind in ("triton", "dynamo"):
        return True
    return block.kind == "skip" and any(word in (block.tag or "").lower() for word in NEEDING)


def missing_needs_lines(text: str, path: Path = README) -> list[str]:
    """`doc:line` of each block of `text` that needs something (`needs_something`) and has no
    visible `**Needs:** ...` line right above its tag."""
    lines = text.splitlines()
    return [f"{b.doc}:{b.line}" for b in readme_blocks(text, path)
            if needs_something(b) and not (b.line >= 3 and NEEDS.match(lines[b.line - 3]))]


def document_blocks() -> list[Block]:
    """Every fenced block of the README and of each docs/ page, document by document, in order."""
    return [b for path in DOCUMENTS for b in readme_blocks(path=path)]


def _runnable(kind: str) -> list[Block]:
    return [b for b in document_blocks() if b.lang in RUNNABLE and b.kind == kind]


def clean_env(home: Path) -> dict[str, str]:
    """The environment a README block runs in: `env -i` plus PATH, a fresh HOME and this checkout."""
    return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
            "PYTHONPATH": str(ROOT)}


def run_block(block: Block, cwd: Path, timeout_s: float = 300.0,
              home: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `block` in `cwd` as a user would paste it, in `clean_env` (HOME `home`, else `cwd/.home`)."""
    home = home or cwd / ".home"
    home.mkdir(exist_ok=True)
    cmd = (["bash", "-e", "-o", "pipefail", "-c", block.code] if block.lang == "bash"
           else ["python", "-c", block.code])
    return subprocess.run(cmd, cwd=cwd, env=clean_env(home), capture_output=True, text=True, timeout=timeout_s)


def _ids(blocks: list[Block]) -> list[str]:
    return [f"{b.doc}:{b.line}-{b.lang}" for b in blocks]


def test_every_readme_test_tag_is_known_and_sits_on_a_fence():
    kinds = [b.kind for b in document_blocks()]  # raises, naming the document and line, for a bad tag
    assert set(kinds) <= {"run", "triton", "dynamo", "skip"}


def test_the_readme_parser_reads_tags_indented_fences_and_refuses_bad_tags():
    text = ("intro\n<!-- readme-test: skip: slow -->\n```bash\necho a\n```\n"
            "- item\n  <!-- readme-test: triton -->\n  ```python\n  print(1)\n  ```\n```text\nout\n```\n")
    assert readme_blocks(text) == [Block(3, "bash", "echo a\n", "skip: slow"),
                                   Block(8, "python", "print(1)\n", "triton"),
                                   Block(11, "text", "out\n", None)]
    with pytest.raises(ValueError, match=r"README.md:3: unknown readme-test tag 'gpu'"):
        [b.kind for b in readme_blocks("x\n<!-- readme-test: gpu -->\n```bash\nls\n```\n")]
    with pytest.raises(ValueError, match=r"README.md:3: a skip tag needs a reason"):
        [b.kind for b in readme_blocks("x\n<!-- readme-test: skip: -->\n```bash\nls\n```\n")]
    with pytest.raises(ValueError, match=r"README.md:1: a readme-test tag must be right above a fence"):
        readme_blocks("<!-- readme-test: triton -->\n\n```bash\nls\n```\n")


def test_the_first_block_is_the_main_job_and_the_suite_and_is_skipped():
    first = readme_blocks()[0]
    assert first.lang == "bash" and "trtllm-mtp-carry bench" in first.code
    assert "bash scripts/test.sh" in first.code  # the suite itself: running it here would recurse
    assert first.kind == "skip"


@pytest.fixture(scope="module")
def newcomer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per document, the one working directory every block of it shares, in its order."""
    return {str(p.relative_to(ROOT)): tmp_path_factory.mktemp(p.stem.lower() + "-clone") for p in DOCUMENTS}


@pytest.mark.parametrize("block", _runnable("run"), ids=_ids(_runnable("run")))
def test_an_untagged_block_runs_as_written_and_exits(block, newcomer_dirs):
    done = run_block(block, newcomer_dirs[block.doc])
    assert done.returncode == 0, f"{block.doc}:{block.line} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def test_the_clean_environment_holds_only_path_home_and_the_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTLLM_MTP_CARRY_SLOTS", "3")  # a developer's setting must not leak in
    done = run_block(Block(1, "python", "import os, sys; print(sorted(os.environ)); print(sys.prefix)\n", None),
                     tmp_path)
    assert done.returncode == 0, done.stderr
    names, prefix = done.stdout.splitlines()[:2]
    # LC_CTYPE: Python sets it itself when the locale is C (PEP 538), as under env -i
    assert set(ast.literal_eval(names)) - {"LC_CTYPE"} == {"HOME", "PATH", "PYTHONPATH"}
    assert prefix == sys.prefix


def _paragraph_above(block: Block, lines: list[str]) -> str:
    i = block.line - 3  # the line above the tag, 0-based
    while i >= 0 and not lines[i].strip():
        i -= 1
    para = []
    while i >= 0 and lines[i].strip():
        para.append(lines[i])
        i -= 1
    return " ".join(reversed(para))


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_a_skipped_block_that_needs_a_gpu_or_tensorrt_says_so_above_it(path):
    lines = path.read_text().splitlines()
    for b in readme_blocks(path=path):
        if b.kind != "skip":
            continue
        reason = (b.tag or "").lower()
        above = _paragraph_above(b, lines)
        if "gpu" in reason:
            assert "GPU" in above, f"{b.doc}:{b.line}: say above the block that it needs a GPU"
        if "tensorrt_llm" in reason or "tensorrt-llm" in reason:
            assert "TensorRT-LLM" in above, f"{b.doc}:{b.line}: say above the block that it needs TensorRT-LLM"
        elif "tensorrt" in reason:
            assert "TensorRT" in above, f"{b.doc}:{b.line}: say above the block that it needs TensorRT"


def test_the_needs_checker_wants_a_visible_line_above_a_tag_that_needs_something():
    text = ("intro\n\n<!-- readme-test: triton -->\n```bash\nls\n```\n"          # needs a server: no line
            "\n**Needs:** an NVIDIA GPU.\n<!-- readme-test: skip: needs a GPU -->\n```bash\nls\n```\n"
            "\nslow:\n<!-- readme-test: skip: takes minutes -->\n```bash\nls\n```\n"  # time alone: fine
            "\n- item\n\n  **Needs:** a deployment.\n  <!-- readme-test: dynamo -->\n  ```bash\n  ls\n  ```\n"
            "\nNeeds: invisible? no, but not the marker\n<!-- readme-test: skip: installs packages -->\n"
            "```bash\nls\n```\n")
    assert missing_needs_lines(text) == ["README.md:4", "README.md:30"]


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_a_block_that_needs_something_says_so_in_a_visible_line(path):
    assert missing_needs_lines(path.read_text(), path) == [], (
        "put a visible '**Needs:** ...' line right above these blocks' readme-test tags")


def test_every_runnable_block_of_the_manual_is_run_or_tagged():
    # a command block without a language would escape the run: the manual's are bash, python or output
    untyped = [f"{b.doc}:{b.line}" for b in document_blocks()
               if b.lang == "" and re.match(r"\s*(pip|python|trtllm-mtp-carry|bash|curl|aiperf) ", b.code)]
    assert untyped == []


@pytest.fixture(scope="module")
def triton_endpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real tritonserver serving what `serve` serves by default (model mtp_carry)."""
    # ServeError comes from a stdlib-only module, imported before the `try` that names it:
    # inside, a missing tritonclient left it unbound and the fixture errored instead of skipping
    from trtllm_mtp_carry.serve.triton.server import ServeError, find_tritonserver

    try:
        import tritonclient.grpc  # noqa: F401

        binary = find_tritonserver()
    except (ImportError, ServeError) as exc:
        pytest.skip(f"no tritonserver for the README's triton blocks: {exc}")
    import socket

    from trtllm_mtp_carry.serve.triton.repo import RepoSpec, write_repository
    from trtllm_mtp_carry.serve.triton.server import Endpoints, TritonServer

    repo = tmp_path_factory.mktemp("readme-repo")
    write_repository(repo, RepoSpec(instances=1))
    socks = [socket.socket() for _ in range(3)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    endpoints = Endpoints("127.0.0.1", *ports)
    server = TritonServer(repo, endpoints, binary=binary, workdir=tmp_path_factory.mktemp("readme-triton"))
    server.start()
    try:
        server.wait_ready([RepoSpec().name], timeout_s=240)
        yield {"8000": str(ports[0]), "8001": str(ports[1]), "8002": str(ports[2])}
    finally:
        server.stop()


@pytest.mark.parametrize("block", _runnable("triton"), ids=_ids(_runnable("triton")))
def test_a_triton_block_runs_against_a_real_server_and_exits(block, newcomer_dirs, triton_endpoints):
    code = re.sub(r"(127\.0\.0\.1|localhost):(800[012])\b",
                  lambda m: f"127.0.0.1:{triton_endpoints[m.group(2)]}", block.code)
    done = run_block(Block(block.line, block.lang, code, block.tag, block.doc), newcomer_dirs[block.doc], timeout_s=180)
    assert done.returncode == 0, f"{block.doc}:{block.line} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
