"""The Dynamo deployment of the tests: docs/DYNAMO.md's own `serve --dynamo` command, in a private
network namespace, started once per module and always stopped.

Without Dynamo installed, or where no private network namespace can be made
(`unshare -rn`), the tests skip with the reason.
"""

from __future__ import annotations

import importlib.util
import re
import signal
import subprocess
from collections.abc import Iterator

import pytest
from dynamo_helpers import Netns, Served, netns_unavailable, readme_blocks


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


@pytest.fixture(scope="module")
def served(netns: Netns, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    (serve_block,) = [code for lang, code in readme_blocks("dynamo")
                      if lang == "bash" and code.startswith("trtllm-mtp-carry serve --dynamo")]
    workdir = tmp_path_factory.mktemp("dynamo-serve")
    (workdir / ".home").mkdir()
    process = subprocess.Popen(netns.argv("bash", "-c", f"exec {serve_block}"),
                               env=netns.clean_env(workdir / ".home"),  # as a README block runs
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, cwd=workdir)
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


@pytest.fixture(scope="session")
def reference_engine():  # type: ignore[no-untyped-def]
    from trtllm_mtp_carry.engine.engine import ReferenceEngine

    return ReferenceEngine.from_pretrained()


