"""The `trtllm-mtp-carry` command line.

Subcommands load their layer lazily, so `info` runs without torch. Settings
flags pin the process-wide values before anything reads them, and a flag that
could not be applied (the value was already pinned) is reported, not ignored.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from . import __version__
from .argtypes import carry_host_memory_size, carry_memory_size, non_negative_int, positive_int
from .cli_error import fail
from .core import settings


def add_settings_flags(p: argparse.ArgumentParser) -> None:
    """Flags that pin the process-wide settings (shared by every subcommand)."""
    p.add_argument(
        "--restore-threshold",
        type=non_negative_int,
        metavar="N",
        help="SSM snapshot restore floor in matched tokens (0 removes it); "
        f"default env {settings.ENV_MARCONI_MIN_TOKENS}, else {settings.DEFAULT_MARCONI_MIN_TOKENS}",
    )
    p.add_argument(
        "--mtp-max-seqs",
        type=positive_int,
        metavar="N",
        help="MTP dispatch cap (sequences per MTP step); the carry is armed at any cap; "
        f"default env {settings.ENV_MTP_MAX_SEQS}, else {settings.DEFAULT_MTP_MAX_SEQS}",
    )
    p.add_argument(
        "--carry-slots",
        type=positive_int,
        metavar="N",
        help="optional cap on the sessions whose drafter rows the carry keeps at once "
        "(1 = the seed's single slot, newest wins); "
        f"default env {settings.ENV_CARRY_SLOTS}, else no cap (memory bounds the store)",
    )
    p.add_argument(
        "--carry-memory",
        type=carry_memory_size,
        metavar="SIZE",
        help="bytes of drafter rows the carry keeps (4GiB, 512MiB) or a fraction of the drafter "
        f"pool (0.5); default env {settings.ENV_CARRY_MEMORY}, else {settings.DEFAULT_CARRY_MEMORY} "
        "(the whole pool: every session whose rows fit)",
    )
    p.add_argument(
        "--carry-host-memory",
        type=carry_host_memory_size,
        metavar="SIZE",
        help="bytes of host memory (8GiB, 512MiB; pinned on a discrete GPU) where entries evicted "
        "from the carry memory wait for their session, copied back before its next turn drafts; "
        f"0 = no host tier; default env {settings.ENV_CARRY_HOST_MEMORY}, else "
        f"{settings.DEFAULT_CARRY_HOST_MEMORY}",
    )
    p.add_argument(
        "--carry-row-dtype",
        choices=settings.ROW_DTYPES,
        help="how carried drafter rows are stored (fp8: e4m3 with one float32 scale per row, K/V "
        "and head, about half the bytes of bf16, so the same carry memory holds about twice the "
        "sessions; nvfp4: e2m1 with one e4m3 scale per 16 values and one e8m0 byte per row, K/V "
        f"and head, 0.28x the bytes of bf16 at head_dim 256); default env {settings.ENV_CARRY_ROW_DTYPE}, else {settings.DEFAULT_CARRY_ROW_DTYPE}",
    )
    p.add_argument(
        "--carry-eviction",
        choices=settings.EVICTION_POLICIES,
        help="which carried entry gives way when the carry is full (returns keeps the entries "
        "likeliest to be adopted per byte, learned from the turns the store sees; incumbent keeps "
        "what it holds and refuses newcomers; lrd evicts the least recently deposited; slru protects "
        f"entries adopted before); default env {settings.ENV_CARRY_EVICTION}, else "
        f"{settings.DEFAULT_CARRY_EVICTION}",
    )
    p.add_argument(
        "--carry-share",
        choices=("on", "off"),
        help="share equal common-prefix drafter blocks between carried entries (a shared system "
        "prompt is held once; only equal bytes merge, within one cache salt); "
        f"default env {settings.ENV_CARRY_SHARE}, else {'on' if settings.DEFAULT_CARRY_SHARE else 'off'}",
    )
    p.add_argument(
        "--carry-idle-s",
        type=non_negative_int,
        metavar="S",
        help="seconds a carried entry waits for its session before it is dropped (0: never); "
        f"default env {settings.ENV_CARRY_IDLE_S}, else {settings.DEFAULT_CARRY_IDLE_S}",
    )


def apply_settings_flags(args: argparse.Namespace) -> list[str]:
    """Pin the settings named by flags; return a warning for each that was not applied."""
    pins: list[tuple[str, Callable[[Any, str], bool], Callable[[], object]]] = [
        ("--restore-threshold", settings.MARCONI_MIN_TOKENS.set, settings.marconi_min_tokens),
        ("--mtp-max-seqs", settings.MTP_MAX_SEQS.set, settings.mtp_max_seqs),
        ("--carry-slots", settings.CARRY_SLOTS.set, lambda: settings.carry_slots() or "no cap"),
        ("--carry-memory", settings.set_carry_memory, settings.carry_memory),
        ("--carry-host-memory", settings.set_carry_host_memory, settings.carry_host_memory),
        ("--carry-row-dtype", settings.set_carry_row_dtype, settings.carry_row_dtype),
        ("--carry-eviction", settings.set_carry_eviction, settings.carry_eviction),
        ("--carry-idle-s", settings.set_carry_idle_s, settings.carry_idle_s),
        ("--carry-share", settings.set_carry_share, lambda: "on" if settings.carry_share() else "off"),
    ]
    warnings = []
    for flag, pin, current in pins:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and not pin(value, flag):
            warnings.append(f"{flag} {value} not applied: already pinned to {current()}")
    return warnings


DRAFTER_POOL_BUDGET = (
    "per engine: EngineConfig num_drafter_blocks x drafter_block_size rows; "
    "CarryRuntime.stats() reports pool_blocks, carry_memory_bytes, bytes_held and entries_held"
)
"""What `info` says of the drafter pool budget: it belongs to an engine, not to the process."""


BARE_SCOPE = ("this process's settings (the reference engine's carry); no TensorRT-LLM executor or "
              "llm.yaml is judged here: info --llm-config YAML judges a TensorRT-LLM deployment")
"""What a bare `info`'s verdict is about: the settings, not a deployment."""


def info_report(cfg: settings.DrafterContext) -> dict[str, object]:
    """The resolved settings, as `info` prints them (configured and armed side by side)."""
    threshold = settings.marconi_min_tokens()
    cap = settings.mtp_max_seqs()
    armed = settings.carry_armed(cfg)
    if armed:
        why = (f"configured; armed at any MTP dispatch cap ({cap} here): drafter rows are "
               "built per prefill chunk under the sequence's own ticket")
    else:
        why = "not configured"
    return {
        "version": __version__,
        "marconi_min_tokens": threshold,
        "marconi_min_tokens_source": settings.MARCONI_MIN_TOKENS.source,
        "mtp_max_seqs": cap,
        "mtp_max_seqs_source": settings.MTP_MAX_SEQS.source,
        "multi_seq_mode": settings.mtp_multi_seq_mode(),
        "carry_slots": settings.carry_slots(),
        "carry_slots_source": settings.CARRY_SLOTS.source,
        "carry_memory": str(settings.carry_memory()),
        "carry_memory_source": settings.CARRY_MEMORY.source,
        "carry_host_memory": settings.carry_host_memory(),
        "carry_host_memory_source": settings.CARRY_HOST_MEMORY.source,
        "carry_row_dtype": settings.carry_row_dtype(),
        # what the TensorRT-LLM adapter reserves at install (trtllm/reservation.py; whole rows),
        # by one rule for both arenas (trtllm.options.RESERVE_RULE); None: a pool fraction, refused there
        **_trtllm_reserve(),
        "trtllm_kv_cache_size": "estimated: free_gpu_memory_fraction (default 0.9) of the memory free "
                                "after the carry's arena",
        "carry_row_dtype_source": settings.CARRY_ROW_DTYPE.source,
        "carry_eviction": settings.carry_eviction(),
        "carry_eviction_source": settings.CARRY_EVICTION.source,
        "carry_idle_s": settings.carry_idle_s(),
        "carry_idle_s_source": settings.CARRY_IDLE_S.source,
        "carry_share": settings.carry_share(),
        "carry_share_source": settings.CARRY_SHARE.source,
        "drafter_pool_budget": DRAFTER_POOL_BUDGET,
        "drafter_prefill": cfg.prefill,
        "carry_configured": cfg.carry,
        "carry_armed": armed,
        "carry_armed_reason": why,
        "carry_armed_scope": BARE_SCOPE,
        "debug": settings.mtp_carry_debug(),
    }


def _trtllm_reserve(options: Any = None) -> dict[str, object]:
    """The bytes the carry inside TensorRT-LLM reserves under `options` (a `CarryOptions`; None:
    a carry file without sizes) and the process settings: `trtllm_reserved_device_bytes` (None
    where the device size is refused, `trtllm_reserved_refused` saying why) and `..._host_bytes`."""
    from .trtllm.options import CarryOptions, TrtllmAdapterError

    options = CarryOptions() if options is None else options
    try:
        device: int | None = options.device_bytes()
        refused = None
    except TrtllmAdapterError as exc:
        device, refused = None, str(exc)
    return {"trtllm_reserved_device_bytes": device, "trtllm_reserved_host_bytes": options.host_bytes(),
            "trtllm_reserved_refused": refused}


@dataclass(frozen=True)
class Checkpoint:
    """What `info --llm-config --model DIR` reads from a Hugging Face checkpoint directory, as
    TensorRT-LLM's loader does: the model's dtype (`config.json` `dtype`, else the deprecated
    `torch_dtype`, else a composite config's `text_config.dtype`, else bfloat16: `BaseLlmArgs.dtype`
    "auto", `llm_args.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412) and its KV-cache quantization
    (`hf_quant_config.json` `quantization.kv_cache_quant_algo`; None: none)."""

    dtype: str = "bfloat16"
    kv_cache_quant_algo: str | None = None


def read_checkpoint(model: str | None) -> Checkpoint:
    """The `Checkpoint` of directory `model` (None: no checkpoint given, the defaults).
    TrtllmAdapterError, one line naming the path, for a directory that does not exist, a missing
    or unreadable `config.json`, or an unreadable `hf_quant_config.json`: never a silent BF16."""
    from .trtllm.options import TrtllmAdapterError

    if model is None:
        return Checkpoint()
    root = Path(model)
    if not root.is_dir():
        raise TrtllmAdapterError(f"--model {model}: no such checkpoint directory")

    def load(name: str) -> dict[str, Any]:
        path = root / name
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise TrtllmAdapterError(f"--model {model}: cannot read {path}: {exc.strerror}") from None
        except ValueError as exc:
            raise TrtllmAdapterError(f"--model {model}: {path} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise TrtllmAdapterError(f"--model {model}: {path} is not a JSON object")
        return data

    if not (root / "config.json").is_file():
        raise TrtllmAdapterError(f"--model {model}: no config.json in it: not a Hugging Face checkpoint")
    config = load("config.json")
    text_config = config.get("text_config")
    text: dict[str, Any] = text_config if isinstance(text_config, dict) else {}
    dtype = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or "bfloat16"
    algo = None
    if (root / "hf_quant_config.json").exists():
        quant = load("hf_quant_config.json").get("quantization") or {}
        value = quant.get("kv_cache_quant_algo") if isinstance(quant, dict) else None
        algo = None if value is None else str(value)
    return Checkpoint(str(dtype), algo)


PAIRING_AT_START = ("the worker's probe reads the draft pool's pairing markers (and, for a QSA pool, "
                    "get_batch_cache_indices' raw_indices) from the live executor at start")
"""What `info --llm-config` cannot judge from files, said below an armed verdict."""


def llm_config_report(path: str, model: str | None = None) -> dict[str, object]:
    """What a TensorRT-LLM `llm.yaml` (extra_llm_api_options) gives the carry, read as TensorRT-LLM's
    `LlmArgs` reads it (`trtllm/llm_yaml.py`: pydantic's coercions, unknown keys refused): the one
    verdict (`trtllm/verdict.py`, the checks and sentences the worker's probe uses, in its order:
    the carry section, speculative decoding, the parallel mapping, disaggregation, the KV format and
    manager, reuse), block reuse and snapshot placement over the model's defaults, what the worker
    reserves, and the worker's `metrics_port` (None: not set). `model`: the checkpoint directory
    (`read_checkpoint`). `llm_config_stands_aside` is the reason the carry stands aside (None: it
    can restore rows; pairing is read from the live executor at start). TrtllmAdapterError (one line)
    on a file or checkpoint TensorRT-LLM would refuse."""
    from .trtllm.kv_formats import DEEPSEEK_V4, verdict_of_options
    from .trtllm.llm_yaml import read_llm_args
    from .trtllm.options import load_llm_options, reuse_stand_aside
    from .trtllm.probe import parallel_refusal, tensor_parallel_note
    from .trtllm.verdict import (
        Verdict,
        carry_options_verdict,
        disaggregation_verdict,
        first,
        speculation_verdict,
    )

    rest, options = load_llm_options(path)
    args = read_llm_args(rest)
    checkpoint = read_checkpoint(model)
    kv = args.kv_cache_config
    # Qwen3-Next's model default (`get_model_defaults`: block reuse off) where the file does not set it
    reuse = bool(kv.enable_block_reuse) if "enable_block_reuse" in kv.model_fields_set else False
    state = kv.mamba_state_config.model_dump()
    model_dtype = checkpoint.dtype if args.dtype == "auto" else args.dtype
    sparse = args.sparse_attention_config
    compression = args.kv_cache_compression_config
    raw = rest.get("kv_cache_config") or {}
    kv_verdict = verdict_of_options({
        "kv_cache_config": {"dtype": kv.dtype, "use_kv_cache_manager_v2": kv.use_kv_cache_manager_v2,
                            "tokens_per_block": raw.get("tokens_per_block")},
        "sparse_attention_config": None if sparse is None else {"algorithm": sparse.algorithm},
        "kv_cache_compression_config": None if compression is None else {"algorithm": compression.algorithm},
        "quant_config": args.quant_config}, checkpoint.kv_cache_quant_algo, model_dtype)
    spec = args.speculative_config
    parallel = parallel_refusal(args.tensor_parallel_size, bool(args.enable_attention_dp),
                                args.pipeline_parallel_size)
    hybrid = kv_verdict.manager != DEEPSEEK_V4  # DeepSeek-V4's target reuses without snapshots
    never = reuse_stand_aside(reuse, hybrid, {**state, "periodic_snapshot_interval": (
        state["periodic_snapshot_interval"] or kv.ignored_interval)}, policy=kv.block_reuse_config.policy)
    aside = first(
        carry_options_verdict(options),
        speculation_verdict(None if spec is None else str(spec.decoding_type)),
        None if parallel is None else Verdict(False, parallel),
        disaggregation_verdict(args.cache_transceiver_config is not None),
        None if kv_verdict.carries else Verdict(False, kv_verdict.line, kv_verdict.details),
        None if never is None else Verdict(False, never))
    fixed = [f"{k}={raw[k]}" for k in ("max_gpu_total_bytes", "max_tokens") if raw.get(k)]
    size = (f"fixed ({', '.join(fixed)}): the carry's reservation is on top of it" if fixed else
            f"estimated: free_gpu_memory_fraction={kv.free_gpu_memory_fraction} of the memory free after "
            "the carry's arena")
    reserve = _trtllm_reserve(options) if options.enable else {
        "trtllm_reserved_device_bytes": 0, "trtllm_reserved_host_bytes": 0, "trtllm_reserved_refused": None}
    return {
        **reserve,
        "trtllm_kv_cache_size": size,
        "trtllm_tensor_parallel": tensor_parallel_note(args.tensor_parallel_size),
        "trtllm_metrics_port": options.metrics_port if options.enable else None,
        "llm_config": path,
        "llm_config_block_reuse": reuse,
        "llm_config_snapshot_placement": ", ".join(f"{k}={v}" for k, v in sorted(state.items()) if v) or "none",
        "llm_config_decoding_type": None if spec is None else str(spec.decoding_type),
        "kv_format": kv_verdict.kv_format,
        "kv_manager": kv_verdict.manager,
        "kv_verdict": kv_verdict.line,
        "kv_verdict_details": list(kv_verdict.details),
        # judged on what the worker's executor holds: TensorRT-LLM's validators applied
        "llm_config_stands_aside": None if aside is None else aside.reason,
        "llm_config_details": list(kv_verdict.details if aside is None else aside.details),
    }


def _reserve_value(report: dict[str, object]) -> str:
    """The reservation line's value: both arenas in `format_bytes`'s one unit rule."""
    device, host = report["trtllm_reserved_device_bytes"], report["trtllm_reserved_host_bytes"]
    assert isinstance(host, int)
    shown = (f"refused ({report['trtllm_reserved_refused']})" if device is None
             else settings.format_bytes(device) if isinstance(device, int) else str(device))
    return f"{shown} device, " + (f"{settings.format_bytes(host)} host" if host else "no host tier")


def cmd_info(args: argparse.Namespace) -> int:
    from .trtllm.options import RESERVE_RULE

    cfg = settings.DrafterContext(prefill=not args.no_prefill, carry=not args.no_carry)
    report = info_report(cfg)
    if args.llm_config is not None:
        from .trtllm.options import TrtllmAdapterError

        try:
            report.update(llm_config_report(args.llm_config, args.model))
        except TrtllmAdapterError as exc:
            print(f"trtllm-mtp-carry: error: --llm-config {args.llm_config}: {exc}", file=sys.stderr)
            return 2
        report["carry_armed_scope"] = f"the TensorRT-LLM worker under {args.llm_config}"
        details = report.pop("llm_config_details")
        assert isinstance(details, list)
        if report["llm_config_stands_aside"] is not None:  # never "armed" for a carry with no row to restore
            report["carry_armed"] = False
            report["carry_armed_reason"] = f"stands aside under {args.llm_config}: {report['llm_config_stands_aside']}"
            report["carry_armed_details"] = details
        elif report["carry_armed"]:
            report["carry_armed_reason"] = f"under {args.llm_config}: {report['kv_verdict']}"
            report["carry_armed_details"] = [*details, PAIRING_AT_START]
    elif args.model is not None:
        print("trtllm-mtp-carry: error: --model needs --llm-config (it decides kv_cache_config.dtype auto)",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
        return 0

    def yes(v: object) -> str:
        return "yes" if v else "no"

    armed_note = str(report["carry_armed_reason"])
    if args.llm_config is None:  # a bare info: say what the verdict is about
        armed_note = f"{armed_note} [{report['carry_armed_scope']}]"
    details = report.get("carry_armed_details") or []
    assert isinstance(details, list)
    rows = [
        ("carry armed", yes(report["carry_armed"]), armed_note),  # the verdict first, one sentence
        *[("", "", f"  {detail}") for detail in details],  # where it was read, what to set
        ("version", report["version"], ""),
        (
            "restore threshold (marconi_min_tokens)",
            report["marconi_min_tokens"],
            report["marconi_min_tokens_source"],
        ),
        ("MTP dispatch cap (mtp_max_seqs)", report["mtp_max_seqs"], report["mtp_max_seqs_source"]),
        ("carry slots (carry_slots)", report["carry_slots"] or "no cap", report["carry_slots_source"]),
        ("carry memory (carry_memory)", report["carry_memory"], report["carry_memory_source"]),
        ("carry host tier (carry_host_memory)",
         settings.format_bytes(host_bytes) if (host_bytes := settings.carry_host_memory()) else "none",
         report["carry_host_memory_source"]),
        ("carry row format (carry_row_dtype)", report["carry_row_dtype"], report["carry_row_dtype_source"]),
        ("TensorRT-LLM worker reserves", _reserve_value(report),
         f"{RESERVE_RULE}; reserved before KV cache estimation measures free memory"
         + ("; the host bytes exactly, page-locked once on a GPU" if report["trtllm_reserved_host_bytes"] else "")
         + "; KV cache size: "
         + str(report["trtllm_kv_cache_size"])),
        ("carry eviction (carry_eviction)", report["carry_eviction"], report["carry_eviction_source"]),
        ("carry idle TTL s (carry_idle_s)", report["carry_idle_s"] or "never",
         report["carry_idle_s_source"]),
        ("carry shares prefix blocks (carry_share)", "on" if report["carry_share"] else "off",
         report["carry_share_source"]),
        ("drafter pool budget", "-", report["drafter_pool_budget"]),
        ("drafter prompt prefill", yes(report["drafter_prefill"]), ""),
        ("carry configured", yes(report["carry_configured"]), ""),
        (f"debug log ({settings.ENV_DEBUG})", "on" if report["debug"] else "off", ""),
    ]
    if args.llm_config is not None:
        rows[-1:-1] = [
            ("KV format (--llm-config)", report["kv_format"],
             f"{report['kv_manager']}: {report['kv_verdict']}"),
            ("speculative decoding (--llm-config)", report["llm_config_decoding_type"] or "none",
             "speculative_config.decoding_type (the carry serves MTP)"),
            ("block reuse (--llm-config)", yes(report["llm_config_block_reuse"]),
             "kv_cache_config.enable_block_reuse (Qwen3-Next's default: off)"),
            ("snapshot placement (--llm-config)", "-", report["llm_config_snapshot_placement"]),
            ("tensor parallel (--llm-config)", "-", report["trtllm_tensor_parallel"]),
        ]
        if report["trtllm_metrics_port"] is not None:
            rows[-1:-1] = [("worker metrics (metrics_port)", report["trtllm_metrics_port"],
                            "Prometheus at http://<host>:<metrics_port + rank>/metrics, one port per worker rank")]
    width = max(len(name) for name, _, _ in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value!s:<6}  {note}".rstrip())
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with one error line: `trtllm-mtp-carry: error: ...`, exit 2 (subparsers too)."""

    def error(self, message: str) -> NoReturn:
        sub = self.prog.split(" ", 1)[1] + " " if " " in self.prog else ""
        self.exit(2, f"trtllm-mtp-carry: error: {message} (see trtllm-mtp-carry {sub}--help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trtllm-mtp-carry",
        description="Carry the MTP drafter's KV across turns of a session (hybrid MTP models).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="print the resolved settings and whether the carry is armed")
    add_settings_flags(info)
    info.add_argument(
        "--no-carry", action="store_true", help="report with the carry not configured"
    )
    info.add_argument(
        "--no-prefill",
        action="store_true",
        help="report with the drafter prompt prefill off (implies --no-carry)",
    )
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.add_argument(
        "--llm-config", metavar="YAML", default=None,
        help="a TensorRT-LLM llm.yaml (extra_llm_api_options): report whether the carry can restore "
             "rows under it (block reuse, the hybrid target's snapshot placement, the KV format "
             "and cache manager: the verdict the worker gives)")
    info.add_argument(
        "--model", metavar="DIR", default=None,
        help="with --llm-config: the checkpoint directory (it must hold config.json); its dtype and "
             "hf_quant_config.json (kv_cache_quant_algo) decide kv_cache_config.dtype auto, as "
             "TensorRT-LLM's loader does")
    info.set_defaults(func=cmd_info)

    from .bench.main import add_arguments
    from .bench.options import DefaultsHelpFormatter

    bench = sub.add_parser(
        "bench", help="replay multi-turn sessions under each drafter policy (carry/rebuild/blind/off)",
        formatter_class=DefaultsHelpFormatter,
    )
    add_settings_flags(bench)
    add_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    from .chat import add_arguments as add_chat_arguments

    chat = sub.add_parser("chat", help="chat with the reference model, showing each turn's carry",
                          formatter_class=DefaultsHelpFormatter)
    add_settings_flags(chat)
    add_chat_arguments(chat)
    chat.set_defaults(func=cmd_chat)

    from .traces.cli import add_arguments as add_replay_arguments

    replay = sub.add_parser("trace-replay",
                            help="replay a chat trace through the carry store, per eviction policy, "
                                 "beside a clairvoyant bound",
                            formatter_class=DefaultsHelpFormatter)
    add_replay_arguments(replay)
    replay.set_defaults(func=cmd_trace_replay)

    from .serve.cli import add_subcommands as add_serve_subcommands

    add_serve_subcommands(sub)  # triton-repo, serve
    return parser


def cmd_chat(args: argparse.Namespace) -> int:
    from .chat import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.main import run

    return run(args)


def cmd_trace_replay(args: argparse.Namespace) -> int:
    from .traces.cli import run

    return run(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "no_prefill", False):
        args.no_carry = True
    try:
        settings.check_environment()  # a malformed variable, before any subcommand prints or pins
        # with `bench --server` the settings are the server's: the bench refuses those flags
        for warning in [] if getattr(args, "server", None) else apply_settings_flags(args):
            print(f"warning: {warning}", file=sys.stderr)
        result: int = args.func(args)
    except ValueError as exc:  # bad values (flags, env, files): one line, no traceback
        return fail(str(exc))
    except KeyboardInterrupt:  # Ctrl-C outside the bench's own handling (loading, printing)
        print("trtllm-mtp-carry: interrupted", file=sys.stderr)
        return 130
    return result


if __name__ == "__main__":
    sys.exit(main())
