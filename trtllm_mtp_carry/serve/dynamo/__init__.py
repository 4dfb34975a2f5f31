"""Serving behind NVIDIA Dynamo: an OpenAI-compatible frontend, session-affine routing, many workers.

- `model_dir`: the model directory the frontend tokenizes with (the package's tokenizer);
- `worker`: the Dynamo worker (`python -m trtllm_mtp_carry.serve.dynamo.worker`);
- `metrics`: the carry counters on each worker's metrics endpoint;
- `launcher`: frontend + N workers on loopback (`trtllm-mtp-carry serve --dynamo`);
- `openai_client`: a streaming `/v1/chat/completions` client, which the bench's
  OpenAI driver (`bench.openai_driver`, `bench --openai URL`) uses.

Dynamo itself is optional (the `dynamo` extra, plus `ai-dynamo` installed with
`--no-deps`); `require_dynamo` names that install when it is missing.
Importing this package loads neither torch nor Dynamo.
"""

from __future__ import annotations

INSTALL_HINT = ('pip install -e ".[dynamo]" && pip install --no-deps ai-dynamo==1.6.1 '
                "(ai-dynamo's aisimulate dependency is an unreachable placeholder)")


class DynamoMissing(RuntimeError):
    """Dynamo is not installed; the message names the install."""


def require_dynamo() -> None:
    """Raise DynamoMissing naming the install unless Dynamo's runtime and frontend import."""
    import importlib.util

    for module in ("dynamo._core", "dynamo.frontend", "dynamo.common.backend"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise DynamoMissing(f"NVIDIA Dynamo is not installed (no module {module}): {INSTALL_HINT}")
