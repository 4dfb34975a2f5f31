"""The Triton repository of the TensorRT-LLM model (`triton-repo --engine trtllm --model PATH`).

What it is for: write `DIR/<name>/config.pbtxt`, `DIR/<name>/1/model.py`
(exporting `trtllm_mtp_carry.serve.trtllm.model.TritonPythonModel`) and
`DIR/<name>/llm_options.yaml`: with `--llm-options YAML` a copy of that file, else
`DEFAULT_LLM_OPTIONS`, the configuration the carry needs on Qwen3-Next (block reuse
on, one recurrent-state snapshot at each prompt's end: `trtllm.options.
RECOMMENDED_KV_CACHE_CONFIG`), so the repository is self-contained and a warm turn
reuses the previous turn's prompt. The configuration is the reference
model's (`serve/triton/repo.py`: decoupled, sequence batching `oldest`,
`CORRID` uint64, `START`/`END`) with this model's inputs, outputs and
parameters (`TrtllmServeOptions`).

Invariants: one instance (one LLM per model; TP=1, in process, as the
adapter requires); the YAML is validated when it is loaded, by the model
(the `mtp_carry` keys by the adapter's `parse_carry_options`), since PyYAML
and the adapter's option types come with TensorRT-LLM; here the file only
has to exist.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from ..options import ServeOptions
from ..triton.repo import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MODEL_NAME,
    INPUTS,
    OUTPUTS,
    RepoSpec,
    render_config,
    write_repository,
)
from .serving import TrtllmServeOptions

MODEL_MODULE = "trtllm_mtp_carry.serve.trtllm.model"
LLM_OPTIONS_FILE = "llm_options.yaml"

DEFAULT_LLM_OPTIONS = """\
# written by trtllm-mtp-carry triton-repo (no --llm-options given): TensorRT-LLM's options
# for a hybrid MTP model such as Qwen3-Next, with what the MTP carry needs (DECISIONS.md
# "Snapshot placement"): block reuse on (Qwen3-Next's default is off) and one recurrent-state
# snapshot at each prompt's end, so the next turn reuses the previous turn's prompt.
speculative_config: {decoding_type: MTP, num_nextn_predict_layers: 3}
kv_cache_config:
  enable_block_reuse: true
  mamba_state_config:
    additional_snapshot_offsets_from_end: [0]
mtp_carry: {enable: true}
"""
"""The `llm_options.yaml` a repository gets without `--llm-options` (pinned equal to
`RECOMMENDED_KV_CACHE_CONFIG` by tests/serve/test_trtllm_model.py)."""

# the reference model's inputs less drafter_policy: TensorRT-LLM's drafting is set per deployment
TRTLLM_INPUTS = tuple(i for i in INPUTS if i[0] != "drafter_policy")
# the reference model's outputs (carry_outcome and drafter_rows_computed from the adapter's
# turn record), and TensorRT-LLM's reused blocks
TRTLLM_OUTPUTS = (*OUTPUTS, ("kv_cache_reused_blocks", "TYPE_INT32", "[ 1 ]"))


@dataclass(frozen=True)
class TrtllmRepoSpec:
    """What one generated TensorRT-LLM model serves; `llm_options_source` is the YAML to copy."""

    options: TrtllmServeOptions
    name: str = DEFAULT_MODEL_NAME
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_candidate_sequences: int = 64
    llm_options_source: Path | None = None

    def __post_init__(self) -> None:
        self.repo_spec()  # the shared checks of name, idle timeout and candidates
        if self.llm_options_source is not None and self.options.llm_options != LLM_OPTIONS_FILE:
            raise ValueError("llm_options_source and options.llm_options go together")
        if self.llm_options_source is not None and not Path(self.llm_options_source).is_file():
            raise ValueError(f"--llm-options {self.llm_options_source}: not a file")

    def repo_spec(self) -> RepoSpec:
        return RepoSpec(name=self.name, instances=1, idle_timeout_s=self.idle_timeout_s,
                        max_candidate_sequences=self.max_candidate_sequences,
                        options=ServeOptions(max_turn_s=self.options.max_turn_s))


def trtllm_spec(name: str, model: str | None, llm_options: str | None, idle_timeout_s: float,
                max_tokens: int, instances: int = 1, max_turn_s: int = 300,
                max_candidate_sequences: int = 64) -> TrtllmRepoSpec:
    """The spec the command line asks for; ValueError naming the flag that is wrong. A `model`
    that exists locally is made absolute; anything else goes to `LLM(model=...)` as given."""
    if model is None or not model.strip():
        raise ValueError("--engine trtllm needs --model PATH (a checkpoint directory or model name)")
    if instances != 1:
        raise ValueError(f"--engine trtllm serves one instance (one LLM, TP=1, in process), got "
                         f"--instances {instances}")
    if Path(model).exists():  # a local checkpoint: absolute, since tritonserver runs elsewhere
        model = str(Path(model).resolve())
    options = TrtllmServeOptions(model=model, llm_options=LLM_OPTIONS_FILE,
                                 max_tokens=max_tokens, max_turn_s=max_turn_s)
    return TrtllmRepoSpec(name=name, idle_timeout_s=idle_timeout_s, options=options,
                          max_candidate_sequences=max_candidate_sequences,
                          llm_options_source=Path(llm_options) if llm_options else None)


def render_trtllm_config(spec: TrtllmRepoSpec) -> str:
    """The model's `config.pbtxt` text."""
    return render_config(spec.repo_spec(), inputs=TRTLLM_INPUTS, outputs=TRTLLM_OUTPUTS,
                         parameters=spec.options.as_parameters())


def write_trtllm_repository(directory: str | Path, spec: TrtllmRepoSpec) -> Path:
    """Write (or overwrite) `directory/<name>/` and return the model's directory."""
    model_dir = write_repository(directory, spec.repo_spec(), config_text=render_trtllm_config(spec),
                                 model_module=MODEL_MODULE)
    copy = model_dir / LLM_OPTIONS_FILE
    if spec.llm_options_source is not None:
        shutil.copyfile(spec.llm_options_source, copy)
    elif spec.options.llm_options == LLM_OPTIONS_FILE:
        copy.write_text(DEFAULT_LLM_OPTIONS)  # the recommended configuration, never a stale copy
    elif copy.exists():
        copy.unlink()  # an overwritten repository keeps no stale options
    return model_dir
