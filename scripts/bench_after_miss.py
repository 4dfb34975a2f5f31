#!/usr/bin/env python3
"""Acceptance after a miss, on the reference engine and on the TensorRT-LLM STAND-IN executor (CPU).

What it measures: the drafts accepted on the turns AFTER a miss (a warm turn that finds no
carried entry of its conversation, so its drafter runs blind over the reused prefix [0, R)),
under what the turn after the miss deposits. Behaviours, each on its own executor:

- `valid-run`: what both executors do: the blind turn deposits the keys it computed itself,
  [R, N - 1) (below R a TensorRT-LLM draft pool's pages hold stale bytes, never rows of this
  conversation); the next turn adopts that run, keys [R, its own R), and stays blind below R.
- `nothing`: the blind turn deposits nothing, so every later turn of the conversation finds
  nothing and runs blind too, for as long as its prefix is reused (the adapter's former gap).
  This script makes it by withholding, in each executor, the deposit of any turn whose valid
  run does not start at key 0 (the package has no such option).
- `rebuild` (the upper bound): the full drafter context every turn (the reference engine's
  `rebuild` policy; the stand-in with block reuse off, every turn prefilled from position 0).
- `blind` (the lower bound): no carry at all (TensorRT-LLM as it is).

The miss is forced: before turn `--miss-turn` of every conversation its carried entry is
dropped (`forget_session` on the reference runtime, `forget_conversation` on the adapter), so
that turn runs blind under `valid-run` and `nothing` alike; the figures are the turns after it.
Greedy outputs are checked identical across the behaviours (the carry never changes tokens;
the script exits 1 if any differs). Acceptance depends on the tokens and the drafter's
arithmetic, not on time: the counts are exact and the same run to run on one machine.

Sessions: the bench's built-in sessions (held-out code conversations: the user shows code,
later turns ask to quote or edit it). On the stand-in each prompt is padded with spaces in
its last user message to a multiple of the prefill chunk, so a warm turn's reused depth R is
chunk-aligned and a rebuild computes bit-equal rows; the reference engine runs them as the
bench does (its prefix cache reuses at block and snapshot boundaries).

    python scripts/bench_after_miss.py                # 8 sessions x 6 turns, 1k history, miss at turn 1
    python scripts/bench_after_miss.py --quick        # 2 sessions x 4 turns, 320-token history
    python scripts/bench_after_miss.py --executors standin --json after-miss.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from trtllm_mtp_carry.bench.main import engine_config
from trtllm_mtp_carry.bench.sessions import BenchSession, builtin_sessions
from trtllm_mtp_carry.core import session_hash
from trtllm_mtp_carry.engine.engine import ReferenceEngine
from trtllm_mtp_carry.engine.model import HybridLM, load_reference
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer

BEHAVIOURS = ("rebuild", "valid-run", "nothing", "blind")
CARRYING = ("valid-run", "nothing")
EXECUTORS = ("reference", "standin")
QUICK = {"sessions": 2, "turns": 4, "history": 320, "new_span": 64, "max_new": 16, "chunk": 64}


def withhold_reference(runtime: Any) -> list[int]:
    """`nothing` on the reference runtime: a turn whose rows do not start at key 0 (a blind
    turn's valid run) is released, not deposited. Returns the list the withheld turns' ids go to."""
    finish, pool, withheld = runtime.finish, runtime.backend.drafter_pool, []

    def finish_or_withhold(seq_id: int, session_hash: int, tokens: Any, *args: Any, **kwargs: Any) -> bool:
        if pool.has_sequence(seq_id):
            runs = pool.sequence_runs(seq_id)  # ((first_key, count), ...) in row order
            if runs and runs[0][0] > 0:
                withheld.append(seq_id)
                runtime.release(seq_id, "not_deposited")
                return False
        return bool(finish(seq_id, session_hash, tokens, *args, **kwargs))

    runtime.finish = finish_or_withhold
    return withheld


def withhold_standin(manager: Any) -> list[int]:
    """`nothing` on the TensorRT-LLM adapter: a freed request whose valid run does not start at
    key 0 deposits nothing (its lease ends as `not_deposited`, as any turn that deposits nothing)."""
    deposit, withheld = manager._deposit, []

    def deposit_or_withhold(rid: int, request: Any, live: Any) -> bool:
        if live is not None and live.key is not None and not request.is_dummy_request:
            lo, _ = live.valid_run(len(request.get_tokens(0)))
            if lo > 0:
                withheld.append(rid)
                return False
        return bool(deposit(rid, request, live))

    manager._deposit = deposit_or_withhold
    return withheld


def _record(executor: str, behaviour: str, session: str, turn: int, **fields: Any) -> dict[str, Any]:
    return {"executor": executor, "behaviour": behaviour, "session": session, "turn": turn, **fields}


def run_reference(model: HybridLM, tok: ChatTokenizer, sessions: list[BenchSession], behaviour: str,
                  args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every session's turns on a fresh reference engine under `behaviour`, one turn at a time
    (as `bench` at concurrency 1); the records and the carry's counters."""
    sizes = SimpleNamespace(new_span=args.new_span, max_new_tokens=args.max_new, concurrency=1,
                            target_blocks=None, drafter_blocks=None, chunk=512, draft_len=args.draft_len,
                            dtype="float32")
    policy = behaviour if behaviour in ("rebuild", "blind") else "carry"
    config = replace(engine_config(sizes, model.cfg.max_position, tok, sessions, "cpu"), policy=policy)
    engine = ReferenceEngine(model, tok, config)
    engine.generate(None, tok.render_chat([{"role": "user", "content": "warm up"}]), max_new_tokens=4)
    runtime = engine.runtime
    withheld = withhold_reference(runtime) if behaviour == "nothing" else []
    records = []
    for s in sessions:
        prompt = tok.render_chat(s.history)
        for t in range(args.turns):
            if t == args.miss_turn and runtime.carries():
                runtime.forget_session(session_hash(s.name))
            r = engine.generate(s.name, prompt, max_new_tokens=args.max_new)
            st = r.stats
            records.append(_record("reference", behaviour, s.name, t, reused=st.reused_tokens,
                                   outcome=(st.outcome_kind + (f" ({st.no_carry_reason})" if st.no_carry_reason
                                                               else "")),
                                   rows_adopted=st.drafter_rows_kept, drafted=st.drafted, accepted=st.accepted,
                                   verify_steps=st.verify_steps, output=list(r.output)))
            if t + 1 < args.turns:
                prompt = tok.next_prompt(r.prompt, r.output, s.followups[t])
    engine.check()
    stats = runtime.stats()
    return records, {"withheld": len(withheld), "deposits": stats.deposits, "outcomes": dict(stats.outcomes),
                     "evictions": dict(stats.evictions) if hasattr(stats, "evictions") else {}}


def _aligned(text: str, prefix_len: int, render: Callable[[str], list[int]], chunk: int) -> list[int]:
    """`render(text + spaces)`, padded so that `prefix_len` plus it is a multiple of `chunk`."""
    n = len(render(text))
    return render(text + " " * ((-(prefix_len + n)) % chunk))


def run_standin(model: HybridLM, tok: ChatTokenizer, sessions: list[BenchSession], behaviour: str,
                args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every session's turns on a fresh stand-in executor under `behaviour` (the carry attached
    in process for `valid-run` and `nothing`), one turn at a time; the records and the carry's counters."""
    from trtllm_mtp_carry.trtllm import attach
    from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG
    from trtllm_mtp_carry.trtllm.standin import ConversationParams, StandinLLM

    chunk = args.chunk
    llm = StandinLLM(model, single_process=True, chunk_size=chunk, max_batch=1, max_draft_len=args.draft_len,
                     prefix_entries=4 * len(sessions), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG,
                     enable_block_reuse=behaviour != "rebuild")
    carry = attach(llm, {"carry_slots": len(sessions)}) if behaviour in CARRYING else None
    if carry is not None and not carry.armed:
        raise RuntimeError(f"the carry did not arm on the stand-in: {carry.reason}")
    withheld = withhold_standin(carry.manager) if carry is not None and behaviour == "nothing" else []
    warm = llm.generate_async(tok.render_chat([{"role": "user", "content": "warm up"}]), 4)
    llm.run_until_done()
    del warm
    records = []
    for s in sessions:
        head = tok.render_chat(s.history[:-1], add_generation_prompt=False)
        prompt = head + _aligned(s.history[-1]["content"], len(head),
                                 lambda u: tok.render_chat([{"role": "user", "content": u}]), chunk)
        for t in range(args.turns):
            if t == args.miss_turn and carry is not None:
                carry.forget_conversation(s.name)
            req = llm.generate_async(prompt, args.max_new,
                                     conversation_params=ConversationParams(conversation_id=s.name))
            llm.run_until_done()
            turn = (carry.turn(req.py_request_id) if carry is not None else None) or {}
            outcome = str(turn.get("outcome", ""))
            if turn.get("no_carry_reason"):
                outcome += f" ({turn['no_carry_reason']})"
            records.append(_record("standin", behaviour, s.name, t, reused=req.reused, outcome=outcome,
                                   rows_adopted=int(turn.get("rows_adopted", 0)), drafted=req.drafted,  # type: ignore[call-overload]
                                   accepted=req.accepted, verify_steps=req.verify_steps,
                                   output=list(req.output)))
            if t + 1 < args.turns:
                prompt = req.prompt + _aligned(
                    s.followups[t], len(req.prompt),
                    lambda u, r=req: tok.next_prompt(r.prompt, r.output, u)[len(r.prompt):], chunk)
    llm.executor.check()
    counters: dict[str, Any] = {"withheld": len(withheld)}
    if carry is not None:
        stats = carry.stats()
        counters.update(deposits=stats.deposits, outcomes=dict(stats.outcomes))
    return records, counters


RUNNERS = {"reference": run_reference, "standin": run_standin}


def _pooled(recs: list[dict[str, Any]]) -> tuple[int, int, int]:
    return (sum(r["accepted"] for r in recs), sum(r["drafted"] for r in recs),
            sum(r["verify_steps"] for r in recs))


def summarize(records: list[dict[str, Any]], executor: str, miss_turn: int) -> dict[str, dict[str, Any]]:
    """Per behaviour, over `executor`'s turns after the miss: pooled counts, accepted per step,
    and per conversation accepted per step (median, min, max)."""
    out = {}
    for b in BEHAVIOURS:
        after = [r for r in records if r["executor"] == executor and r["behaviour"] == b and r["turn"] > miss_turn]
        if not after:
            continue
        acc, drafted, steps = _pooled(after)
        per_conv, by_conv = [], {}
        for name in dict.fromkeys(r["session"] for r in after):
            a, _, st = _pooled([r for r in after if r["session"] == name])
            per_conv.append(a / st if st else 0.0)
            by_conv[name] = a
        out[b] = {"turns": len(after), "accepted": acc, "drafted": drafted, "verify_steps": steps,
                  "acceptance": acc / drafted if drafted else 0.0,
                  "accepted_per_step": acc / steps if steps else 0.0,
                  "per_conversation": (statistics.median(per_conv), min(per_conv), max(per_conv)),
                  "by_conversation": by_conv,  # accepted drafts after the miss, per conversation
                  "rows_adopted": sum(r["rows_adopted"] for r in after),
                  "reused": sum(r["reused"] for r in after),
                  "adopted_turns": sum(r["outcome"].startswith("adopted") for r in after)}
    return out


def report(records: list[dict[str, Any]], counters: dict[tuple[str, str], dict[str, Any]],
           executors: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Print the tables; return the summaries (for `--json`)."""
    summaries = {}
    for ex in executors:
        summary = summarize(records, ex, args.miss_turn)
        summaries[ex] = summary
        name = {"reference": "reference engine", "standin": "TensorRT-LLM stand-in (not TensorRT-LLM)"}[ex]
        after = args.turns - 1 - args.miss_turn
        print(f"\n{name}: {args.sessions} conversations, miss forced at turn {args.miss_turn}, "
              f"turns {args.miss_turn + 1}..{args.turns - 1} measured ({after} a conversation); "
              f"draft length {args.draft_len}; outputs identical across {', '.join(BEHAVIOURS)}")
        print("| behaviour | turns | accepted / drafted | acceptance | accepted per step | "
              "per conversation: median (min-max) | turns adopted | rows adopted / reused keys |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for b, s in summary.items():
            med, lo, hi = s["per_conversation"]
            print(f"| {b} | {s['turns']} | {s['accepted']} / {s['drafted']} | {s['acceptance']:.3f} | "
                  f"{s['accepted_per_step']:.3f} | {med:.3f} ({lo:.3f}-{hi:.3f}) | {s['adopted_turns']} | "
                  f"{s['rows_adopted']} / {s['reused']} |")
        # accepted per step, pooled over the conversations, turn by turn (the miss turn marked)
        turns = range(1, args.turns)
        print("| accepted / verify steps by turn | " + " | ".join(
            f"turn {t}{' (miss)' if t == args.miss_turn else ''}" for t in turns) + " |")
        print("|---|" + "---:|" * len(turns))
        for b in BEHAVIOURS:
            cells = []
            for t in turns:
                a, _, st = _pooled([r for r in records if r["executor"] == ex and r["behaviour"] == b
                                    and r["turn"] == t])
                cells.append(f"{a}/{st}")
            print(f"| {b} | " + " | ".join(cells) + " |")
        if {"rebuild", "valid-run", "nothing"} <= summary.keys():
            gap = summary["rebuild"]["accepted"] - summary["nothing"]["accepted"]
            got = summary["valid-run"]["accepted"] - summary["nothing"]["accepted"]
            share = f", {got / gap:.0%} of rebuild's" if gap > 0 else ""
            print(f"accepted drafts over nothing's, {summary['nothing']['turns']} turns: valid-run {got:+d}, "
                  f"rebuild {gap:+d}{share}")
            diffs = [summary["valid-run"]["by_conversation"][n] - summary["nothing"]["by_conversation"][n]
                     for n in summary["nothing"]["by_conversation"]]
            print(f"valid-run - nothing, accepted drafts per conversation: median {statistics.median(diffs):+g} "
                  f"({min(diffs):+d}..{max(diffs):+d}); more in {sum(d > 0 for d in diffs)}, the same in "
                  f"{sum(d == 0 for d in diffs)}, fewer in {sum(d < 0 for d in diffs)} of {len(diffs)}")
        for b in CARRYING:
            c = counters.get((ex, b))
            if c:
                print(f"{b} carry counters: " + json.dumps(c))
        order = [summary[b]["accepted"] for b in BEHAVIOURS if b in summary]
        print("accepted drafts rebuild >= valid-run >= nothing >= blind:",
              all(x >= y for x, y in pairwise(order)))
    return summaries


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executors", default=",".join(EXECUTORS), help="comma-separated: reference, standin")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6, help="turns per conversation (the first is cold)")
    ap.add_argument("--history", type=int, default=1024, help="tokens of history before turn 0")
    ap.add_argument("--new-span", type=int, default=128, help="tokens each later user message adds")
    ap.add_argument("--max-new", type=int, default=32, help="answer length cap per turn")
    ap.add_argument("--draft-len", type=int, default=2, help="draft tokens per verify step, 1..3")
    ap.add_argument("--chunk", type=int, default=64, help="the stand-in's prefill chunk (prompts padded to it)")
    ap.add_argument("--miss-turn", type=int, default=1, help="the turn whose carried entry is dropped first")
    ap.add_argument("--quick", action="store_true",
                    help="defaults for a quick run: 2 sessions x 4 turns, 320-token history, 64-token spans, "
                         "16-token answers, 64-token chunks (flags given beside it win)")
    ap.add_argument("--json", help="write the per-turn records and the summaries here")
    if ap.parse_args(argv).quick:  # quick's sizes are defaults: a flag given beside it wins
        ap.set_defaults(**QUICK)
    args = ap.parse_args(argv)
    prog = Path(sys.argv[0]).name
    executors = [e.strip() for e in args.executors.split(",") if e.strip()]
    bad = [e for e in executors if e not in EXECUTORS]
    problem = (f"--executors: unknown executor {bad[0]!r} (reference, standin)" if bad else
               "--executors: name at least one executor" if not executors else
               f"--miss-turn must be in 1..{args.turns - 2} (a warm turn, and one after it), "
               f"got {args.miss_turn}" if not 1 <= args.miss_turn <= args.turns - 2 else
               f"--draft-len must be in 1..3, got {args.draft_len}" if not 1 <= args.draft_len <= 3 else
               f"--chunk must be a positive multiple of 16, got {args.chunk}"
               if args.chunk <= 0 or args.chunk % 16 else
               next((f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}"
                     for k in ("sessions", "history", "new_span", "max_new") if getattr(args, k) < 1), None))
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    model, tok = load_reference()
    sessions = builtin_sessions(args.sessions, args.turns, args.history, args.new_span, tok)
    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    counters: dict[tuple[str, str], dict[str, Any]] = {}
    for ex in executors:
        for b in BEHAVIOURS:
            recs, counters[(ex, b)] = RUNNERS[ex](model, tok, sessions, b, args)
            records += recs
        outputs = {b: [(r["session"], r["turn"], r["output"]) for r in records
                       if r["executor"] == ex and r["behaviour"] == b] for b in BEHAVIOURS}
        differ = [b for b in BEHAVIOURS if outputs[b] != outputs["rebuild"]]
        if differ:
            print(f"{prog}: outputs differ on the {ex} executor: {', '.join(differ)} against rebuild",
                  file=sys.stderr)
            return 1
    summaries = report(records, counters, executors, args)
    print(f"\n({time.perf_counter() - t0:.1f} s; torch {torch.__version__}, 1 thread)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summaries": summaries, "records": records,
                       "counters": {f"{e}/{b}": c for (e, b), c in counters.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
