"""The `triton-repo` and `serve` subcommands (registered by `trtllm_mtp_carry.cli`).

`serve --dynamo` serves behind NVIDIA Dynamo instead (`serve.dynamo.cli`).
`triton-repo DIR` writes a model repository; `serve` writes one into a
temporary directory (or takes `--repository DIR`), starts `tritonserver` on
loopback with the given ports, waits for the model, prints the endpoints and
stops the server (its whole process group) on Ctrl-C or SIGTERM. Errors are
one line, `trtllm-mtp-carry: error: ...`, exit status 2; the server's log is
kept (`--log-file`, default a file in the temp directory; its path is printed).

While serving, `serve` watches the backend stubs: when one dies (Triton 2.51
keeps the model "ready" and leaves that instance's requests unanswered), it
says which instance died, stops the server (so every client in flight gets an
error and readiness fails) and exits 2; restarting `serve` recovers.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..argtypes import carry_host_memory_size, carry_memory_size, non_negative_int, positive_int
from ..cli_error import fail
from ..core.row_format import ROW_DTYPES
from ..progress import progress
from .dynamo.cli import add_dynamo_flags, cmd_serve_dynamo
from .options import ENGINES, POLICIES, ServeOptions, carry_options
from .triton.repo import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CANDIDATE_SEQUENCES,
    DEFAULT_MODEL_NAME,
    RepoSpec,
)

if TYPE_CHECKING:
    from .trtllm.repo import TrtllmRepoSpec

TRTLLM_ENGINE = "trtllm"  # TensorRT-LLM's model (trtllm_mtp_carry/serve/trtllm/model.py)


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
                   help="a session with no request in flight for this long ends and its carried rows "
                   "are freed (default %(default)s)")
    p.add_argument("--max-turn-s", type=positive_int, default=d.max_turn_s,
                   help="a turn unfinished this long after it arrived is cancelled with an error "
                   "(default %(default)s)")
    p.add_argument("--max-sessions", dest="max_candidate_sequences", type=positive_int,
                   default=DEFAULT_MAX_CANDIDATE_SEQUENCES, metavar="N",
                   help="open sessions per instance (Triton's max_candidate_sequences); a START beyond "
                   "it waits until a session ends, or until the request's timeout (default %(default)s)")
    p.add_argument("--engine", choices=(*ENGINES, TRTLLM_ENGINE), default=d.engine,
                   help="reference (this package's engine) or trtllm (TensorRT-LLM with the carry attached)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="--engine trtllm: the checkpoint directory (or model name) LLM(model=...) loads")
    p.add_argument("--llm-options", default=None, metavar="YAML",
                   help="--engine trtllm: LLM(**options) keywords, as TensorRT-LLM's extra_llm_api_options "
                   "YAML, with an optional mtp_carry section (enable, carry_slots, carry_memory)")
    p.add_argument("--policy", choices=POLICIES, default=d.drafter_policy, help="default drafter policy")
    p.add_argument("--draft-len", type=non_negative_int, default=d.draft_len)
    p.add_argument("--max-tokens", type=positive_int, default=d.max_tokens,
                   help="max_tokens of a request that sends none (default %(default)s)")
    p.add_argument("--max-model-len", type=positive_int, default=None)
    p.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs)
    p.add_argument("--restore-threshold", dest="serve_marconi_min_tokens",
                   type=non_negative_int, default=None, metavar="N",
                   help="the model's SSM restore threshold (pinned in each instance); default env "
                   "TRTLLM_MTP_CARRY_MARCONI_MIN_TOKENS, else 256")
    p.add_argument("--carry-slots", dest="serve_carry_slots", type=positive_int, default=None,
                   metavar="N", help="carry slots per instance (pinned in each instance); default env "
                   "TRTLLM_MTP_CARRY_SLOTS, else no cap")
    p.add_argument("--carry-memory", dest="serve_carry_memory", type=carry_memory_size, default=None,
                   metavar="SIZE", help="carry budget per instance: 4GiB, 512MiB or a drafter pool "
                   "fraction like 0.5; default env TRTLLM_MTP_CARRY_MEMORY, else the whole pool")
    p.add_argument("--carry-host-memory", dest="serve_carry_host_memory", type=carry_host_memory_size,
                   default=None, metavar="SIZE", help="host tier per instance: entries evicted from the "
                   "carry budget wait in this much host memory (8GiB); default env "
                   "TRTLLM_MTP_CARRY_HOST_MEMORY, else 0: none")
    p.add_argument("--carry-row-dtype", dest="serve_carry_row_dtype", choices=ROW_DTYPES, default=None,
                   help="how each instance stores carried rows (fp8: about half the bytes of bf16; nvfp4: "
                   "0.28x at head_dim 256); default env "
                   "TRTLLM_MTP_CARRY_ROW_DTYPE, else bf16")
    p.add_argument("--device", default=d.device)
    # The settings flags of this process stay unset: these options pin each served instance. A carry
    # option not given takes its TRTLLM_MTP_CARRY_* variable (serve.options.carry_options), written
    # into the model's parameters with the other carry variables (eviction, idle TTL, sharing).
    p.set_defaults(marconi_min_tokens=None, mtp_max_seqs=None, carry_slots=None)


def _spec(args: argparse.Namespace) -> RepoSpec | TrtllmRepoSpec:
    if args.engine == TRTLLM_ENGINE:
        return _trtllm_spec(args)
    if args.model is not None or args.llm_options is not None:
        raise ValueError("--model and --llm-options are options of --engine trtllm")
    options = ServeOptions(
        engine=args.engine, drafter_policy=args.policy, draft_len=args.draft_len,
        **carry_options(args), max_model_len=args.max_model_len, max_tokens=args.max_tokens,
        max_num_seqs=args.max_num_seqs, device=args.device, max_turn_s=args.max_turn_s,
    )
    return RepoSpec(name=args.name, instances=args.instances, idle_timeout_s=args.idle_timeout_s,
                    max_candidate_sequences=args.max_candidate_sequences, options=options)


def _trtllm_spec(args: argparse.Namespace) -> TrtllmRepoSpec:
    from .trtllm.repo import trtllm_spec

    for flag, value, where in (("--carry-slots", args.serve_carry_slots, "carry_slots in the mtp_carry section"),
                               ("--carry-host-memory", args.serve_carry_host_memory,
                                "carry_host_memory in the mtp_carry section"),
                               ("--carry-row-dtype", args.serve_carry_row_dtype,
                                "carry_row_dtype in the mtp_carry section"),
                               ("--max-model-len", args.max_model_len, "max_seq_len"),
                               ("--restore-threshold", args.serve_marconi_min_tokens, None)):
        if value is not None:
            raise ValueError(f"{flag} is a reference-engine option; with --engine trtllm "
                             + (f"set {where} in --llm-options" if where else "it does not apply"))
    return trtllm_spec(args.name, args.model, args.llm_options, args.idle_timeout_s, args.max_tokens,
                       args.instances, args.max_turn_s, args.max_candidate_sequences)


def _write(directory: str, spec: RepoSpec | TrtllmRepoSpec) -> Path:
    from .triton.repo import write_repository

    if isinstance(spec, RepoSpec):
        return write_repository(directory, spec)
    from .trtllm.repo import write_trtllm_repository

    return write_trtllm_repository(directory, spec)


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
    serve.add_argument("--host", default="127.0.0.1", help="listen address of every socket the server "
                       "opens (default %(default)s: loopback only)")
    serve.add_argument("--http-port", type=_port, default=8000)
    serve.add_argument("--grpc-port", type=_port, default=8001)
    serve.add_argument("--metrics-port", type=_port, default=8002)
    serve.add_argument("--ready-timeout-s", type=float, default=300.0)
    serve.add_argument("--exit-timeout-s", type=positive_int, default=3, metavar="S",
                       help="on Ctrl-C or SIGTERM, turns still running get this long before the server "
                       "exits (open sessions never delay it longer; default %(default)s)")
    serve.add_argument("--log-file", default=None, metavar="PATH",
                       help="tritonserver's log, kept after it stops (default: "
                       "trtllm-mtp-carry-serve-<time>-<pid>.log in the temp directory)")
    _add_model_flags(serve)
    add_dynamo_flags(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_triton_repo(args: argparse.Namespace) -> int:
    try:
        model_dir = _write(args.directory, _spec(args))
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    print(f"wrote {model_dir}/config.pbtxt and {model_dir}/1/model.py")
    return 0


def _log_file(args: argparse.Namespace) -> Path:
    if args.log_file is not None:
        return Path(args.log_file).resolve()
    stamp = time.strftime("%Y%m%dT%H%M%S")
    return Path(tempfile.gettempdir()) / f"trtllm-mtp-carry-serve-{stamp}-{os.getpid()}.log"


def cmd_serve(args: argparse.Namespace) -> int:
    if args.dynamo:
        return cmd_serve_dynamo(args)
    from .triton.server import Endpoints, ServeError, TritonServer, find_tritonserver

    try:
        spec = _spec(args)
        binary = find_tritonserver(args.tritonserver)
    except (ValueError, ServeError) as exc:
        return fail(str(exc))
    if args.repository is not None and not Path(args.repository).is_dir():
        return fail(f"--repository {args.repository}: no such directory")
    with tempfile.TemporaryDirectory(prefix="mtp-carry-repo-") as tmp:
        repository = args.repository
        if repository is None:
            repository = tmp
            _write(repository, spec)
        endpoints = Endpoints(args.host, args.http_port, args.grpc_port, args.metrics_port)
        server = TritonServer(repository, endpoints, binary=binary, log_path=_log_file(args),
                              exit_timeout_s=args.exit_timeout_s)
        stop = threading.Event()
        grace_s = None  # stop()'s default: the exit timeout and 5 s
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            server.start()
            with progress(None, "waiting for tritonserver", "check") as bar:  # a terminal only
                server.wait_ready([spec.name], args.ready_timeout_s, on_poll=bar.update)
            stubs = server.stubs()
            print(f"serving model {spec.name!r} from {repository}\n"
                  f"  HTTP    {endpoints.http}\n  gRPC    {endpoints.grpc}\n  metrics {endpoints.metrics}\n"
                  f"  log     {server.log_path}\nCtrl-C stops the server.", flush=True)
            while not stop.wait(0.5):
                if server.process is not None and server.process.poll() is not None:
                    cause = server.failure_cause() or "no error line in the log"
                    return fail(f"tritonserver exited with status {server.process.returncode}: {cause} "
                                 f"(log: {server.log_path})")
                alive = server.stubs()
                dead = sorted(name for pid, name in stubs.items() if pid not in alive)
                if dead:
                    grace_s = args.exit_timeout_s + 1.0  # its requests never finish: no need to wait longer
                    return fail(f"model instance {', '.join(dead)} died (its backend stub is gone): its "
                                 "sessions and requests in flight are lost; stopping the server, restart "
                                 f"serve to recover (log: {server.log_path})")
        except ServeError as exc:
            return fail(str(exc))
        finally:
            server.stop(grace_s)
            if server.killed:
                print("tritonserver did not exit after its exit timeout: killed it", file=sys.stderr)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    print(f"server stopped (log: {server.log_path})")
    return 0
