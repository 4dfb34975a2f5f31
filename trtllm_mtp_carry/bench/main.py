"""`trtllm-mtp-carry bench`: replay sessions under each policy and report side by side."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..core import marconi_min_tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench's options (no torch needed to build the parser)."""
    p.add_argument("--policies", default="carry,rebuild,blind",
                   help="comma-separated drafter policies to compare (carry, rebuild, blind, off)")
    p.add_argument("--sessions", type=int, default=2, help="number of built-in sessions")
    p.add_argument("--turns", type=int, default=3, help="turns per built-in session (first is cold)")
    p.add_argument("--history", type=int, default=1024, help="tokens of history before turn 1")
    p.add_argument("--new-span", type=int, default=128, help="tokens each warm turn adds")
    p.add_argument("--conversations", metavar="PATH.jsonl",
                   help="replay your own chat conversations ({'messages': [...]} per line) instead")
    p.add_argument("--max-new-tokens", type=int, default=48, help="answer length cap per turn")
    p.add_argument("--draft-len", type=int, default=2, help="draft tokens per verify step (1..3)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size (multiple of 16)")
    p.add_argument("--concurrency", type=int, default=1, help="sessions in flight at once")
    p.add_argument("--interleave", action="store_true",
                   help="alternate sessions turn by turn, so the single carry slot is contested")
    p.add_argument("--device", default="cpu", help="torch device (cuda where there is one)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--weights", metavar="DIR", help="reference.safetensors + reference.json directory")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="plot per-turn drafter prep and acceptance")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from ..engine.engine import EngineConfig
    from ..engine.model import load_reference
    from ..runtime.policy import DrafterPolicy
    from . import report
    from .replay import replay_lockstep
    from .sessions import builtin_sessions, load_conversations, sessions_from_conversations

    policies = [DrafterPolicy.parse(p.strip()) for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise ValueError(f"--policies names no policy: {args.policies!r}")
    for name in ("sessions", "turns", "history", "new_span", "max_new_tokens", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_reference(path=args.weights)
    if args.conversations:
        sessions = sessions_from_conversations(load_conversations(args.conversations))
    else:
        sessions = builtin_sessions(args.sessions, args.turns, args.history, args.new_span, tokenizer)
    longest = max(len(tokenizer.render_chat(s.history)) + len(s.followups) * (args.new_span + args.max_new_tokens + 8)
                  for s in sessions)
    max_len = min(model.cfg.max_position, max(4096, 1 << (longest - 1).bit_length()))
    config = EngineConfig(
        max_model_len=max_len, num_target_blocks=max(4096, 2 * max_len * args.concurrency // 16),
        num_drafter_blocks=max(1024, 2 * max_len * args.concurrency // 16),
        prefill_chunk=args.chunk, draft_len=args.draft_len, max_num_seqs=args.concurrency,
        device=args.device, dtype=args.dtype, snapshot_budget_mb=256,
    )
    total = len(policies) * sum(1 + len(s.followups) for s in sessions)
    bar = tqdm(total=total, desc="bench", unit="turn", disable=args.no_progress, file=sys.stderr)
    started = time.perf_counter()
    runs = replay_lockstep(model, tokenizer, sessions, policies, config, args.max_new_tokens,
                           args.concurrency, args.interleave, on_turn=lambda: bar.update(1))
    bar.close()
    summary = {r.policy: report.summaries(r) for r in runs}
    identical = report.outputs_identical(runs)
    print(report.turn_table(runs))
    print()
    print(report.summary_table(summary))
    print(f"\noutputs identical across policies: {identical}   "
          f"(restore threshold {marconi_min_tokens()}, {time.perf_counter() - started:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_json(args, runs, summary, identical), f, indent=1)
    if args.plot:
        report.plot(runs, args.plot)
    return 0 if identical else 1


def _json(args: argparse.Namespace, runs: list[Any], summary: dict[str, Any],
          identical: bool) -> dict[str, Any]:
    from . import report
    return {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "marconi_min_tokens": marconi_min_tokens(),
        "policies": {
            r.policy: {
                "turns": [{"session": t.session, "turn": t.turn, **t.stats,
                           "output": t.output} for t in r.turns],
                "summary": summary[r.policy],
                "runtime": r.runtime,
            }
            for r in runs
        },
        "ratios": {f"carry/{o}": report.ratios(summary, "carry", o) for o in ("rebuild", "blind")},
        "outputs_identical": identical,
    }
