"""The bench's driver through a running Triton server (`bench --server HOST:PORT`).

What it is for: replay the same sessions as the in-process bench, over the
served model's gRPC stream (`serve.triton.client.StreamClient`), with one
correlation id per (replay, session, policy), and return the same
`PolicyRun` records (turns tagged with their replay, busy time and runtime
facts per replay), so the bench's report code shows the policies side by
side unchanged. Turn 1 sends the rendered history as `input_ids` (with
`START`); each later turn sends only the next user message as `text_input`
(the server extends its own history; the last turn sets `END`, which frees
the session's carried rows).

    replay r:  turn round 0          turn round 1         ...
               | A: s0 s1 | B: s0 s1 | B: s0 s1 | A: s0 s1 |   (policy order rotates)

Fairness: policies advance in lockstep (`driver.lockstep_batches`), one turn
round at a time, after one warm-up turn per policy, so drift of the machine
favours none of them. The server's prefix cache is shared by every session
of an instance, and the policies replay identical prompts, so every turn
carries a `cache_salt` of its (run, policy, replay): a turn reuses only
blocks and SSM snapshots its own session's earlier turns cached (sessions of
one policy and replay share a namespace, as in the in-process bench's fresh
engine per policy and replay), never those of another policy, replay or
bench run. Time to first token is the client's (send to the first response
with tokens); the server's own figure is kept as `server_ttft_ms`.
`busy_s[r]` is the client's wall time of a policy's batches in replay `r`,
so the report's tokens/s is the client-side aggregate at `concurrency`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ..engine.tokenizer import ChatTokenizer
from ..serve.triton.client import StreamClient, TurnReply, model_ready, server_unreachable
from .driver import PolicyRun, TurnRecord, check_counts, lockstep_batches, policy_names, sort_turns
from .sessions import BenchSession

ID_BITS = 20
"""Low bits of a correlation id: (replay, policy, session) within one run; the rest is the run's nonce."""


class TritonDriver:
    """The bench's driver through the Triton server at `server` ("host:port", its gRPC
    port) serving `model` (`driver.Driver`): `repeat` replays, at most `concurrency`
    sessions of one policy in flight at once, `timeout_s` for each turn's final response."""

    def __init__(self, server: str, model: str = "mtp_carry", max_new_tokens: int = 32,
                 concurrency: int = 4, timeout_s: float = 600.0, repeat: int = 1) -> None:
        check_counts(concurrency, repeat)
        self.server, self.model, self.max_new_tokens = server, model, max_new_tokens
        self.concurrency, self.timeout_s, self.repeat = concurrency, timeout_s, repeat

    def check(self) -> None:
        """Return when a Triton server answers at `server` and serves `model`; ValueError
        naming `--server` (and the address) otherwise, or the missing tritonclient."""
        try:
            why = server_unreachable(self.server)
            ready = why is None and model_ready(self.server, self.model)
        except ImportError:
            raise ValueError('--server needs tritonclient: pip install -e ".[serve]"') from None
        if why is not None:
            raise ValueError(f"--server {self.server}: no Triton server answers there ({why})")
        if not ready:
            raise ValueError(f"--server {self.server}: model {self.model!r} is not ready there (see --model)")

    def replay(self, sessions: Sequence[BenchSession], policies: Sequence[Any]) -> Iterator[list[PolicyRun]]:
        """Replay `sessions` `repeat` times under each policy (DrafterPolicy or name) through
        the server; yields the runs so far after every batch of turns, and once more at the
        end. A turn the server refuses raises RuntimeError naming session, turn and message."""
        names = policy_names(policies)
        if self.repeat * len(names) * len(sessions) >= (1 << ID_BITS) - len(names):
            raise ValueError(f"{self.repeat} replays x {len(names)} policies x {len(sessions)} sessions "
                             "need more correlation ids than one run has")
        tok = ChatTokenizer()
        nonce = secrets.randbits(40) << ID_BITS  # fresh sessions on a server that may have served others
        runs = {p: PolicyRun(p) for p in names}
        turns = 1 + max((len(s.followups) for s in sessions), default=0)
        with StreamClient(self.server, self.model) as client:
            for i, policy in enumerate(names):  # first-call costs stay out of the figures
                warm = client.turn(nonce | ((1 << ID_BITS) - 1 - i), start=True, end=True, max_tokens=4,
                                   policy=policy,
                                   input_ids=tok.render_chat([{"role": "user", "content": "warm up"}]))
                if warm.error:
                    raise RuntimeError(f"warm-up turn under {policy} refused: {warm.error}")
            for r in range(self.repeat):
                corrid = {(p, s.name): nonce | (((r * len(names) + i) * len(sessions)) + j + 1)
                          for i, p in enumerate(names) for j, s in enumerate(sessions)}
                prompts = {key: tok.render_chat(s.history) for key in corrid
                           for s in sessions if s.name == key[1]}
                for policy in names:
                    runs[policy].busy_s[r] = 0.0
                salt = {p: f"{p}/replay{r}/run{nonce >> ID_BITS:x}" for p in names}
                for t, policy, batch in lockstep_batches(sessions, names, turns, self.concurrency, r):
                    t0 = time.perf_counter()
                    sent = {}
                    for s in batch:
                        key = (policy, s.name)
                        last = t == len(s.followups)
                        if t == 0:
                            sent[s.name] = client.send(corrid[key], start=True, end=last,
                                                       input_ids=prompts[key],
                                                       max_tokens=self.max_new_tokens, policy=policy,
                                                       cache_salt=salt[policy])
                        else:
                            sent[s.name] = client.send(corrid[key], end=last, text=s.followups[t - 1],
                                                       max_tokens=self.max_new_tokens, policy=policy,
                                                       cache_salt=salt[policy])
                    replies = {s.name: client.wait(sent[s.name], self.timeout_s) for s in batch}
                    runs[policy].busy_s[r] += time.perf_counter() - t0
                    for s in batch:
                        key = (policy, s.name)
                        _record(runs[policy], s.name, t, r, prompts[key], replies[s.name])
                        if t < len(s.followups):
                            prompts[key] = tok.next_prompt(prompts[key], replies[s.name].output,
                                                           s.followups[t])
                    yield [runs[p] for p in names]
                for policy in names:
                    runs[policy].runtime[r] = {"server": self.server, "model": self.model, "policy": policy}
        sort_turns(runs.values(), sessions)
        yield [runs[p] for p in names]

    def report_lines(self, runs: Sequence[PolicyRun]) -> list[str]:
        """Nothing: each turn's instance is in its record (`stats["instance"]`)."""
        return []


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
