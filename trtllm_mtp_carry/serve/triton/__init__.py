"""Serving behind Triton Inference Server.

- `repo`: the model repository generator (`trtllm-mtp-carry triton-repo`);
- `model`: the Python-backend model the repository's `model.py` exports (the carry's
  Triton custom metrics are `trtllm_mtp_carry.metrics.CarryMetrics`);
- `server`: find, start and stop `tritonserver` (`trtllm-mtp-carry serve`);
- `client`: a gRPC streaming client (one stream, many sessions), which the
  bench's Triton driver (`bench.triton_driver`) uses.

Importing this package loads no torch; the engine is built inside the model.
"""
