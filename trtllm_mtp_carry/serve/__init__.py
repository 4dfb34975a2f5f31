"""Serving the carry (deployment layer): what every front end shares, one subpackage per front end.

Shared here, by every server the package runs behind:
- `options`: the served model's options, one typed record (parsed from Triton's
  `parameters`, or from a worker's flags);
- `engines`: the engine seam (`reference` now, TensorRT-LLM through the adapter);
- `session_server`: one engine driven by one thread, many sessions streamed;
- `cli`: the `triton-repo` and `serve` subcommands.

Front ends:
- `triton/`: Triton Inference Server (repository generator, Python-backend
  model, custom metrics, `tritonserver` launcher, gRPC stream client);
- `dynamo/`: NVIDIA Dynamo (OpenAI-compatible frontend, workers).

Importing this package loads no torch; the engine is built inside the model.
"""
