"""A private network namespace for the Dynamo tests, and a client that runs inside it.

The deployment listens on 127.0.0.1 only by itself (its event broker keeps Dynamo's
ZMQ publishers off 0.0.0.0: test_dynamo_supervision.py checks it on plain
loopback). These tests still run every Dynamo process (frontend, workers,
clients) in one private user + network namespace (`unshare -rn`, held open by a
sleeping process, entered with `nsenter`) so that the docs' fixed ports (8000,
8002) are private there and never collide with another run on the machine.

`ns_client.py` is the client side: it reads one JSON job on stdin, runs it
against the deployment with `serve.dynamo.openai_client`, and prints JSON.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
README = ROOT / "README.md"

# the holder: bring the namespace's loopback up (SIOCGIFFLAGS / SIOCSIFFLAGS, IFF_UP), then wait
_HOLD = r"""
import fcntl, signal, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0))[:18])[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
print("ready", flush=True)
signal.pause()
"""


def netns_unavailable() -> str | None:
    """Why a private network namespace cannot be made here (None: it can)."""
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare -rn refused: {probe.stderr.strip()}"
    return None


class Netns:
    """One private network namespace; `argv(cmd)` runs `cmd` inside it."""

    def __init__(self) -> None:
        self.holder = subprocess.Popen(["unshare", "-rn", sys.executable, "-c", _HOLD],
                                       stdout=subprocess.PIPE, text=True)
        assert self.holder.stdout is not None
        line = self.holder.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise RuntimeError(f"network namespace holder did not start: {line!r}")

    def argv(self, *cmd: str) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "--user", "--net", "--preserve-credentials",
                *cmd]

    @staticmethod
    def clean_env(home: Path) -> dict[str, str]:
        """What a README block runs in, as tests/test_readme_blocks.py runs one: `env -i` plus
        PATH (this interpreter's bin first), a fresh HOME and this checkout."""
        return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
                "PYTHONPATH": str(ROOT)}

    @staticmethod
    def env(**extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env.update(extra)
        return env

    def run(self, *cmd: str, input: str | None = None, timeout: float = 300.0,
            cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """`cmd` inside the namespace, in `env` (default this environment, this interpreter's bin first)."""
        return subprocess.run(self.argv(*cmd), input=input, capture_output=True, text=True,
                              timeout=timeout, env=self.env() if env is None else env, cwd=cwd)

    def client(self, job: dict[str, Any], timeout: float = 300.0) -> Any:
        """Run one `ns_client.py` job inside the namespace; its JSON answer."""
        done = self.run(sys.executable, str(HERE / "ns_client.py"), input=json.dumps(job),
                        timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"ns_client failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(done.stdout)

    def close(self) -> None:
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait(5)


def readme_blocks(tag: str) -> list[tuple[str, str]]:
    """(language, code) of every block tagged `<!-- readme-test: TAG -->` in the README, then in
    each docs/ page (alphabetically), as tests/test_readme_blocks.py orders them."""
    pattern = re.compile(r"^([ \t]*)<!-- readme-test: " + re.escape(tag) + r" -->\n[ \t]*```(\w+)\n(.*?)\n[ \t]*```",
                         re.S | re.M)
    return [(m.group(2), textwrap.dedent(m.group(3)))
            for path in (README, *sorted((ROOT / "docs").glob("*.md")))
            for m in pattern.finditer(path.read_text())]


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


def expected_text(engine, messages: list[dict[str, str]], max_tokens: int) -> str:  # type: ignore[no-untyped-def]
    """The answer plain greedy decoding gives in process (no drafter), as the frontend renders it."""
    prompt = engine.tokenizer.render_chat(messages)
    result = engine.generate(None, prompt, max_new_tokens=max_tokens, policy="off")
    return bytes(i for i in result.output if i < 256).decode("utf-8", "replace")
