"""`trtllm-mtp-carry trace-replay TRACE.jsonl`: the carry store on a real trace, per policy.

What it is for: the figures that choose the eviction policy and the budgets
(DECISIONS.md, BENCHMARKS.md): per policy, follow-ups adopted (by tier),
misses by reason, evictions, refusals, peak bytes per tier, and the
clairvoyant bound with each policy's distance to it; what a missed turn
leaves behind (`--after-miss`: valid runs or gaps, and how much of the reused
prefix adopted rows cover) and how sessions moving between workers
(`--move`, `--pull`) change adoption and cost bytes moved; `--json` writes the
same (`policies.<name>.follow_ups`, `policies.<name>.adopted`,
`policies.<name>.after_miss`, `policies.<name>.moves`, `bound.follow_ups`,
`bound.adopted`, ...). With `--after-miss full` and no `--move` it prints no
after-miss and no moves line, and the figures are those of every finish
depositing all its rows on its conversation's hash worker. Torch-free.

Flags never pin the process settings (the replay builds its own stores):
their dests are `replay_*`, so `apply_settings_flags` does not see them.
Each carry flag not given takes its `TRTLLM_MTP_CARRY_*` variable, as every
command does (`--carry-memory` TRTLLM_MTP_CARRY_MEMORY, `--carry-host-memory`
TRTLLM_MTP_CARRY_HOST_MEMORY, `--carry-eviction` TRTLLM_MTP_CARRY_EVICTION,
`--carry-idle-s` TRTLLM_MTP_CARRY_IDLE_S); with neither, the replay's default. A
malformed variable is the command line's one error line before anything runs.
Bad input is one error line (ValueError; the CLI prints it and exits 2): a
malformed trace line names its line number; a move flag without the move model
it belongs to, or a move model without its flag, names both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.row_format import (
    DEFAULT_CARRY_ROW_DTYPE,
    KV_DTYPES,
    ROW_DTYPES,
    RowFormat,
    carried_row_format,
)
from ..core.settings import (
    CARRY_EVICTION,
    CARRY_HOST_MEMORY,
    CARRY_IDLE_S,
    CARRY_MEMORY,
    CARRY_ROW_DTYPE,
    DEFAULT_CARRY_EVICTION,
    DEFAULT_CARRY_IDLE_S,
    ENV_CARRY_EVICTION,
    ENV_CARRY_HOST_MEMORY,
    ENV_CARRY_IDLE_S,
    ENV_CARRY_MEMORY,
    ENV_CARRY_ROW_DTYPE,
    EVICTION_POLICIES,
    Pinned,
    check_eviction_policy,
    parse_carry_memory,
)
from .defaults import (
    AFTER_MISS,
    DECODE_S_PER_TOKEN,
    MOVE_MODELS,
    PREFILL_TOKENS_PER_S,
    QWEN3_NEXT_MTP_HEAD_DIM,
    QWEN3_NEXT_MTP_ROW_BYTES,
    QWEN3_NEXT_MTP_VECTORS_PER_ROW,
)

if TYPE_CHECKING:  # the replay (numpy) loads only when the command runs
    from .replay import BoundResult, PolicyResult

DEFAULT_REPLAY_MEMORY = "1GiB"
"""The replay's default budget per worker: the TensorRT-LLM adapter's default carry_memory
(`trtllm.options.DEFAULT_CARRY_MEMORY`; the reference runtime's default is a pool fraction,
which a replay without a pool cannot resolve)."""

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "fp8": 1}


def row_bytes_from_config(path: str) -> int:
    """Bytes of one drafter row from a Hugging Face `config.json`: MTP layers x 2 (K, V) x KV heads x
    head_dim x dtype bytes (`mtp_num_hidden_layers` or `num_nextn_predict_layers`, default 1)."""
    return row_format_from_config(path).row_nbytes


def row_format_from_config(path: str, row_dtype: str = DEFAULT_CARRY_ROW_DTYPE) -> RowFormat:
    """The carried rows' format from a Hugging Face `config.json` (as `row_bytes_from_config` reads
    it): MTP layers x 2 (K, V) x KV heads vectors of head_dim elements, stored as `row_dtype`
    (`bf16`: the config's dtype bytes each; `fp8`: one byte each plus a float32 scale per vector;
    `nvfp4`: half a byte each plus an e4m3 scale per 16 and one scale byte per vector)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model-config {path}: cannot read a JSON config ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--model-config {path}: expected a JSON object")
    heads = cfg.get("num_key_value_heads", cfg.get("num_attention_heads"))
    head_dim = cfg.get("head_dim")
    if head_dim is None and isinstance(cfg.get("hidden_size"), int) and isinstance(
            cfg.get("num_attention_heads"), int):
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    layers = cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 1))
    dtype = cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))
    for name, value in (("num_key_value_heads", heads), ("head_dim", head_dim),
                        ("mtp_num_hidden_layers", layers)):
        if type(value) is not int or value < 1:
            raise ValueError(f"--model-config {path}: {name} must be a positive int, got {value!r}")
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"--model-config {path}: torch_dtype {dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
    assert isinstance(heads, int) and isinstance(head_dim, int) and isinstance(layers, int)
    return RowFormat(row_dtype, layers * 2 * heads, head_dim, _DTYPE_BYTES[dtype])


def replay_row_bytes(row_dtype: str, row_bytes: int | None, model_config: str | None,
                     kv_dtype: str = "auto") -> int:
    """Bytes of one carried row for the replay, in the format the adapter would hold it
    (`carried_row_format(row_dtype, kv_dtype)`: an FP8 pool's own 1-byte rows, `fp8_kv`, whatever
    `row_dtype` says): `--model-config`'s geometry, else `--row-bytes` (the pool's own row bytes:
    not with packed fp8 or nvfp4, whose bytes need the geometry), else Qwen3-Next's MTP layer."""
    fmt = carried_row_format(row_dtype, kv_dtype)
    if model_config:
        return row_format_from_config(model_config, fmt).row_nbytes
    if row_bytes is not None:
        if fmt in ("fp8", "nvfp4"):
            raise ValueError(f"--row-bytes {row_bytes} with --carry-row-dtype {row_dtype}: packed rows' "
                             "bytes depend on the head geometry; give --model-config instead")
        return row_bytes
    return RowFormat(fmt, QWEN3_NEXT_MTP_VECTORS_PER_ROW, QWEN3_NEXT_MTP_HEAD_DIM).row_nbytes


def replay_moves(args: argparse.Namespace) -> tuple[str, float | None, int | None, bool]:
    """`--move`, `--move-every` (in seconds), `--move-load` and `--pull` checked against each other
    and `--workers`: ValueError naming the flag that is missing or does not apply."""
    model, every, load, pull = args.replay_move, args.replay_move_every, args.replay_move_load, args.replay_pull
    if model in ("drain", "crash") and every is None:
        raise ValueError(f"--move {model} needs --move-every MIN (minutes between restarts)")
    if model not in ("drain", "crash") and every is not None:
        raise ValueError(f"--move-every {every:g} applies to --move drain or crash, not --move {model}")
    if model == "overflow" and load is None:
        raise ValueError("--move overflow needs --move-load N (requests in flight above which a session leaves)")
    if model != "overflow" and load is not None:
        raise ValueError(f"--move-load {load} applies to --move overflow, not --move {model}")
    if pull and model == "none":
        raise ValueError("--pull needs --move drain, crash or overflow (with --move none no session moves)")
    if model != "none" and args.replay_workers < 2:
        raise ValueError(f"--move {model} needs --workers >= 2 (a session moves to another worker), "
                         f"got --workers {args.replay_workers}")
    return model, None if every is None else every * 60.0, load, pull


DEFAULT_REPLAY_HOST_MEMORY = "0B"
"""The replay's default host tier per worker: none (the package default)."""


def resolve_replay_options(args: argparse.Namespace) -> None:
    """Fill each carry flag not given (None) from its `TRTLLM_MTP_CARRY_*` variable, else the
    replay's default, in place; a malformed variable is a ValueError naming it and its value."""
    import os

    table: tuple[tuple[str, Pinned[Any], object], ...] = (
        ("replay_memory", CARRY_MEMORY, DEFAULT_REPLAY_MEMORY),
        ("replay_host_memory", CARRY_HOST_MEMORY, DEFAULT_REPLAY_HOST_MEMORY),
        ("replay_eviction", CARRY_EVICTION, DEFAULT_CARRY_EVICTION),
        ("replay_row_dtype", CARRY_ROW_DTYPE, DEFAULT_CARRY_ROW_DTYPE),
        ("replay_idle_s", CARRY_IDLE_S, DEFAULT_CARRY_IDLE_S),
    )
    for dest, setting, default in table:
        if getattr(args, dest) is not None:
            continue
        setting.check_env()  # a malformed variable: the one error line, naming it
        raw = os.environ.get(setting.env_var)
        if raw is None:
            setattr(args, dest, default)
            continue
        raw = raw.strip()
        if setting is CARRY_MEMORY:  # a server takes a pool fraction; the replay has no pool
            _memory(raw, f"environment variable {setting.env_var}", allow_unbounded=False)
        setattr(args, dest, int(raw) if setting is CARRY_IDLE_S else raw)


def _memory(text: str, flag: str, allow_unbounded: bool) -> int | None:
    if allow_unbounded and text.strip().lower() in ("unbounded", "none"):
        return None
    mem = parse_carry_memory(text, what=flag)
    if mem.nbytes is None:
        raise ValueError(f"{flag}={text!r}: a replay has no drafter pool to take a fraction of; "
                         "give bytes with a unit (1GiB, 512MiB)")
    return mem.nbytes


def _policies(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ValueError(f"--carry-eviction {text!r} names no policy; expected some of {', '.join(EVICTION_POLICIES)}")
    return list(dict.fromkeys(check_eviction_policy(n, "--carry-eviction") for n in names))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `trace-replay` arguments (dests `replay_*`: they pin no process setting)."""
    from ..argtypes import non_negative_float, non_negative_int, positive_float, positive_int

    p.add_argument("trace", metavar="TRACE.jsonl",
                   help="a mooncake trace (timestamp ms, input_length, output_length, hash_ids) or one with "
                        "conversation ids (chat_id, parent_chat_id, timestamp s, turn, hash_ids); "
                        "the format is read from the first line")
    p.add_argument("--workers", dest="replay_workers", type=positive_int, default=1, metavar="N",
                   help="session-affine workers (a hash of the conversation), each with its own store; "
                        "figures are summed")
    p.add_argument("--carry-memory", dest="replay_memory", default=None, metavar="SIZE",
                   help="device budget per worker (bytes with a unit, or 'unbounded'); default env "
                        f"{ENV_CARRY_MEMORY} (bytes), else {DEFAULT_REPLAY_MEMORY} (the TensorRT-LLM adapter's)")
    p.add_argument("--carry-host-memory", dest="replay_host_memory", default=None, metavar="SIZE",
                   help=f"host tier budget per worker (0B: no host tier); default env {ENV_CARRY_HOST_MEMORY}, "
                        f"else {DEFAULT_REPLAY_HOST_MEMORY}")
    p.add_argument("--carry-eviction", dest="replay_eviction", default=None,
                   metavar="POLICY[,POLICY...]",
                   help=f"one policy or a comma list of {', '.join(EVICTION_POLICIES)}; default env "
                        f"{ENV_CARRY_EVICTION}, else {DEFAULT_CARRY_EVICTION}")
    p.add_argument("--carry-idle-s", dest="replay_idle_s", type=non_negative_int,
                   default=None, metavar="S",
                   help=f"idle time-to-live of an entry in seconds (0: never); default env {ENV_CARRY_IDLE_S}, "
                        f"else {DEFAULT_CARRY_IDLE_S}")
    rows = p.add_mutually_exclusive_group()
    rows.add_argument("--row-bytes", dest="replay_row_bytes", type=positive_int, metavar="N",
                      help=f"bytes of one drafter row (default {QWEN3_NEXT_MTP_ROW_BYTES}: Qwen3-Next's MTP "
                           "layer, 2 KV heads x 256 x K and V x bf16)")
    rows.add_argument("--model-config", dest="replay_model_config", metavar="PATH",
                      help="derive --row-bytes from a Hugging Face config.json (or its folder)")
    p.add_argument("--carry-row-dtype", dest="replay_row_dtype", choices=ROW_DTYPES,
                   default=None,
                   help="the carried rows' format, so their bytes (fp8: e4m3 plus one float32 scale per "
                        "row, K/V and head; nvfp4: e2m1 pairs, one e4m3 scale per 16 values and one e8m0 "
                        f"byte per row, K/V and head); default env {ENV_CARRY_ROW_DTYPE}, else {DEFAULT_CARRY_ROW_DTYPE}")
    p.add_argument("--kv-dtype", dest="replay_kv_dtype", choices=KV_DTYPES, default="auto",
                   help="the draft pool's KV format (kv_cache_config.dtype): auto (the model's dtype), or "
                        "fp8: float8_e4m3fn pages, whose rows the carry holds as their own bytes (one byte "
                        "an element, no scales, whatever --carry-row-dtype says), or nvfp4: e2m1 payload "
                        "and e4m3 block-scale pages, held as their own bytes (head_dim/2 + head_dim/16 a "
                        "vector, 576 B a Qwen3-Next MTP row); --row-bytes then names those bytes")
    p.add_argument("--prefill-tokens-per-s", dest="replay_prefill_rate", type=positive_float,
                   default=PREFILL_TOKENS_PER_S, metavar="R",
                   help="service model: prompt tokens prefilled per second")
    p.add_argument("--decode-s-per-token", dest="replay_decode_s", type=non_negative_float,
                   default=DECODE_S_PER_TOKEN, metavar="S",
                   help="service model: seconds per output token")
    p.add_argument("--host-copy-gbps", dest="replay_copy_gbps", type=positive_float, metavar="GB/S",
                   help="host-to-device copy rate for the restore time per adopted host turn "
                        "(default: measured here, memory to memory)")
    p.add_argument("--after-miss", dest="replay_after_miss", choices=AFTER_MISS,
                   default=AFTER_MISS[0],
                   help="what a follow-up that ran blind over its reused prefix [0, R) deposits: valid-run "
                        "(keys [R, N), the prefix known invalid; the next turn adopts them, blind below R: "
                        "what both executors do), nothing (no deposit, a gap: the conversation stays blind while "
                        "its prefix is reused), full (all N rows as if valid: an upper bound no executor reaches)")
    p.add_argument("--move", dest="replay_move", choices=MOVE_MODELS, default="none",
                   help="how sessions leave their worker: drain (every --move-every minutes one worker, "
                        "round-robin, stops gracefully and restarts empty), crash (the same, its rows lost), "
                        "overflow (a session leaves a worker with more than --move-load requests in flight "
                        "for the least-loaded one); needs --workers >= 2")
    p.add_argument("--move-every", dest="replay_move_every", type=positive_float, metavar="MIN",
                   help="minutes between restarts (--move drain or crash)")
    p.add_argument("--move-load", dest="replay_move_load", type=non_negative_int, metavar="N",
                   help="requests in flight on a worker (arrived, not finished by the service model) above "
                        "which a session leaves it (--move overflow)")
    p.add_argument("--pull", dest="replay_pull", action="store_true",
                   help="a moved session's rows follow it: a draining worker offers its entries to each "
                        "session's new worker, and a turn on a new worker reads its entry from the one that "
                        "holds it (counted as bytes moved); without it a moved session misses")
    p.add_argument("--json", dest="replay_json", metavar="PATH", help="also write the figures as JSON")


def measure_copy_gbps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Memory-to-memory copy rate of this machine, GB/s (median of `repeats` copies of `nbytes`)."""
    src = bytearray(nbytes)
    dst = bytearray(nbytes)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst[:] = src
        rates.append(nbytes / max(time.perf_counter() - t0, 1e-9) / 1e9)
    return sorted(rates)[len(rates) // 2]


def _fmt_bytes(n: int | None) -> str:
    """A byte figure by the one rule (`core.settings.format_bytes`); None: no budget."""
    from ..core.settings import format_bytes

    return "unbounded" if n is None else format_bytes(n)


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


_AFTER_MISS_SAYS = {
    "valid-run": "a blind turn deposits the keys it computed, [R, N); the next turn adopts them, blind below R",
    "nothing": "a blind turn deposits nothing; its conversation stays blind while its prefix is reused",
}


def _after_miss_line(r: PolicyResult) -> str:
    a = r.after_miss
    return (f"after a miss: {a.valid_runs} valid runs deposited ({a.replaced_fuller} replacing a fuller "
            f"entry), {a.gaps} gaps ({a.blind_after_gap} misses "
            f"blind after one); adopted rows cover {_pct(a.covered_keys, a.reused_keys_adopted)} of the "
            f"adopting turns' reused prefix keys ({_pct(a.covered_keys, a.reused_keys)} of every follow-up's)")


def _moves_says(model: str, every_min: float | None, load: int | None, pull: bool) -> str:
    if model == "overflow":
        what = (f"overflow: a session leaves a worker with more than {load} requests in flight for the "
                "least-loaded one")
    else:
        what = (f"{model}: every {every_min:g} min one worker (round-robin) "
                f"{'stops gracefully' if model == 'drain' else 'crashes'} and restarts empty")
    if not pull:
        return what + "; no pull (a moved session misses)"
    if model == "crash":
        return what + "; pull (a lost worker's rows cannot follow)"
    if model == "drain":
        return what + "; pull (its entries are offered to each session's new worker)"
    return what + "; pull (a moved session reads its entry from the worker that holds it)"


def _moves_line(r: PolicyResult) -> str:
    m = r.moves
    moved = sum(m.entries_moved.values())
    return (f"moves: {m.restarts} restarts, {m.session_moves} session moves; {m.moved_follow_ups} follow-ups "
            f"on another worker, {m.moved_adopted} adopted (remote {r.adopted_by_source['remote']}); "
            f"moved {moved} entries, {_fmt_bytes(sum(m.bytes_moved.values()))} (handoff "
            f"{m.entries_moved['handoff']}, {_fmt_bytes(m.bytes_moved['handoff'])}; pull "
            f"{m.entries_moved['pull']}, {_fmt_bytes(m.bytes_moved['pull'])}); refused by a peer "
            f"{m.handoff_refused}; lost {m.lost_entries} entries, {_fmt_bytes(m.lost_bytes)}, and "
            f"{m.lost_in_flight} running turns' deposits")


def report(results: list[PolicyResult], bound: BoundResult, copy_gbps: float | None) -> dict[str, Any]:
    """The JSON figures (module header)."""
    out: dict[str, Any] = {"policies": {}, "bound": {
        "follow_ups": bound.follow_ups, "adopted": bound.adopted,
        "adopted_fraction": round(bound.adopted_fraction, 6)}}
    for r in results:
        host_hits = r.adopted_by_tier["host"]
        restore_ms = (r.bytes_restored / (copy_gbps * 1e9) * 1e3 / host_hits
                      if host_hits and copy_gbps else 0.0)
        out["policies"][r.policy] = {
            "follow_ups": r.follow_ups, "adopted": r.adopted,
            "adopted_fraction": round(r.adopted_fraction, 6),
            "adopted_by_tier": r.adopted_by_tier,
            "distance_to_bound": bound.adopted - r.adopted,
            "misses": r.misses, "evictions": r.evictions, "refusals": r.refusals,
            "deposits": r.deposits, "peak_bytes": r.peak_bytes,
            "demotions": r.demotions, "bytes_restored": r.bytes_restored,
            "restore_ms_per_host_hit": round(restore_ms, 4),
            "adopted_by_source": r.adopted_by_source,
            "after_miss": {**dataclasses.asdict(r.after_miss),
                           "coverage_adopted": round(r.after_miss.coverage_adopted, 6),
                           "coverage": round(r.after_miss.coverage, 6)},
            "moves": dataclasses.asdict(r.moves),
        }
    return out


def run(args: argparse.Namespace) -> int:
    from .reader import read_trace
    from .replay import Moves, ReplayConfig, ServiceModel, clairvoyant_bound, replay

    resolve_replay_options(args)
    model, every_s, load, pull = replay_moves(args)
    budget = _memory(args.replay_memory, "--carry-memory", allow_unbounded=True)
    host = _memory(args.replay_host_memory, "--carry-host-memory", allow_unbounded=False) or 0
    policies = _policies(args.replay_eviction)
    row_bytes = replay_row_bytes(args.replay_row_dtype, args.replay_row_bytes, args.replay_model_config,
                                 args.replay_kv_dtype)
    row_format = carried_row_format(args.replay_row_dtype, args.replay_kv_dtype)
    if args.replay_json:
        from ..bench.options import output_path

        output_path(args.replay_json, "--json")
    config = ReplayConfig(budget, args.replay_workers, host, float(args.replay_idle_s) or None, row_bytes,
                          ServiceModel(args.replay_prefill_rate, args.replay_decode_s),
                          args.replay_after_miss, Moves(model, every_s, load, pull))
    t0 = time.perf_counter()
    trace = read_trace(args.trace)
    t_read = time.perf_counter() - t0
    from ..progress import progress

    # one step for the clairvoyant bound (a pass over the whole trace of its own, as long as a
    # policy's), then one per policy; the bar names the step it is on
    with progress(1 + len(policies), "trace-replay", "step") as bar:
        bar.set_postfix_str("clairvoyant bound")
        bound = clairvoyant_bound(trace, config)
        bar.update()
        results = []
        for name in policies:
            bar.set_postfix_str(name)
            results.append(replay(trace, name, config))
            bar.update()
    t_all = time.perf_counter() - t0
    copy_gbps = args.replay_copy_gbps or (measure_copy_gbps() if host else None)
    print(f"trace {args.trace} ({trace.format}): {len(trace)} requests, {trace.conversations} conversations, "
          f"{trace.follow_ups} follow-up turns")
    print(f"{config.workers} worker(s), each: carry memory {_fmt_bytes(budget)}, host {_fmt_bytes(host)}, "
          f"idle TTL {args.replay_idle_s or 'never'} s; {row_bytes} B a row "
          f"({row_format}); service "
          f"{config.service.prefill_tokens_per_s:g} prompt tokens/s + {config.service.decode_s_per_token:g} s "
          f"an output token")
    after_miss = config.after_miss != "full"
    if after_miss:
        print(f"after a miss: {config.after_miss} ({_AFTER_MISS_SAYS[config.after_miss]})")
    if model != "none":
        print(f"moves: {_moves_says(model, args.replay_move_every, load, pull)}")
    print(f"clairvoyant bound: {bound.adopted} of {bound.follow_ups} follow-ups adopted "
          f"({_pct(bound.adopted, bound.follow_ups)}{'' if model == 'none' else '; no moves'})")
    width = max(len(r.policy) for r in results)
    for r in results:
        tiers = r.adopted_by_tier
        print(f"{r.policy:<{width}}  adopted {r.adopted} ({_pct(r.adopted, r.follow_ups)}; device "
              f"{tiers['device']}, host {tiers['host']}), {bound.adopted - r.adopted} below the bound; "
              f"peak device {_fmt_bytes(r.peak_bytes['device'])}, host {_fmt_bytes(r.peak_bytes['host'])}")
        misses = ", ".join(f"{k} {v}" for k, v in r.misses.items()) or "none"
        evictions = ", ".join(f"{k} {v}" for k, v in r.evictions.items() if v) or "none"
        refusals = ", ".join(f"{k} {v}" for k, v in r.refusals.items() if v) or "none"
        print(f"{'':<{width}}  misses: {misses}; evictions: {evictions}; refused: {refusals}")
        if after_miss:
            print(f"{'':<{width}}  {_after_miss_line(r)}")
        if model != "none":
            print(f"{'':<{width}}  {_moves_line(r)}")
        if tiers["host"] and copy_gbps:
            per = r.bytes_restored / (copy_gbps * 1e9) * 1e3 / tiers["host"]
            print(f"{'':<{width}}  restore: {_fmt_bytes(r.bytes_restored)} back from host, {per:.2f} ms per "
                  f"adopted host turn at {copy_gbps:.1f} GB/s"
                  f"{' (given)' if args.replay_copy_gbps else ' (measured here, memory to memory)'}")
    print(f"replayed in {t_all:.1f} s (reading the trace {t_read:.1f} s)")
    if args.replay_json:
        out = report(results, bound, copy_gbps)
        out["trace"] = {"path": str(args.trace), "format": trace.format, "requests": len(trace),
                        "conversations": trace.conversations, "follow_ups": trace.follow_ups}
        out["config"] = {"workers": config.workers, "carry_memory_bytes": budget, "host_memory_bytes": host,
                         "idle_s": args.replay_idle_s, "row_bytes": row_bytes,
                         "row_dtype": args.replay_row_dtype, "kv_dtype": args.replay_kv_dtype,
                         "row_format": row_format,
                         "prefill_tokens_per_s": config.service.prefill_tokens_per_s,
                         "decode_s_per_token": config.service.decode_s_per_token,
                         "host_copy_gbps": copy_gbps, "after_miss": config.after_miss,
                         "moves": {"model": model, "every_min": args.replay_move_every, "load": load,
                                   "pull": pull}}
        Path(args.replay_json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


__all__ = ["DEFAULT_REPLAY_MEMORY", "add_arguments", "measure_copy_gbps", "replay_row_bytes", "report",
           "row_bytes_from_config", "row_format_from_config", "run"]
