#!/usr/bin/env python3
"""Carry vs blind vs rebuild on the TensorRT-LLM STAND-IN executor (CPU; not TensorRT-LLM).

What it measures: the adapter (`trtllm_mtp_carry.trtllm`, installed unchanged
by the worker-process path, `TRTLLM_MTP_CARRY_WORKER`) on the stand-in executor
that follows TensorRT-LLM's PyExecutor source, at a long history. Policies:
`carry` (installed in the stand-in's worker-side executor), `blind` (TensorRT-LLM as is:
fresh draft pages over the reused prefix), `rebuild` (block reuse off: every
turn prefills from position 0). One executor per policy, in one process;
each (session, turn) runs under the three policies back to back, so every
per-turn ratio is paired. Figures: medians (p25-p75) over the warm turns.

Workload: held-out code sessions cycled to about `--history` tokens (the user
shows code, the model acknowledges it); each later turn asks to repeat one of
the functions shown in the history, so the answer copies the reused prefix.
Prompts are padded to a multiple of the prefill chunk, so a warm turn's
reused depth is chunk-aligned (rebuild then computes bit-equal rows).

Reuse: the stand-in's hybrid target reuses a prefix only at its snapshot points, as
TensorRT-LLM's `MambaHybridCacheManagerV2` does; every policy runs under the recommended
placement (`kv_cache_config.mamba_state_config.additional_snapshot_offsets_from_end: [0]`,
`--snapshot-placement end`), or under none (`none`: block reuse on, no snapshot point: no
warm turn reuses anything and the worker hook stands aside). The reused depth R of every
warm turn is printed next to the previous turn's prompt length.

    python scripts/trtllm_standin_bench.py --history 8192 --sessions 3 --turns 4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from itertools import cycle
from pathlib import Path

import torch

from trtllm_mtp_carry.bench.sessions import load_conversations
from trtllm_mtp_carry.bench.stats import Spread, paired_ratio
from trtllm_mtp_carry.engine.model import load_reference
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer
from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, worker
from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG
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
    ap.add_argument("--snapshot-placement", choices=("end", "none"), default="end",
                    help="the hybrid target's mamba_state_config: a snapshot at each prompt's end "
                         "(the recommended placement), or none")
    args = ap.parse_args(argv)
    kv_cache_config = (RECOMMENDED_KV_CACHE_CONFIG if args.snapshot_placement == "end"
                       else {"enable_block_reuse": True})
    torch.set_num_threads(1)
    model, tok = load_reference()
    llms = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "carry.yaml"
        config.write_text(f"mtp_carry: {{carry_slots: {args.sessions}}}\n")
        for p in POLICIES:
            if p == "carry":  # the executor "in a worker": only the worker hook can install it
                os.environ[worker.ENV] = str(config)
            llms[p] = StandinLLM(model, single_process=p != "carry", chunk_size=args.chunk,
                                 max_batch=1, num_pages=16384, prefix_entries=4 * args.sessions,
                                 kv_cache_config=kv_cache_config, enable_block_reuse=p != "rebuild")
            os.environ.pop(worker.ENV, None)
    carry = llms["carry"].executor.resource_manager.resource_managers.get(CARRY_MANAGER_KEY)
    warm = StandinLLM(model, single_process=True, chunk_size=args.chunk,
                      kv_cache_config=kv_cache_config)  # warm-up: torch's first calls are slow
    warm.generate_async(tok.render_chat([{"role": "user", "content": "warm up"}]), 8)
    warm.run_until_done()

    records = []
    for s in range(args.sessions):
        history, names = session_history(7 * s, args.history, tok)
        head = tok.render_chat(history[:-1], add_generation_prompt=False)
        prompt = head + pad(lambda t: tok.render_chat([{"role": "user", "content": t}]),
                            history[-1]["content"], len(head), args.chunk)
        prompts = dict.fromkeys(POLICIES, prompt)
        last_prompt: dict[str, list[int]] = {}
        for turn in range(args.turns):
            outs = {}
            prompts_before = dict(last_prompt) if turn else {}
            for p in POLICIES:  # the same session and turn under each policy, back to back
                llm = llms[p]
                t0 = time.perf_counter()
                req = llm.generate_async(prompts[p], args.max_new, conversation_params=
                                         ConversationParams(conversation_id=f"s{s}"))
                while not req.output and not req.is_finished:  # until the first token
                    llm.executor.step()
                ttft = (time.perf_counter() - t0) * 1e3
                llm.run_until_done()
                outs[p] = req.output
                last_prompt[p] = req.prompt
                records.append({"session": s, "turn": turn, "policy": p, "ttft_ms": ttft,
                                "reused": req.reused, "prompt": len(req.prompt),
                                "previous_prompt": len(prompts_before[p]) if turn else 0,
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
    r_col = [(r["session"], r["turn"], r["reused"], r["previous_prompt"]) for r in warm_recs
             if r["policy"] == "carry"]
    print("reused depth R per warm turn (carry; session, turn, R, previous prompt length):",
          ", ".join(f"s{s} t{t} R={r} prev={pp}" for s, t, r, pp in r_col))
    print("R = previous prompt length on every warm turn:", all(r == pp for _, _, r, pp in r_col))
    if carry is not None:
        print("carry stats:", json.dumps({k: v for k, v in carry.stats().items()
                                           if k in ("outcomes", "rows_scattered", "deposits")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
