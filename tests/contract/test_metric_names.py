"""Every front end exports the carry under the same names, whichever executor carries.

A dashboard built on the reference engine (its Triton model, its Dynamo worker) reads a
TensorRT-LLM worker (the worker-installed carry's own endpoint, the TensorRT-LLM Triton
model, `attach`) unchanged: every executor's `stats()` is one `CarryStats`, and every front
end turns it into the same `mtp_carry_runtime{field}` gauges and counter families. The
executors run the same scripted turns (tests/contract/executors.py) before each front end
renders them; the name sets are compared, not only their counts.
"""

from __future__ import annotations

import re
from dataclasses import fields
from types import SimpleNamespace

from executors import EXECUTORS
from test_carry_contract import Tokens, cold_then_warm, misses

from trtllm_mtp_carry.metrics import CarryMetrics, MetricRegistry
from trtllm_mtp_carry.serve.dynamo.metrics import WorkerMetrics as DynamoWorkerMetrics
from trtllm_mtp_carry.serve.trtllm.model import TrtllmMetrics
from trtllm_mtp_carry.service import CarryStats
from trtllm_mtp_carry.trtllm.metrics import WorkerMetrics as TrtllmWorkerMetrics

DRAFTS = "mtp_carry_drafts_total"
"""Drafts proposed and accepted are an engine's per-request figures (the reference engine's turn
stats, TensorRT-LLM's request metrics): a worker-installed carry's resource manager never sees
them, so its own endpoint leaves this family out (TensorRT-LLM's metrics have them)."""


def names(page: str) -> tuple[set[str], set[str]]:
    """(families with a series, `mtp_carry_runtime` field labels) of a Prometheus text page."""
    families, runtime = set(), set()
    for line in page.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head = line.rsplit(" ", 1)[0]
        family = head.split("{", 1)[0]
        families.add(family)
        if family == "mtp_carry_runtime":
            runtime.add(dict(re.findall(r'(\w+)="([^"]*)"', head))["field"])
    return families, runtime


def run(name: str):
    ex = EXECUTORS[name](slots=4, idle_s=100.0, host_rows=64)
    tok = Tokens(20)
    ex.turns = cold_then_warm(ex, tok) + misses(ex, tok)
    return ex


def turn_stats(turn) -> SimpleNamespace:
    """What a front end's per-turn record reads of an engine's turn statistics (`TurnStats`)."""
    return SimpleNamespace(outcome_kind=turn.kind, no_carry_reason=turn.reason, drafter_rows_kept=turn.rows_adopted,
                           drafter_rows_computed=1, drafted=2, accepted=1)


def test_every_executor_reports_one_carry_stats_with_one_field_set():
    got = {name: run(name).stats() for name in EXECUTORS}
    assert {type(s) for s in got.values()} == {CarryStats}
    vocab = {name: {f.name: sorted(v) if isinstance(v := getattr(s, f.name), dict) else None
                    for f in fields(s)} for name, s in got.items()}
    first, *others = vocab.values()
    assert all(v == first for v in others)  # every dict field lists the same keys, zeros included


def test_every_front_end_renders_the_same_metric_names():
    reference, trtllm = run("reference"), run("trtllm-standin")
    pages = {}
    # the reference engine's Triton model (its custom metrics) and its Dynamo worker
    triton_registry = MetricRegistry()
    triton = CarryMetrics(triton_registry, "mtp_carry", "0")
    dynamo = DynamoWorkerMetrics("mtp_carry", "1")
    for metrics in (triton, dynamo):
        for turn in reference.turns:
            metrics.record_turn(turn_stats(turn))
        metrics.record_session_end("end", 1)
        metrics.refresh(reference.stats())
    pages["triton (reference)"] = triton_registry.exposition()
    pages["dynamo (reference)"] = dynamo.exposition()
    # TensorRT-LLM: the Triton model over the LLM API (attach's stats) and the worker install's endpoint
    trt_registry = MetricRegistry()
    trt = TrtllmMetrics(trt_registry, "tensorrt_llm", "0")
    for turn in trtllm.turns:
        trt.record_trtllm_turn(turn_stats(turn))
    trt.record_session_end("end", 1)
    trt.refresh(trtllm.manager.stats())
    pages["triton (TensorRT-LLM)"] = trt_registry.exposition()
    worker = TrtllmWorkerMetrics(0)
    worker.bind(trtllm.manager)
    pages["worker install (TensorRT-LLM)"] = worker.render()
    runtime_fields = {name: names(page)[1] for name, page in pages.items()}
    first = runtime_fields["triton (reference)"]
    assert len(first) > 60 and {"rows_adopted", "outcomes.adopted", "fault_steps.prepare",
                                "no_carry_reasons.idle", "hits_host", "pinned_bytes"} <= first
    for name, got in runtime_fields.items():
        assert got == first, f"{name}: {sorted(got ^ first)}"
    families = {name: names(page)[0] for name, page in pages.items()}
    every = {"mtp_carry_outcomes_total", "mtp_carry_no_carry_total", "mtp_carry_drafter_rows_total",
             "mtp_carry_sessions_ended_total", "mtp_carry_rows_freed_total", "mtp_carry_runtime"}
    for name, got in families.items():
        assert got == every | ({DRAFTS} if "worker install" not in name else set()), name
