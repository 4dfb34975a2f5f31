"""Dynamo's frontend, N carry workers and an event broker, started, watched and stopped as one deployment.

What it is for: `trtllm-mtp-carry serve --dynamo` and the tests. A
`DynamoDeployment` starts the event broker (`event_broker`),
`python -m dynamo.frontend` (OpenAI API on `http_host:http_port`, the router
mode, session affinity and request migration of its `DynamoSpec`) and N workers
(`python -m trtllm_mtp_carry.serve.dynamo.worker`), waits until every worker
is registered and the model is listed, watches them (`supervise`) and stops them all.

Ownership and invariants:
- Every deployment has its own working directory (a fresh file-discovery
  directory, so no stale entry of an earlier run is routed to; the model
  directory; `HOME`, where the frontend caches model cards; the logs), removed
  on `stop()` (kept with `stop(remove=False)`, for `error_lines()`).
- Every socket it opens binds to `spec.http_host` (127.0.0.1 unless asked):
  the frontend's HTTP port, each process's request and response planes
  (`DYN_TCP_RPC_HOST`, `DYN_TCP_RESPONSE_STREAM_HOST`), each worker's system
  (metrics) server, the event broker's two ports (Dynamo's ZMQ publishers
  connect to it instead of binding 0.0.0.0 themselves) and the launcher's
  status server (`StatusServer`); each worker's `carry` endpoint shares its request
  plane, its carry client's response stream binds `--host` too, and NIXL moves
  carried rows on shared memory (no socket) unless `--host` is another address
  (`--transfer-host`: UCX confined to that address's interface). docs/DYNAMO.md
  lists them.
- `stop()` writes `<workdir>/stopping` before it signals the workers: every worker
  stops, so none hands its carried rows to peers that stop too (a single worker's
  SIGTERM still does: `carry_peers`).
- Readiness never asks a worker's `/health` (it answers 503 until the worker
  registers, and Dynamo logs each 503 as an ERROR): a worker is ready when its
  `generate` instance is in the discovery directory, the deployment when every
  live worker is and the frontend lists the model.
- Under `supervise()`, a worker that dies is reported once (its index, pid, exit
  status) and, by `on_worker_death="restart"`, restarted in its slot after a
  backoff (1 s, doubling, at most 30 s), at most `worker_restarts` times per
  slot; its discovery entries are removed at once, so the router stops sending
  to it. When a slot's restarts are spent, at the first death under `"exit"`, or
  when the frontend or the broker dies, `failure` names the process (one line,
  passed to `on_failure`, by default `on_event`) and `failed` is set; `serve --dynamo`
  then stops and prints it once, as its error line.
- Each process runs in its own process group; `stop()` sends SIGTERM to
  every group, waits, then SIGKILLs what is left. Nothing outside the
  deployment is ever signalled.
- With N workers on a machine, each worker's torch gets cores // N threads
  unless `OMP_NUM_THREADS` is set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...metrics import serve_http
from ..options import ServeOptions
from . import require_dynamo
from .event_broker import broker_url

ROUTER_MODES = ("kv", "round-robin", "random", "least-loaded", "power-of-two")
"""The frontend's router modes offered here (`--router-mode`)."""

ON_WORKER_DEATH = ("restart", "exit")
"""What the supervisor does when a worker dies (`--on-worker-death`)."""

DEFAULT_MODEL_NAME = "mtp-carry"

_WILDCARD_HOSTS = ("0.0.0.0", "")
"""`--host` values that bind every interface (reached on loopback from this host)."""

DEFAULT_MIGRATION_LIMIT = 3
"""Dynamo's `--migration-limit` for `serve --dynamo`: a stream cut by a dead worker is resent
(prompt plus the tokens already streamed) to a live worker up to this many times. Dynamo's own
default is 0 (a cut stream fails: "Migration limit exhausted")."""

KNOWN_SHUTDOWN_ERRORS = (
    "monitor_instance_source: The Sender is dropped",
    "Failed to send file watch event",
    "Brokered KV membership task ended unexpectedly",
)
"""ERROR lines Dynamo 1.6.1 itself logs while a process shuts down (its discovery watchers and
the frontend's KV membership task see their channels close); `error_lines()` leaves them out
only after that process logged `Runtime shutdown initiated`; docs/DYNAMO.md names them."""

SHUTDOWN_MARK = "Runtime shutdown initiated"

STOPPING_FILE = "stopping"
"""Written in the deployment's directory before `stop()` signals the workers: every worker stops, so
none offers its carried entries to peers that stop too (a single worker's SIGTERM still does)."""

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0


class DeploymentError(RuntimeError):
    """A process of the deployment failed to start or exited; the message has its log tail."""


@dataclass(frozen=True)
class DynamoSpec:
    """What to deploy: the workers' model options, the frontend's routing and migration,
    where every socket binds, and what happens when a worker dies."""

    workers: int = 2
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    name: str = DEFAULT_MODEL_NAME
    router_mode: str = "kv"
    session_affinity: bool = True
    affinity_ttl_s: int = 600
    affinity_mode: str = "soft"  # hard pins a migrated stream to its dead worker (fails: 503)
    kv_events: bool = True
    idle_timeout_s: float | None = 600.0
    migration_limit: int = DEFAULT_MIGRATION_LIMIT
    on_worker_death: str = "restart"
    worker_restarts: int = 3
    status_port: int | None = None  # the launcher's /health and /metrics (None: none)
    options: ServeOptions = field(default_factory=ServeOptions)
    carry_moves: bool = True  # entries follow their sessions between workers (NIXL; the nixl extra)
    pull_budget_ms: int = 1000  # how long a turn may wait for its entry from a peer
    drain_s: int = 10  # how long a planned stop may spend handing entries to peers
    carry_digests: bool = False  # each turn reports the digest of the rows it deposited

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
        if isinstance(self.migration_limit, bool) or not isinstance(self.migration_limit, int) \
                or not 0 <= self.migration_limit <= 100:
            raise ValueError(f"migration limit must be an int in [0, 100], got {self.migration_limit!r}")
        if self.on_worker_death not in ON_WORKER_DEATH:
            raise ValueError(f"on worker death must be one of {', '.join(ON_WORKER_DEATH)}, "
                             f"got {self.on_worker_death!r}")
        if isinstance(self.worker_restarts, bool) or not isinstance(self.worker_restarts, int) \
                or self.worker_restarts < 0:
            raise ValueError(f"worker restarts must be an int >= 0, got {self.worker_restarts!r}")
        for name in ("pull_budget_ms", "drain_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name.replace('_', ' ')} must be a positive int, got {value!r}")
        if ":" in self.http_host:  # the sockets (free_port), URLs and broker addresses are IPv4's
            raise ValueError(f"host must be an IPv4 address or a host name, got {self.http_host!r}")

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (`.../v1`), as a client on this host reaches it."""
        return f"http://{self.connect_host}:{self.http_port}/v1"

    @property
    def connect_host(self) -> str:
        """Where a process on this host reaches a socket bound to `http_host` (a wildcard
        address is reached on loopback)."""
        return "127.0.0.1" if self.http_host in _WILDCARD_HOSTS else self.http_host

    def frontend_args(self) -> list[str]:
        args = ["--http-host", self.http_host, "--http-port", str(self.http_port),
                "--discovery-backend", "file", "--request-plane", "tcp",
                "--router-mode", self.router_mode, "--migration-limit", str(self.migration_limit)]
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
                            ("--restore-threshold", o.marconi_min_tokens),
                            ("--carry-slots", o.carry_slots), ("--carry-memory", o.carry_memory),
                            ("--carry-host-memory", o.carry_host_memory),
                            ("--carry-row-dtype", o.carry_row_dtype),
                            ("--carry-eviction", o.carry_eviction), ("--carry-idle-s", o.carry_idle_s),
                            ("--carry-share", o.carry_share), ("--idle-timeout-s", self.idle_timeout_s)):
            if value is not None:
                args += [flag, str(value)]
        if not self.kv_events:
            args += ["--no-kv-events"]
        if self.carry_moves:
            args += ["--transfer-host", self.http_host, "--carry-pull-budget-ms", str(self.pull_budget_ms),
                     "--carry-drain-s", str(self.drain_s),
                     "--stopping-file", str(Path(model_dir).parent / STOPPING_FILE)]
            args += ["--carry-digests"] if self.carry_digests else []
        else:
            args += ["--no-carry-moves"]
        return args


@dataclass
class WorkerProcess:
    """One started worker: its slot, process, ports and log. A restarted worker is a new
    WorkerProcess in the same slot (`index`), `generation` one higher."""

    index: int
    process: subprocess.Popen[bytes]
    system_port: int
    rpc_port: int
    log_path: Path
    host: str = "127.0.0.1"
    generation: int = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.system_port}/metrics"


def free_port(low: int = 20000, high: int = 32767, host: str = "127.0.0.1") -> int:
    """A port in [low, high] free on `host` right now. Dynamo reads `DYN_SYSTEM_PORT` as an
    i16, so a worker's system port must stay below 32768 (the kernel's picks do not)."""
    import random

    for port in random.sample(range(low, high + 1), 200):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise DeploymentError(f"no free port on {host} in [{low}, {high}]")


def _get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode("utf-8", "replace")
    except OSError:
        return 0, ""


def exit_text(returncode: int) -> str:
    """`exit status N`, or `killed by SIGKILL` for a signal."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


class DynamoDeployment:
    """Broker + frontend + workers of one `DynamoSpec`; `start()`, `wait_ready()`, `supervise()`,
    `stop()` (or `with`, which does not supervise)."""

    def __init__(self, spec: DynamoSpec, python: str | None = None,
                 on_event: Callable[[str], None] | None = None,
                 on_failure: Callable[[str], None] | None = None) -> None:
        require_dynamo()
        self.spec = spec
        self.python = python or sys.executable
        self.workdir = Path(tempfile.mkdtemp(prefix="mtp-carry-dynamo-"))
        self.frontend: subprocess.Popen[bytes] | None = None
        self.broker: subprocess.Popen[bytes] | None = None
        self.workers: list[WorkerProcess] = []
        self._next_index = 0
        self.model_dir = self.workdir / "model"
        self._broker_ports = (0, 0)
        self.on_event = on_event or (lambda line: print(line, flush=True))
        self.on_failure = on_failure or self.on_event  # the line naming why supervision gave up
        self.restarts = 0  # workers restarted by the supervisor
        self.deaths = 0  # worker deaths the supervisor saw
        self.failure: str | None = None  # why supervision gave up (names the process)
        self.failed = threading.Event()
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._status: StatusServer | None = None

    # ---- lifecycle ----

    def env(self) -> dict[str, str]:
        host = self.spec.http_host
        env = dict(os.environ)
        env.update({
            "HOME": str(self.workdir / "home"), "HF_HUB_OFFLINE": "1",
            "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(self.workdir / "discovery"),
            "DYN_REQUEST_PLANE": "tcp", "DYN_TCP_RPC_HOST": host,
            "DYN_TCP_RESPONSE_STREAM_HOST": host, "DYN_SYSTEM_HOST": host,
            "DYN_EVENT_PLANE": "zmq", "DYN_EVENT_PLANE_HOST": host,
            "DYN_ZMQ_BROKER_URL": broker_url(self.spec.connect_host, *self._broker_ports),
            "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0",
        })
        env.pop("DYN_SYSTEM_ENABLED", None)
        env.pop("DYN_ZMQ_BROKER_ENABLED", None)
        return env

    def start(self) -> None:
        """Start the broker, the frontend and the workers (not yet ready; each worker writes the
        model directory from its engine before it registers)."""
        (self.workdir / "home").mkdir()
        (self.workdir / "discovery").mkdir()
        host = self.spec.http_host
        xsub = free_port(host=host)
        xpub = free_port(host=host)
        while xpub == xsub:
            xpub = free_port(host=host)
        self._broker_ports = (xsub, xpub)
        log = self.workdir / "broker.log"
        self.broker = subprocess.Popen(
            [self.python, "-m", "trtllm_mtp_carry.serve.dynamo.event_broker",
             "--xsub", f"tcp://{_zmq_host(host)}:{xsub}", "--xpub", f"tcp://{_zmq_host(host)}:{xpub}"],
            env=self.env(), stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        log = self.workdir / "frontend.log"
        self.frontend = subprocess.Popen(
            [self.python, "-m", "dynamo.frontend", *self.spec.frontend_args()],
            env=self.env(), stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        for _ in range(self.spec.workers):
            self.add_worker()
        if self.spec.status_port is not None:
            try:
                self._status = StatusServer(self, host, self.spec.status_port)
            except OSError as exc:
                raise DeploymentError(f"the status server cannot listen on {host}:{self.spec.status_port} "
                                      f"(--metrics-port): {exc}") from exc

    def add_worker(self) -> WorkerProcess:
        """Start one more worker (also after a failover); `wait_ready` waits for it too."""
        with self._lock:
            index = self._next_index
            self._next_index += 1
            worker = self._spawn(index, 0)
            self.workers.append(worker)
        return worker

    def _spawn(self, index: int, generation: int) -> WorkerProcess:
        host = self.spec.http_host
        port, rpc = free_port(host=host), free_port(host=host)
        env = self.env()
        env["DYN_SYSTEM_PORT"] = str(port)
        env["DYN_TCP_RPC_PORT"] = str(rpc)  # names the worker's discovery entries (`_entries`)
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.spec.workers))
        log = self.workdir / f"worker{index}.log"
        process = subprocess.Popen(
            [self.python, "-m", "trtllm_mtp_carry.serve.dynamo.worker",
             *self.spec.worker_args(str(self.model_dir))],
            env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        return WorkerProcess(index, process, port, rpc, log, self.spec.connect_host, generation)

    def live_workers(self) -> list[WorkerProcess]:
        with self._lock:
            return [w for w in self.workers if w.process.poll() is None]

    def _instances(self) -> list[Path]:
        folder = self.workdir / "discovery" / "v1" / "instances"
        return list(folder.iterdir()) if folder.is_dir() else []

    def _entries(self, worker: WorkerProcess) -> list[Path]:
        """The worker's discovery entries: those whose transport is its request-plane port."""
        mark = f":{worker.rpc_port}/"
        found = []
        for path in self._instances():
            try:
                if mark in path.read_text(errors="replace"):
                    found.append(path)
            except OSError:
                continue
        return found

    def registered(self) -> int:
        """Workers registered in discovery now (their `generate` endpoint instances)."""
        return sum(1 for p in self._instances() if "%2Fgenerate%2F" in p.name)

    def worker_registered(self, worker: WorkerProcess) -> bool:
        return any("%2Fgenerate%2F" in p.name for p in self._entries(worker))

    def wait_ready(self, timeout_s: float = 300.0, on_poll: Callable[[], object] | None = None) -> None:
        """Until every live worker is registered and the frontend lists the model;
        DeploymentError (with the log's tail) if a process exits or time runs out. `on_poll` is
        called after each check that found it not ready yet (`serve --dynamo`'s progress bar).
        Never polls a worker's `/health` (see the module's invariants)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            live = self.live_workers()
            registered = sum(self.worker_registered(w) for w in live)
            status, body = _get(f"{self.spec.base_url}/models")
            listed = status == 200 and any(m.get("id") == self.spec.name
                                           for m in json.loads(body).get("data", []))
            if listed and registered == len(live):
                return
            if time.monotonic() > deadline:
                raise DeploymentError(f"not ready after {timeout_s:.0f} s (model listed: {listed}, "
                                      f"registered: {registered}/{len(live)}); logs in {self.workdir}")
            if on_poll is not None:
                on_poll()
            time.sleep(0.2)

    def _dead_core(self) -> list[tuple[str, subprocess.Popen[bytes], str]]:
        """The frontend and the broker, those that exited: (name, process, log file name). Either
        one dying ends the deployment (no restart)."""
        return [(name, p, log) for name, p, log in (("the Dynamo frontend", self.frontend, "frontend.log"),
                                                    ("the event broker", self.broker, "broker.log"))
                if p is not None and p.poll() is not None]

    def _check_alive(self) -> None:
        for name, process, log in self._dead_core():
            raise DeploymentError(f"{name} exited ({exit_text(process.returncode)}):\n"
                                  f"{self.log_tail(self.workdir / log)}")
        if not self.live_workers() and not self._supervising():
            last = self.workers[-1] if self.workers else None
            tail = self.log_tail(last.log_path) if last else ""
            raise DeploymentError(f"no worker is running:\n{tail}")

    @staticmethod
    def log_tail(path: Path, lines: int = 20) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def error_lines(self, include_known: bool = False) -> list[str]:
        """Every line logged at level ERROR by any process of the deployment (`log: line`),
        less Dynamo's own `KNOWN_SHUTDOWN_ERRORS` logged after that process's shutdown began,
        unless `include_known`."""
        found = []
        for path in sorted(self.workdir.glob("*.log")):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            shutting = False
            for line in text.splitlines():
                plain = _strip_ansi(line)
                shutting = shutting or SHUTDOWN_MARK in plain
                if " ERROR " not in f" {plain} " and "ERROR:" not in plain:
                    continue
                if not include_known and shutting and any(k in plain for k in KNOWN_SHUTDOWN_ERRORS):
                    continue
                found.append(f"{path.name}: {plain}")
        return found

    def signal_worker(self, index: int, sig: int) -> None:
        """Send `sig` to worker `index`'s process (SIGKILL/SIGTERM: failover)."""
        worker = next(w for w in self.workers if w.index == index)
        if worker.process.poll() is None:
            worker.process.send_signal(sig)

    # ---- supervision ----

    def supervise(self, interval_s: float = 0.2) -> None:
        """Watch every process from a thread until `stop()` (see the module's invariants)."""
        if self._supervisor is None:
            self._supervisor = threading.Thread(target=self._watch, args=(interval_s,),
                                                name="mtp-carry-dynamo-supervisor", daemon=True)
            self._supervisor.start()

    def _supervising(self) -> bool:
        return self._supervisor is not None and not self.failed.is_set()

    def _give_up(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            self.on_failure(reason)
            self.failed.set()

    def _watch(self, interval_s: float) -> None:
        pending: dict[int, float] = {}  # slot -> when to restart it
        attempts: dict[int, int] = {}  # slot -> restarts so far
        seen: set[int] = set()  # pids already reported dead
        while not self._stopping.wait(interval_s) and not self.failed.is_set():
            for name, process, _ in self._dead_core():
                if not self._stopping.is_set():
                    self._give_up(f"{name} (pid {process.pid}) died: {exit_text(process.returncode)}; "
                                  "stopping the deployment")
            with self._lock:
                workers = list(self.workers)
            for w in workers:
                if w.pid in seen or w.process.poll() is None or self._stopping.is_set():
                    continue
                seen.add(w.pid)
                self.deaths += 1
                for path in self._entries(w):  # the router stops sending to it now
                    path.unlink(missing_ok=True)
                status = exit_text(w.process.returncode)
                done = attempts.get(w.index, 0)
                if self.spec.on_worker_death == "exit":
                    self._give_up(f"worker {w.index} (pid {w.pid}) died: {status}; "
                                  "--on-worker-death exit: stopping the deployment")
                elif done >= self.spec.worker_restarts:
                    self._give_up(f"worker {w.index} (pid {w.pid}) died: {status}; its restarts are spent "
                                  f"(--worker-restarts {self.spec.worker_restarts}): stopping the deployment")
                else:
                    delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** done)
                    attempts[w.index] = done + 1
                    pending[w.index] = time.monotonic() + delay
                    self.on_event(f"worker {w.index} (pid {w.pid}) died: {status}; restarting it in "
                                  f"{delay:g} s (restart {done + 1} of {self.spec.worker_restarts})")
            now = time.monotonic()
            for slot, when in list(pending.items()):
                if now < when or self._stopping.is_set() or self.failed.is_set():
                    continue
                del pending[slot]
                with self._lock:
                    i = next(i for i, w in enumerate(self.workers) if w.index == slot)
                    new = self._spawn(slot, self.workers[i].generation + 1)
                    self.workers[i] = new
                    self.restarts += 1
                self.on_event(f"worker {slot} restarted: pid {new.pid}, metrics {new.metrics_url}")

    def health(self) -> dict[str, object]:
        """What the status server's `/health` answers: workers alive (running), registered,
        configured; restarts and deaths so far; `status` healthy / degraded / failed."""
        live = self.live_workers()
        registered = sum(self.worker_registered(w) for w in live)
        status = ("failed" if self.failed.is_set()
                  else "healthy" if registered == len(live) == self.spec.workers else "degraded")
        return {"status": status, "workers_configured": self.spec.workers, "workers_alive": len(live),
                "workers_registered": registered, "worker_restarts": self.restarts,
                "worker_deaths": self.deaths, "failure": self.failure}

    # ---- stop ----

    def stop(self, timeout_s: float = 15.0, remove: bool = True) -> None:
        """SIGTERM every process group (workers, frontend, broker), SIGKILL what outlives
        `timeout_s`; remove the workdir (its logs too) unless `remove` is False."""
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(5)
        if self._status is not None:
            self._status.close()
        with self._lock:
            workers = [w.process for w in self.workers]
        (self.workdir / STOPPING_FILE).touch()
        deadline = time.monotonic() + timeout_s
        # the workers first (a frontend stopped before them logs Dynamo's KNOWN_SHUTDOWN_ERRORS
        # more often, measured), the broker last (events flow until the others stop)
        for group in (workers, [self.frontend], [self.broker]):
            processes = [p for p in group if p is not None]
            for p in processes:
                _signal_group(p, signal.SIGTERM)
            for p in processes:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(p, signal.SIGKILL)
                    p.wait(5)
        if remove:
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


class StatusServer:
    """The launcher's own `/health` (JSON of `DynamoDeployment.health`; HTTP 200 when healthy,
    503 otherwise) and `/metrics` (Prometheus text: `mtp_carry_dynamo_workers{state=configured|
    alive|registered}`, `mtp_carry_dynamo_worker_restarts_total`, `mtp_carry_dynamo_worker_deaths_total`),
    on `host:port` from a daemon thread."""

    def __init__(self, deployment: DynamoDeployment, host: str, port: int) -> None:
        def answer(path: str) -> tuple[int, str, str]:
            health = deployment.health()
            if path == "/health":
                return 200 if health["status"] == "healthy" else 503, "application/json", json.dumps(health)
            if path == "/metrics":
                return 200, "text/plain; version=0.0.4", status_metrics(health)
            return 404, "text/plain", "not found: try /health or /metrics\n"

        self.server = serve_http(host, port, "mtp-carry-dynamo-status", answer)
        self.port = int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def status_metrics(health: dict[str, object]) -> str:
    """The status server's Prometheus text for one `health()` answer."""
    lines = ["# HELP mtp_carry_dynamo_workers Dynamo workers of this deployment, by state "
             "(configured, alive: process running, registered: serving)",
             "# TYPE mtp_carry_dynamo_workers gauge"]
    for state in ("configured", "alive", "registered"):
        lines.append(f'mtp_carry_dynamo_workers{{state="{state}"}} {health[f"workers_{state}"]}')
    lines += ["# HELP mtp_carry_dynamo_worker_restarts_total Workers restarted after they died",
              "# TYPE mtp_carry_dynamo_worker_restarts_total counter",
              f"mtp_carry_dynamo_worker_restarts_total {health['worker_restarts']}",
              "# HELP mtp_carry_dynamo_worker_deaths_total Worker processes that died (any exit "
              "the launcher did not ask for)",
              "# TYPE mtp_carry_dynamo_worker_deaths_total counter",
              f"mtp_carry_dynamo_worker_deaths_total {health['worker_deaths']}"]
    return "\n".join(lines) + "\n"


def _zmq_host(host: str) -> str:
    return "*" if host in _WILDCARD_HOSTS else host


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _strip_ansi(line: str) -> str:
    return _ANSI.sub("", line)


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the process's own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
