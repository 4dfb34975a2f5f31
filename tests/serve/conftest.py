"""A real `tritonserver` for the serve tests, started once and always stopped.

The server (the one nvidia-pytriton ships, or one on PATH) listens on
127.0.0.1 with free ports and serves a generated repository: `mtp_carry`
(2 instances) and `mtp_carry_short` (1 instance, short timers, 2 open
sessions) loaded at start, and `mtp_carry_probe`, loaded only by the test of
bad parameters. The fixture stops the server's whole process group, so no
Python-backend stub outlives the session. Without a server the tests skip.
"""

from __future__ import annotations

import dataclasses
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from serve_helpers import (
    CARRY_SLOTS,
    MARCONI,
    MAX_TOKENS,
    MODEL,
    PROBE,
    SHORT,
    SHORT_IDLE_S,
    SHORT_MAX_TURN_S,
    SHORT_SESSIONS,
    free_ports,
    tritonserver_or_skip,
)

from trtllm_mtp_carry.serve.options import ServeOptions
from trtllm_mtp_carry.serve.triton.repo import RepoSpec, write_repository
from trtllm_mtp_carry.serve.triton.server import (
    Endpoints,
    TritonServer,
)


@dataclass
class Served:
    """The running server: its endpoints and repository."""

    endpoints: Endpoints
    repository: Path
    server: TritonServer

    def metrics(self) -> str:
        with urllib.request.urlopen(self.endpoints.metrics, timeout=10) as r:
            return str(r.read().decode())


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    binary = tritonserver_or_skip()
    repo = tmp_path_factory.mktemp("repo")
    options = ServeOptions(max_tokens=MAX_TOKENS, marconi_min_tokens=MARCONI, carry_slots=CARRY_SLOTS)
    write_repository(repo, RepoSpec(name=MODEL, instances=2, options=options))
    write_repository(repo, RepoSpec(name=PROBE, instances=1, options=options))
    short = dataclasses.replace(options, max_turn_s=SHORT_MAX_TURN_S)
    write_repository(repo, RepoSpec(name=SHORT, instances=1, idle_timeout_s=SHORT_IDLE_S,
                                    max_candidate_sequences=SHORT_SESSIONS, options=short))
    endpoints = Endpoints("127.0.0.1", *free_ports(3))
    server = TritonServer(repo, endpoints, binary=binary, workdir=tmp_path_factory.mktemp("triton"),
                          extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}",
                                      f"--load-model={SHORT}"])
    server.start()
    try:
        server.wait_ready([MODEL, SHORT], timeout_s=240)
        yield Served(endpoints, repo, server)
    finally:
        server.stop()
