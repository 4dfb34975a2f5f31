"""Deterministic multi-turn chat sessions built offline from the Python stdlib.

What it is for: training data for the reference model and the held-out
sessions the benchmark replays. Sessions are shaped so that the drafter's
context matters: turn 1 pastes code, later turns ask to repeat, rename,
continue, quote docstrings or signatures of it, and the assistant answers by
copying or editing earlier content.

Invariants: only files under `sysconfig.get_paths()["stdlib"]` are read (no
writes, no network); files are visited sorted and every choice comes from a
seeded `random.Random`, so a machine's stdlib gives the same sessions every
run. Train and held-out sessions come from disjoint files (split by a CRC of
the relative path). The stdlib differs slightly between Python builds, so the
shipped weights and JSONL are artifacts of the machine that trained them.
"""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path

HELDOUT_MOD = 16  # a file is held out when crc32(relpath) % HELDOUT_MOD == 0
DEFAULT_HELDOUT_JSONL = Path(__file__).parent / "data" / "heldout_sessions.jsonl"

Session = list[dict]  # [{"role": ..., "content": ...}, ...]


@dataclass(frozen=True)
class Snippet:
    """One function's dedented source, with its name, docstring and renameable names."""

    path: str
    name: str
    source: str
    docstring: str | None
    identifiers: tuple[str, ...]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: Path) -> list[Path]:
    skip = ("site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "encodings")
    return sorted(p for p in root.rglob("*.py")
                  if not any(part in skip for part in p.relative_to(root).parts))


def _snippets(path: Path, rel: str, min_len: int, max_len: int) -> list[Snippet]:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (UnicodeDecodeError, SyntaxError, ValueError, OSError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if node.end_lineno is None or node.end_lineno - node.lineno > 40:
            continue
        src = textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))
        if not min_len <= len(src) <= max_len or not src.isascii() or "\t" in src:
            continue
        names = {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
        names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                  and isinstance(n.ctx, ast.Store)}
        names = {n for n in names if len(n) >= 2 and n not in ("self", "cls")}
        out.append(Snippet(rel, node.name, src, ast.get_docstring(node), tuple(sorted(names))))
    out.sort(key=lambda s: (s.source.count("\n"), s.name, s.source))
    return out


def collect_snippets(heldout: bool, root: Path | None = None, min_len: int = 80,
                     max_len: int = 520) -> list[list[Snippet]]:
    """Per-file lists of snippets from the train (or held-out) files, files sorted by path."""
    root = root or stdlib_root()
    groups = []
    seen: set[str] = set()
    for p in _stdlib_files(root):
        rel = p.relative_to(root).as_posix()
        if (zlib.crc32(rel.encode()) % HELDOUT_MOD == 0) != heldout:
            continue
        sn = [x for x in _snippets(p, rel, min_len, max_len) if x.source not in seen]
        seen.update(x.source for x in sn)
        if sn:
            groups.append(sn)
    return groups


_NEW_NAMES = ("value", "item", "result", "data", "node", "buf", "count", "key", "entry",
              "target", "total", "parts", "name_", "obj", "tmp", "acc", "elem", "spec")


def _rename(src: str, old: str, new: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new, src)


def _block(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


def make_session(rng: random.Random, group: list[Snippet], max_chars: int = 900) -> Session:
    """One session over 1-3 functions of one file; later answers copy or edit earlier text."""
    k = min(len(group), rng.choice((1, 1, 2, 2, 3)))
    start = rng.randrange(len(group) - k + 1)
    chosen = list(group[start:start + k])
    rng.shuffle(chosen)
    while len(chosen) > 1 and sum(len(s.source) for s in chosen) > max_chars // 2:
        chosen.pop()
    paste = "\n\n".join(s.source.rstrip() for s in chosen)
    names = ", ".join(f"`{s.name}`" for s in chosen)
    opener = rng.choice((
        f"Here is some code from `{chosen[0].path}`:\n\n{_block(paste)}",
        f"I am reading `{chosen[0].path}`. Look at this:\n\n{_block(paste)}",
        f"{_block(paste)}\n\nKeep this in mind, I will ask about it.",
        f"Take a look at this code:\n\n{_block(paste)}",
    ))
    msgs: Session = [{"role": "user", "content": opener},
                     {"role": "assistant", "content": f"Got it. It defines {names}."}]
    if rng.random() < 0.3:
        msgs.insert(0, {"role": "system", "content": "You are a careful assistant for Python code."})
    renamed: dict[str, str] = {}
    used = len(paste)
    for _ in range(rng.randint(3, 6)):
        s = rng.choice(chosen)
        cur = renamed.get(s.name, s.source).rstrip()
        lines = cur.split("\n")
        kinds = ["repeat", "signature", "continue", "first"]
        if s.identifiers:
            kinds += ["rename", "rename"]
        if s.docstring:
            kinds.append("doc")
        if s.name in renamed:
            kinds.append("again")
        kind = rng.choice(kinds)
        if kind in ("repeat", "again"):
            q = rng.choice((f"Show `{s.name}` again.", f"Repeat `{s.name}` exactly.",
                            f"Please print the current version of `{s.name}`."))
            a = _block(cur)
        elif kind == "signature":
            q = f"What is the signature of `{s.name}`?"
            a = f"`{lines[0].rstrip(':')}`"
        elif kind == "continue" and len(lines) >= 3:
            cut = rng.randint(1, len(lines) - 1)
            q = f"Continue `{s.name}` after this:\n\n{_block(chr(10).join(lines[:cut]))}"
            a = _block("\n".join(lines[cut:]))
        elif kind == "first" or kind == "continue":
            n = rng.randint(1, min(4, len(lines)))
            q = f"Show the first {n} line{'s' if n > 1 else ''} of `{s.name}`."
            a = _block("\n".join(lines[:n]))
        elif kind == "rename":
            old = rng.choice(s.identifiers)
            new = rng.choice(_NEW_NAMES)
            if re.search(rf"\b{re.escape(new)}\b", cur) or not re.search(rf"\b{re.escape(old)}\b", cur):
                new = old + "_" + rng.choice(("x", "new", "2", "v"))
            edited = _rename(cur, old, new)
            renamed[s.name] = edited
            q = rng.choice((f"Rename `{old}` to `{new}` in `{s.name}`.",
                            f"In `{s.name}`, use the name `{new}` instead of `{old}`."))
            a = _block(edited)
        else:  # doc
            q = f"Quote the docstring of `{s.name}`."
            a = f'"""{s.docstring}"""'
        used += len(q) + len(a)
        if used > max_chars and len(msgs) > 2:
            break
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs


def build_sessions(n: int, heldout: bool, seed: int, root: Path | None = None,
                   groups: list[list[Snippet]] | None = None,
                   max_chars: int = 900) -> list[Session]:
    """`n` sessions, deterministic for a given stdlib and seed; round-robin over shuffled files."""
    groups = collect_snippets(heldout, root) if groups is None else groups
    if not groups:
        raise ValueError(f"no usable stdlib files found under {root or stdlib_root()}")
    rng = random.Random(seed)
    order = list(range(len(groups)))
    out: list[Session] = []
    while len(out) < n:
        rng.shuffle(order)
        for i in order[: n - len(out)]:
            out.append(make_session(rng, groups[i], max_chars))
    return out


def write_jsonl(sessions: list[Session], path: Path = DEFAULT_HELDOUT_JSONL) -> None:
    """One `{"messages": [...]}` object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for m in sessions:
            f.write(json.dumps({"messages": m}) + "\n")


def read_jsonl(path: Path = DEFAULT_HELDOUT_JSONL) -> list[Session]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]
