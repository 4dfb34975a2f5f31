"""The carry counters of one Dynamo worker, on that worker's metrics endpoint.

What it is for: the same families as the Triton model's custom metrics
(`serve.triton.metrics.CarryMetrics`: turns by outcome kind, drafter rows
adopted/computed, drafts proposed/accepted, sessions ended, rows freed, the
runtime's holdings), counted by that very class over an in-process registry
with the Python backend's `MetricFamily` interface, and rendered as
Prometheus text for Dynamo's `/metrics` (`EngineMetrics.register_prometheus_expfmt_callback`).

Plus `mtp_carry_kv_events_total{kind=stored|removed}`: the prefix-cache blocks
this worker announced to the router (its KV events).

Labels: Dynamo's own labels of the worker (`auto_labels`: namespace,
component, endpoint, model, ...) plus `instance=<worker id>`, so the counters
of several workers add up and tell apart. Updated only from the worker's
stepping thread; a scrape reads plain ints under a lock.
"""

from __future__ import annotations

import threading
from typing import Any

from ..triton.metrics import CarryMetrics


class _Metric:
    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self.value = 0.0

    def increment(self, value: float) -> None:
        with self._lock:
            self.value += value

    def set(self, value: float) -> None:
        with self._lock:
            self.value = float(value)


class _Family:
    """`pb_utils.MetricFamily`'s interface, kept in memory."""

    COUNTER = "counter"
    GAUGE = "gauge"

    def __init__(self, registry: _Registry, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[tuple[dict[str, str], _Metric]] = []
        self._lock = registry.lock
        registry.families.append(self)

    def Metric(self, labels: dict[str, str]) -> _Metric:  # noqa: N802 (pb_utils' name)
        metric = _Metric(self._lock)
        with self._lock:
            self.metrics.append((dict(labels), metric))
        return metric


class _Registry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.families: list[_Family] = []
        registry = self

        class MetricFamily(_Family):
            def __init__(self, name: str, description: str, kind: str) -> None:
                super().__init__(registry, name, description, kind)

        self.MetricFamily = MetricFamily  # the `pb_utils` attribute CarryMetrics reads


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class WorkerMetrics:
    """CarryMetrics over an in-process registry, rendered with the worker's labels."""

    def __init__(self, model: str, worker: str) -> None:
        self._registry = _Registry()
        self._model, self._worker = model, worker
        self._carry = CarryMetrics(self._registry, model, worker)
        self._kv_family = self._registry.MetricFamily(
            "mtp_carry_kv_events_total", "Prefix-cache blocks published to the router as KV events, "
            "by kind (stored, removed)", _Family.COUNTER)
        self._kv_events: dict[str, _Metric] = {}
        self.base_labels: dict[str, str] = {}  # Dynamo's labels of this worker

    def record_turn(self, stats: Any) -> None:
        self._carry.record_turn(stats)

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
        lines: list[str] = []
        with self._registry.lock:
            for family in self._registry.families:
                if not family.metrics:
                    continue
                lines.append(f"# HELP {family.name} {family.description}")
                lines.append(f"# TYPE {family.name} {family.kind}")
                for labels, metric in family.metrics:
                    merged = {**{k: str(v) for k, v in self.base_labels.items()}, **labels}
                    text = ",".join(f'{k}="{_escape(v)}"' for k, v in merged.items())
                    value = metric.value
                    lines.append(f"{family.name}{{{text}}} {int(value) if value.is_integer() else value}")
        return "\n".join(lines) + ("\n" if lines else "")
