"""Triton custom metrics of the carry, on the server's metrics endpoint.

What it is for: per model instance (labels `model`, `instance`), counters of
what the carry did and gauges of what it holds:

    mtp_carry_outcomes_total{kind}            turns by carry outcome kind
    mtp_carry_no_carry_total{reason}          no_carry turns by why the session's entry was
                                              absent (never_carried, memory, idle, ...)
    mtp_carry_drafter_rows_total{source}      rows adopted (kept) / computed
    mtp_carry_drafts_total{result}            drafts proposed / accepted
    mtp_carry_sessions_ended_total{cause}     end / restart / idle
    mtp_carry_rows_freed_total                carried rows freed by session ends
    mtp_carry_errors_total{reason}            error responses, by session_server.ERROR_REASONS
                                              (Triton counts a decoupled model's error
                                              responses as successes)
    mtp_carry_runtime{field}                  every int or float (and dict-of-int) field of
                                              the runtime's stats: carry_memory_bytes (the budget),
                                              bytes_held, entries_held, evictions.<cause>,
                                              no_carry_reasons.<reason>, refusals.<cause>; the
                                              host tier's carry_host_memory_bytes, hits_device,
                                              hits_host, demotions, host_bytes_held,
                                              bytes_demoted, bytes_restored, peak_*_bytes and
                                              the copy times demote_ms, restore_ms,
                                              restore_wait_ms

Called from the model instance's stepping thread, and for errors also from
`execute`'s thread: metric creation is locked. `pb_utils` is passed in, as it
exists only inside the Python backend's stub.
"""

from __future__ import annotations

import threading
from dataclasses import fields, is_dataclass
from typing import Any


class CarryMetrics:
    """Creates the metric families once and updates them per turn and per session end.

    Another engine's Triton model (TensorRT-LLM's) subclasses it to feed the same
    families; its subclass API is `_metric(family, key, value)`, the one metric of a
    family (by its key in `_families`) with this instance's labels plus `key=value`,
    created on first use.
    """

    def __init__(self, pb_utils: Any, model: str, instance: str) -> None:
        family = pb_utils.MetricFamily
        self._labels = {"model": model, "instance": instance}
        self._families = {
            "outcomes": family("mtp_carry_outcomes_total", "Turns by carry outcome kind", family.COUNTER),
            "no_carry": family("mtp_carry_no_carry_total",
                               "no_carry turns by why the session's own entry was absent", family.COUNTER),
            "rows": family("mtp_carry_drafter_rows_total",
                           "Drafter rows adopted from the carry (source=adopted) or computed", family.COUNTER),
            "drafts": family("mtp_carry_drafts_total", "Draft tokens proposed and accepted", family.COUNTER),
            "ended": family("mtp_carry_sessions_ended_total",
                            "Sessions ended, by cause (end, restart, idle)", family.COUNTER),
            "freed": family("mtp_carry_rows_freed_total",
                            "Carried drafter rows freed when a session ended", family.COUNTER),
            "runtime": family("mtp_carry_runtime", "The carry runtime's counters and holdings", family.GAUGE),
            "errors": family("mtp_carry_errors_total", "Error responses, by reason", family.COUNTER),
        }
        self._metrics: dict[tuple[str, str, str], Any] = {}
        self._lock = threading.Lock()

    def _metric(self, family: str, key: str = "", value: str = "") -> Any:
        ident = (family, key, value)
        with self._lock:
            metric = self._metrics.get(ident)
            if metric is None:
                labels = dict(self._labels, **({key: value} if key else {}))
                metric = self._metrics[ident] = self._families[family].Metric(labels=labels)
        return metric

    def record_turn(self, stats: Any) -> None:
        """Count one finished turn from its TurnStats."""
        self._metric("outcomes", "kind", stats.outcome_kind or "none").increment(1)
        if stats.outcome_kind == "no_carry":
            reason = getattr(stats, "no_carry_reason", "") or "never_carried"
            self._metric("no_carry", "reason", reason).increment(1)
        for source, value in (("adopted", stats.drafter_rows_kept), ("computed", stats.drafter_rows_computed)):
            if value:
                self._metric("rows", "source", source).increment(value)
        for result, value in (("proposed", stats.drafted), ("accepted", stats.accepted)):
            if value:
                self._metric("drafts", "result", result).increment(value)

    def record_error(self, reason: str) -> None:
        """Count one error response."""
        self._metric("errors", "reason", reason).increment(1)

    def record_session_end(self, cause: str, rows_freed: int) -> None:
        self._metric("ended", "cause", cause).increment(1)
        if rows_freed:
            self._metric("freed").increment(rows_freed)

    def refresh(self, runtime_stats: Any) -> None:
        """Set a gauge for every int or float field of the runtime's frozen stats snapshot, and
        for every entry of its dict-of-int fields as `field="<name>.<key>"`."""
        if not is_dataclass(runtime_stats):
            return
        for f in fields(runtime_stats):
            value = getattr(runtime_stats, f.name)
            items = value.items() if isinstance(value, dict) else [("", value)]
            for key, v in items:
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._metric("runtime", "field", f"{f.name}.{key}" if key else f.name).set(v)
