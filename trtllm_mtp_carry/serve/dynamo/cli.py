"""`trtllm-mtp-carry serve --dynamo`: Dynamo's frontend and N carry workers until Ctrl-C.

`add_dynamo_flags` adds the Dynamo flags to the `serve` parser
(`serve.cli`); `cmd_serve_dynamo` runs the deployment: starts it with every
socket on `--host` (127.0.0.1 by default), waits until the model is listed,
prints the OpenAI base URL, the status URL and each worker's pid and metrics
URL, watches every process (a dead worker is restarted, or the deployment
stops: `--on-worker-death`, `--worker-restarts`), and stops every process on
Ctrl-C or SIGTERM. Errors are one line, `trtllm-mtp-carry: error: ...`, exit
status 2 (Dynamo missing included: the line names the extra and the
`--no-deps` install; a worker whose restarts are spent: the line names it).
"""

from __future__ import annotations

import argparse
import signal
import threading

from ...argtypes import non_negative_int, positive_int
from ...cli_error import fail
from ...progress import progress
from ..options import ServeOptions, carry_options
from .launcher import DEFAULT_MIGRATION_LIMIT


def add_dynamo_flags(p: argparse.ArgumentParser) -> None:
    """The `serve` flags of the Dynamo front end (`--host`/`--http-port` and the model
    flags are shared with Triton's)."""
    g = p.add_argument_group("Dynamo (with --dynamo)")
    g.add_argument("--dynamo", action="store_true",
                   help="serve behind NVIDIA Dynamo (OpenAI API, session-affine routing) instead of Triton")
    g.add_argument("--workers", type=positive_int, default=2, help="Dynamo workers, each with its own engine "
                   "and carry (default %(default)s)")
    g.add_argument("--router-mode", default="kv",
                   choices=("kv", "round-robin", "random", "least-loaded", "power-of-two"),
                   help="the frontend's router (default %(default)s: prefix-aware from KV events)")
    g.add_argument("--no-session-affinity", dest="session_affinity", action="store_false",
                   help="route each turn on its own (x-dynamo-session-id is then ignored)")
    g.add_argument("--affinity-ttl-s", type=positive_int, default=600,
                   help="how long an idle session stays bound to its worker (default %(default)s)")
    g.add_argument("--affinity-mode", choices=("hard", "soft"), default="soft",
                   help="soft (default): a session moves when its worker is gone, and a stream cut by "
                   "a dead worker migrates; hard: a session waits for its worker (Dynamo 1.6.1 then "
                   "fails a cut stream of a session instead of migrating it)")
    g.add_argument("--no-kv-events", dest="kv_events", action="store_false",
                   help="workers publish no KV events (kv mode then routes on load only)")
    g.add_argument("--migration-limit", type=non_negative_int, default=DEFAULT_MIGRATION_LIMIT,
                   help="a stream cut by a dead worker is resent to a live one up to this many times "
                   "(Dynamo's request migration; 0: off; default %(default)s)")
    g.add_argument("--on-worker-death", choices=("restart", "exit"), default="restart",
                   help="restart a worker that dies (default), or stop the deployment with an error")
    g.add_argument("--no-carry-moves", dest="carry_moves", action="store_false",
                   help="carried rows stay on the worker that deposited them (by default a turn that "
                   "lands on another worker pulls its session's rows from the worker holding them, and a "
                   "stopping worker hands its rows to the others, over NIXL: the nixl extra)")
    g.add_argument("--carry-pull-budget-ms", type=positive_int, default=1000,
                   help="how long a turn may wait for its session's rows from another worker "
                   "(default %(default)s)")
    g.add_argument("--carry-drain-s", type=positive_int, default=10,
                   help="how long a stopping worker may spend handing its rows to the others "
                   "(default %(default)s)")
    g.add_argument("--worker-restarts", type=non_negative_int, default=3,
                   help="restarts per worker before the deployment stops with an error naming it "
                   "(backoff 1 s, doubling; default %(default)s)")


def _moves_line(spec: object) -> str:
    """What the startup lines say about carried rows moving between workers."""
    import importlib.util

    if not getattr(spec, "carry_moves", False):
        return "off (--no-carry-moves): carried rows stay on their worker"
    if importlib.util.find_spec("nixl") is None:
        return 'off: NIXL is not installed (pip install -e ".[nixl]"); carried rows stay on their worker'
    return "carried rows follow their session to another worker (NIXL; shared memory on loopback)"


def cmd_serve_dynamo(args: argparse.Namespace) -> int:
    """Run the Dynamo deployment the `serve --dynamo` flags describe, until Ctrl-C or SIGTERM."""
    from . import DynamoMissing
    from .launcher import DeploymentError, DynamoDeployment, DynamoSpec

    if args.instances != 1:
        return fail(f"--instances={args.instances} is Triton's; with --dynamo use --workers")
    try:
        options = ServeOptions(
            engine=args.engine, drafter_policy=args.policy, draft_len=args.draft_len,
            **carry_options(args), max_model_len=args.max_model_len, max_tokens=args.max_tokens,
            max_num_seqs=args.max_num_seqs, device=args.device,
        )
        spec = DynamoSpec(
            workers=args.workers, http_host=args.host, http_port=args.http_port, name=args.name,
            router_mode=args.router_mode, session_affinity=args.session_affinity,
            affinity_ttl_s=args.affinity_ttl_s, affinity_mode=args.affinity_mode,
            kv_events=args.kv_events, idle_timeout_s=args.idle_timeout_s,
            migration_limit=args.migration_limit, on_worker_death=args.on_worker_death,
            worker_restarts=args.worker_restarts, status_port=args.metrics_port, options=options,
            carry_moves=args.carry_moves, pull_budget_ms=args.carry_pull_budget_ms, drain_s=args.carry_drain_s)
        # the failure line is this command's error line (`fail`, below): printed once, there
        deployment = DynamoDeployment(spec, on_failure=lambda line: None)
    except (ValueError, DynamoMissing) as exc:
        return fail(str(exc))
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        deployment.start()
        deployment.supervise()
        with progress(None, "waiting for Dynamo", "check") as bar:  # a terminal only
            deployment.wait_ready(args.ready_timeout_s, on_poll=bar.update)
        affinity = f"session affinity {spec.affinity_mode if spec.session_affinity else 'off'}"
        lines = [f"serving model {spec.name!r} behind Dynamo ({len(deployment.workers)} workers, "
                 f"router {spec.router_mode}, {affinity}, migration limit {spec.migration_limit})",
                 f"  OpenAI  {spec.base_url}",
                 f"  status  http://{spec.connect_host}:{args.metrics_port}/health and /metrics "
                 f"(workers alive, restarts)"]
        lines += [f"  worker {w.index}  pid {w.pid}  metrics {w.metrics_url}" for w in deployment.workers]
        lines.append(f"  moves   {_moves_line(spec)}")
        lines += [f"  logs    {deployment.workdir}", "Ctrl-C stops every process."]
        print("\n".join(lines), flush=True)
        while not stop.wait(0.5):
            if deployment.failed.is_set():
                return fail(deployment.failure or "the deployment failed")
    except DeploymentError as exc:
        return fail(str(exc))
    finally:
        deployment.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("deployment stopped", flush=True)
    return 0
