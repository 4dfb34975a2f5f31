"""The Dynamo deployment of the tests: the README's own `serve --dynamo` command, in a private
network namespace, started once per module and always stopped.

Without Dynamo installed, or where no private network namespace can be made
(`unshare -rn`), the tests skip with the reason.
"""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from dynamo_helpers import ROOT, Netns, netns_unavailable

README = ROOT / "README.md"


def readme_blocks(tag: str) -> list[tuple[str, str]]:
    """(language, code) of every README block tagged `<!-- readme-test: TAG -->`."""
    text = README.read_text()
    pattern = re.compile(r"^([ \t]*)<!-- readme-test: " + re.escape(tag) + r" -->\n[ \t]*```(\w+)\n(.*?)\n[ \t]*```",
                         re.S | re.M)
    return [(m.group(2), textwrap.dedent(m.group(3))) for m in pattern.finditer(text)]


def _skip_reason() -> str | None:
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.frontend") is None:
        return 'Dynamo is not installed (pip install -e ".[dynamo]" && pip install --no-deps ai-dynamo==1.6.1)'
    return netns_unavailable()


@pytest.fixture(scope="session")
def netns() -> Iterator[Netns]:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    ns = Netns()
    try:
        yield ns
    finally:
        ns.close()


@dataclass
class Served:
    """The running `serve --dynamo` of the README: its base URL, workers and output."""

    netns: Netns
    base_url: str
    model: str
    worker_pids: list[int]
    metrics_urls: list[str]
    process: subprocess.Popen[str]
    output: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def served(netns: Netns, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    (serve_block,) = [code for lang, code in readme_blocks("dynamo")
                      if lang == "bash" and code.startswith("trtllm-mtp-carry serve --dynamo")]
    process = subprocess.Popen(netns.argv("bash", "-c", f"exec {serve_block}"), env=netns.env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, cwd=tmp_path_factory.mktemp("dynamo-serve"))
    assert process.stdout is not None
    lines: list[str] = []
    try:
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("Ctrl-C stops every process") or "error:" in line:
                break
        if not lines or not lines[-1].startswith("Ctrl-C"):
            raise RuntimeError("serve --dynamo did not come up:\n" + "\n".join(lines[-40:]))
        text = "\n".join(lines)
        base_url = re.search(r"OpenAI\s+(\S+)", text).group(1)  # type: ignore[union-attr]
        model = re.search(r"serving model '([^']+)'", text).group(1)  # type: ignore[union-attr]
        workers = re.findall(r"worker \d+\s+pid (\d+)\s+metrics (\S+)", text)
        yield Served(netns, base_url, model, [int(p) for p, _ in workers], [u for _, u in workers],
                     process, lines)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            rest, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            rest, _ = process.communicate()
        lines += rest.splitlines()


def expected_text(engine, messages: list[dict[str, str]], max_tokens: int) -> str:  # type: ignore[no-untyped-def]
    """The answer plain greedy decoding gives in process (no drafter), as the frontend renders it."""
    prompt = engine.tokenizer.render_chat(messages)
    result = engine.generate(None, prompt, max_new_tokens=max_tokens, policy="off")
    return bytes(i for i in result.output if i < 256).decode("utf-8", "replace")


@pytest.fixture(scope="session")
def reference_engine():  # type: ignore[no-untyped-def]
    from trtllm_mtp_carry.engine.engine import ReferenceEngine

    return ReferenceEngine.from_pretrained()


