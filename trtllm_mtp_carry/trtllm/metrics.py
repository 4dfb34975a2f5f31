"""Prometheus metrics of a worker-installed carry: the Triton model's families, over HTTP.

What it is for: a carry installed in TensorRT-LLM's worker process (`trtllm.worker`)
has no `stats()` a parent process can call. With `metrics_port` in the carry file

```yaml
mtp_carry: {carry_slots: 16, metrics_port: 9400}
```

it serves its counters at `http://<host>:<metrics_port + rank>/metrics` in
Prometheus's text exposition format (version 0.0.4), `rank` the worker's
`Mapping.rank` (`draft.mapping.rank`: TensorRT-LLM's global rank of this worker,
`tensorrt_llm/mapping.py`; 0 where the mapping has none), so every worker rank on
a host gets its own port. The families are the Triton model's, created through the
same class (`trtllm_mtp_carry/metrics.CarryMetrics`) over the registry the Dynamo worker
renders its endpoint with (`trtllm_mtp_carry/metrics.MetricRegistry`), labelled `model="tensorrt_llm"`,
`instance="rank<r>"`:

    mtp_carry_outcomes_total{kind}          warm turns by carry outcome kind
    mtp_carry_no_carry_total{reason}        no_carry turns by why the entry was absent
    mtp_carry_drafter_rows_total{source}    rows adopted (restored into the pages) / computed by TensorRT-LLM
    mtp_carry_sessions_ended_total{cause}   end (forget_conversation)
    mtp_carry_rows_freed_total              carried rows dropped by session ends
    mtp_carry_errors_total{reason}          faults inside the carry, by exception kind
    mtp_carry_runtime{field}                every number of `stats()` (`CarryStats`, the fields every
                                            executor reports), dicts as `field.key`

(`mtp_carry_drafts_total` stays absent: drafts proposed and accepted are
TensorRT-LLM's own per-request metrics, not something the resource manager sees.)

Invariants:
- Values are read from the bound manager's `stats()` at each scrape; counters only
  ever grow (a manager of a later build, after KV cache estimation, continues them).
- Nothing here raises into the worker: a port in use, or out of range with the
  rank added, is one line and the carry runs without metrics.
- One endpoint per process; it serves until `close_worker_metrics()` or the process ends.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any

from ..metrics import CarryMetrics, MetricRegistry, serve_http
from ..service.stats import CarryStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus's text exposition format."""


class WorkerMetrics:
    """The metrics of the carry manager bound last (`bind`), in `CarryMetrics`'s families."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.registry = MetricRegistry()
        self.families = CarryMetrics(self.registry, "tensorrt_llm", f"rank{rank}")
        self._manager: Any = None
        self._seen: dict[tuple[str, str, str], float] = {}  # counter totals already added
        self._lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    def bind(self, manager: Any) -> None:
        """Serve `manager`'s counters from now on (a fresh build's manager counts from 0)."""
        with self._lock:
            self._manager = manager
            self._seen = {}

    def render(self) -> str:
        """The text a scrape gets: the bound manager's counters read now."""
        with self._lock:
            if self._manager is not None:
                self._refresh(self._manager.stats())
            return self.registry.exposition()

    def _count(self, family: str, key: str, value: str, total: float) -> None:
        ident = (family, key, value)
        seen = self._seen.get(ident)
        if seen is None or total > seen:  # the series exists from its first scrape on
            self.families.metric(family, key, value).increment(total - (seen or 0))
            self._seen[ident] = total

    def _refresh(self, stats: CarryStats) -> None:
        for kind, n in stats.outcomes.items():
            self._count("outcomes", "kind", kind, n)
        for reason, n in stats.no_carry_reasons.items():
            if n:
                self._count("no_carry", "reason", reason, n)
        self._count("rows", "source", "adopted", stats.rows_adopted)
        self._count("rows", "source", "computed", stats.rows_computed)
        self._count("ended", "cause", "end", stats.sessions_ended)
        self._count("freed", "", "", stats.rows_freed)
        for kind, n in stats.faults.items():
            self._count("errors", "reason", kind, n)
        self.families.refresh(stats)

    def serve(self, host: str, port: int) -> None:
        """Start the HTTP endpoint (`GET /metrics`) on a daemon thread; OSError if the port is taken."""

        def answer(path: str) -> tuple[int, str, str]:
            if path != "/metrics":
                return 404, "text/plain", "only /metrics is served here\n"
            return 200, CONTENT_TYPE, self.render()

        self.server = serve_http(host, port, "mtp-carry-metrics", answer)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


_EXPORTER: WorkerMetrics | None = None
_EXPORTER_LOCK = threading.Lock()


def worker_rank(draft: Any) -> int:
    """This worker's rank: the draft KV manager's `mapping.rank` (TensorRT-LLM's `Mapping.rank`),
    0 where it has none."""
    mapping = getattr(draft, "mapping", None)
    rank = getattr(mapping, "rank", 0)
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else 0


def export_worker_metrics(manager: Any, base_port: int, report: Callable[[str], None],
                          host: str = "0.0.0.0") -> WorkerMetrics | None:
    """Serve `manager`'s counters on port `base_port + rank` (rank: `worker_rank`); a second
    call in the process (the second build under KV cache estimation) rebinds the endpoint
    to the new manager. Returns the endpoint, or None after one line saying why not; never raises."""
    global _EXPORTER
    try:
        rank = worker_rank(manager.draft)
        port = base_port + rank
        with _EXPORTER_LOCK:
            if _EXPORTER is not None and _EXPORTER.server is not None \
                    and _EXPORTER.server.server_address[1] == port:
                _EXPORTER.bind(manager)
                return _EXPORTER
            if port > 65535:
                report(f"mtp carry: metrics: stands aside: mtp_carry.metrics_port {base_port} + rank "
                       f"{rank} = {port} is past 65535")
                return None
            exporter = WorkerMetrics(rank)
            exporter.bind(manager)
            try:
                exporter.serve(host, port)
            except OSError as exc:
                report(f"mtp carry: metrics: stands aside: cannot serve on {host}:{port} "
                       f"({exc.strerror or exc})")
                return None
            if _EXPORTER is not None:
                _EXPORTER.close()
            _EXPORTER = exporter
        report(f"mtp carry: metrics on http://{host}:{port}/metrics (metrics_port {base_port} + rank {rank})")
        return exporter
    except Exception as exc:  # the carry runs without metrics, the executor without a fault
        report(f"mtp carry: metrics: stands aside: {type(exc).__name__}: {exc}")
        return None


def close_worker_metrics() -> None:
    """Stop this process's metrics endpoint (if any)."""
    global _EXPORTER
    with _EXPORTER_LOCK:
        if _EXPORTER is not None:
            _EXPORTER.close()
            _EXPORTER = None
