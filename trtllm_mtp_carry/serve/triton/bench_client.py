"""The session benchmark through a running server (`bench --server HOST:PORT`).

What it is for: replay the same sessions as the in-process bench, over
tritonclient's gRPC stream, with one correlation id per (replay, session,
policy), and return the same `PolicyRun` records (turns tagged with their
replay, busy time and runtime facts per replay), so the bench's report code
shows the policies side by side unchanged. Turn 1 sends the rendered history
as `input_ids` (with `START`); each later turn sends only the next user
message as `text_input` (the server extends its own history; the last turn
sets `END`, which frees the session's carried rows).

    replay r:  turn round 0          turn round 1         ...
               | A: s0 s1 | B: s0 s1 | B: s0 s1 | A: s0 s1 |   (policy order rotates)

Fairness: policies advance in lockstep, one turn round at a time, after one
warm-up turn per policy, so drift of the machine favours none of them. The
server's prefix cache is shared by every session of an instance, and the
policies replay identical prompts, so every turn carries a `cache_salt` of
its (run, policy, replay): a turn reuses only blocks and SSM snapshots its
own session's earlier turns cached (sessions of one policy and replay share
a namespace, as in the in-process bench's fresh engine per policy and
replay), never those of another policy, replay or bench run. The order of the
policies still rotates every turn round and replay. Time to first token is the client's (send to the first
response with tokens); the server's own figure is kept as `server_ttft_ms`.
`busy_s[r]` is the client's wall time of a policy's batches in replay `r`,
so the report's tokens/s is the client-side aggregate at `concurrency`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ...bench.replay import PolicyRun, TurnRecord, lockstep_batches, next_prompt, sort_turns
from ...bench.sessions import BenchSession
from ...engine.tokenizer import ChatTokenizer
from .client import StreamClient, TurnReply

_ID_BITS = 20  # low bits of a correlation id: (replay, policy, session) within one run


def iter_replay_on_server(
    server: str, sessions: Sequence[BenchSession], policies: Sequence[Any], max_new_tokens: int,
    concurrency: int = 4, model: str = "mtp_carry", timeout_s: float = 600.0, repeat: int = 1,
) -> Iterator[list[PolicyRun]]:
    """Replay `sessions` `repeat` times under each policy (DrafterPolicy or name) through
    the server at `server` ("host:port", gRPC); yields the runs so far after every batch
    of turns (an interrupted caller keeps them), and once more at the end.

    At most `concurrency` sessions of one policy are in flight at once. A turn
    the server refuses raises RuntimeError naming the session, turn and message.
    """
    names = [str(getattr(p, "value", p)) for p in policies]  # DrafterPolicy or its name
    if concurrency <= 0:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if repeat <= 0:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if repeat * len(names) * len(sessions) >= (1 << _ID_BITS) - len(names):
        raise ValueError(f"{repeat} replays x {len(names)} policies x {len(sessions)} sessions "
                         "need more correlation ids than one run has")
    tok = ChatTokenizer()
    nonce = secrets.randbits(40) << _ID_BITS  # fresh sessions on a server that may have served others
    runs = {p: PolicyRun(p) for p in names}
    turns = 1 + max((len(s.followups) for s in sessions), default=0)
    with StreamClient(server, model) as client:
        for i, policy in enumerate(names):  # first-call costs stay out of the figures
            warm = client.turn(nonce | ((1 << _ID_BITS) - 1 - i), start=True, end=True, max_tokens=4,
                               policy=policy,
                               input_ids=tok.render_chat([{"role": "user", "content": "warm up"}]))
            if warm.error:
                raise RuntimeError(f"warm-up turn under {policy} refused: {warm.error}")
        for r in range(repeat):
            corrid = {(p, s.name): nonce | (((r * len(names) + i) * len(sessions)) + j + 1)
                      for i, p in enumerate(names) for j, s in enumerate(sessions)}
            prompts = {key: tok.render_chat(s.history) for key in corrid
                       for s in sessions if s.name == key[1]}
            for policy in names:
                runs[policy].busy_s[r] = 0.0
            salt = {p: f"{p}/replay{r}/run{nonce >> _ID_BITS:x}" for p in names}
            for t, policy, batch in lockstep_batches(sessions, names, turns, concurrency, r):
                t0 = time.perf_counter()
                sent = {}
                for s in batch:
                    key = (policy, s.name)
                    last = t == len(s.followups)
                    if t == 0:
                        sent[s.name] = client.send(corrid[key], start=True, end=last,
                                                   input_ids=prompts[key],
                                                   max_tokens=max_new_tokens, policy=policy,
                                                   cache_salt=salt[policy])
                    else:
                        sent[s.name] = client.send(corrid[key], end=last, text=s.followups[t - 1],
                                                   max_tokens=max_new_tokens, policy=policy,
                                                   cache_salt=salt[policy])
                replies = {s.name: client.wait(sent[s.name], timeout_s) for s in batch}
                runs[policy].busy_s[r] += time.perf_counter() - t0
                for s in batch:
                    key = (policy, s.name)
                    _record(runs[policy], s.name, t, r, prompts[key], replies[s.name])
                    if t < len(s.followups):
                        prompts[key] = next_prompt(tok, prompts[key], replies[s.name].output,
                                                   s.followups[t])
                yield [runs[p] for p in names]
            for policy in names:
                runs[policy].runtime[r] = {"server": server, "model": model, "policy": policy}
    sort_turns(runs.values(), sessions)
    yield [runs[p] for p in names]


def replay_on_server(
    server: str, sessions: Sequence[BenchSession], policies: Sequence[Any], max_new_tokens: int,
    concurrency: int = 4, model: str = "mtp_carry", timeout_s: float = 600.0, repeat: int = 1,
) -> list[PolicyRun]:
    """`iter_replay_on_server` run to the end: one `PolicyRun` per policy, in `policies`' order,
    turns sorted by (replay, turn, session)."""
    last: list[PolicyRun] = []
    for runs in iter_replay_on_server(server, sessions, policies, max_new_tokens, concurrency,
                                      model, timeout_s, repeat):
        last = runs
    return last


def _record(run: PolicyRun, session: str, turn: int, replay: int, prompt: list[int],
            reply: TurnReply) -> None:
    if reply.error is not None:
        raise RuntimeError(f"session {session} turn {turn} (replay {replay}) under {run.policy} "
                           f"refused: {reply.error}")
    stats = dict(reply.stats)
    stats["ttft_ms"] = reply.ttft_ms if reply.ttft_ms is not None else reply.total_ms
    stats["total_ms"] = reply.total_ms
    stats["instance"] = reply.instance
    stats["client_prompt_tokens"] = len(prompt)
    run.turns.append(TurnRecord(session, turn, stats, reply.output, replay))
