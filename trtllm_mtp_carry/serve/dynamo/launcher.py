"""Dynamo's frontend and N carry workers on loopback, started and stopped as one deployment.

What it is for: `trtllm-mtp-carry serve --dynamo` and the tests. A
`DynamoDeployment` starts
`python -m dynamo.frontend` (OpenAI API on `http_host:http_port`, the router
mode and session affinity of its `DynamoSpec`) and N workers
(`python -m trtllm_mtp_carry.serve.dynamo.worker`), waits until every worker
is registered and the model is listed, and stops them all.

Ownership and invariants:
- Every deployment has its own working directory (a fresh file-discovery
  directory, so no stale entry of an earlier run is routed to; the model
  directory; `HOME`, where the frontend caches model cards; the logs), removed
  on `stop()`.
- Every listener it configures is on 127.0.0.1 (frontend, request and
  response planes, each worker's system/metrics server). Dynamo's ZMQ
  KV-event publisher binds 0.0.0.0 by itself: run inside a private network
  namespace (`unshare -rn`) to keep even that off the network.
- Each process runs in its own process group; `stop()` sends SIGTERM to
  every group, waits, then SIGKILLs what is left. Nothing outside the
  deployment is ever signalled.
- With N workers on a machine, each worker's torch gets cores // N threads
  unless `OMP_NUM_THREADS` is set.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..options import ServeOptions
from . import require_dynamo

ROUTER_MODES = ("kv", "round-robin", "random", "least-loaded", "power-of-two")
"""The frontend's router modes offered here (`--router-mode`)."""

DEFAULT_MODEL_NAME = "mtp-carry"


class DeploymentError(RuntimeError):
    """A process of the deployment failed to start or exited; the message has its log tail."""


@dataclass(frozen=True)
class DynamoSpec:
    """What to deploy: the workers' model options and the frontend's routing."""

    workers: int = 2
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    name: str = DEFAULT_MODEL_NAME
    router_mode: str = "kv"
    session_affinity: bool = True
    affinity_ttl_s: int = 600
    affinity_mode: str = "hard"
    kv_events: bool = True
    idle_timeout_s: float | None = 600.0
    options: ServeOptions = field(default_factory=ServeOptions)

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers <= 0:
            raise ValueError(f"workers must be a positive int, got {self.workers!r}")
        if self.router_mode not in ROUTER_MODES:
            raise ValueError(f"router mode must be one of {', '.join(ROUTER_MODES)}, got {self.router_mode!r}")
        if self.affinity_mode not in ("hard", "soft"):
            raise ValueError(f"affinity mode must be hard or soft, got {self.affinity_mode!r}")
        if not 1 <= self.affinity_ttl_s <= 86400:
            raise ValueError(f"affinity TTL must be in [1, 86400] seconds, got {self.affinity_ttl_s!r}")
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise ValueError(f"idle timeout must be > 0 seconds, got {self.idle_timeout_s!r}")

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (`.../v1`)."""
        return f"http://{self.http_host}:{self.http_port}/v1"

    def frontend_args(self) -> list[str]:
        args = ["--http-host", self.http_host, "--http-port", str(self.http_port),
                "--discovery-backend", "file", "--request-plane", "tcp",
                "--router-mode", self.router_mode]
        if self.session_affinity:
            args += ["--router-session-affinity-ttl-secs", str(self.affinity_ttl_s),
                     "--router-session-affinity-mode", self.affinity_mode]
        if self.router_mode == "kv" and not self.kv_events:
            args += ["--no-router-kv-events"]
        return args

    def worker_args(self, model_dir: str) -> list[str]:
        o = self.options
        args = ["--model-dir", model_dir, "--served-model-name", self.name,
                "--discovery-backend", "file", "--request-plane", "tcp",
                "--engine", o.engine, "--policy", o.drafter_policy, "--draft-len", str(o.draft_len),
                "--max-tokens", str(o.max_tokens), "--max-num-seqs", str(o.max_num_seqs),
                "--device", o.device]
        for flag, value in (("--max-model-len", o.max_model_len),
                            ("--marconi-min-tokens", o.marconi_min_tokens),
                            ("--carry-slots", o.carry_slots), ("--carry-memory", o.carry_memory),
                            ("--carry-host-memory", o.carry_host_memory),
                            ("--carry-row-dtype", o.carry_row_dtype),
                            ("--carry-eviction", o.carry_eviction), ("--carry-idle-s", o.carry_idle_s),
                            ("--carry-share", o.carry_share), ("--idle-timeout-s", self.idle_timeout_s)):
            if value is not None:
                args += [flag, str(value)]
        if not self.kv_events:
            args += ["--no-kv-events"]
        return args


@dataclass
class WorkerProcess:
    """One started worker: its process, system (metrics) port and log."""

    index: int
    process: subprocess.Popen[bytes]
    system_port: int
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.system_port}/metrics"


def free_port(low: int = 20000, high: int = 32767) -> int:
    """A loopback port in [low, high] free right now. Dynamo reads `DYN_SYSTEM_PORT` as an
    i16, so a worker's system port must stay below 32768 (the kernel's picks do not)."""
    import random

    for port in random.sample(range(low, high + 1), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise DeploymentError(f"no free loopback port in [{low}, {high}]")


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode("utf-8", "replace")
    except OSError:
        return 0, ""


class DynamoDeployment:
    """Frontend + workers of one `DynamoSpec`; `start()`, `wait_ready()`, `stop()` (or `with`)."""

    def __init__(self, spec: DynamoSpec, python: str | None = None) -> None:
        require_dynamo()
        self.spec = spec
        self.python = python or sys.executable
        self.workdir = Path(tempfile.mkdtemp(prefix="mtp-carry-dynamo-"))
        self.frontend: subprocess.Popen[bytes] | None = None
        self.workers: list[WorkerProcess] = []
        self._next_index = 0
        self.model_dir = self.workdir / "model"

    # ---- lifecycle ----

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "HOME": str(self.workdir / "home"), "HF_HUB_OFFLINE": "1",
            "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(self.workdir / "discovery"),
            "DYN_REQUEST_PLANE": "tcp", "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",
        })
        env.pop("DYN_SYSTEM_ENABLED", None)
        return env

    def start(self) -> None:
        """Start the frontend and the workers (not yet ready; each worker writes the model
        directory from its engine before it registers)."""
        (self.workdir / "home").mkdir()
        (self.workdir / "discovery").mkdir()
        log = self.workdir / "frontend.log"
        self.frontend = subprocess.Popen(
            [self.python, "-m", "dynamo.frontend", *self.spec.frontend_args()],
            env=self.env(), stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        for _ in range(self.spec.workers):
            self.add_worker()

    def add_worker(self) -> WorkerProcess:
        """Start one more worker (also after a failover); `wait_ready` waits for it too."""
        index = self._next_index
        self._next_index += 1
        port = free_port()
        env = self.env()
        env["DYN_SYSTEM_PORT"] = str(port)
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.spec.workers))
        log = self.workdir / f"worker{index}.log"
        process = subprocess.Popen(
            [self.python, "-m", "trtllm_mtp_carry.serve.dynamo.worker",
             *self.spec.worker_args(str(self.model_dir))],
            env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        worker = WorkerProcess(index, process, port, log)
        self.workers.append(worker)
        return worker

    def live_workers(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.process.poll() is None]

    def registered(self) -> int:
        """Workers registered in discovery now (their `generate` endpoint instances)."""
        folder = self.workdir / "discovery" / "v1" / "instances"
        if not folder.is_dir():
            return 0
        return sum(1 for p in folder.iterdir() if "%2Fgenerate%2F" in p.name)

    def wait_ready(self, timeout_s: float = 300.0, on_poll: Callable[[], object] | None = None) -> None:
        """Until every live worker is registered and healthy and the frontend lists the model;
        DeploymentError (with the log's tail) if a process exits or time runs out. `on_poll` is
        called after each check that found it not ready yet (`serve --dynamo`'s progress bar)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            live = self.live_workers()
            healthy = all(_get(f"http://127.0.0.1:{w.system_port}/health")[0] == 200 for w in live)
            status, body = _get(f"{self.spec.base_url}/models")
            listed = status == 200 and any(m.get("id") == self.spec.name
                                           for m in json.loads(body).get("data", []))
            if healthy and listed and self.registered() >= len(live):
                return
            if time.monotonic() > deadline:
                raise DeploymentError(f"not ready after {timeout_s:.0f} s (workers healthy: {healthy}, "
                                      f"model listed: {listed}, registered: {self.registered()}/"
                                      f"{len(live)}); logs in {self.workdir}")
            if on_poll is not None:
                on_poll()
            time.sleep(0.2)

    def _check_alive(self) -> None:
        if self.frontend is not None and self.frontend.poll() is not None:
            raise DeploymentError(f"the Dynamo frontend exited with status {self.frontend.returncode}:\n"
                                  f"{self.log_tail(self.workdir / 'frontend.log')}")
        if not self.live_workers():
            last = self.workers[-1] if self.workers else None
            tail = self.log_tail(last.log_path) if last else ""
            raise DeploymentError(f"no worker is running:\n{tail}")

    @staticmethod
    def log_tail(path: Path, lines: int = 20) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def signal_worker(self, index: int, sig: int) -> None:
        """Send `sig` to worker `index`'s process (SIGKILL/SIGTERM: failover)."""
        worker = next(w for w in self.workers if w.index == index)
        if worker.process.poll() is None:
            worker.process.send_signal(sig)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every process group, SIGKILL what outlives `timeout_s`; remove the workdir."""
        processes = [w.process for w in self.workers]
        if self.frontend is not None:
            processes.append(self.frontend)
        for p in processes:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in processes:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(5)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> DynamoDeployment:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the process's own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
