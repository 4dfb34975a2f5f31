"""The carry counters of one Dynamo worker, on that worker's metrics endpoint.

What it is for: the same families as the Triton model's custom metrics
(`serve.triton.metrics.CarryMetrics`: turns by outcome kind, drafter rows
adopted/computed, drafts proposed/accepted, sessions ended, rows freed, the
runtime's holdings), counted by that very class over an in-process registry
with the Python backend's `MetricFamily` interface, and rendered as
Prometheus text for Dynamo's `/metrics` (`EngineMetrics.register_prometheus_expfmt_callback`).

Plus `mtp_carry_kv_events_total{kind=stored|removed}`: the prefix-cache blocks
this worker announced to the router (its KV events).

`mtp_carry_outcomes_total` counts every request this worker was handed exactly
once: at its admission by its carry outcome kind, or as `kind="cancelled"` when
its client cancelled it before admission (the worker never started it). Their
sum equals the requests Dynamo routed here (`dynamo_component_requests_total`
of the `generate` endpoint), bad requests aside (400s, counted in neither).

Labels: Dynamo's own labels of the worker (`auto_labels`: namespace,
component, endpoint, model, ...) plus `instance=<worker id>`, so the counters
of several workers add up and tell apart. Updated only from the worker's
stepping thread; a scrape reads plain ints under a lock.
"""

from __future__ import annotations

import re
from typing import Any

from ...metrics import CarryMetrics, MetricRegistry


class WorkerMetrics:
    """CarryMetrics over an in-process registry, rendered with the worker's labels."""

    def __init__(self, model: str, worker: str) -> None:
        self._registry = MetricRegistry()
        self._model, self._worker = model, worker
        self._carry = CarryMetrics(self._registry, model, worker)
        self._kv_family = self._registry.MetricFamily(
            "mtp_carry_kv_events_total", "Prefix-cache blocks published to the router as KV events, "
            "by kind (stored, removed)", self._registry.MetricFamily.COUNTER)
        self._kv_events: dict[str, Any] = {}
        self.base_labels: dict[str, str] = {}  # Dynamo's labels of this worker

    def record_turn(self, stats: Any) -> None:
        self._carry.record_turn(stats)

    def record_unadmitted(self, reason: str) -> None:
        self._carry.record_unadmitted(reason)

    def record_session_end(self, cause: str, rows_freed: int) -> None:
        self._carry.record_session_end(cause, rows_freed)

    def refresh(self, runtime_stats: Any) -> None:
        self._carry.refresh(runtime_stats)

    def record_kv_events(self, stored: int, removed: int) -> None:
        """Set the KV-event counters to the relay's totals (blocks announced stored / removed)."""
        for kind, value in (("stored", stored), ("removed", removed)):
            metric = self._kv_events.get(kind)
            if metric is None:
                metric = self._kv_events[kind] = self._kv_family.Metric(
                    labels={"model": self._model, "instance": self._worker, "kind": kind})
            metric.set(value)

    def exposition(self) -> str:
        """Every family in Prometheus text format (HELP, TYPE, one line per labelled series)."""
        return self._registry.exposition(self.base_labels)


TALLY_KEYS = ("outcomes", "cancelled", "runtime_outcomes", "requests", "rows_adopted_total",
              "rows_adopted_runtime")
"""What `tally` sums from one worker's page (the counts the invariants above compare)."""


def tally(page: str) -> tuple[str, dict[str, float]]:
    """One worker's `/metrics` page summed as the module's invariants compare it: (its Dynamo
    `worker_id`, "" if the page has none; {`outcomes`: sum of `mtp_carry_outcomes_total`,
    `cancelled`: its kind="cancelled" part, `runtime_outcomes`: the runtime's `outcomes.*`
    gauges, `requests`: Dynamo's `dynamo_component_requests_total` of `generate`,
    `rows_adopted_total`: `drafter_rows_total{source="adopted"}`, `rows_adopted_runtime`: the
    runtime's `rows_adopted`}). For the fault script and the Dynamo tests."""
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
            m["cancelled"] += v if labels["kind"] == "cancelled" else 0
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
