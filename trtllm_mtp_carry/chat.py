"""`trtllm-mtp-carry chat`: an interactive multi-turn chat with the reference model.

The answer streams as the target verifies tokens (`ReferenceEngine.step()` +
`output_so_far`), then one status line shows the drafter's carry outcome, the
rows it computed, time to first token and the draft acceptance, so the carry
can be watched working turn by turn. Commands (`/help`, `/new`, `/stats`,
`/quit`) never reach the model; an unknown `/word` is answered, not sent.
Ctrl-C during an answer cancels that answer (`engine.cancel`: its rows are
freed, the conversation stays as it was before the message) and returns to
the prompt; Ctrl-C or end of input at the prompt leaves.

Invariant: the conversation's token prompt is only ever extended by a
finished turn (prompt + answer + end of turn + next user message), so every
warm turn's prompt extends the previous one exactly and the prefix cache and
the carry can match it.
"""

from __future__ import annotations

import argparse
import codecs
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from typing import Any, TextIO

from .bench.options import draft_len, positive_int, resolve_device, weights_dir
from .core.settings import carry_settings_line

HELP = """commands (never sent to the model):
  /help    this list
  /new     start a new session (the next turn is cold; the carry refuses the old session's rows)
  /stats   the carry runtime's counters so far
  /quit    leave (end of input or Ctrl-C at the prompt does too)
Ctrl-C while an answer streams cancels that answer and returns here."""

TRAINED_ON = """The reference model is tiny (1.6M parameters) and was trained only on chats about
Python standard-library code: a first message pastes one to three functions, later
messages ask about them. It answers prompts like these (use a function you pasted):
  Here is some code:  ```<paste a function>```
  Show `name` again.            Repeat `name` exactly.
  What is the signature of `name`?
  Show the first 3 lines of `name`.
  Continue `name` after this:  ```<its first lines>```
  Rename `old` to `new` in `name`.
  Quote the docstring of `name`.
Anything else gets byte soup; the carry's figures are still real."""

COMMAND = re.compile(r"^/\w+$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="carry", help="drafter policy: carry, rebuild, blind or off")
    p.add_argument("--max-new-tokens", type=positive_int, metavar="N", default=200, help="answer length cap")
    p.add_argument("--draft-len", type=draft_len, metavar="N", default=2, help="draft tokens per verify step, 1..3")
    p.add_argument("--system", default=None, help="an optional system message")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:N")
    p.add_argument("--weights", metavar="DIR", help="reference.safetensors + reference.json directory")


@contextmanager
def _sigint_as_flag() -> Iterator[list[bool]]:
    """While streaming, Ctrl-C only sets a flag, checked between engine steps, so it can
    never land inside a step's bookkeeping. Off the main thread, Ctrl-C is left alone."""
    flag = [False]

    def handler(signum: int, frame: Any) -> None:
        flag[0] = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def stats_table(stats: Any) -> str:
    """The runtime's counters as a two-column table (nested counts as `name.kind`, zeros left out)."""
    rows: list[tuple[str, str]] = []
    fields = asdict(stats) if is_dataclass(stats) and not isinstance(stats, type) else vars(stats)
    for name, value in fields.items():
        if isinstance(value, dict):
            rows += [(f"{name}.{k}", str(v)) for k, v in value.items() if v]
        elif isinstance(value, bool):
            rows.append((name, "yes" if value else "no"))
        else:
            rows.append((name, str(value)))
    width = max(len(n) for n, _ in rows)
    return "\n".join(f"  {n:<{width}}  {v:>8}" for n, v in rows)


def _stream(engine: Any, rid: int, stdout: TextIO) -> Any:
    """Step the engine until request `rid` finishes, printing its text as tokens are
    accepted; returns its TurnResult, or None when Ctrl-C cancelled it."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    shown = 0

    def show(tokens: list[int]) -> None:
        text = decoder.decode(bytes(t for t in tokens if t < 256))  # specials end the turn
        if text:
            print(text, end="", file=stdout, flush=True)

    with _sigint_as_flag() as interrupted:
        while True:
            if interrupted[0]:
                engine.cancel(rid)
                print(" [cancelled]", file=stdout, flush=True)
                return None
            result = next((r for r in engine.step() if r.request_id == rid), None)
            so_far = result.output if result is not None else engine.output_so_far(rid)
            show(so_far[shown:])
            shown = len(so_far)
            if result is not None:
                show([])
                print(decoder.decode(b"", final=True), file=stdout, flush=True)
                return result


def run(args: argparse.Namespace, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    from .engine.engine import ReferenceEngine
    from .runtime.policy import DrafterPolicy

    policy = DrafterPolicy.parse(args.policy)
    weights_dir(args.weights)
    device = resolve_device(args.device)
    engine = ReferenceEngine.from_pretrained(args.weights, policy=policy, draft_len=args.draft_len,
                                             device=str(device))
    tok = engine.tokenizer
    session = 1
    messages = [{"role": "system", "content": args.system}] if args.system else []
    prompt: list[int] = []
    interactive = stdin.isatty()
    print(f"reference model, drafter policy {policy.value}; /help lists the commands.\n{TRAINED_ON}",
          file=stdout)
    print(carry_settings_line(), file=stdout)
    while True:
        if interactive:
            print("you> ", end="", file=stdout, flush=True)
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            print(file=stdout)
            return 0
        text = line.rstrip("\n")
        if not line or text.strip() == "/quit":
            return 0
        if COMMAND.match(text.strip()):
            command = text.strip()
            if command == "/help":
                print(HELP, file=stdout)
            elif command == "/stats":
                print(stats_table(engine.runtime.stats()), file=stdout)
            elif command == "/new":
                session += 1
                messages = messages[:1] if args.system else []
                prompt = []
                print(f"-- session {session}", file=stdout)
            else:
                print(f"unknown command {command}; /help lists the commands", file=stdout)
            continue
        if not text.strip():
            continue
        if prompt:  # continue the rendered conversation exactly, so the prefix cache matches
            turn_prompt = [*prompt, *tok.encode("\n"), *tok.render_message("user", text),
                           tok.im_start_id, tok.assistant_id]
        else:
            turn_prompt = tok.render_chat([*messages, {"role": "user", "content": text}])
        rid = engine.submit(session, turn_prompt, max_new_tokens=args.max_new_tokens)
        print("model> ", end="", file=stdout, flush=True)
        result = _stream(engine, rid, stdout)
        if result is None:
            continue  # cancelled: the conversation stays as it was before this message
        answer = result.output if result.output[-1:] == [tok.eos_id] else [*result.output, tok.eos_id]
        prompt = [*turn_prompt, *answer]
        s = result.stats
        print(f"  [{s.outcome}; rows computed {s.drafter_rows_computed}, reused {s.reused_tokens}/"
              f"{s.prompt_tokens} tokens, ttft {s.ttft_ms:.0f} ms, "
              f"acceptance {s.accepted}/{s.drafted}]", file=stdout, flush=True)
