"""The session benchmark through Dynamo's OpenAI API (`bench --openai URL`).

What it is for: replay the same sessions as the in-process bench through
`/v1/chat/completions` (streaming), with one `x-dynamo-session-id` per
(run, replay, policy, session), and return the same `PolicyRun` records, so
the bench's report (client-side TTFT, outcomes, paired ratios) is unchanged.
The chat is kept client-side, as an OpenAI client does: each turn sends the
history, the model's earlier answers and the next user message.

The per-turn carry outcome is the worker's own: the final chunk's
`nvext.engine_data.mtp_carry` (asked for with `nvext.extra_fields`), the
turn's `TurnStats` as the engine measured them, with the id of the worker
that served it (`nvext.worker_id`, kept as the turn's `instance`).

Fairness (as `serve.triton.bench_client`): policies advance in lockstep, one
turn round at a time, their order rotating every round and replay, after
one warm-up turn per policy; every turn carries a `cache_salt` of its (run,
policy, replay), so a turn reuses only prefix-cache blocks its own policy
and replay cached. Time to first token is the client's (request sent to the
first chunk with text); the worker's own figure is kept as `server_ttft_ms`.
`busy_s[r]` is the client's wall time of a policy's batches in replay `r`.
"""

from __future__ import annotations

import argparse
import secrets
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...bench.replay import PolicyRun, TurnRecord, lockstep_batches, sort_turns
from ...bench.sessions import BenchSession
from ...engine.tokenizer import ChatTokenizer
from .openai_client import ChatReply, chat


def iter_replay_openai(
    base_url: str, sessions: Sequence[BenchSession], policies: Sequence[Any], max_new_tokens: int,
    concurrency: int = 4, model: str = "mtp_carry", timeout_s: float = 600.0, repeat: int = 1,
) -> Iterator[list[PolicyRun]]:
    """Replay `sessions` `repeat` times under each policy through the OpenAI API at
    `base_url` (".../v1"); yields the runs so far after every batch of turns, and once
    more at the end. A refused turn raises RuntimeError naming session, turn and message."""
    names = [str(getattr(p, "value", p)) for p in policies]
    if concurrency <= 0:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if repeat <= 0:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    tok = ChatTokenizer()
    run_id = f"{secrets.randbits(40):010x}"  # fresh sessions on a deployment that served others
    runs = {p: PolicyRun(p) for p in names}
    turns = 1 + max((len(s.followups) for s in sessions), default=0)

    def send(messages: list[dict[str, str]], session: str, policy: str, salt: str,
             max_tokens: int) -> ChatReply:
        return chat(base_url, model, messages, max_tokens, session_id=session, policy=policy,
                    cache_salt=salt, timeout_s=timeout_s)

    with ThreadPoolExecutor(concurrency) as pool:
        for policy in names:  # first-call costs stay out of the figures
            warm = send([{"role": "user", "content": "warm up"}], f"{run_id}/warm/{policy}", policy,
                        f"{run_id}/warm", 4)
            if warm.error is not None:
                raise RuntimeError(f"warm-up turn under {policy} refused: {warm.error}")
        for r in range(repeat):
            chats = {(p, s.name): list(s.history) for p in names for s in sessions}
            salt = {p: f"{p}/replay{r}/run{run_id}" for p in names}
            for policy in names:
                runs[policy].busy_s[r] = 0.0
            for t, policy, batch in lockstep_batches(sessions, names, turns, concurrency, r):
                t0 = time.perf_counter()
                futures = {s.name: pool.submit(send, chats[(policy, s.name)],
                                               f"{run_id}/r{r}/{policy}/{s.name}", policy,
                                               salt[policy], max_new_tokens) for s in batch}
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
                runs[policy].runtime[r] = {"openai": base_url, "model": model, "policy": policy}
    sort_turns(runs.values(), sessions)
    yield [runs[p] for p in names]


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


def run_openai(args: argparse.Namespace) -> int:
    """`bench --openai URL`: the bench's sessions and report, through a Dynamo deployment."""
    from ...bench import main as bench

    given = bench.server_side_flags(args)
    if given:
        raise ValueError(f"{', '.join(given)} with --openai {args.openai}: the engine is the workers' "
                         "(set it with `trtllm-mtp-carry serve --dynamo` options); drop "
                         f"{'it' if len(given) == 1 else 'them'} here")
    if args.server:
        raise ValueError("--server and --openai: pick one (Triton's gRPC or Dynamo's OpenAI API)")
    bench._check(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    env = bench.server_environment(args.openai, args.model)
    env["device"] = f"Dynamo OpenAI API {args.openai}, model {args.model} (client-side timing)"
    probe = chat(args.openai, args.model, [{"role": "user", "content": "ping"}], 1, timeout_s=60)
    if probe.error is not None:
        raise ValueError(f"--openai {args.openai}: {probe.error}")
    started = time.perf_counter()
    sessions = bench._sessions(args, ChatTokenizer())
    print(bench.environment_line(env))
    last: list[list[PolicyRun]] = [[]]

    def replays() -> Iterator[list[PolicyRun]]:
        for runs in iter_replay_openai(args.openai, sessions, policies, args.max_new_tokens,
                                       args.concurrency, args.model, repeat=args.repeat):
            last[0] = runs
            yield runs

    try:
        status = bench._drive_and_report(args, env, replays(), len(policies), sessions, started)
    except (RuntimeError, TimeoutError) as exc:
        raise ValueError(f"--openai {args.openai}: {exc}") from None
    print("\n".join(["", "routing (all replays):", *placement_lines(last[0])]))
    return status
