"""A Dynamo deployment on plain loopback under faults: sockets, cancellations, a SIGKILLed worker, clean stops.

Real Dynamo 1.6.1 (frontend, event broker, carry workers), no network namespace:
every socket the deployment opens must be on 127.0.0.1 by itself. One
deployment of two workers serves the module (request migration on, the
supervisor restarting dead workers); one-worker deployments pin a clean start
and stop (no ERROR line) and, through the CLI, the exit naming a dead worker
(`--on-worker-death exit`, or its restarts spent).

Pins (issue 45): no listener beyond loopback; every request a worker was handed
counts exactly once in `mtp_carry_outcomes_total` (its outcome kind, or
`cancelled` when cancelled before admission), so each worker's sum equals
Dynamo's own `dynamo_component_requests_total`, and the admitted ones equal the
runtime's `outcomes.*` gauge; `drafter_rows_total{source="adopted"}` equals the
runtime's `rows_adopted` under cancellations; a worker SIGKILLed mid-load is
reported and restarted while every in-flight stream completes through
migration with the in-process greedy answer; a restarted worker's sessions miss
honestly (`never_carried`) and adopt again from their next turn.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from dynamo_helpers import ROOT, expected_text

from trtllm_mtp_carry.serve.dynamo.launcher import (
    KNOWN_SHUTDOWN_ERRORS,
    DynamoDeployment,
    DynamoSpec,
    _get,
    free_port,
)
from trtllm_mtp_carry.serve.dynamo.metrics import tally
from trtllm_mtp_carry.serve.dynamo.openai_client import SESSION_HEADER, chat, chat_body
from trtllm_mtp_carry.serve.options import ServeOptions

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.frontend") is None,
    reason='Dynamo is not installed (pip install -e ".[dynamo]" && pip install --no-deps ai-dynamo==1.6.1)')

READY_S = 300.0  # the CPU is shared: Dynamo's start can be slow
TOPIC = "Write a Python function that parses a CSV line into fields, with tests."


@pytest.fixture(scope="module")
def deployment():
    events: list[str] = []
    spec = DynamoSpec(workers=2, http_port=free_port(), status_port=0, migration_limit=3,
                      options=ServeOptions(max_tokens=48))
    d = DynamoDeployment(spec, on_event=events.append)
    d.events = events  # type: ignore[attr-defined]
    try:
        d.start()
        d.supervise()
        d.wait_ready(READY_S)
        yield d
    finally:
        d.stop()


def _metrics(d: DynamoDeployment) -> dict[str, dict[str, float]]:
    """Per live worker (by its Dynamo worker id): the sums the assertions compare."""
    out = {}
    for w in d.live_workers():
        status, page = _get(w.metrics_url, timeout=10)
        assert status == 200
        wid, m = tally(page)
        out[wid] = m
    return out


def _cancelling_client(base_url: str, model: str, session: str, messages: list, when: str) -> int:
    """A streaming turn whose client hangs up: `at_once` right after sending the request,
    `first_token` after the first chunk with text. Returns the HTTP status seen (0: none)."""
    host, port = base_url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(chat_body(model, messages, 200)),
                 {"content-type": "application/json", SESSION_HEADER: session})
    status = 0
    if when == "first_token":
        response = conn.getresponse()
        status = response.status
        for raw in response:
            if raw.startswith(b"data:") and b'"content"' in raw:
                break
    elif when.startswith("after_"):  # hang up after this many seconds, whatever came
        time.sleep(float(when[len("after_"):]))
    conn.sock.close()
    conn.close()
    return status


def _settled(d: DynamoDeployment, check, timeout_s: float = 60.0):
    """`_metrics` once `check(metrics)` holds (cancellations reach a worker asynchronously),
    else the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(d)
        if check(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def test_every_socket_of_the_deployment_listens_on_loopback_only(deployment: DynamoDeployment) -> None:
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) not found")
    listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    pids = {deployment.frontend.pid: "frontend", deployment.broker.pid: "broker",  # type: ignore[union-attr]
            **{w.pid: f"worker{w.index}" for w in deployment.live_workers()}}
    status_port = deployment._status.port  # type: ignore[union-attr]
    found: dict[str, list[str]] = {}
    for ln in listing.splitlines():
        local = ln.split()[3]
        owner = next((name for pid, name in pids.items() if f"pid={pid}," in ln), None)
        if owner is None and local.endswith(f":{status_port}"):
            owner = "launcher status"
        if owner is not None:
            found.setdefault(owner, []).append(local.rsplit(":", 1)[0])
    # HTTP + request plane on the frontend, XSUB + XPUB on the broker, request plane +
    # system server per worker (+ the response-stream server where one was opened)
    assert {k: len(v) >= 2 for k, v in found.items() if k != "launcher status"} == {
        "frontend": True, "broker": True, "worker0": True, "worker1": True}
    assert found["launcher status"] == ["127.0.0.1"]
    assert {host for hosts in found.values() for host in hosts} == {"127.0.0.1"}, found


def test_host_moves_every_socket_of_the_deployment_there() -> None:
    # the one option that opens the deployment: checked with another loopback address
    # (127.0.0.2), so nothing opens to a network during the test
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) not found")
    try:
        port = free_port(host="127.0.0.2")
    except Exception as exc:  # no 127.0.0.0/8 beyond 127.0.0.1 on this host
        pytest.skip(f"127.0.0.2 is not bindable here: {exc}")
    spec = DynamoSpec(workers=1, http_host="127.0.0.2", http_port=port, status_port=0)
    d = DynamoDeployment(spec, on_event=lambda line: None)
    try:
        d.start()
        d.wait_ready(READY_S)
        assert chat(spec.base_url, spec.name, [{"role": "user", "content": TOPIC}], 4).error is None
        listing = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
        pids = [d.frontend.pid, d.broker.pid, d.workers[0].pid]  # type: ignore[union-attr]
        status_port = d._status.port  # type: ignore[union-attr]
        local = [ln.split()[3] for ln in listing.splitlines()
                 if any(f"pid={pid}," in ln for pid in pids) or ln.split()[3].endswith(f":{status_port}")]
    finally:
        d.stop()
    # frontend: HTTP + response stream; broker: XSUB + XPUB; worker: request plane + system + the
    # response stream of its carry endpoint's client (entry moves; NIXL on shared memory opens none); status
    assert len(local) == 8 and {addr.rsplit(":", 1)[0] for addr in local} == {"127.0.0.2"}, local


def test_cancelled_turns_count_once_and_each_workers_outcomes_equal_its_requests(
        deployment: DynamoDeployment) -> None:
    d, spec = deployment, deployment.spec
    before = _metrics(d)
    jobs = []  # 12 sessions x 2 turns; a quarter of the turns cancelled, at once or mid-stream
    for i in range(12):
        jobs.append((f"c{i}", [{"role": "user", "content": f"{TOPIC} Variant {i}."}]))

    def run(job):
        session, messages = job
        n = int(session[1:])
        first = chat(spec.base_url, spec.name, messages, 24, session_id=session)
        assert first.error is None, first.error
        follow = messages + [{"role": "assistant", "content": first.text},
                             {"role": "user", "content": "Now add type hints."}]
        if n % 4 == 0:
            _cancelling_client(spec.base_url, spec.name, session, follow, "at_once")
        elif n % 4 == 1:
            _cancelling_client(spec.base_url, spec.name, session, follow, "first_token")
        else:
            second = chat(spec.base_url, spec.name, follow, 24, session_id=session)
            assert second.error is None, second.error

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(run, jobs))
    # a turn queued behind its session's long running turn, cancelled while it waits:
    # never started, counted once as kind="cancelled" on the session's worker
    long = [{"role": "user", "content": "List the numbers from 1 to 500, one per line."}]  # ~650 tokens
    answer: list = []
    running = threading.Thread(target=lambda: answer.append(
        chat(spec.base_url, spec.name, long, 2000, session_id="queued")))
    running.start()
    time.sleep(0.5)
    _cancelling_client(spec.base_url, spec.name, "queued", long, "after_0.5")
    running.join(300)
    assert answer[0].error is None and answer[0].usage["completion_tokens"] > 600  # it outlasted the follower

    def agree(m) -> bool:
        return all(x["outcomes"] == x["requests"] for x in m.values())

    after = _settled(d, agree)
    for wid, m in after.items():
        b = before.get(wid, dict.fromkeys(m, 0.0))
        delta = {k: m[k] - b[k] for k in m}
        # every request Dynamo handed this worker counted once: admitted by kind, else cancelled
        assert delta["outcomes"] == delta["requests"], (wid, delta)
        assert m["outcomes"] - m["cancelled"] - m["rejected"] == m["runtime_outcomes"], (wid, m)
        assert m["rows_adopted_total"] == m["rows_adopted_runtime"], (wid, m)
    routed = sum(m["requests"] - before.get(w, {"requests": 0.0})["requests"] for w, m in after.items())
    assert 20 <= routed <= 26  # 12 first turns + 6 finished + the long one and its queued follower;
    # a turn cancelled at once may never be routed
    cancelled = sum(m["cancelled"] - before.get(w, {"cancelled": 0.0})["cancelled"] for w, m in after.items())
    # the queued follower at least (a turn hung up at once may also be cancelled before its
    # admission, by timing; each such one is in the outcomes = requests equality above)
    assert cancelled >= 1


def test_a_request_the_worker_rejects_counts_once_as_rejected(deployment: DynamoDeployment) -> None:
    # a 400 the worker gives (an unknown drafter policy, a prompt past the context) is a request
    # Dynamo counted: it counts once in mtp_carry_outcomes_total too, as kind="rejected"
    d, spec = deployment, deployment.spec
    before = _metrics(d)
    unknown = chat(spec.base_url, spec.name, [{"role": "user", "content": TOPIC}], 4, session_id="rj",
                   policy="fastest", stream=False)
    too_long = chat(spec.base_url, spec.name, [{"role": "user", "content": "y" * 33000}], 4, stream=False)
    assert (unknown.status, too_long.status) == (400, 400), (unknown.error, too_long.error)
    after = _settled(d, lambda m: all(x["outcomes"] == x["requests"] for x in m.values()))
    rejected = 0.0
    for wid, m in after.items():
        b = before.get(wid, dict.fromkeys(m, 0.0))
        assert m["outcomes"] - b["outcomes"] == m["requests"] - b["requests"], (wid, m, b)
        assert m["outcomes"] - m["cancelled"] - m["rejected"] == m["runtime_outcomes"], (wid, m)
        rejected += m["rejected"] - b["rejected"]
    assert rejected == 2


def test_a_worker_killed_mid_load_is_restarted_and_in_flight_streams_complete_by_migration(
        deployment: DynamoDeployment, reference_engine) -> None:
    d, spec = deployment, deployment.spec
    streams = [[{"role": "user", "content": f"{TOPIC} Case {i}, in detail."}] for i in range(6)]
    first_turns = [chat(spec.base_url, spec.name, m, 8, session_id=f"k{i}") for i, m in enumerate(streams)]
    assert [t.error for t in first_turns] == [None] * 6
    histories = [m + [{"role": "assistant", "content": t.text}, {"role": "user", "content": "Explain it."}]
                 for m, t in zip(streams, first_turns, strict=True)]
    results: list = [None] * 6

    def run(i: int) -> None:
        results[i] = chat(spec.base_url, spec.name, histories[i], 48, session_id=f"k{i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    victim = None
    while time.monotonic() < deadline and victim is None:  # the first worker seen streaming dies
        for w in d.live_workers():
            page = _get(w.metrics_url, timeout=5)[1]
            inflight = re.search(
                r'dynamo_component_inflight_requests\{[^}]*dynamo_endpoint="generate"[^}]*\} (\d+)', page)
            if inflight and int(inflight.group(1)) > 0:
                victim = w
                victim_id = int(re.search(r'worker_id="([0-9a-f]+)"', page).group(1), 16)  # type: ignore[union-attr]
                break
        time.sleep(0.02)
    assert victim is not None, "no worker was seen with a request in flight"
    victim.process.send_signal(signal.SIGKILL)
    for t in threads:
        t.join(300)
    for i, reply in enumerate(results):
        assert reply.error is None, (i, reply.error)
        assert reply.finish_reason in ("stop", "length")
        assert reply.text == expected_text(reference_engine, histories[i], 48), i
    # a stream the victim was serving finished on the other worker (nvext.worker_id keeps the
    # first routing; the worker's own report names who finished); a turn the victim finished
    # before the kill (its in-flight count is read just before) names the victim itself
    routed = [r for r in results if r.worker_id == victim_id]
    assert any(r.carry["worker_id"] != victim_id for r in routed), [r.carry["worker_id"] for r in routed]

    deadline = time.monotonic() + READY_S
    while not any(e.startswith(f"worker {victim.index} restarted") for e in d.events) \
            and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.2)
    assert d.events[:2] == [  # type: ignore[attr-defined]
        f"worker {victim.index} (pid {victim.pid}) died: killed by SIGKILL; restarting it in 1 s "
        f"(restart 1 of 3)",
        f"worker {victim.index} restarted: pid {d.workers[victim.index].pid}, "
        f"metrics {d.workers[victim.index].metrics_url}"]
    d.wait_ready(READY_S)
    status, body = _get(f"http://127.0.0.1:{d._status.port}/health")  # type: ignore[union-attr]
    health = json.loads(body)
    assert status == 200 and (health["workers_alive"], health["workers_registered"],
                              health["worker_restarts"], health["worker_deaths"]) == (2, 2, 1, 1)
    page = _get(f"http://127.0.0.1:{d._status.port}/metrics")[1]  # type: ignore[union-attr]
    assert 'mtp_carry_dynamo_workers{state="alive"} 2' in page.splitlines()
    assert "mtp_carry_dynamo_worker_restarts_total 1" in page.splitlines()

    # the sessions go on: where a turn lands on a worker without the session's rows it pulls them
    # from the live worker holding them (adopted, remote), or, its holder dead, misses honestly
    # (never_carried); the turn after adopts again
    live = {int(wid, 16) for wid in _metrics(d) if wid}
    for i, reply in enumerate(results):
        history = histories[i] + [{"role": "assistant", "content": reply.text},
                                  {"role": "user", "content": "Shorter."}]
        third = chat(spec.base_url, spec.name, history, 8, session_id=f"k{i}")
        assert third.error is None, third.error
        # the worker's own report names who finished the turn (nvext.worker_id keeps the first
        # routing of a migrated stream)
        if third.carry["worker_id"] == reply.carry["worker_id"]:
            assert (third.carry["outcome_kind"], third.carry["rows_source"]) == ("adopted", "local"), (i, third.carry)
        elif reply.carry["worker_id"] in live:
            assert (third.carry["outcome_kind"], third.carry["rows_source"], third.carry["pull"]) == (
                "adopted", "remote", "received"), (i, third.carry)
        else:
            assert (third.carry["outcome_kind"], third.carry["no_carry_reason"]) == (
                "no_carry", "never_carried"), (i, third.carry)
        history += [{"role": "assistant", "content": third.text}, {"role": "user", "content": "Again."}]
        fourth = chat(spec.base_url, spec.name, history, 8, session_id=f"k{i}")
        assert fourth.error is None and fourth.carry["worker_id"] == third.carry["worker_id"]
        assert fourth.carry["outcome_kind"] == "adopted", (i, fourth.carry)


def test_sessions_of_restarted_workers_miss_as_never_carried_then_adopt_again(
        deployment: DynamoDeployment) -> None:
    d, spec = deployment, deployment.spec
    histories = []
    for i in range(4):  # two turns each: the second adopts the first's rows
        history = [{"role": "user", "content": f"{TOPIC} Restart case {i}."}]
        for follow in ("Add a docstring.", "Shorter."):
            reply = chat(spec.base_url, spec.name, history, 8, session_id=f"r{i}")
            assert reply.error is None
            history += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": follow}]
        assert reply.carry["outcome_kind"] == "adopted"
        histories.append(history)
    restarts = d.restarts
    for w in d.live_workers():  # every worker dies: whatever serves next holds nothing
        w.process.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + READY_S
    while d.restarts < restarts + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    d.wait_ready(READY_S)
    for i, history in enumerate(histories):
        miss = chat(spec.base_url, spec.name, history, 8, session_id=f"r{i}")
        assert miss.error is None, miss.error
        assert (miss.carry["outcome_kind"], miss.carry["no_carry_reason"], miss.carry["drafter_rows_kept"]) \
            == ("no_carry", "never_carried", 0), (i, miss.carry)
        history = history + [{"role": "assistant", "content": miss.text}, {"role": "user", "content": "Again."}]
        again = chat(spec.base_url, spec.name, history, 8, session_id=f"r{i}")
        assert again.error is None and again.carry["worker_id"] == miss.carry["worker_id"]
        assert again.carry["outcome_kind"] == "adopted", (i, again.carry)


def test_a_clean_start_and_stop_log_no_error_line() -> None:
    spec = DynamoSpec(workers=1, http_port=free_port())
    d = DynamoDeployment(spec, on_event=lambda line: None)
    try:
        d.start()
        d.wait_ready(READY_S)
        reply = chat(spec.base_url, spec.name, [{"role": "user", "content": TOPIC}], 8, session_id="q")
        assert reply.error is None
    finally:
        d.stop(remove=False)
    try:
        assert d.error_lines() == []
        for line in d.error_lines(include_known=True):  # Dynamo's own, named in docs/DYNAMO.md
            assert any(k in line for k in KNOWN_SHUTDOWN_ERRORS), line
    finally:
        shutil.rmtree(d.workdir, ignore_errors=True)


@pytest.mark.parametrize("flags, why", [
    (["--on-worker-death", "exit"], "--on-worker-death exit: stopping the deployment"),
    (["--worker-restarts", "0"], "its restarts are spent (--worker-restarts 0): stopping the deployment"),
])
def test_serve_exits_non_zero_naming_the_dead_worker_at_its_first_death_or_its_last_restart(
        tmp_path: Path, flags: list[str], why: str) -> None:
    port, status_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", "from trtllm_mtp_carry.cli import main; raise SystemExit(main())",
         "serve", "--dynamo", "--workers", "1", "--http-port", str(port), "--metrics-port", str(status_port),
         *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, start_new_session=True,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path),
             "PYTHONPATH": str(ROOT)})
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        (pid,) = re.findall(r"worker 0\s+pid (\d+)", "".join(lines))
        assert json.loads(_get(f"http://127.0.0.1:{status_port}/health")[1])["workers_alive"] == 1
        subprocess.run(["kill", "-KILL", pid], check=True)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 2
    assert err.splitlines()[-1] == f"trtllm-mtp-carry: error: worker 0 (pid {pid}) died: killed by SIGKILL; {why}"
    assert ("".join(lines) + out + err).count(f"died: killed by SIGKILL; {why}") == 1  # printed once
