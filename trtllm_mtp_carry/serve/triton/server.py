"""Find, start, watch and stop a `tritonserver` process for a model repository.

What it is for: `trtllm-mtp-carry serve` and the tests start the real server
through `TritonServer`. It owns the server's process group: `stop()` (and
leaving the `with` block) signals the whole group, so the Python-backend
stubs never outlive the server. It also watches the stubs (`stubs()`): one
that dies (a crash, `kill -9`) leaves its requests without a response while
Triton 2.51 keeps reporting the model ready, so `serve` checks for it.

Stopping: Triton counts every open sequence (a session not yet ENDed) as an
inference in flight and waits `--exit-timeout-secs` for them on SIGTERM, then
exits without unloading its models, leaving the stubs' shared-memory regions
behind. So the timeout is short (`exit_timeout_s`: turns still running get
that long), and each server gets its own shared-memory prefix for the stubs'
regions (`shm_prefix`): once its process group is gone, `stop()` removes the
regions with that prefix (only this server's) that it left.

The environment it sets up (facts checked with Triton 2.51 from
`nvidia-pytriton`):
- that wheel ships the stub per Python version apart from the backend, so a
  backend directory is assembled with the stub for this interpreter;
- the stub links the system `libpython3.x`: its directory goes on
  `LD_LIBRARY_PATH` (with the wheel's own bundled libraries);
- the stub imports the first `numpy` on `PATH`'s Python: this environment's
  `bin` goes first on `PATH`.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

INSTALL_HINT = 'pip install -e ".[serve]" (nvidia-pytriton bundles tritonserver)'


class ServeError(RuntimeError):
    """The server could not be found, started or made ready (the message says why)."""


@dataclass(frozen=True)
class Endpoints:
    """Where the server listens."""

    host: str
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def http(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"


def _pytriton_dir() -> Path | None:
    spec = find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def find_tritonserver(explicit: str | Path | None = None) -> Path:
    """`explicit`, else the binary nvidia-pytriton ships, else `tritonserver` on PATH."""
    if explicit is not None:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ServeError(f"--tritonserver {str(explicit)!r} is not an executable file")
        return path
    bundled = _pytriton_dir()
    if bundled is not None and (bundled / "bin" / "tritonserver").is_file():
        return bundled / "bin" / "tritonserver"
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path)
    raise ServeError(f"no tritonserver found; install one with {INSTALL_HINT} or pass --tritonserver PATH")


def backend_directory(binary: Path, workdir: Path) -> Path:
    """The backends directory to serve with: the binary's own when it holds the Python
    backend's stub, else one assembled in `workdir` with the stub for this Python."""
    root = binary.resolve().parent.parent
    own = root / "backends"
    if (own / "python" / "triton_python_backend_stub").is_file():
        return own
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not (own / "python" / "libtriton_python.so").is_file() or not stub.is_file():
        raise ServeError(f"{binary} has no Python backend stub for Python {version}")
    target = workdir / "backends" / "python"
    target.mkdir(parents=True, exist_ok=True)
    for src in (*(own / "python").iterdir(), stub):
        dst = target / src.name
        if src.is_file() and not dst.exists():
            dst.symlink_to(src)
    return workdir / "backends"


def server_env(binary: Path) -> dict[str, str]:
    """The environment the server and its Python stubs need (see the module header)."""
    env = dict(os.environ)
    libs = [sysconfig.get_config_var("LIBDIR") or ""]
    bundled_libs = binary.resolve().parent.parent.parent.parent / "nvidia_pytriton.libs"
    if bundled_libs.is_dir():
        libs.append(str(bundled_libs))
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


STUB = "triton_python_backend_stub"


class TritonServer:
    """A running `tritonserver` on `endpoints`, serving `repository`; a context manager.

    `extra_args` go to the server as given (e.g. `--model-control-mode=explicit`).
    The log goes to `log_path` (default: a file in the work directory, removed
    with it; a path given here is kept). On SIGTERM the server waits at most
    `exit_timeout_s` for requests in flight and open sessions (module header).
    """

    def __init__(self, repository: str | Path, endpoints: Endpoints, binary: Path | None = None,
                 extra_args: Sequence[str] = (), workdir: str | Path | None = None,
                 log_path: str | Path | None = None, exit_timeout_s: int = 3) -> None:
        self.repository = Path(repository)
        self.endpoints = endpoints
        self.binary = binary or find_tritonserver()
        self.extra_args = list(extra_args)
        self.exit_timeout_s = exit_timeout_s
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="mtp-carry-triton-")
        self.workdir = Path(workdir) if workdir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        self.log_path = Path(log_path) if log_path is not None else self.workdir / "tritonserver.log"
        self.shm_prefix = f"mtp_carry_{secrets.token_hex(6)}_"  # this server's stub regions
        self.process: subprocess.Popen[bytes] | None = None
        self.killed = False  # stop() had to SIGKILL the server
        self.removed_regions: list[str] = []  # what stop() removed from /dev/shm (this server's)

    def command(self) -> list[str]:
        e = self.endpoints
        return [
            str(self.binary), f"--model-repository={self.repository}",
            f"--backend-directory={backend_directory(self.binary, self.workdir)}",
            f"--http-address={e.host}", f"--http-port={e.http_port}",
            f"--grpc-address={e.host}", f"--grpc-port={e.grpc_port}",
            f"--metrics-address={e.host}", f"--metrics-port={e.metrics_port}",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            *self.extra_args,
        ]

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            env=server_env(self.binary), start_new_session=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def failure_cause(self) -> str:
        """The log's line that says why the server failed, as one line (without
        tritonserver's timestamp prefix); '' if the log names none."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        # most specific first: a model's load error, then the server's own, then any error line
        # (but the CUDA driver notes a CPU-only machine always logs)
        for pattern in (r"failed to load '[^']*' version \d+: ", r"^error: ", r"^E\d{4} (?!.*CudaDriver)"):
            found = [line for line in lines if re.search(pattern, line)]
            if found:
                text = re.sub(r"^[EWI]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] ", "", found[0]).strip()
                # the first line of a quoted message (a Python error's traceback follows as "\n")
                return text.strip('"').split("\\n")[0].replace('\\"', '"').strip()
        return ""

    def wait_ready(self, models: Sequence[str], timeout_s: float = 180.0,
                   on_poll: Callable[[], object] | None = None) -> None:
        """Block until the server and `models` are ready; ServeError naming the cause in one
        line (the log's error line and the log's path) if the server exits or the time runs out.
        `on_poll` is called after each check that found them not ready yet (`serve`'s progress bar)."""
        deadline = time.monotonic() + timeout_s
        urls = [f"http://{self.endpoints.http}/v2/models/{m}/ready" for m in models]
        urls.insert(0, f"http://{self.endpoints.http}/v2/health/live")
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                cause = self.failure_cause() or "no error line in the log"
                raise ServeError(f"tritonserver exited before its models were ready: {cause} "
                                 f"(log: {self.log_path})")
            if all(_http_ok(u) for u in urls):
                return
            if on_poll is not None:
                on_poll()
            time.sleep(0.5)
        raise ServeError(f"tritonserver not ready after {timeout_s:.0f} s (log: {self.log_path})")

    def stubs(self) -> dict[int, str]:
        """The server's live Python-backend stubs: pid -> model instance name."""
        if self.process is None:
            return {}
        return {pid: argv[8] if len(argv) > 8 else "?"
                for pid, argv in _processes_in_group(self.process.pid) if Path(argv[0]).name == STUB}

    def regions(self) -> list[str]:
        """This server's shared-memory regions now in /dev/shm."""
        try:
            return sorted(n for n in os.listdir("/dev/shm") if n.startswith(self.shm_prefix))
        except OSError:
            return []

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM the server's process group, SIGKILL it after `grace_s` (default: the exit
        timeout and 5 s; then `killed` is set), then remove this server's shared-memory
        regions it left; idempotent."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.exit_timeout_s + 5.0 if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                self.killed = True
        if proc is not None:
            _signal_group(proc.pid, signal.SIGKILL)  # stubs left in the group, if any
            proc.wait()
            _wait_group_gone(proc.pid, 5.0)
        if proc is not None:
            for name in self.regions():  # left by an exit without unloading (module header)
                try:
                    os.unlink(f"/dev/shm/{name}")
                    self.removed_regions.append(name)
                except OSError:
                    pass
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _processes_in_group(pgid: int) -> list[tuple[int, list[str]]]:
    """(pid, argv) of every process in process group `pgid`, read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            # fields after the parenthesised command: state, ppid, pgrp, ...
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if argv and argv[0]:
            found.append((int(entry), argv))
    return found


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _processes_in_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False
