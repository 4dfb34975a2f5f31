"""Benchmark sessions: a long history, then follow-up user messages (the new spans).

A session is replayed turn by turn: turn 1 renders the history (cold), and each
later turn appends the model's own answer, then the next user message, so the
prompt of turn n+1 extends turn n's prompt and output exactly (warm).

Built-in sessions come from the held-out sessions shipped with the reference
model (code the user shows, then asks to quote, continue or edit), so the
answers copy earlier content and the drafter's context matters.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..engine.tokenizer import ChatTokenizer

HELDOUT = "engine/data/heldout_sessions.jsonl"


@dataclass(frozen=True)
class BenchSession:
    """`history` (messages ending with a user message) and the follow-up user texts."""

    name: str
    history: list[dict[str, str]]
    followups: list[str]


def load_conversations(path: str | Path | None = None) -> list[list[dict[str, str]]]:
    """Chat conversations from a JSONL file of `{"messages": [{role, content}, ...]}` lines.

    `None` reads the held-out sessions shipped with the reference model. A
    malformed line is a ValueError naming the file and line number.
    """
    if path is None:
        text = resources.files("trtllm_mtp_carry").joinpath(HELDOUT).read_text()
        source = f"trtllm_mtp_carry/{HELDOUT}"
    else:
        text = Path(path).read_text()
        source = str(path)
    conversations = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            messages = record["messages"]
            if not isinstance(messages, list) or not messages:
                raise ValueError("'messages' must be a non-empty list")
            for m in messages:
                if m.get("role") not in ("system", "user", "assistant") or not isinstance(
                    m.get("content"), str
                ):
                    raise ValueError(f"bad message {m!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{source}:{lineno}: not a chat conversation line: {exc}") from None
        conversations.append(messages)
    if not conversations:
        raise ValueError(f"{source} holds no conversations")
    return conversations


def sessions_from_conversations(conversations: list[list[dict[str, str]]]) -> list[BenchSession]:
    """The user's own conversations: history up to the first user message, then its user turns."""
    out = []
    for i, messages in enumerate(conversations):
        users = [j for j, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise ValueError(f"conversation {i} has no user message")
        first = users[0]
        out.append(BenchSession(f"conv{i}", messages[: first + 1],
                                [messages[j]["content"] for j in users[1:]]))
    return out


def builtin_sessions(
    num_sessions: int, turns: int, history_tokens: int, new_span_tokens: int,
    tokenizer: ChatTokenizer, conversations: list[list[dict[str, str]]] | None = None,
    shared_prefix_tokens: int = 0,
) -> list[BenchSession]:
    """`num_sessions` sessions of about `history_tokens` history and `turns - 1` follow-ups.

    Each history cycles through the held-out conversations from its own
    offset, so sessions differ; each follow-up is about `new_span_tokens`
    rendered tokens of held-out user messages. With `shared_prefix_tokens`,
    every history starts with the same system message of exactly that many
    content tokens (`shared_system_prompt`), as sessions of one deployment do.
    """
    if num_sessions < 1 or turns < 1:
        raise ValueError(f"need at least one session and one turn, got {num_sessions} and {turns}")
    pool = conversations if conversations is not None else load_conversations()
    system = shared_system_prompt(shared_prefix_tokens, tokenizer, pool) if shared_prefix_tokens else None
    sessions = []
    for s in range(num_sessions):
        messages = _cycle(pool, offset=s * 7)
        history: list[dict[str, str]] = [] if system is None else [{"role": "system", "content": system}]
        size = 0
        while True:
            m = next(messages)
            history.append(m)
            size += len(tokenizer.render_message(m["role"], m["content"]))
            if m["role"] == "user" and size >= history_tokens:
                break
        user_texts = (m["content"] for m in _cycle(pool, offset=s * 7 + 3) if m["role"] == "user")
        followups = [_user_text(user_texts, new_span_tokens, tokenizer) for _ in range(turns - 1)]
        sessions.append(BenchSession(f"s{s}", history, followups))
    return sessions


def shared_system_prompt(tokens: int, tokenizer: ChatTokenizer,
                         conversations: list[list[dict[str, str]]]) -> str:
    """A system message of exactly `tokens` content tokens, from held-out texts (the same
    for every call with the same arguments): a deployment's long shared instructions."""
    parts: list[int] = []
    texts = (m["content"] for m in _cycle(conversations, offset=len(conversations) // 2))
    while len(parts) < tokens:
        parts += tokenizer.encode(next(texts) + "\n\n")
    text = bytes(parts[:tokens]).decode("utf-8", errors="ignore")
    while len(tokenizer.encode(text)) < tokens:  # a multi-byte character cut at the end
        text += " "
    return text


def _cycle(pool: list[list[dict[str, str]]], offset: int) -> Iterator[dict[str, str]]:
    i = offset
    while True:
        yield from pool[i % len(pool)]
        i += 1


def _user_text(texts: Iterator[str], span: int, tokenizer: ChatTokenizer) -> str:
    """Join user texts until the rendered turn (answer end, message, prompt) is about `span` tokens."""
    overhead = 2 + len(tokenizer.render_message("user", "")) + 2
    budget = max(1, span - overhead)
    parts: list[str] = []
    size = 0
    while size < budget:
        t = next(texts)
        parts.append(t)
        size += len(tokenizer.encode(t)) + 2
    data = tokenizer.encode("\n\n".join(parts))[:budget]
    return bytes(data).decode("utf-8", errors="ignore")
