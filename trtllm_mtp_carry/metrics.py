"""The carry's metric families, and an in-memory registry that renders them for Prometheus.

What it is for: every front end reports the same families (`CarryMetrics`), so one
dashboard reads a Triton model (Triton's custom metrics, `pb_utils.MetricFamily`), a
Dynamo worker (Dynamo's `/metrics`) and a TensorRT-LLM worker-installed carry (its own
endpoint, `trtllm/metrics.py`) alike. `CarryMetrics` is written against the Python
backend's `MetricFamily` interface; `MetricRegistry` offers that interface in memory and
renders every family in Prometheus's text exposition format (0.0.4) for the front ends
that serve their own endpoint.

    mtp_carry_outcomes_total{kind}            turns by carry outcome kind, each counted once when
                                              it leaves the engine (finished or stopped) with
                                              the kind decided at its admission, as the runtime's
                                              `outcomes` gauge counts it (kind="fault": the
                                              admission itself faulted; a fault later in a turn
                                              keeps its kind and counts in `turns_faulted`);
                                              kind="cancelled": a request cancelled before its
                                              admission (never started, no carry decision: the
                                              runtime's gauge has no such kind)
    mtp_carry_no_carry_total{reason}          no_carry turns by why the session's entry was
                                              absent (never_carried, memory, idle, ...)
    mtp_carry_drafter_rows_total{source}      rows adopted (kept) / computed
    mtp_carry_drafts_total{result}            drafts proposed / accepted
    mtp_carry_sessions_ended_total{cause}     end / restart / idle
    mtp_carry_rows_freed_total                carried rows freed by session ends
    mtp_carry_errors_total{reason}            errors, by reason (the Triton model: error
                                              responses, by session_server.ERROR_REASONS:
                                              Triton counts a decoupled model's error
                                              responses as successes;
                                              a worker-installed carry: faults by exception kind)
    mtp_carry_runtime{field}                  every int or float (and dict-of-int) field of
                                              the runtime's stats (see `CarryMetrics.refresh`)

Invariants:
- Metric creation is locked (`metric`); a registry's series are read and written under
  one lock, so a scrape sees each value whole.
- Pure Python: no torch, no Triton (`pb_utils` is passed in).
"""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class CarryMetrics:
    """Creates the metric families once and updates them per turn and per session end.

    Another engine's Triton model (TensorRT-LLM's) subclasses it to feed the same
    families through `metric(family, key, value)`.
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
        self._family = family

    def add_counter(self, family: str, name: str, description: str) -> None:
        """One more counter family beside the carry's (a front end's own), as `metric(family, ...)`."""
        self._families[family] = self._family(name, description, self._family.COUNTER)

    def metric(self, family: str, key: str = "", value: str = "") -> Any:
        """The one metric of `family` (its key in the table above) with this instance's
        labels plus `key=value`, created on first use."""
        ident = (family, key, value)
        with self._lock:
            metric = self._metrics.get(ident)
            if metric is None:
                labels = dict(self._labels, **({key: value} if key else {}))
                metric = self._metrics[ident] = self._families[family].Metric(labels=labels)
        return metric

    def record_turn(self, stats: Any) -> None:
        """Count one turn that left the engine (finished or stopped) from its TurnStats: its
        `outcome_kind` (decided at admission, `fault` if a fault cost it the carry at any step;
        none before admission: not counted), the rows and drafts it got to."""
        if stats.outcome_kind:
            self.metric("outcomes", "kind", stats.outcome_kind).increment(1)
        if stats.outcome_kind == "no_carry":
            reason = getattr(stats, "no_carry_reason", "") or "never_carried"
            self.metric("no_carry", "reason", reason).increment(1)
        for source, value in (("adopted", stats.drafter_rows_kept), ("computed", stats.drafter_rows_computed)):
            if value:
                self.metric("rows", "source", source).increment(value)
        for result, value in (("proposed", stats.drafted), ("accepted", stats.accepted)):
            if value:
                self.metric("drafts", "result", result).increment(value)

    def record_unadmitted(self, reason: str) -> None:
        """Count one request that left before its admission as `outcomes{kind=reason}`
        (`cancelled`: its client cancelled it; it never ran and made no carry decision), so
        the outcomes add up to the requests a front end started."""
        self.metric("outcomes", "kind", reason).increment(1)

    def record_error(self, reason: str) -> None:
        """Count one error response."""
        self.metric("errors", "reason", reason).increment(1)

    def record_session_end(self, cause: str, rows_freed: int) -> None:
        self.metric("ended", "cause", cause).increment(1)
        if rows_freed:
            self.metric("freed").increment(rows_freed)

    def refresh(self, runtime_stats: Any) -> None:
        """Set a gauge for every int or float field of the runtime's frozen stats snapshot, and
        for every entry of its dict-of-int fields as `field="<name>.<key>"`."""
        if is_dataclass(runtime_stats):
            self.set_runtime({f.name: getattr(runtime_stats, f.name) for f in fields(runtime_stats)})

    def set_runtime(self, values: Mapping[str, Any]) -> None:
        """Set a `runtime` gauge for every int or float of `values`, and for every int or float
        entry of its dict values as `field="<name>.<key>"` (bools and anything else skipped)."""
        for name, value in values.items():
            items = value.items() if isinstance(value, dict) else [("", value)]
            for key, v in items:
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.metric("runtime", "field", f"{name}.{key}" if key else name).set(v)


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

    def __init__(self, registry: MetricRegistry, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[tuple[dict[str, str], _Metric]] = []
        self._lock = registry.lock
        registry.families.append(self)

    def Metric(self, labels: dict[str, str]) -> _Metric:  # noqa: N802 (pb_utils' name)
        metric = _Metric(self._lock)
        with self._lock:
            self.metrics.append((dict(labels), metric))
        return metric


class MetricRegistry:
    """`pb_utils`'s `MetricFamily` (what `CarryMetrics` takes), in memory: `exposition()`
    renders every family that has a series as Prometheus text."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.families: list[_Family] = []
        registry = self

        class MetricFamily(_Family):
            def __init__(self, name: str, description: str, kind: str) -> None:
                super().__init__(registry, name, description, kind)

        self.MetricFamily = MetricFamily  # the `pb_utils` attribute CarryMetrics reads

    def exposition(self, base_labels: dict[str, str] | None = None) -> str:
        """Every family in Prometheus text format (HELP, TYPE, one line per labelled series),
        each series' labels after `base_labels`."""
        base = {k: str(v) for k, v in (base_labels or {}).items()}
        lines: list[str] = []
        with self.lock:
            for family in self.families:
                if not family.metrics:
                    continue
                lines.append(f"# HELP {family.name} {family.description}")
                lines.append(f"# TYPE {family.name} {family.kind}")
                for labels, metric in family.metrics:
                    merged = {**base, **labels}
                    text = ",".join(f'{k}="{_escape(v)}"' for k, v in merged.items())
                    value = metric.value
                    lines.append(f"{family.name}{{{text}}} {int(value) if value.is_integer() else value}")
        return "\n".join(lines) + ("\n" if lines else "")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def serve_http(host: str, port: int, name: str, answer: Callable[[str], tuple[int, str, str]]) -> ThreadingHTTPServer:
    """Answer `GET` on `host:port` from daemon thread `name` (a front end's own endpoint):
    `answer(path)` (the path without its query) gives the status, content type and body. No
    access log (a scrape every few seconds is not worth a line); OSError if the port is taken."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            code, kind, body = answer(urllib.parse.urlsplit(self.path).path)
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return None

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server
