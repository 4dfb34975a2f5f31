"""What the serve tests share: the served model's names and sizes, a metrics reader, a poll,
free loopback ports and the server binary (imported by name: a bare `conftest` import
would resolve to another folder's conftest when several test folders run together)."""

import re
import socket
import time
from pathlib import Path

import pytest

import trtllm_mtp_carry.core as core
from trtllm_mtp_carry.serve.triton.server import ServeError, find_tritonserver

MODEL = "mtp_carry"  # 2 instances, loaded at start
PROBE = "mtp_carry_probe"  # loaded only with bad parameters
SHORT = "mtp_carry_short"  # 1 instance, short timers and SHORT_SESSIONS open sessions, loaded at start
SHORT_IDLE_S = 1.0  # its session idle timeout
SHORT_MAX_TURN_S = 20  # its turn limit (Triton's sequence timer: the two together)
SHORT_SESSIONS = 2  # its open-session cap (max_candidate_sequences)
MAX_TOKENS = 24  # the served default max_tokens
MARCONI = 48  # the served restore threshold (short test prompts still restore)
HAS_CARRY_SLOTS = hasattr(core, "set_carry_slots")  # several slots per instance (issue 9)
CARRY_SLOTS = 4 if HAS_CARRY_SLOTS else None  # every session of an instance keeps its rows


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (Prometheus text)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_for(predicate, timeout_s: float) -> bool:
    """Poll `predicate` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tritonserver_or_skip() -> Path:
    try:
        import tritonclient.grpc  # noqa: F401
    except ImportError:
        pytest.skip('tritonclient is not installed (pip install -e ".[serve]")')
    try:
        return find_tritonserver()
    except ServeError as exc:
        pytest.skip(str(exc))
