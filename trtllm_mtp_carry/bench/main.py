"""`trtllm-mtp-carry bench`: replay sessions under each policy and report side by side.

Flow: check every option (one error line naming the flag, before any model
loads) -> print the environment line -> replay the session set `--repeat`
times, all policies in lockstep (replay 0 is the warm-up) -> per-turn table,
warm-turn summary (medians [p25-p75]), paired ratios -> JSON and plot.
Ctrl-C stops the replay: what finished is summarised, marked partial, and the
command exits 130.

Each target is one driver (`driver.Driver`: sessions and policies in, the
bench's records out): in process (`replay.LocalDriver`), a running Triton
server with `--server HOST:PORT` (`triton_driver`), Dynamo's OpenAI API with
`--openai URL` (`openai_driver`); this module checks the flags once, and the
same report code prints every target. Through a server the engine's sizes
are the server's, so the flags that set them here (`SERVER_SIDE_FLAGS`) are
refused with --server and --openai rather than silently ignored.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__
from ..core import marconi_min_tokens, mtp_max_seqs, settings
from .options import (
    HOST_VARIANT,
    draft_len,
    output_path,
    positive_int,
    prefill_chunk,
    resolve_device,
    weights_dir,
)

if TYPE_CHECKING:
    from .driver import Driver, PolicyRun

DEFAULT_POLICIES = "carry,rebuild,blind,off"

SERVER_SIDE_FLAGS = ("--draft-len", "--chunk", "--drafter-blocks", "--target-blocks", "--device", "--dtype",
                     "--threads", "--weights", "--restore-threshold", "--mtp-max-seqs", "--carry-slots",
                     "--carry-memory", "--carry-host-memory", "--carry-eviction", "--carry-idle-s",
                     "--carry-share", "--carry-row-dtype")
"""Flags that size or place the engine: with --server they are the server's parameters."""


class _Given(argparse.Action):
    """Store the value and remember that the flag was typed (a default is not a choice)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        given = set(getattr(namespace, "given_flags", ()))
        given.add(self.option_strings[0])
        namespace.given_flags = given


def server_address(text: str) -> str:
    """argparse type: HOST:PORT of a Triton server's gRPC endpoint."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (the server's gRPC port), got {text!r}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's options (no torch needed to build the parser)."""
    p.add_argument("--policies", default=DEFAULT_POLICIES, metavar="LIST",
                   help="comma-separated drafter policies to compare, first is the numerator of "
                        "every ratio (carry, carry-fp8, carry-nvfp4, carry-host, rebuild, blind, paired, "
                        "off; paired models TensorRT-LLM's paired draft reuse, as its main branch pairs "
                        "a hybrid's draft pool; carry-fp8 / carry-nvfp4 are carry with its entries stored "
                        "in FP8 / NVFP4, "
                        "carry-host is carry adopting from the host tier (one device slot); all "
                        "are over carry in the ratios)")
    p.add_argument("--sessions", type=positive_int, metavar="N", default=4, help="number of built-in sessions")
    p.add_argument("--turns", type=positive_int, metavar="N", default=4,
                   help="turns per built-in session (the first is cold)")
    p.add_argument("--history", type=positive_int, metavar="N", default=1024, help="tokens of history before turn 1")
    p.add_argument("--new-span", type=positive_int, metavar="N", default=128, help="tokens each warm turn adds")
    p.add_argument("--shared-prefix", type=positive_int, metavar="N", default=None,
                   help="every built-in session starts with the same N-token system prompt "
                        "(sessions of one deployment sharing a prefix)")
    p.add_argument("--conversations", metavar="PATH.jsonl",
                   help="replay your own chat conversations ({'messages': [...]} per line) instead")
    p.add_argument("--max-new-tokens", type=positive_int, metavar="N", default=32, help="answer length cap per turn")
    p.add_argument("--draft-len", action=_Given, type=draft_len, metavar="N", default=2, help="draft tokens per verify step, 1..3")
    p.add_argument("--chunk", action=_Given, type=prefill_chunk, metavar="N", default=512, help="prefill chunk size (multiple of 16)")
    p.add_argument("--concurrency", type=positive_int, metavar="N", default=1,
                   help="sessions in flight at once; also the MTP dispatch cap the bench arms")
    p.add_argument("--interleave", action="store_true",
                   help="start sessions round-robin turn by turn, so carried entries are contested")
    p.add_argument("--repeat", type=positive_int, metavar="N", default=5,
                   help="replay the session set N times; with N > 1 the first is a warm-up, "
                        "shown but left out of the summary")
    p.add_argument("--drafter-blocks", type=positive_int, default=None, metavar="N",
                   help="drafter KV pool size in 16-row blocks (default: room for every in-flight "
                        "sequence and carried session; smaller forces evictions)")
    p.add_argument("--target-blocks", type=positive_int, default=None, metavar="N",
                   help="target KV pool size in 16-token blocks (default: room for every in-flight "
                        "sequence and every session's cached prefix)")
    p.add_argument("--device", action=_Given, default="cpu", help="torch device: cpu, cuda or cuda:N")
    p.add_argument("--dtype", action=_Given, default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--threads", action=_Given, type=positive_int, metavar="N", default=1,
                   help="torch intra-op threads (the reference model's ops are too small to gain "
                        "from more, and extra threads on a busy CPU make timings erratic)")
    p.add_argument("--weights", metavar="DIR", help="reference.safetensors + reference.json directory")
    p.add_argument("--server", type=server_address, metavar="HOST:PORT",
                   help="replay through a running `trtllm-mtp-carry serve` (its gRPC port) instead of "
                        "an in-process engine; the engine's sizes are then the server's")
    p.add_argument("--openai", metavar="URL",
                   help="replay through the OpenAI API of `trtllm-mtp-carry serve --dynamo` (its /v1 "
                        "base URL, e.g. http://127.0.0.1:8000/v1) instead of an in-process engine")
    p.add_argument("--model", default="mtp_carry", metavar="NAME",
                   help="the served model's name (with --server or --openai)")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="plot time to first token per turn (needs [plot])")
    p.add_argument("--figures", action="store_true",
                   help="end with tab-separated FIGURE/CHECK lines (drafter prep per policy, carry and "
                        "carry-fp8 drafter prep over blind's against <= 1.1x, carry-host ttft over "
                        "carry's against <= 1.05x, outputs identical) for scripts/gpu_smoke.sh")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none when stderr is not a terminal)")


def _device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        model = ""
    return f"cpu ({model or platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not on every platform
        return None


def environment(device: Any) -> dict[str, Any]:
    """What the figures were measured on: versions, device, threads, load, time (UTC)."""
    import torch

    return {
        "package": f"trtllm_mtp_carry {__version__}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": _device_name(device),
        "threads": torch.get_num_threads(),
        "load_avg_start": _loadavg(),
        "load_avg_end": None,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def environment_line(env: dict[str, Any]) -> str:
    threads = f", {env['threads']} threads" if env["threads"] is not None else ""
    return (f"environment: {env['package']}, torch {env['torch']}, Python {env['python']}, "
            f"{env['device']}{threads}, load average {env['load_avg_start']} at start"
            + (f", {env['load_avg_end']} at end" if env["load_avg_end"] is not None else "")
            + f", {env['timestamp']}")


def _settings() -> dict[str, Any]:
    """The process-wide settings as resolved (whatever the core exposes)."""
    out: dict[str, Any] = {"marconi_min_tokens": marconi_min_tokens(), "mtp_max_seqs": mtp_max_seqs()}
    out["carry_slots"] = settings.carry_slots()  # None (JSON null): no cap
    out["carry_memory"] = str(settings.carry_memory())
    out["carry_host_memory"] = settings.carry_host_memory()
    out["carry_eviction"] = settings.carry_eviction()
    out["carry_idle_s"] = settings.carry_idle_s()
    out["carry_share"] = settings.carry_share()
    out["carry_row_dtype"] = settings.carry_row_dtype()
    return out


def _check(args: argparse.Namespace) -> None:
    """Everything that can be checked before the model loads; ValueError naming the flag."""
    from .replay import BenchPolicy

    names = _policy_names(args)
    if not names:
        raise ValueError(f"--policies names no policy: {args.policies!r}")
    for name in names:
        BenchPolicy.parse(name)
    if len(set(names)) != len(names):
        raise ValueError(f"--policies names a policy twice: {args.policies!r}")
    if args.conversations is not None and getattr(args, "shared_prefix", None):
        raise ValueError("--shared-prefix applies to the built-in sessions, not to --conversations")
    if args.conversations is not None and not Path(args.conversations).is_file():
        raise ValueError(f"--conversations {args.conversations}: no such file")
    weights_dir(args.weights)
    output_path(args.json, "--json")
    output_path(args.plot, "--plot")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'trtllm-mtp-carry[plot]'") from None
    if args.mtp_max_seqs is not None and args.mtp_max_seqs != args.concurrency:
        raise ValueError(
            f"--mtp-max-seqs {args.mtp_max_seqs} differs from --concurrency {args.concurrency}: "
            "the bench sets the MTP dispatch cap from --concurrency"
        )


def engine_config(args: argparse.Namespace, max_position: int, tokenizer: Any, sessions: list[Any],
                  device: str) -> Any:
    """Engine sizes for this run: every turn fits, every session's cached prefix stays,
    and the drafter pool holds the in-flight sequences plus the carried sessions
    (unless `--drafter-blocks` shrinks it to force evictions)."""
    from ..engine.engine import EngineConfig

    first_lens = [len(tokenizer.render_chat(s.history)) for s in sessions]
    longest = max(n + len(s.followups) * (args.new_span + args.max_new_tokens + 8)
                  for n, s in zip(first_lens, sessions, strict=True))
    if longest > max_position:
        raise ValueError(
            f"sessions reach {longest} tokens (history {max(first_lens)} + turns x (--new-span + "
            f"--max-new-tokens)), past the model's {max_position}; lower --history, "
            "--turns, --new-span or --max-new-tokens")
    max_len = min(max_position, max(4096, 1 << (longest - 1).bit_length()))
    per_seq = -(-max_len // 16)
    slots = settings.carry_slots() or len(sessions)  # None: no slot cap, the carry may hold every session
    target_blocks = getattr(args, "target_blocks", None)
    if target_blocks is not None and target_blocks < per_seq:
        raise ValueError(f"--target-blocks {target_blocks} cannot hold one sequence of up to {max_len} "
                         f"tokens: use at least {per_seq}")
    return EngineConfig(
        max_model_len=max_len,
        # room for every in-flight sequence plus every session's cached prefix, so the
        # prefix cache does not evict a session between its turns (that would make warm
        # turns cold and say nothing about the carry)
        num_target_blocks=target_blocks or max(4096, per_seq * (args.concurrency + len(sessions))),
        num_drafter_blocks=args.drafter_blocks or max(
            1024, per_seq * (args.concurrency + min(slots, len(sessions)))),
        prefill_chunk=args.chunk, draft_len=args.draft_len, max_num_seqs=args.concurrency,
        mtp_max_seqs=args.concurrency, device=device, dtype=args.dtype, snapshot_budget_mb=256,
    )


def server_side_flags(args: argparse.Namespace) -> list[str]:
    """The `SERVER_SIDE_FLAGS` the user typed (settings flags and paths default to None)."""
    typed = set(getattr(args, "given_flags", ()))
    for flag in ("--restore-threshold", "--mtp-max-seqs", "--carry-slots", "--weights",
                 "--drafter-blocks", "--target-blocks", "--carry-memory", "--carry-host-memory",
                 "--carry-eviction", "--carry-idle-s", "--carry-share", "--carry-row-dtype"):
        if getattr(args, flag[2:].replace("-", "_"), None) is not None:
            typed.add(flag)
    return [f for f in SERVER_SIDE_FLAGS if f in typed]


def run(args: argparse.Namespace) -> int:
    """`bench`: on the target the flags name (`--openai`, `--server`, else in process)."""
    if args.openai:
        return run_openai(args)
    if args.server:
        return run_server(args)
    return run_local(args)


def _policy_names(args: argparse.Namespace) -> list[str]:
    """The names `--policies` lists, stripped, empty items dropped."""
    return [p.strip() for p in args.policies.split(",") if p.strip()]


def _check_env_cap(args: argparse.Namespace) -> None:
    """`TRTLLM_MTP_CARRY_MAX_SEQS` is held to the rule of `--mtp-max-seqs`: the in-process bench
    sets the cap from `--concurrency`, so a variable that differs is an error naming it."""
    raw = os.environ.get(settings.ENV_MTP_MAX_SEQS)
    if args.mtp_max_seqs is None and raw is not None:
        cap = settings.parse_env_int(settings.ENV_MTP_MAX_SEQS, raw, 1)
        if cap != args.concurrency:
            raise ValueError(f"environment variable {settings.ENV_MTP_MAX_SEQS}={raw!r} differs from "
                             f"--concurrency {args.concurrency}: the bench sets the MTP dispatch cap "
                             "from --concurrency")


def run_local(args: argparse.Namespace) -> int:
    """`bench`: the sessions on in-process reference engines (`replay.LocalDriver`)."""
    _check(args)
    _check_env_cap(args)
    import torch

    from ..engine.model import load_reference
    from .replay import LocalDriver

    policies = _policy_names(args)
    device = resolve_device(args.device)
    settings.MTP_MAX_SEQS.set(args.concurrency, source="--concurrency")  # the cap the bench arms
    torch.set_num_threads(args.threads)
    env = environment(device)
    started = time.perf_counter()
    model, tokenizer = load_reference(path=args.weights)
    sessions = _sessions(args, tokenizer)
    config = engine_config(args, model.cfg.max_position, tokenizer, sessions, str(device))  # may refuse
    print(environment_line(env))  # only once every option is known to be good
    _note_below_threshold(sessions, tokenizer)
    driver = LocalDriver(model, tokenizer, config, args.max_new_tokens, args.concurrency,
                         args.interleave, args.repeat)
    return _drive_and_report(args, env, driver, sessions, policies, started)


def _drive_and_report(args: argparse.Namespace, env: dict[str, Any], driver: Driver,
                      sessions: list[Any], policies: list[str], started: float) -> int:
    """Advance the driver's replay (each step yields every policy's run so far) under a
    progress bar, then report, then the driver's own lines; Ctrl-C reports the turns
    finished so far (partial) and returns 130."""
    from ..progress import progress
    from . import report

    first_measured = 1 if args.repeat > 1 else 0
    total = args.repeat * len(policies) * sum(1 + len(s.followups) for s in sessions)
    bar = progress(total, "bench", "turn", off=args.no_progress)
    runs: list[PolicyRun] = []
    partial = False
    done = 0
    try:
        for runs in driver.replay(sessions, policies):
            now = sum(len(r.turns) for r in runs)
            bar.update(now - done)
            done = now
    except KeyboardInterrupt:
        partial = True
    finally:
        bar.close()
    env["load_avg_end"] = _loadavg()
    if partial and not any(report.measured(r, first_measured) for r in runs):
        first_measured = 0  # stopped during the warm-up: summarise what there is
    identical = _report(args, env, runs, first_measured, partial, time.perf_counter() - started,
                        per_replay=total // args.repeat)
    for line in driver.report_lines(runs):
        print(line)
    if partial:
        print("partial: interrupted by Ctrl-C", file=sys.stderr)
        return 130
    return 0 if identical else 1


def server_environment(address: str, model: str) -> dict[str, Any]:
    """What a server run was measured from: the client's versions, the server, load, time."""
    return {
        "package": f"trtllm_mtp_carry {__version__}",
        "torch": _torch_version(),
        "python": platform.python_version(),
        "device": f"Triton server {address}, model {model} (client-side timing)",
        "threads": None,
        "load_avg_start": _loadavg(),
        "load_avg_end": None,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _refuse_server_side_flags(args: argparse.Namespace, target: str, whose: str, set_with: str) -> None:
    """ValueError naming the `SERVER_SIDE_FLAGS` typed with a remote `target` ("--server
    HOST:PORT"): the engine there is `whose` ("the server's"), set with `set_with`."""
    given = server_side_flags(args)
    if given:
        raise ValueError(f"{', '.join(given)} with {target}: the engine is {whose} (set it with "
                         f"{set_with}); drop {'it' if len(given) == 1 else 'them'} here")


def _drive_remote(args: argparse.Namespace, target: str, env: dict[str, Any], driver: Driver) -> int:
    """The remote part every target shares: sessions (the package's tokenizer renders them),
    the environment line, drive and report; a refused turn or a dead server is one
    ValueError naming `target`."""
    from ..engine.tokenizer import ChatTokenizer

    policies = _policy_names(args)
    started = time.perf_counter()
    sessions = _sessions(args, ChatTokenizer())
    print(environment_line(env))
    try:
        return _drive_and_report(args, env, driver, sessions, policies, started)
    except (RuntimeError, TimeoutError) as exc:  # a refused turn, a dead server
        raise ValueError(f"{target}: {exc}") from None


def run_server(args: argparse.Namespace) -> int:
    """`bench --server`: the same sessions and report, through a running Triton server
    (`triton_driver.TritonDriver`)."""
    _refuse_server_side_flags(args, f"--server {args.server}", "the server's",
                              "`trtllm-mtp-carry serve` or `triton-repo` options")
    _check(args)
    if "paired" in _policy_names(args):
        raise ValueError(f"--policies paired with --server {args.server}: paired (the model of "
                         "TensorRT-LLM's paired draft reuse) runs on the in-process reference engine only")
    _refuse_row_variants(args, f"--server {args.server}")
    from .triton_driver import TritonDriver

    driver = TritonDriver(args.server, args.model, args.max_new_tokens, args.concurrency,
                          repeat=args.repeat)
    driver.check()
    env = server_environment(args.server, args.model)
    return _drive_remote(args, f"--server {args.server}", env, driver)


def run_openai(args: argparse.Namespace) -> int:
    """`bench --openai URL`: the same sessions and report, through a Dynamo deployment
    (`openai_driver.OpenAIDriver`), then where its router put the sessions."""
    _refuse_server_side_flags(args, f"--openai {args.openai}", "the workers'",
                              "`trtllm-mtp-carry serve --dynamo` options")
    if args.server:
        raise ValueError("--server and --openai: pick one (Triton's gRPC or Dynamo's OpenAI API)")
    _check(args)
    _refuse_row_variants(args, f"--openai {args.openai}")
    from .openai_driver import OpenAIDriver

    env = server_environment(args.openai, args.model)
    env["device"] = f"Dynamo OpenAI API {args.openai}, model {args.model} (client-side timing)"
    driver = OpenAIDriver(args.openai, args.model, args.max_new_tokens, args.concurrency,
                          repeat=args.repeat)
    driver.check()
    return _drive_remote(args, f"--openai {args.openai}", env, driver)


def _refuse_row_variants(args: argparse.Namespace, target: str) -> None:
    """ValueError for a `carry-<row dtype>` policy with a remote `target`: its row format is the
    server's `carry_row_dtype`, one per server."""
    variants = [p for p in _policy_names(args) if p.startswith("carry-")]
    if HOST_VARIANT in variants:
        raise ValueError(f"--policies {HOST_VARIANT} with {target}: the server's carry store decides "
                         "which entries live in its host tier (its carry_memory and carry_host_memory, "
                         "set when serving); compare host and device hits in process")
    if variants:
        raise ValueError(f"--policies {variants[0]} with {target}: the server stores carried rows in its "
                         "own carry_row_dtype (set it when serving); compare row formats in process")


def _sessions(args: argparse.Namespace, tokenizer: Any) -> list[Any]:
    """The built-in sessions, or the user's `--conversations` (errors name the flag)."""
    from .sessions import builtin_sessions, load_conversations, sessions_from_conversations

    if not args.conversations:
        return builtin_sessions(args.sessions, args.turns, args.history, args.new_span, tokenizer,
                                shared_prefix_tokens=getattr(args, "shared_prefix", None) or 0)
    try:
        conversations = load_conversations(args.conversations)
    except OSError as exc:
        raise ValueError(f"--conversations {args.conversations}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"--conversations: {exc}") from None
    return sessions_from_conversations(conversations)


def _report(args: argparse.Namespace, env: dict[str, Any], runs: list[Any], first_measured: int,
            partial: bool, wall: float, per_replay: int) -> bool:
    """Print the tables and ratios, write the JSON and plot; returns outputs_identical.
    `per_replay`: the per-turn table's rows in one whole replay (turns x policies)."""
    from . import report

    summary = {r.policy: report.policy_summary(r, first_measured) for r in runs}
    ratios = report.paired(runs, first_measured)
    identical = report.outputs_identical(runs)
    print(report.turn_table(runs, first_measured))
    print()
    scope = report.summary_scope(runs, first_measured, args.repeat, per_replay, partial)
    print(f"warm turns, median [p25-p75] ({scope})")
    print(report.summary_table(summary))
    print()
    print(report.reuse_table(summary))
    print()
    for line in report.ratio_lines(ratios):
        print(line)
    print(f"\noutputs identical across policies: {identical}   ({wall:.1f} s)")
    print(environment_line(env))
    if getattr(args, "figures", False):
        # the targets are a GPU's: judged only where this process ran the engine on CUDA
        remote = getattr(args, "server", None) or getattr(args, "openai", None)
        off_gpu = "a server" if remote else None if str(args.device).startswith("cuda") else str(args.device)
        for line in report.figure_lines(runs, first_measured, identical, off_gpu):
            print(line)
        from ..dataplane.ops import cuda_kernels

        print(report.timing_basis_line(off_gpu, cuda_kernels()))
    if args.json:
        data = _json(args, env, runs, summary, ratios, identical, first_measured, partial)
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1, default=str)  # counters the runtime may add: never fail here
        print(f"wrote {args.json}")
    if args.plot and runs:
        report.plot(runs, args.plot, first_measured)
        print(f"wrote {args.plot}")
    return identical


def _note_below_threshold(sessions: list[Any], tokenizer: Any) -> None:
    """Say once when some session's history is below the restore threshold: its warm
    turns reuse nothing (the SSM snapshot is not restored), so they are really cold."""
    threshold = marconi_min_tokens()
    short = [(s.name, n) for s in sessions
             if (n := len(tokenizer.render_chat(s.history))) < threshold and s.followups]
    if short:
        name, n = short[0]
        more = f" (and {len(short) - 1} more)" if len(short) > 1 else ""
        print(f"note: session {name}'s history is {n} tokens{more}, below the restore threshold "
              f"{threshold}: its warm turns reuse nothing and run cold; lower the threshold with "
              "--restore-threshold N")


def _json(args: argparse.Namespace, env: dict[str, Any], runs: list[Any], summary: dict[str, Any],
          ratios: dict[str, Any], identical: bool, first_measured: int, partial: bool) -> dict[str, Any]:
    config = {k: v for k, v in vars(args).items() if k not in ("func", "given_flags")}
    if args.server:  # the engine's sizes are the server's: this process's defaults would mislead
        for flag in SERVER_SIDE_FLAGS:
            config.pop(flag[2:].replace("-", "_"), None)
    else:
        config |= _settings()  # resolved values, not the flags' None
    return {
        "environment": env,
        "config": config,
        "partial": partial,
        "first_measured_replay": first_measured,
        "summary": {**summary, "ratios": ratios},
        "policies": {
            r.policy: {
                "turns": [{"replay": t.replay, "session": t.session, "turn": t.turn, **t.stats,
                           "output": t.output} for t in r.turns],
                "busy_s": {str(k): v for k, v in sorted(r.busy_s.items())},
                "runtime": {str(k): v for k, v in sorted(r.runtime.items())},
            }
            for r in runs
        },
        "outputs_identical": identical,
    }
