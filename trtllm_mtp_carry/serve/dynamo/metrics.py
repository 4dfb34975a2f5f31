"""The carry counters of one Dynamo worker, on that worker's metrics endpoint.

What it is for: the same families as the Triton model's custom metrics
(`metrics.CarryMetrics`: turns by outcome kind, drafter rows
adopted/computed, drafts proposed/accepted, sessions ended, rows freed, the
runtime's holdings), counted by that very class over an in-process registry
with the Python backend's `MetricFamily` interface, and rendered as
Prometheus text for Dynamo's `/metrics` (`EngineMetrics.register_prometheus_expfmt_callback`).

Plus `mtp_carry_kv_events_total{kind=stored|removed}`: the prefix-cache blocks
this worker announced to the router (its KV events); and the moves of carried
entries between workers (`carry_peers`):

    mtp_carry_adoptions_total{source}         adopted turns by where their rows came from: local
                                              (deposited here) or remote (moved here from a peer)
    mtp_carry_pulls_total{result}             pulls on a miss: received, or the remote miss reason
                                              (carry_peers.REMOTE_MISS_REASONS)
    mtp_carry_pull_ms_total{result}           their wall time, summed (mean: over pulls_total)
    mtp_carry_moved_rows_total{direction}     carried rows moved in (received) / out (lent, taken)
    mtp_carry_moved_bytes_total{direction}    their bytes
    mtp_carry_drained_entries_total{result}   entries a planned stop moved to peers / dropped

`mtp_carry_outcomes_total` counts every request this worker was handed exactly
once: at its admission by its carry outcome kind, as `kind="cancelled"` when
its client cancelled it before admission (the worker never started it), or as
`kind="rejected"` when the worker refused it (a 400: an unknown drafter policy,
a prompt past the context). Their sum equals the requests Dynamo routed here
(`dynamo_component_requests_total` of the `generate` endpoint), which count
rejected requests too.

Labels: Dynamo's own labels of the worker (`auto_labels`: namespace,
component, endpoint, model, ...) plus `instance=<worker id>`, so the counters
of several workers add up and tell apart. Updated only from the worker's
stepping thread; a scrape reads plain ints under a lock.
"""

from __future__ import annotations

import re

from ...metrics import CarryMetrics, MetricRegistry

_FAMILIES = (  # (key, name, description): this worker's own counters, beside the carry's
    ("kv_events", "mtp_carry_kv_events_total",
     "Prefix-cache blocks published to the router as KV events, by kind (stored, removed)"),
    ("adoptions", "mtp_carry_adoptions_total", "Adopted turns by where their rows came from (local, remote)"),
    ("pulls", "mtp_carry_pulls_total",
     "Pulls of a missing entry from peers, by result (received or the remote miss reason)"),
    ("pull_ms", "mtp_carry_pull_ms_total", "Wall milliseconds of pulls, by result"),
    ("moved_rows", "mtp_carry_moved_rows_total", "Carried rows moved between workers, by direction (in, out)"),
    ("moved_bytes", "mtp_carry_moved_bytes_total", "Bytes of carried rows moved between workers, by direction"),
    ("drained", "mtp_carry_drained_entries_total", "Carried entries a planned stop moved to peers or dropped"),
)


class WorkerMetrics(CarryMetrics):
    """CarryMetrics over an in-process registry, with this worker's own counters, rendered with
    the worker's labels."""

    def __init__(self, model: str, worker: str) -> None:
        self._registry = MetricRegistry()
        super().__init__(self._registry, model, worker)
        for family in _FAMILIES:
            self.add_counter(*family)
        self.base_labels: dict[str, str] = {}  # Dynamo's labels of this worker

    def record_kv_events(self, stored: int, removed: int) -> None:
        """Set the KV-event counters to the relay's totals (blocks announced stored / removed)."""
        for kind, value in (("stored", stored), ("removed", removed)):
            self.metric("kv_events", "kind", kind).set(value)

    def record_adoption(self, source: str) -> None:
        """One adopted turn whose rows came from `source` (`local` or `remote`)."""
        self.metric("adoptions", "source", source).increment(1)

    def record_pull(self, result: str, ms: float) -> None:
        """One pull on a miss and its wall time (`carry_peers.PULL_RESULTS`)."""
        self.metric("pulls", "result", result).increment(1)
        self.metric("pull_ms", "result", result).increment(ms)

    def record_moved(self, direction: str, rows: int, nbytes: int) -> None:
        """An entry of `rows` rows, `nbytes` bytes, moved `in` (received) or `out` (taken by a peer)."""
        self.metric("moved_rows", "direction", direction).increment(rows)
        self.metric("moved_bytes", "direction", direction).increment(nbytes)

    def record_drain(self, result: str, entries: int) -> None:
        """Entries a planned stop `moved` to peers or `dropped`."""
        self.metric("drained", "result", result).increment(entries)

    def exposition(self) -> str:
        """Every family in Prometheus text format (HELP, TYPE, one line per labelled series)."""
        return self._registry.exposition(self.base_labels)


TALLY_KEYS = ("outcomes", "cancelled", "rejected", "runtime_outcomes", "requests", "rows_adopted_total",
              "rows_adopted_runtime", "adopted", "adopted_remote", "pulls_received", "moved_rows_in",
              "moved_rows_out", "drained_moved", "drained_dropped")
"""What `tally` sums from one worker's page (the counts the invariants above compare)."""


def tally(page: str) -> tuple[str, dict[str, float]]:
    """One worker's `/metrics` page summed as the module's invariants compare it: (its Dynamo
    `worker_id`, "" if the page has none; {`outcomes`: sum of `mtp_carry_outcomes_total`,
    `cancelled` and `rejected`: its kind="cancelled" and kind="rejected" parts,
    `runtime_outcomes`: the runtime's `outcomes.*` gauges, `requests`: Dynamo's
    `dynamo_component_requests_total` of `generate`, `rows_adopted_total`:
    `drafter_rows_total{source="adopted"}`, `rows_adopted_runtime`: the runtime's
    `rows_adopted`, `adopted`: outcomes kind="adopted", `adopted_remote`:
    `adoptions_total{source="remote"}`, `pulls_received`: `pulls_total{result="received"}`,
    `moved_rows_in`/`_out`: `moved_rows_total` by direction, `drained_moved`/`_dropped`:
    `drained_entries_total` by result}). For the fault script and the Dynamo tests."""
    m = dict.fromkeys(TALLY_KEYS, 0.0)
    worker_id = ""
    for line in page.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        head, value = line.rsplit(" ", 1)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', head))
        name, v = head.split("{", 1)[0], float(value)
        if name == "mtp_carry_outcomes_total":
            m["outcomes"] += v
            if labels["kind"] in ("cancelled", "rejected", "adopted"):
                m[labels["kind"]] += v
        elif name == "mtp_carry_adoptions_total" and labels["source"] == "remote":
            m["adopted_remote"] += v
        elif name == "mtp_carry_pulls_total" and labels["result"] == "received":
            m["pulls_received"] += v
        elif name == "mtp_carry_moved_rows_total":
            m[f"moved_rows_{labels['direction']}"] += v
        elif name == "mtp_carry_drained_entries_total":
            m[f"drained_{labels['result']}"] += v
        elif name == "mtp_carry_runtime" and labels["field"].startswith("outcomes."):
            m["runtime_outcomes"] += v
        elif name == "mtp_carry_runtime" and labels["field"] == "rows_adopted":
            m["rows_adopted_runtime"] = v
        elif name == "mtp_carry_drafter_rows_total" and labels["source"] == "adopted":
            m["rows_adopted_total"] += v
        elif name == "dynamo_component_requests_total" and labels.get("dynamo_endpoint") == "generate":
            m["requests"] += v
            worker_id = labels["worker_id"]
    return worker_id, m
