"""The session benchmark through a running server (`bench --server HOST:PORT`).

What it is for: replay the same sessions as the in-process bench, over
tritonclient's gRPC stream, with one correlation id per (session, policy),
and return the same `PolicyRun` records, so the bench's report shows the
policies side by side. Turn 1 sends the rendered history as `input_ids`
(with `START`); each later turn sends only the next user message as
`text_input` (the server extends its own history; the last turn sets `END`,
which frees the session's carried rows).

Fairness: policies advance in lockstep, one turn round at a time (every
session's turn `t` under policy A, then under policy B, ...), after one
warm-up turn per policy, so drift of the machine favours none of them. Time
to first token is the client's (send to the first response with tokens);
the server's own figure is kept as `server_ttft_ms`.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from ..bench.replay import PolicyRun, TurnRecord, next_prompt
from ..bench.sessions import BenchSession
from ..engine.tokenizer import ChatTokenizer
from .client import StreamClient, TurnReply


def replay_on_server(
    server: str, sessions: Sequence[BenchSession], policies: Sequence[Any], max_new_tokens: int,
    concurrency: int = 4, model: str = "mtp_carry", timeout_s: float = 600.0,
) -> list[PolicyRun]:
    """Replay `sessions` under each policy (DrafterPolicy or name) through the server at
    `server` ("host:port", gRPC). The engine's sizes (draft length, restore threshold)
    are the server's parameters, not the client's.

    At most `concurrency` sessions of one policy are in flight at once. A turn
    the server refuses raises RuntimeError naming the session, turn and message.
    """
    policies = [str(getattr(p, "value", p)) for p in policies]  # DrafterPolicy or its name
    if concurrency <= 0:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    tok = ChatTokenizer()
    nonce = secrets.randbits(40) << 20  # fresh sessions on a server that may have served others
    corrid = {(p, s.name): nonce | (i * len(sessions) + j + 1)
              for i, p in enumerate(policies) for j, s in enumerate(sessions)}
    by_name = {s.name: s for s in sessions}
    prompts = {key: tok.render_chat(by_name[key[1]].history) for key in corrid}
    runs = {p: PolicyRun(p) for p in policies}
    turns = 1 + max((len(s.followups) for s in sessions), default=0)
    with StreamClient(server, model) as client:
        for i, policy in enumerate(policies):  # first-call costs stay out of the figures
            warm = client.turn(nonce | (0xFFFFF - i), start=True, end=True, max_tokens=4, policy=policy,
                               input_ids=tok.render_chat([{"role": "user", "content": "warm up"}]))
            if warm.error:
                raise RuntimeError(f"warm-up turn under {policy} refused: {warm.error}")
        for t in range(turns):
            for policy in policies:
                live = [s for s in sessions if t <= len(s.followups)]
                for lo in range(0, len(live), concurrency):
                    batch = live[lo:lo + concurrency]
                    sent = {}
                    for s in batch:
                        key = (policy, s.name)
                        last = t == len(s.followups)
                        if t == 0:
                            rid = client.send(corrid[key], start=True, end=last, input_ids=prompts[key],
                                              max_tokens=max_new_tokens, policy=policy)
                        else:
                            rid = client.send(corrid[key], end=last, text=s.followups[t - 1],
                                              max_tokens=max_new_tokens, policy=policy)
                        sent[s.name] = rid
                    for s in batch:
                        reply = client.wait(sent[s.name], timeout_s)
                        key = (policy, s.name)
                        _record(runs[policy], s.name, t, prompts[key], reply)
                        if t < len(s.followups):
                            prompts[key] = next_prompt(tok, prompts[key], reply.output, s.followups[t])
    for policy, run in runs.items():
        order = {s.name: i for i, s in enumerate(sessions)}
        run.turns.sort(key=lambda r: (r.turn, order[r.session]))
        run.runtime = {"server": server, "model": model, "policy": policy}
    return [runs[p] for p in policies]


def _record(run: PolicyRun, session: str, turn: int, prompt: list[int], reply: TurnReply) -> None:
    if reply.error is not None:
        raise RuntimeError(f"session {session} turn {turn} under {run.policy} refused: {reply.error}")
    stats = dict(reply.stats)
    stats["ttft_ms"] = reply.ttft_ms if reply.ttft_ms is not None else reply.total_ms
    stats["total_ms"] = reply.total_ms
    stats["instance"] = reply.instance
    stats["client_prompt_tokens"] = len(prompt)
    run.turns.append(TurnRecord(session, turn, stats, reply.output))
