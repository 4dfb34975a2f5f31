"""Triton custom metrics of the carry, on the server's metrics endpoint.

What it is for: the Triton model's import path of `CarryMetrics`, which lives in
`trtllm_mtp_carry/metrics.py` (torch-free), shared with the Dynamo worker and the
TensorRT-LLM worker's endpoint; that module's header lists the families. Here they
are labelled per model instance (`model`, `instance`); `mtp_carry_errors_total{reason}`
counts error responses by `session_server.ERROR_REASONS` (Triton counts a decoupled
model's error responses as successes).

Called from the model instance's stepping thread, and for errors also from
`execute`'s thread: metric creation is locked. `pb_utils` is passed in, as it
exists only inside the Python backend's stub.
"""

from __future__ import annotations

from ...metrics import CarryMetrics

__all__ = ["CarryMetrics"]
