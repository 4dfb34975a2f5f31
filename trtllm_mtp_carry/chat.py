"""`trtllm-mtp-carry chat`: an interactive multi-turn chat with the reference model.

Each answer is followed by one status line: the drafter's carry outcome, the
rows it computed, time to first token and the draft acceptance, so the carry
can be watched working turn by turn. `/stats` prints the runtime's counters,
`/new` starts a new session, `/quit` (or end of input) leaves.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="carry", help="drafter policy: carry, rebuild, blind or off")
    p.add_argument("--max-new-tokens", type=int, default=200, help="answer length cap")
    p.add_argument("--draft-len", type=int, default=2, help="draft tokens per verify step (1..3)")
    p.add_argument("--system", default=None, help="an optional system message")
    p.add_argument("--device", default="cpu")
    p.add_argument("--weights", metavar="DIR", help="reference.safetensors + reference.json directory")


def run(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    from .engine.engine import ReferenceEngine
    from .runtime.policy import DrafterPolicy

    policy = DrafterPolicy.parse(args.policy)
    engine = ReferenceEngine.from_pretrained(args.weights, policy=policy, draft_len=args.draft_len,
                                             device=args.device)
    tok = engine.tokenizer
    session = 1
    messages = [{"role": "system", "content": args.system}] if args.system else []
    prompt: list[int] = []
    interactive = stdin.isatty()
    print(f"reference model, policy {policy.value}; /new, /stats, /quit", file=stdout)
    while True:
        if interactive:
            print("you> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/quit":
            return 0
        text = line.rstrip("\n")
        if text == "/stats":
            print(engine.runtime.stats(), file=stdout)
            continue
        if text == "/new":
            session += 1
            messages = messages[:1] if args.system else []
            prompt = []
            print(f"-- session {session}", file=stdout)
            continue
        if not text.strip():
            continue
        if prompt:  # continue the rendered conversation exactly, so the prefix cache matches
            prompt = [*prompt, *tok.encode("\n"), *tok.render_message("user", text),
                      tok.im_start_id, tok.assistant_id]
        else:
            prompt = tok.render_chat([*messages, {"role": "user", "content": text}])
        result = engine.generate(session, prompt, max_new_tokens=args.max_new_tokens)
        answer = result.output if result.output[-1:] == [tok.eos_id] else [*result.output, tok.eos_id]
        prompt = [*prompt, *answer]
        s = result.stats
        print(f"model> {result.text}", file=stdout)
        print(f"  [{s.outcome}; rows computed {s.drafter_rows_computed}, reused {s.reused_tokens}/"
              f"{s.prompt_tokens} tokens, ttft {s.ttft_ms:.0f} ms, "
              f"acceptance {s.accepted}/{s.drafted}]", file=stdout, flush=True)
