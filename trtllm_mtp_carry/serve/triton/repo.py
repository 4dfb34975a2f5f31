"""The Triton model repository generator (`trtllm-mtp-carry triton-repo DIR`).

What it is for: write `DIR/<name>/config.pbtxt` and `DIR/<name>/1/model.py`,
a Python-backend model that serves the carry runtime. The repository owns
nothing at run time; the model (`serve/triton/model.py`) owns its engine.

Invariants of the written configuration (the facts checked on Triton 2.51):
- decoupled transaction policy and `max_batch_size: 0` (one request per
  turn, several streamed responses);
- sequence batching with the `oldest` strategy; control inputs `START` and
  `END` as `int32_false_true`, `CORRID` as `TYPE_UINT64` (the correlation id
  *is* the session, and the batcher keeps it on one instance, the affinity
  the carry needs);
- every runtime option is a string parameter (`ServeOptions.as_parameters`),
  so the model validates them all at load;
- `max_sequence_idle_microseconds` is `idle_timeout_s + options.max_turn_s`:
  Triton's idle timer starts at a request's arrival, so it must outlast the
  longest turn (the model cancels a turn at `max_turn_s`) plus the session's
  own idle timeout, which the model counts from the turn's end (model.py);
- `max_candidate_sequences` caps the open sessions (sequences) per instance:
  a START beyond it waits in Triton's backlog until a session ends (END or
  the idle timeout); the sequence batcher has no queue policy, so a client
  bounds that wait with the request's `timeout` parameter (microseconds) and
  then gets "timeout of the corresponding sequence has been expired".

`model.py` pins the directory this package was imported from on `sys.path`,
so the server runs the very code that wrote the repository.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..options import ServeOptions

DEFAULT_MODEL_NAME = "mtp_carry"
DEFAULT_IDLE_TIMEOUT_S = 600.0
DEFAULT_MAX_CANDIDATE_SEQUENCES = 64  # open sessions per instance

# (name, Triton type, dims, optional); TensorRT-LLM's Triton models use these names
INPUTS = (
    ("text_input", "TYPE_STRING", "[ 1 ]", True),
    ("input_ids", "TYPE_INT64", "[ -1 ]", True),
    ("max_tokens", "TYPE_INT32", "[ 1 ]", True),
    ("drafter_policy", "TYPE_STRING", "[ 1 ]", True),
    ("cache_salt", "TYPE_STRING", "[ 1 ]", True),  # prefix-cache namespace (BYTES)
)
OUTPUTS = (
    ("text_output", "TYPE_STRING", "[ 1 ]"),
    ("output_ids", "TYPE_INT64", "[ -1 ]"),
    ("carry_outcome", "TYPE_STRING", "[ 1 ]"),
    ("drafter_rows_computed", "TYPE_INT32", "[ 1 ]"),
    ("drafted", "TYPE_INT32", "[ 1 ]"),
    ("accepted", "TYPE_INT32", "[ 1 ]"),
    ("ttft_ms", "TYPE_FP32", "[ 1 ]"),
    ("model_instance", "TYPE_STRING", "[ 1 ]"),
    ("turn_stats", "TYPE_STRING", "[ 1 ]"),  # JSON of every TurnStats field
)

MODEL_PY = '''"""Triton Python-backend entry point written by `trtllm-mtp-carry triton-repo`.

The model itself is `{module}.TritonPythonModel`;
this file only puts the package that wrote the repository first on sys.path.
"""

import sys

PACKAGE_ROOT = {root!r}
if PACKAGE_ROOT not in sys.path:
    sys.path.insert(0, PACKAGE_ROOT)

from {module} import TritonPythonModel  # noqa: E402,F401
'''
MODEL_MODULE = "trtllm_mtp_carry.serve.triton.model"  # the reference engine's model


@dataclass(frozen=True)
class RepoSpec:
    """What one generated model serves: its name, instances, idle timeout and options."""

    name: str = DEFAULT_MODEL_NAME
    instances: int = 1
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_candidate_sequences: int = DEFAULT_MAX_CANDIDATE_SEQUENCES
    options: ServeOptions = field(default_factory=ServeOptions)

    def __post_init__(self) -> None:
        if not self.name or not all(c.isalnum() or c in "_-." for c in self.name):
            raise ValueError(f"model name must be letters, digits, '_', '-' or '.', got {self.name!r}")
        for key in ("instances", "max_candidate_sequences"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s!r}")


def render_config(spec: RepoSpec, inputs: tuple[tuple[str, str, str, bool], ...] = INPUTS,
                  outputs: tuple[tuple[str, str, str], ...] = OUTPUTS,
                  parameters: dict[str, str] | None = None) -> str:
    """The model's `config.pbtxt` text (parses with Triton's `model_config_pb2`); `inputs`,
    `outputs` and `parameters` (default: the reference model's) let another engine's model
    (`--engine trtllm`) share the sequence-batching contract."""
    if parameters is None:
        parameters = spec.options.as_parameters()
    control = [
        ("START", "CONTROL_SEQUENCE_START", "int32_false_true: [ 0, 1 ]"),
        ("END", "CONTROL_SEQUENCE_END", "int32_false_true: [ 0, 1 ]"),
        ("CORRID", "CONTROL_SEQUENCE_CORRID", "data_type: TYPE_UINT64"),
    ]
    lines = [
        f'name: "{spec.name}"',
        'backend: "python"',
        "max_batch_size: 0",
        "model_transaction_policy { decoupled: true }",
        "sequence_batching {",
        f"  max_sequence_idle_microseconds: {int((spec.idle_timeout_s + spec.options.max_turn_s) * 1e6)}",
        f"  oldest {{ max_candidate_sequences: {spec.max_candidate_sequences} "
        "max_queue_delay_microseconds: 0 }",
        "  control_input [",
        ",\n".join(f'    {{ name: "{n}" control [ {{ kind: {k} {v} }} ] }}' for n, k, v in control),
        "  ]",
        "}",
        "input [",
        ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d} optional: {str(o).lower()} }}'
                   for n, t, d, o in inputs),
        "]",
        "output [",
        ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d} }}' for n, t, d in outputs),
        "]",
        f"instance_group [ {{ count: {spec.instances} kind: KIND_CPU }} ]",
        "parameters [",
        ",\n".join(f'  {{ key: "{k}" value {{ string_value: "{v}" }} }}'
                   for k, v in parameters.items()),
        "]",
    ]
    return "\n".join(lines) + "\n"


def package_root() -> Path:
    """The directory holding the `trtllm_mtp_carry` package this code was imported from."""
    return Path(__file__).resolve().parents[3]


def write_repository(directory: str | Path, spec: RepoSpec, config_text: str | None = None,
                     model_module: str = MODEL_MODULE) -> Path:
    """Write (or overwrite) `directory/<name>/` and return the model's directory
    (`config_text` and `model_module` default to the reference engine's model)."""
    model_dir = Path(directory) / spec.name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(render_config(spec) if config_text is None else config_text)
    (model_dir / "1" / "model.py").write_text(MODEL_PY.format(root=str(package_root()), module=model_module))
    return model_dir
