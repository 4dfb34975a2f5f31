#!/usr/bin/env python3
"""Carry vs blind vs rebuild on the TensorRT-LLM STAND-IN executor (CPU; not TensorRT-LLM).

What it measures: the adapter (`trtllm_mtp_carry.trtllm`, attached unchanged)
on the stand-in executor that follows TensorRT-LLM's PyExecutor protocol, at
a long history. Policies: `carry` (attached), `blind` (TensorRT-LLM as is:
fresh draft pages over the reused prefix), `rebuild` (block reuse off: every
turn prefills from position 0). One executor per policy, in one process;
each (session, turn) runs under the three policies back to back, so every
per-turn ratio is paired. Figures: medians (p25-p75) over the warm turns.

Workload: held-out code sessions cycled to about `--history` tokens (the user
shows code, the model acknowledges it); each later turn asks to repeat one of
the functions shown in the history, so the answer copies the reused prefix.
Prompts are padded to a multiple of the prefill chunk, so a warm turn's
reused depth is chunk-aligned (rebuild then computes bit-equal rows).

    python scripts/trtllm_standin_bench.py --history 8192 --sessions 3 --turns 4
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from itertools import cycle

import torch

from trtllm_mtp_carry.bench.sessions import load_conversations
from trtllm_mtp_carry.bench.stats import Spread, paired_ratio
from trtllm_mtp_carry.engine.model import load_reference
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer
from trtllm_mtp_carry.trtllm import attach
from trtllm_mtp_carry.trtllm.standin import ConversationParams, StandinLLM

POLICIES = ("carry", "blind", "rebuild")


def session_history(offset: int, history: int, tok: ChatTokenizer) -> tuple[list[dict], list[str]]:
    """Messages (first user turns of held-out conversations) to about `history` tokens, and the
    names of the functions they show."""
    pool = load_conversations()
    messages: list[dict] = []
    names: list[str] = []
    size = 0
    for conv in cycle(pool[offset:] + pool[:offset]):
        first = next(j for j, m in enumerate(conv) if m["role"] == "user")
        part = conv[: first + 2]  # (system,) user shows code, assistant acknowledges
        shown = re.findall(r"defines `([^`]+)`", part[-1]["content"]) if len(part) > first + 1 else []
        if not shown or any(m["role"] == "system" for m in part[1:]):
            continue
        messages += [m for m in part if m["role"] != "system"]
        names.append(shown[0])
        size += sum(len(tok.render_message(m["role"], m["content"])) for m in part)
        if size >= history:
            break
    return messages, names


def pad(tokens_for: callable, text: str, prefix: int, chunk: int) -> list[int]:  # type: ignore[valid-type]
    n = len(tokens_for(text))
    return tokens_for(text + " " * ((-(prefix + n)) % chunk))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=8192)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4, help="turns per session (the first is cold)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    ap.add_argument("--json", help="write per-turn records here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = load_reference()
    llms = {}
    for p in POLICIES:
        llms[p] = StandinLLM(model, chunk_size=args.chunk, max_batch=1, num_pages=16384,
                             prefix_entries=4 * args.sessions,
                             enable_block_reuse=p != "rebuild")
    carry = attach(llms["carry"], {"carry_slots": args.sessions})
    warm = StandinLLM(model, chunk_size=args.chunk)  # warm-up: torch's first calls are slow
    warm.generate_async(tok.render_chat([{"role": "user", "content": "warm up"}]), 8)
    warm.run_until_done()

    records = []
    for s in range(args.sessions):
        history, names = session_history(7 * s, args.history, tok)
        head = tok.render_chat(history[:-1], add_generation_prompt=False)
        prompt = head + pad(lambda t: tok.render_chat([{"role": "user", "content": t}]),
                            history[-1]["content"], len(head), args.chunk)
        prompts = dict.fromkeys(POLICIES, prompt)
        for turn in range(args.turns):
            outs = {}
            for p in POLICIES:  # the same session and turn under each policy, back to back
                llm = llms[p]
                t0 = time.perf_counter()
                req = llm.generate_async(prompts[p], args.max_new, conversation_params=
                                         ConversationParams(conversation_id=f"s{s}"))
                while not req.is_context_finished:
                    llm.executor.step()
                ttft = (time.perf_counter() - t0) * 1e3
                llm.run_until_done()
                outs[p] = req.output
                records.append({"session": s, "turn": turn, "policy": p, "ttft_ms": ttft,
                                "reused": req.reused, "prompt": len(req.prompt),
                                "accepted": req.accepted, "verify_steps": req.verify_steps,
                                "acceptance": req.accepted / max(req.verify_steps, 1)})
                ask = f"Repeat `{names[turn % len(names)]}` exactly."
                prompts[p] = req.prompt + pad(
                    lambda u, r=req: tok.next_prompt(r.prompt, r.output, u)[len(r.prompt):],
                    ask, len(req.prompt), args.chunk)
            if not outs["carry"] == outs["blind"] == outs["rebuild"]:
                print(f"outputs differ at session {s} turn {turn}", file=sys.stderr)
                return 1
    warm_recs = [r for r in records if r["turn"] > 0]

    def col(p: str, key: str) -> list[float]:
        return [r[key] for r in warm_recs if r["policy"] == p]

    def fmt(sp: Spread, digits: int = 1) -> str:
        return f"{sp.median:.{digits}f} ({sp.p25:.{digits}f}-{sp.p75:.{digits}f})"

    print(f"history ~{args.history} tokens, {args.sessions} sessions x {args.turns - 1} warm turns, "
          f"chunk {args.chunk}, answers up to {args.max_new} tokens; outputs identical")
    print("| policy | warm TTFT ms | reused tokens | acceptance (accepted / verify step) |")
    print("|---|---:|---:|---:|")
    for p in POLICIES:
        print(f"| {p} | {fmt(Spread.of(col(p, 'ttft_ms')))} | "
              f"{fmt(Spread.of(col(p, 'reused')), 0)} | {fmt(Spread.of(col(p, 'acceptance')), 3)} |")
    print("| paired ratio | carry/blind | carry/rebuild |")
    print("|---|---:|---:|")
    for key in ("ttft_ms", "acceptance"):
        cells = []
        for other in ("blind", "rebuild"):
            pr = paired_ratio(col("carry", key), col(other, key), key, other)
            cells.append(pr.reason or fmt(pr.spread, 3))
        print(f"| {key} | {cells[0]} | {cells[1]} |")
    print("carry stats:", json.dumps({k: v for k, v in carry.stats().items()
                                       if k in ("outcomes", "rows_scattered", "deposits")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
