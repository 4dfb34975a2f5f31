"""Carried rows follow a session to another worker: real Dynamo 1.6.1 and NIXL 1.5.1, on loopback.

`serve --dynamo` deployments of 3 and 2 workers (round-robin with session affinity, so sessions
spread; each turn reports the digest of the rows it deposited). Every session has a twin with the
same messages on another worker: the control that never moves.

Pins: after a graceful stop (SIGTERM) of a worker, every session it held adopts its rows on the
worker that serves its next turn (pushed there by the drain, or pulled from the peer it was
pushed to), bit for bit (the digest read equals the digest at deposit), with the output of the
in-process greedy answer and the rows kept, drafts and acceptance of its twin that never moved;
every socket the deployment opens listens on 127.0.0.1 (NIXL on shared memory opens none); a
holder that hangs mid-pull costs the turn its carry within the pull budget (an honest miss,
`pull="timeout"`), and one killed while a pull waits on it the same (`holder_gone` or
`timeout`), never a hang.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from dynamo_helpers import expected_text

from trtllm_mtp_carry.serve.dynamo.launcher import DynamoDeployment, DynamoSpec, _get, free_port
from trtllm_mtp_carry.serve.dynamo.metrics import tally
from trtllm_mtp_carry.serve.dynamo.openai_client import chat
from trtllm_mtp_carry.serve.options import ServeOptions

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.frontend") is None
    or importlib.util.find_spec("nixl") is None,
    reason='Dynamo or NIXL is not installed (pip install -e ".[dynamo,nixl]" && pip install --no-deps '
           'ai-dynamo==1.6.1)')

READY_S = 300.0
MAX_TOKENS = 12
PULL_BUDGET_MS = 1500
TOPICS = ("parses a CSV line into fields", "reverses the words of a sentence", "counts vowels in a string")


def _deployment(workers: int) -> DynamoDeployment:
    spec = DynamoSpec(workers=workers, http_port=free_port(), status_port=0, router_mode="round-robin",
                      carry_digests=True, pull_budget_ms=PULL_BUDGET_MS, options=ServeOptions(max_tokens=MAX_TOKENS))
    d = DynamoDeployment(spec, on_event=lambda line: None)
    try:
        d.start()
        d.supervise()
        d.wait_ready(READY_S)
    except BaseException:
        d.stop()
        raise
    return d


def _worker_index(d: DynamoDeployment) -> dict[int, int]:
    """Dynamo worker id -> deployment slot, from each live worker's metrics."""
    ids = {}
    for w in d.live_workers():
        found = re.search(r'worker_id="([0-9a-f]+)"', _get(w.metrics_url, timeout=10)[1])
        if found:
            ids[int(found.group(1), 16)] = w.index
    return ids


class Sessions:
    """Twin sessions (`m<i>` and `t<i>`: the same messages) driven turn by turn."""

    def __init__(self, d: DynamoDeployment, count: int) -> None:
        self.d = d
        self.history = {}
        for i in range(count):
            for twin in ("m", "t"):
                self.history[f"{twin}{i}"] = [{"role": "user", "content": f"Write a Python function that "
                                                                           f"{TOPICS[i % len(TOPICS)]}, case {i}."}]
        self.last: dict[str, dict] = {}

    def turn(self, sid: str, follow: str) -> dict:
        spec = self.d.spec
        messages = list(self.history[sid])
        reply = chat(spec.base_url, spec.name, messages, MAX_TOKENS, session_id=sid)
        assert reply.error is None, (sid, reply.error)
        record = dict(reply.carry, text=reply.text, messages=messages)
        self.history[sid] = messages + [{"role": "assistant", "content": reply.text},
                                        {"role": "user", "content": follow}]
        self.last[sid] = record
        return record


def _listeners_on_loopback_only(d: DynamoDeployment) -> None:
    if shutil.which("ss") is None:  # never a silent pass: the pin needs the sockets listed
        pytest.fail("ss (iproute2) is not installed: the deployment's listening sockets cannot be checked")
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    pids = [d.frontend.pid, d.broker.pid, *(w.pid for w in d.live_workers())]  # type: ignore[union-attr]
    hosts = {ln.split()[3].rsplit(":", 1)[0] for ln in listing.splitlines() if any(f"pid={p}," in ln for p in pids)}
    assert hosts == {"127.0.0.1"}, listing


def _graceful_stop_moves_every_session(d: DynamoDeployment, reference_engine, pairs: int) -> dict[str, float]:
    s = Sessions(d, pairs)
    for follow in ("Add type hints.", "Shorter."):  # the second turn adopts the first's rows where it ran
        for sid in s.history:
            s.turn(sid, follow)
    held = {sid: r["worker_id"] for sid, r in s.last.items()}
    slots = _worker_index(d)
    # the victim: the worker holding the most sessions whose twin lives elsewhere
    counts: dict[int, int] = {}
    for i in range(pairs):
        if held[f"m{i}"] != held[f"t{i}"]:
            for sid in (f"m{i}", f"t{i}"):
                counts[held[sid]] = counts.get(held[sid], 0) + 1
    victim_id = max(counts, key=lambda w: counts[w])
    moved = sorted(sid for sid, w in held.items() if w == victim_id and held[_twin(sid)] != victim_id)
    assert moved, held
    deposited = {sid: s.last[sid]["carry_digest"] for sid in moved}
    assert all(deposited.values()), deposited
    _listeners_on_loopback_only(d)

    victim = next(w for w in d.live_workers() if w.index == slots[victim_id])
    victim.process.send_signal(signal.SIGTERM)
    victim.process.wait(60)  # its drain is bounded (--carry-drain-s)
    deadline = time.monotonic() + READY_S
    while d.restarts < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    d.wait_ready(READY_S)

    before = _tallies(d)
    for sid in moved:
        twin = _twin(sid)
        got, control = s.turn(sid, "Again."), s.turn(twin, "Again.")
        assert got["worker_id"] != victim_id
        assert (got["outcome_kind"], got["rows_source"]) == ("adopted", "remote"), (sid, got)
        assert got["moved_in"]["digest"] == deposited[sid], (sid, got["moved_in"], deposited[sid])
        assert got["moved_in"]["via"] in ("push", "pull")
        assert got["text"] == control["text"] == expected_text(reference_engine, got["messages"], MAX_TOKENS)
        assert (control["outcome_kind"], control["rows_source"]) == ("adopted", "local"), (twin, control)
        assert (got["drafter_rows_kept"], got["drafted"], got["accepted"]) == (
            control["drafter_rows_kept"], control["drafted"], control["accepted"]), (sid, got, control)
    after = _tallies(d)
    delta = {k: sum(m[k] - before.get(wid, dict.fromkeys(m, 0.0))[k] for wid, m in after.items())
             for k in ("adopted_remote", "outcomes", "requests")}
    assert delta["adopted_remote"] == len(moved) and delta["outcomes"] == delta["requests"], delta
    total = {k: sum(m[k] for m in after.values()) for k in ("moved_rows_in", "pulls_received")}
    assert total["moved_rows_in"] >= sum(s.last[sid]["moved_in"]["rows"] for sid in moved), total
    _listeners_on_loopback_only(d)
    return total


def _twin(sid: str) -> str:
    return ("t" if sid[0] == "m" else "m") + sid[1:]


def _tallies(d: DynamoDeployment) -> dict[str, dict[str, float]]:
    """Each live worker's metrics summed (`tally`), by its Dynamo worker id."""
    return dict(tally(_get(w.metrics_url, timeout=10)[1]) for w in d.live_workers())


def test_three_workers_a_stopped_workers_sessions_adopt_their_rows_bit_for_bit_where_they_land(
        reference_engine) -> None:
    d = _deployment(3)
    try:
        _graceful_stop_moves_every_session(d, reference_engine, pairs=3)
        assert d.error_lines() == []
    finally:
        d.stop()


def test_two_workers_moves_and_a_hung_or_killed_holder_costs_a_turn_its_carry_within_the_budget(
        reference_engine) -> None:
    d = _deployment(2)
    try:
        _graceful_stop_moves_every_session(d, reference_engine, pairs=1)
        # two sessions held by one worker: it hangs mid-pull (stopped: alive, never answering),
        # then dies while the second session's pull waits on it; each turn, routed to the other
        # worker, misses honestly within the pull budget
        s = Sessions(d, 0)
        ask = "Write a Python function that sorts a list of words."
        s.history = {"hung": [{"role": "user", "content": ask}]}
        s.turn("hung", "Explain it.")
        holder_id = s.last["hung"]["worker_id"]
        for i in range(8):  # round-robin with affinity: a new session lands on the holder every other one
            s.history[f"killed{i}"] = [{"role": "user", "content": f"{ask} Case {i}."}]
            if s.turn(f"killed{i}", "Explain it.")["worker_id"] == holder_id:
                killed = f"killed{i}"
                break
        else:
            pytest.fail(f"no second session landed on worker {holder_id:x}")
        slots = _worker_index(d)
        holder = next(w for w in d.live_workers() if w.index == slots[holder_id])
        holder.process.send_signal(signal.SIGSTOP)
        try:
            for path in d._entries(holder):  # the router stops sending it turns; its carry endpoint stays
                if "%2Fgenerate%2F" in path.name:
                    path.unlink()
            time.sleep(2.0)
            t0 = time.monotonic()
            missed = s.turn("hung", "Again.")
            took = time.monotonic() - t0
            with ThreadPoolExecutor(1) as pool:  # the holder dies while this turn's pull waits on it
                t1 = time.monotonic()
                pending = pool.submit(s.turn, killed, "Again.")
                time.sleep(PULL_BUDGET_MS / 3000)
                holder.process.send_signal(signal.SIGKILL)
                died = pending.result(timeout=120)
                took_died = time.monotonic() - t1
        finally:
            holder.process.send_signal(signal.SIGKILL)
            holder.process.send_signal(signal.SIGCONT)
        assert (missed["outcome_kind"], missed["no_carry_reason"], missed["pull"]) == (
            "no_carry", "never_carried", "timeout"), missed
        assert PULL_BUDGET_MS - 50 <= missed["pull_ms"] < PULL_BUDGET_MS + 1000, missed
        assert took < 60, took
        assert missed["text"] == expected_text(reference_engine, missed["messages"], MAX_TOKENS)
        assert (died["outcome_kind"], died["no_carry_reason"]) == ("no_carry", "never_carried"), died
        assert died["pull"] in ("holder_gone", "timeout"), died  # refused at once, or the budget spent
        assert died["pull_ms"] < PULL_BUDGET_MS + 1000, died
        assert took_died < 60, took_died
        assert died["text"] == expected_text(reference_engine, died["messages"], MAX_TOKENS)
    finally:
        d.stop()
