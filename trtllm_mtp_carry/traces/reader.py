"""Chat traces as turns of conversations: read, check, and rebuild who follows whom.

What it is for: the trace replay (`replay.py`) needs, per request, its arrival
time, its input and output tokens, its conversation, its turn index and the
depth of its prompt a prefix cache reuses (`reused_tokens`). Two formats are
read, told apart by the first line's keys:

- `mooncake` (Mooncake FAST'25 release): `timestamp` (ms), `input_length`,
  `output_length`, `hash_ids` (one id per 512-token block, equal ids for equal
  prefixes). No conversation ids: a request whose `hash_ids` share at least
  their first two blocks with an earlier request's (past the first block, a
  system prompt every request shares) is a later turn of that request's
  conversation; with several such requests, the one sharing the longest prefix,
  the latest among equals::

      r1: 0 7 8 9            conversation A, turn 1
      r2: 0 7 8 9 10 11      shares 0 7 8 9 with r1: A, turn 2
      r3: 0 12 13            shares only block 0: conversation B, turn 1

- `conversation` (explicit ids): `chat_id`, `parent_chat_id` (-1 or null for a
  first turn), `timestamp` (s), `turn`, `hash_ids` (16-token blocks);
  `input_length` (default 16 per hash id) and `output_length` (default 0) when
  present. A request's conversation is its parent's (a parent the trace does
  not hold, or holds only on a later line, starts a conversation of its own).

A follow-up's reused depth is the prompt it shares with the request it extends
(its parent): the hash blocks both prompts share times the block's tokens,
capped at the parent's prompt and at the follow-up's own prompt less its last
token (a prefix lookup never matches the token it must compute). In the
example above r2 reuses min(4 x 512, input(r1), input(r2) - 1) tokens. A first
turn reuses nothing (0): the system prompt every conversation shares is not a
turn of it.

Invariants:
- Requests are returned in arrival order (a stable sort of the file's order);
  `turn[i]` is 1 + the number of earlier requests of the same conversation.
- A malformed line is one ValueError naming its line number (1-based) and what
  is wrong; nothing is returned for a file with one bad line.
- Rebuilding conversations is linear in the trace's blocks (a trie of prefixes,
  one dict lookup per block).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMATS: tuple[str, ...] = ("mooncake", "conversation")
"""Trace formats, as `Trace.format` names them."""

MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
CONVERSATION_KEYS = ("chat_id", "parent_chat_id", "timestamp", "turn", "hash_ids")
CONVERSATION_BLOCK_TOKENS = 16  # the explicit-id traces hash 16-token blocks
MOONCAKE_BLOCK_TOKENS = 512
"""A Mooncake trace's hash block; the first, id 0, is a system prompt every request shares."""


@dataclass(frozen=True)
class Trace:
    """A trace's requests in arrival order, as parallel arrays (one entry per request).

    `arrival_s` float64 seconds since the trace's start; `input_tokens`,
    `output_tokens` int64; `conversation` int64 ids (dense, 0-based, in order of
    first appearance); `turn` int64, 1 for a conversation's first request;
    `reused_tokens` int64, the prompt tokens shared with the request it extends
    (module header; 0 for a first turn), always < `input_tokens` or 0.
    """

    format: str
    arrival_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    conversation: np.ndarray
    turn: np.ndarray
    reused_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def conversations(self) -> int:
        return int(self.conversation.max()) + 1 if len(self) else 0

    @property
    def follow_ups(self) -> int:
        """Requests that are not their conversation's first turn."""
        return int(np.count_nonzero(self.turn > 1))


def _bad(lineno: int, what: str) -> ValueError:
    return ValueError(f"trace line {lineno}: {what}")


def _int_field(obj: dict[str, object], key: str, lineno: int, minimum: int = 0) -> int:
    value = obj.get(key)
    if type(value) is not int or value < minimum:
        raise _bad(lineno, f"{key!r} must be an int >= {minimum}, got {value!r}")
    return value


def _time_field(obj: dict[str, object], key: str, lineno: int) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise _bad(lineno, f"{key!r} must be a number >= 0, got {value!r}")
    return float(value)


def _hash_ids(obj: dict[str, object], lineno: int) -> list[int]:
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(type(h) is int for h in ids):
        raise _bad(lineno, f"'hash_ids' must be a list of ints, got {ids!r:.80}")
    return ids


def _lines(path: Path) -> Iterable[tuple[int, dict[str, object]]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise _bad(lineno, f"not JSON ({exc.__class__.__name__}: {exc})") from None
            if not isinstance(obj, dict):
                raise _bad(lineno, f"expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj


def detect_format(obj: dict[str, object], lineno: int = 1) -> str:
    """The format (`FORMATS`) a trace's first object is in; ValueError naming the keys otherwise."""
    if all(k in obj for k in CONVERSATION_KEYS):
        return "conversation"
    if all(k in obj for k in MOONCAKE_KEYS):
        return "mooncake"
    raise _bad(lineno, f"neither a mooncake trace ({', '.join(MOONCAKE_KEYS)}) nor one with "
                       f"conversation ids ({', '.join(CONVERSATION_KEYS)}); keys: {sorted(obj)}")


def read_trace(path: str | Path) -> Trace:
    """Read `path` (format detected from its first line) and rebuild its conversations."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace {str(path)!r} is not a file")
    lines = iter(_lines(path))
    first = next(lines, None)
    if first is None:
        raise ValueError(f"trace {str(path)!r} holds no requests")
    fmt = detect_format(first[1], first[0])
    if fmt == "mooncake":
        return _mooncake(_chain([first], lines))
    return _conversation(_chain([first], lines))


def _chain(head: list[tuple[int, dict[str, object]]],
           rest: Iterable[tuple[int, dict[str, object]]]) -> Iterable[tuple[int, dict[str, object]]]:
    yield from head
    yield from rest


def _mooncake(lines: Iterable[tuple[int, dict[str, object]]]) -> Trace:
    t, inp, out, parent_of, shared_of = [], [], [], [], []
    trie: dict[tuple[int, int], int] = {}  # (prefix node, next block id) -> node of the longer prefix
    owner: list[int] = [-1]  # node -> the latest request whose hashes pass through it; node 0 = root
    for lineno, obj in lines:
        for key in MOONCAKE_KEYS:
            if key not in obj:
                raise _bad(lineno, f"missing {key!r} (a mooncake trace line has {', '.join(MOONCAKE_KEYS)})")
        t.append(_time_field(obj, "timestamp", lineno) / 1000.0)
        inp.append(_int_field(obj, "input_length", lineno))
        out.append(_int_field(obj, "output_length", lineno))
        ids = _hash_ids(obj, lineno)
        i = len(t) - 1
        parent, shared, node = -1, 0, 0
        for depth, h in enumerate(ids, 1):
            nxt = trie.get((node, h))
            if nxt is None:
                nxt = trie[(node, h)] = len(owner)
                owner.append(-1)
            elif depth >= 2 and owner[nxt] >= 0:
                # deepest shared prefix past the first block so far: no request passes the next
                # node yet, so the parent shares exactly `depth` blocks
                parent, shared = owner[nxt], depth
            owner[nxt] = i
            node = nxt
        parent_of.append(parent)
        shared_of.append(shared * MOONCAKE_BLOCK_TOKENS)
    return _build("mooncake", t, inp, out, parent_of, shared_of)


def _conversation(lines: Iterable[tuple[int, dict[str, object]]]) -> Trace:
    t, inp, out, parent_of, shared_of = [], [], [], [], []
    index: dict[object, int] = {}
    hashes: list[list[int]] = []
    for lineno, obj in lines:
        for key in CONVERSATION_KEYS:
            if key not in obj:
                raise _bad(lineno, f"missing {key!r} (a trace with conversation ids has "
                                   f"{', '.join(CONVERSATION_KEYS)})")
        chat, parent = obj["chat_id"], obj["parent_chat_id"]
        if not isinstance(chat, (int, str)) or isinstance(chat, bool):
            raise _bad(lineno, f"'chat_id' must be an int or a str, got {chat!r}")
        if parent is not None and (not isinstance(parent, (int, str)) or isinstance(parent, bool)):
            raise _bad(lineno, f"'parent_chat_id' must be an int, a str or null, got {parent!r}")
        if chat in index:
            raise _bad(lineno, f"'chat_id' {chat!r} repeats line {index[chat] + 1}'s request")
        _int_field(obj, "turn", lineno, minimum=0)
        ids = _hash_ids(obj, lineno)
        t.append(_time_field(obj, "timestamp", lineno))
        inp.append(_int_field(obj, "input_length", lineno) if "input_length" in obj
                   else CONVERSATION_BLOCK_TOKENS * len(ids))
        out.append(_int_field(obj, "output_length", lineno) if "output_length" in obj else 0)
        index[chat] = len(t) - 1
        p = index.get(parent, -1) if parent is not None else -1
        parent_of.append(p)
        hashes.append(ids)
        shared_of.append(0 if p < 0 else CONVERSATION_BLOCK_TOKENS * _shared_blocks(hashes[p], ids))
    return _build("conversation", t, inp, out, parent_of, shared_of)


def _shared_blocks(a: list[int], b: list[int]) -> int:
    """How many leading hash ids `a` and `b` share (numpy: no Python loop over the blocks)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if len(differ) else n


def _build(fmt: str, t: list[float], inp: list[int], out: list[int], parent_of: list[int],
           shared_of: list[int]) -> Trace:
    """Conversations from parent links (file order), then everything in arrival order; a
    follow-up's reused depth from the tokens it shares with its parent (module header)."""
    conv = np.empty(len(t), dtype=np.int64)
    turn = np.empty(len(t), dtype=np.int64)
    count = 0
    for i, p in enumerate(parent_of):  # parents precede their children in the file
        if p < 0:
            conv[i] = count
            count += 1
        else:
            conv[i] = conv[p]
    inputs = np.asarray(inp, dtype=np.int64)
    parents = np.asarray(parent_of, dtype=np.int64)
    has_parent = parents >= 0
    reused = np.zeros(len(t), dtype=np.int64)
    reused[has_parent] = np.minimum.reduce([np.asarray(shared_of, dtype=np.int64)[has_parent],
                                            inputs[parents[has_parent]], inputs[has_parent] - 1])
    reused = np.maximum(reused, 0)
    arrival = np.asarray(t, dtype=np.float64)
    order = np.argsort(arrival, kind="stable")
    _, first, inverse = np.unique(conv[order], return_index=True, return_inverse=True)
    conv = np.argsort(np.argsort(first))[inverse]  # dense ids in order of first arrival
    # turn = 1 + earlier requests of the conversation, in arrival order
    by_conv = np.argsort(conv, kind="stable")
    starts = np.r_[0, np.flatnonzero(np.diff(conv[by_conv])) + 1]
    rank = np.arange(len(conv)) - np.repeat(starts, np.diff(np.r_[starts, len(conv)]))
    turn[by_conv] = rank + 1
    return Trace(fmt, arrival[order], inputs[order], np.asarray(out, dtype=np.int64)[order], conv, turn,
                 reused[order])


__all__ = ["CONVERSATION_KEYS", "FORMATS", "MOONCAKE_BLOCK_TOKENS", "MOONCAKE_KEYS", "Trace", "detect_format",
           "read_trace"]
