"""Serving the carry behind Triton Inference Server (deployment layer).

- `options`: the served model's options, parsed from Triton's `parameters`;
- `repo`: the model repository generator (`trtllm-mtp-carry triton-repo`);
- `triton_model`: the Python-backend model the repository's `model.py` exports;
- `session_server`: one engine driven by one thread, many sessions streamed;
- `engines`: the engine seam (`reference` now, TensorRT-LLM later);
- `metrics`: Triton custom metrics of the carry;
- `server`: find, start and stop `tritonserver` (`trtllm-mtp-carry serve`);
- `client`: a gRPC streaming client (one stream, many sessions);
- `bench_client`: the session replay through a running server.

Importing this package loads no torch; the engine is built inside the model.
"""
