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
exists only inside the Python backend's stub. The class lives in
`trtllm_mtp_carry/metrics.py`, shared with the Dynamo worker and the TensorRT-LLM worker's
endpoint.
"""

from __future__ import annotations

from ...metrics import CarryMetrics

__all__ = ["CarryMetrics"]
