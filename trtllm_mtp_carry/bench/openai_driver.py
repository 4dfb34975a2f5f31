"""The bench's driver through Dynamo's OpenAI API (`bench --openai URL`).

What it is for: replay the same sessions as the in-process bench through
`/v1/chat/completions` (streaming, `serve.dynamo.openai_client.chat`), with
one `x-dynamo-session-id` per (run, replay, policy, session), and return the
same `PolicyRun` records, so the bench's report (client-side TTFT, outcomes,
paired ratios) is unchanged. The chat is kept client-side, as an OpenAI
client does: each turn sends the history, the model's earlier answers and
the next user message.

The per-turn carry outcome is the worker's own: the final chunk's
`nvext.engine_data.mtp_carry` (asked for with `nvext.extra_fields`), the
turn's `TurnStats` as the engine measured them, with the id of the worker
that served it (`nvext.worker_id`, kept as the turn's `instance`).

Fairness (as `triton_driver`): policies advance in lockstep
(`driver.lockstep_batches`), one turn round at a time, their order rotating
every round and replay, after one warm-up turn per policy; every turn
carries a `cache_salt` of its (run, policy, replay), so a turn reuses only
prefix-cache blocks its own policy and replay cached. Time to first token is
the client's (request sent to the first chunk with text); the worker's own
figure is kept as `server_ttft_ms`. `busy_s[r]` is the client's wall time of
a policy's batches in replay `r`.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..engine.tokenizer import ChatTokenizer
from ..serve.dynamo.openai_client import ChatReply, chat
from .driver import PolicyRun, TurnRecord, check_counts, lockstep_batches, policy_names, sort_turns
from .sessions import BenchSession


class OpenAIDriver:
    """The bench's driver through the OpenAI API at `base_url` (".../v1") serving `model`
    (`driver.Driver`): `repeat` replays, at most `concurrency` turns of one policy in
    flight at once, `timeout_s` for each turn's whole answer."""

    def __init__(self, base_url: str, model: str = "mtp_carry", max_new_tokens: int = 32,
                 concurrency: int = 4, timeout_s: float = 600.0, repeat: int = 1) -> None:
        check_counts(concurrency, repeat)
        self.base_url, self.model, self.max_new_tokens = base_url, model, max_new_tokens
        self.concurrency, self.timeout_s, self.repeat = concurrency, timeout_s, repeat

    def check(self) -> None:
        """Return when the deployment answers one chat turn; ValueError naming `--openai`
        (and the URL) with its error otherwise."""
        probe = chat(self.base_url, self.model, [{"role": "user", "content": "ping"}], 1, timeout_s=60)
        if probe.error is not None:
            raise ValueError(f"--openai {self.base_url}: {probe.error}")

    def _send(self, messages: list[dict[str, str]], session: str, policy: str, salt: str,
              max_tokens: int) -> ChatReply:
        return chat(self.base_url, self.model, messages, max_tokens, session_id=session, policy=policy,
                    cache_salt=salt, timeout_s=self.timeout_s)

    def replay(self, sessions: Sequence[BenchSession], policies: Sequence[Any]) -> Iterator[list[PolicyRun]]:
        """Replay `sessions` `repeat` times under each policy through the API; yields the runs
        so far after every batch of turns, and once more at the end. A refused turn raises
        RuntimeError naming session, turn and message."""
        names = policy_names(policies)
        tok = ChatTokenizer()
        run_id = f"{secrets.randbits(40):010x}"  # fresh sessions on a deployment that served others
        runs = {p: PolicyRun(p) for p in names}
        turns = 1 + max((len(s.followups) for s in sessions), default=0)
        with ThreadPoolExecutor(self.concurrency) as pool:
            for policy in names:  # first-call costs stay out of the figures
                warm = self._send([{"role": "user", "content": "warm up"}], f"{run_id}/warm/{policy}",
                                  policy, f"{run_id}/warm", 4)
                if warm.error is not None:
                    raise RuntimeError(f"warm-up turn under {policy} refused: {warm.error}")
            for r in range(self.repeat):
                chats = {(p, s.name): list(s.history) for p in names for s in sessions}
                salt = {p: f"{p}/replay{r}/run{run_id}" for p in names}
                for policy in names:
                    runs[policy].busy_s[r] = 0.0
                for t, policy, batch in lockstep_batches(sessions, names, turns, self.concurrency, r):
                    t0 = time.perf_counter()
                    futures = {s.name: pool.submit(self._send, chats[(policy, s.name)],
                                                   f"{run_id}/r{r}/{policy}/{s.name}", policy,
                                                   salt[policy], self.max_new_tokens) for s in batch}
                    replies = {name: f.result() for name, f in futures.items()}
                    runs[policy].busy_s[r] += time.perf_counter() - t0
                    for s in batch:
                        messages = chats[(policy, s.name)]
                        _record(runs[policy], tok, s.name, t, r, messages, replies[s.name])
                        if t < len(s.followups):
                            messages += [{"role": "assistant", "content": replies[s.name].text},
                                         {"role": "user", "content": s.followups[t]}]
                    yield [runs[p] for p in names]
                for policy in names:
                    runs[policy].runtime[r] = {"openai": self.base_url, "model": self.model, "policy": policy}
        sort_turns(runs.values(), sessions)
        yield [runs[p] for p in names]

    def report_lines(self, runs: Sequence[PolicyRun]) -> list[str]:
        """Where the router put the sessions (all replays): a blank line, a heading, `placement_lines`."""
        return ["", "routing (all replays):", *placement_lines(runs)]


def _record(run: PolicyRun, tok: ChatTokenizer, session: str, turn: int, replay: int,
            messages: list[dict[str, str]], reply: ChatReply) -> None:
    if reply.error is not None:
        raise RuntimeError(f"session {session} turn {turn} (replay {replay}) under {run.policy} "
                           f"refused (HTTP {reply.status}): {reply.error}")
    if not reply.carry:
        raise RuntimeError(f"session {session} turn {turn}: the reply has no nvext.engine_data.mtp_carry "
                           "(is the deployment serving trtllm_mtp_carry's worker?)")
    stats = dict(reply.carry)
    stats["server_ttft_ms"] = stats.get("ttft_ms")
    stats["ttft_ms"] = reply.ttft_ms if reply.ttft_ms is not None else reply.total_ms
    stats["total_ms"] = reply.total_ms
    stats["instance"] = f"{reply.worker_id:x}" if reply.worker_id is not None else None
    stats["client_prompt_tokens"] = len(tok.render_chat(messages))
    output = tok.encode(reply.text) + ([tok.eos_id] if reply.finish_reason == "stop" else [])
    run.turns.append(TurnRecord(session, turn, stats, output, replay))


def placement_lines(runs: Sequence[PolicyRun]) -> list[str]:
    """Where the router put the sessions: per policy, sessions that stayed on one worker, turns per worker."""
    lines = []
    for run in runs:
        workers: dict[tuple[int, str], set[str]] = {}
        for rec in run.turns:
            workers.setdefault((rec.replay, rec.session), set()).add(str(rec.stats.get("instance")))
        kept = sum(1 for w in workers.values() if len(w) == 1)
        per_worker = Counter(str(rec.stats.get("instance")) for rec in run.turns)
        lines.append(f"{run.policy}: sessions on one worker {kept}/{len(workers)}, turns per worker "
                     + ", ".join(f"{w}={n}" for w, n in sorted(per_worker.items())))
    return lines
