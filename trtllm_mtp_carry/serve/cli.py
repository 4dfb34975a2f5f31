"""The `triton-repo` and `serve` subcommands (registered by `trtllm_mtp_carry.cli`).

`triton-repo DIR` writes a model repository; `serve` writes one into a
temporary directory (or takes `--repository DIR`), starts `tritonserver` on
loopback with the given ports, waits for the model, prints the endpoints and
stops the server (its whole process group) on Ctrl-C or SIGTERM. Errors are
one line, `trtllm-mtp-carry: error: ...`, exit status 2.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from typing import Any

from ..argtypes import carry_memory_size, non_negative_int, positive_int
from .options import ENGINES, POLICIES, ServeOptions
from .triton.repo import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MODEL_NAME, RepoSpec


def _port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"not a port: {value}")
    return int(value)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    d = ServeOptions()
    p.add_argument("--name", default=DEFAULT_MODEL_NAME, help="model name (default %(default)s)")
    p.add_argument("--instances", type=positive_int, default=1,
                   help="model instances, each with its own engine and carry (default %(default)s)")
    p.add_argument("--idle-timeout-s", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                   help="a session idle this long ends and its carried rows are freed (default %(default)s)")
    p.add_argument("--engine", choices=ENGINES, default=d.engine)
    p.add_argument("--policy", choices=POLICIES, default=d.drafter_policy, help="default drafter policy")
    p.add_argument("--draft-len", type=non_negative_int, default=d.draft_len)
    p.add_argument("--max-tokens", type=positive_int, default=d.max_tokens,
                   help="max_tokens of a request that sends none (default %(default)s)")
    p.add_argument("--max-model-len", type=positive_int, default=None)
    p.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs)
    p.add_argument("--marconi-min-tokens", dest="serve_marconi_min_tokens",
                   type=non_negative_int, default=None, metavar="N",
                   help="the model's SSM restore threshold (pinned in each instance)")
    p.add_argument("--carry-slots", dest="serve_carry_slots", type=positive_int, default=None,
                   metavar="N", help="carry slots per instance (pinned in each instance)")
    p.add_argument("--carry-memory", dest="serve_carry_memory", type=carry_memory_size, default=None,
                   metavar="SIZE", help="carry budget per instance: 4GiB, 512MiB or a drafter pool "
                   "fraction like 0.5 (default: the whole pool)")
    p.add_argument("--device", default=d.device)
    # The settings flags of this process stay unset: these options pin each served instance.
    p.set_defaults(marconi_min_tokens=None, mtp_max_seqs=None, carry_slots=None)


def _spec(args: argparse.Namespace) -> RepoSpec:
    options = ServeOptions(
        engine=args.engine, drafter_policy=args.policy, draft_len=args.draft_len,
        marconi_min_tokens=args.serve_marconi_min_tokens, carry_slots=args.serve_carry_slots,
        carry_memory=args.serve_carry_memory,
        max_model_len=args.max_model_len, max_tokens=args.max_tokens,
        max_num_seqs=args.max_num_seqs, device=args.device,
    )
    return RepoSpec(name=args.name, instances=args.instances, idle_timeout_s=args.idle_timeout_s,
                    options=options)


def add_subcommands(sub: Any) -> None:
    """Register `triton-repo` and `serve` on the main parser's subparsers."""
    repo = sub.add_parser("triton-repo", help="write a Triton model repository serving the carry")
    repo.add_argument("directory", help="repository directory (created; the model's folder is overwritten)")
    _add_model_flags(repo)
    repo.set_defaults(func=cmd_triton_repo)

    serve = sub.add_parser("serve", help="serve the carry with tritonserver until Ctrl-C")
    serve.add_argument("--repository", default=None,
                       help="serve this repository as is (the model flags then only name the model to "
                       "wait for, --name); default: write one to a temporary directory")
    serve.add_argument("--tritonserver", default=None, metavar="PATH",
                       help="server binary (default: nvidia-pytriton's, else tritonserver on PATH)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    serve.add_argument("--http-port", type=_port, default=8000)
    serve.add_argument("--grpc-port", type=_port, default=8001)
    serve.add_argument("--metrics-port", type=_port, default=8002)
    serve.add_argument("--ready-timeout-s", type=float, default=300.0)
    _add_model_flags(serve)
    serve.set_defaults(func=cmd_serve)


def _fail(message: str) -> int:
    print(f"trtllm-mtp-carry: error: {message}", file=sys.stderr)
    return 2


def cmd_triton_repo(args: argparse.Namespace) -> int:
    from .triton.repo import write_repository

    try:
        model_dir = write_repository(args.directory, _spec(args))
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    print(f"wrote {model_dir}/config.pbtxt and {model_dir}/1/model.py")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .triton.repo import write_repository
    from .triton.server import Endpoints, ServeError, TritonServer, find_tritonserver

    try:
        spec = _spec(args)
        binary = find_tritonserver(args.tritonserver)
    except (ValueError, ServeError) as exc:
        return _fail(str(exc))
    with tempfile.TemporaryDirectory(prefix="mtp-carry-repo-") as tmp:
        repository = args.repository
        if repository is None:
            repository = tmp
            write_repository(repository, spec)
        endpoints = Endpoints(args.host, args.http_port, args.grpc_port, args.metrics_port)
        server = TritonServer(repository, endpoints, binary=binary)
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.start()
            server.wait_ready([spec.name], args.ready_timeout_s)
            print(f"serving model {spec.name!r} from {repository}\n"
                  f"  HTTP    {endpoints.http}\n  gRPC    {endpoints.grpc}\n  metrics {endpoints.metrics}\n"
                  f"  log     {server.log_path}\nCtrl-C stops the server.", flush=True)
            while not stop.wait(1.0):
                if server.process is not None and server.process.poll() is not None:
                    return _fail(f"tritonserver exited with status {server.process.returncode}:\n"
                                 f"{server.log_tail()}")
        except ServeError as exc:
            return _fail(str(exc))
        finally:
            server.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    print("server stopped")
    return 0
