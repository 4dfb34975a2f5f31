"""Carried rows following sessions between workers, measured: a graceful stop under `serve --dynamo`,
and the NIXL read of one entry's range by size.

Part 1 (`--workers`, `--pairs`): a deployment of N workers (round-robin with session affinity, so
sessions spread; each turn reports the digest of the rows it deposited). `--pairs` twin sessions
(the same messages under two session ids) run `--turns` turns each; then the worker holding the
most sessions whose twin lives elsewhere is stopped gracefully (SIGTERM: its drain hands its
entries to the others) and every session runs one more turn. Prints, as JSON: the first turns'
pull cost (no peer holds a new session: `no_holder`), the drain (entries, ms, from the worker's
log), per moved session whether it adopted remotely and how (push or pull), the digest read
against the digest at deposit, the pulls' ms, the bytes moved, and the moved sessions' drafts and
acceptance against their twins that never moved (outputs compared too).

Part 2 (`--read-sizes`): one holder process exposes ranges of each size; this process reads each
`--reps` times over NIXL on shared memory (one descriptor) and prints the median and p25-p75 ms.

    python scripts/dynamo_moves_run.py [--workers 3] [--pairs 6] [--turns 3] [--read-sizes 65536,1048576,16777216]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtllm_mtp_carry.serve.dynamo.launcher import DynamoDeployment, DynamoSpec, _get, free_port  # noqa: E402
from trtllm_mtp_carry.serve.dynamo.metrics import tally  # noqa: E402
from trtllm_mtp_carry.serve.dynamo.openai_client import chat  # noqa: E402
from trtllm_mtp_carry.serve.options import ServeOptions  # noqa: E402

TOPICS = ("parses a CSV line into fields", "reverses the words of a sentence", "counts vowels in a string",
          "merges two sorted lists", "checks whether a string is a palindrome", "flattens a nested list")
FOLLOWS = ("Add type hints.", "Shorter.", "Add a docstring.", "Again.", "Explain it.")


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "median": None, "p25": None, "p75": None}
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"n": len(values), "median": round(statistics.median(values), 2), "p25": round(q[0], 2),
            "p75": round(q[2], 2)}


def graceful_stop(workers: int, pairs: int, turns: int, max_tokens: int) -> dict:
    spec = DynamoSpec(workers=workers, http_port=free_port(), router_mode="round-robin", carry_digests=True,
                      options=ServeOptions(max_tokens=max_tokens))
    d = DynamoDeployment(spec, on_event=lambda line: None)
    d.start()
    d.supervise()
    d.wait_ready(300)
    try:
        history = {f"{t}{i}": [{"role": "user", "content": f"Write a Python function that {TOPICS[i % len(TOPICS)]}, "
                                                            f"case {i}."}]
                   for i in range(pairs) for t in ("m", "t")}
        last: dict[str, dict] = {}
        first_pulls: list[float] = []

        def turn(sid: str, follow: str) -> dict:
            reply = chat(spec.base_url, spec.name, history[sid], max_tokens, session_id=sid)
            if reply.error is not None:
                raise RuntimeError(f"{sid}: {reply.error}")
            history[sid] = history[sid] + [{"role": "assistant", "content": reply.text},
                                           {"role": "user", "content": follow}]
            last[sid] = dict(reply.carry, text=reply.text)
            return last[sid]

        for k in range(turns - 1):
            for sid in history:
                r = turn(sid, FOLLOWS[k % len(FOLLOWS)])
                if k == 0:
                    first_pulls.append(r["pull_ms"])
        held = {sid: r["worker_id"] for sid, r in last.items()}
        twin = {sid: ("t" if sid[0] == "m" else "m") + sid[1:] for sid in held}
        counts: dict[int, int] = {}
        for sid, w in held.items():
            if held[twin[sid]] != w:
                counts[w] = counts.get(w, 0) + 1
        victim_id = max(counts, key=lambda w: counts[w])
        moved = sorted(s for s, w in held.items() if w == victim_id and held[twin[s]] != victim_id)
        deposited = {s: last[s]["carry_digest"] for s in moved}
        slots = {}
        for w in d.live_workers():
            found = re.search(r'worker_id="([0-9a-f]+)"', _get(w.metrics_url, timeout=10)[1])
            if found:
                slots[int(found.group(1), 16)] = w
        victim = slots[victim_id]
        log = victim.log_path
        t0 = time.monotonic()
        victim.process.send_signal(signal.SIGTERM)
        victim.process.wait(60)
        stop_s = time.monotonic() - t0
        drain = [ln for ln in log.read_text(errors="replace").splitlines() if "drained" in ln]
        deadline = time.monotonic() + 300
        while d.restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        d.wait_ready(300)
        results = []
        for s in moved:
            got, control = turn(s, "Again."), turn(twin[s], "Again.")
            results.append({"session": s, "outcome": got["outcome_kind"], "rows_source": got["rows_source"],
                            "via": (got["moved_in"] or {}).get("via"), "pull": got["pull"], "pull_ms": got["pull_ms"],
                            "digest_equal": (got["moved_in"] or {}).get("digest") == deposited[s],
                            "rows": (got["moved_in"] or {}).get("rows"), "bytes": (got["moved_in"] or {}).get("bytes"),
                            "text_equal_twin": got["text"] == control["text"],
                            "drafted": [got["drafted"], control["drafted"]],
                            "accepted": [got["accepted"], control["accepted"]]})
        totals = {}
        for w in d.live_workers():
            m = tally(_get(w.metrics_url, timeout=10)[1])[1]
            for k in ("moved_rows_in", "pulls_received", "adopted_remote"):
                totals[k] = totals.get(k, 0) + m[k]
        acc_moved = sum(r["accepted"][0] for r in results) / max(1, sum(r["drafted"][0] for r in results))
        acc_twin = sum(r["accepted"][1] for r in results) / max(1, sum(r["drafted"][1] for r in results))
        return {"workers": workers, "sessions": len(history), "first_turn_pull_ms": spread(first_pulls),
                "moved_sessions": len(moved), "stop_s": round(stop_s, 2),
                "drain_log": [re.sub(r"\x1b\[[0-9;]*m", "", ln).split("drained", 1)[1].strip() for ln in drain],
                "adopted_remote": sum(r["rows_source"] == "remote" for r in results),
                "via": {v: sum(r["via"] == v for r in results) for v in ("push", "pull")},
                "digests_equal": all(r["digest_equal"] for r in results),
                "outputs_equal_twins": all(r["text_equal_twin"] for r in results),
                "received_pull_ms": spread([r["pull_ms"] for r in results if r["pull"] == "received"]),
                "bytes_per_entry": spread([float(r["bytes"]) for r in results if r["bytes"]]),
                "acceptance_moved": round(acc_moved, 4), "acceptance_twins": round(acc_twin, 4),
                "counters": totals, "per_session": results}
    finally:
        d.stop()


def read_sizes(sizes: list[int], reps: int) -> dict:
    import torch

    from trtllm_mtp_carry.serve.dynamo.nixl_transport import NixlTransport, Offer, ucx_environment

    root = Path(__file__).resolve().parent.parent
    code = ("import sys, json, os, time, torch\n"
            "from trtllm_mtp_carry.serve.dynamo.nixl_transport import NixlTransport, ucx_environment\n"
            "os.environ.update(ucx_environment('127.0.0.1')); t = NixlTransport(f'h-{os.getpid()}')\n"
            f"rs = [torch.randint(0, 255, (n,), dtype=torch.uint8) for n in {sizes!r}]\n"
            "print(json.dumps([t.expose(r).as_dict() for r in rs]), flush=True)\n"
            "os.set_blocking(sys.stdin.fileno(), False)\n"
            "while True:\n    t.pump()\n    try:\n        if sys.stdin.read() == '': break\n"
            "    except TypeError: pass\n    time.sleep(0.001)\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(root)))
    assert holder.stdout is not None and holder.stdin is not None
    offers = next(json.loads(ln) for ln in holder.stdout if ln.startswith("["))
    os.environ.update(ucx_environment("127.0.0.1"))
    reader = NixlTransport(f"r-{os.getpid()}")
    out = {}
    try:
        for size, o in zip(sizes, offers, strict=True):
            offer = Offer.from_dict(o)
            times = []
            for i in range(reps + 2):
                landing = torch.empty(size, dtype=torch.uint8)
                s = asyncio.run(reader.read(offer, landing, time.monotonic() + 30))
                if i >= 2:  # two warm-up reads (the first connects)
                    times.append(s * 1e3)
            out[str(size)] = spread(times)
    finally:
        holder.stdin.close()
        holder.wait(30)
        reader.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--read-sizes", default="65536,1048576,16777216")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    t0 = time.monotonic()
    result = {"machine": f"{platform.node()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
              "graceful_stop": graceful_stop(args.workers, args.pairs, args.turns, args.max_tokens)}
    if args.read_sizes:
        result["nixl_read_ms_by_size"] = read_sizes([int(x) for x in args.read_sizes.split(",")], args.reps)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
