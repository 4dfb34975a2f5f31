"""An `llm.yaml` (`extra_llm_api_options`) read as TensorRT-LLM's pydantic `LlmArgs` reads it.

What it is for: `trtllm-mtp-carry info --llm-config llm.yaml` judges a deployment before it
starts. Its verdict is only right if every value means what it will mean to TensorRT-LLM:
`enable_block_reuse: "false"` is False to pydantic, `"yes"`, `"0"` and `1` are booleans by
pydantic's rules, a typo'd key is refused because the models forbid extra keys, a literal
outside its set is refused. So this module validates the file with pydantic itself (v2, what
TensorRT-LLM's models are), over models that mirror TensorRT-LLM's:

- `tensorrt_llm/llmapi/llm_args.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412:
  `BaseLlmArgs` / `TorchLlmArgs` (`model_config = ConfigDict(arbitrary_types_allowed=True,
  extra="forbid")`, and every nested config a `StrictBaseModel`, `extra="forbid"` too),
  `KvCacheConfig`, `MambaStateConfig`, `BlockReuseConfig`, `CacheTransceiverConfig`, the
  `SpeculativeConfig` union (discriminated by `decoding_type`), the `SparseAttentionConfig`
  union (by `algorithm`), the `KvCacheCompressionConfigType` union (by `algorithm`);
- `update_llm_args_with_extra_dict` (same file): the file-level keys it maps besides the
  `LlmArgs` fields (`quant_config`, `calib_config`, `hf_revision`), and the removed
  `sampler_type` (`_check_removed_sampler_type`: `auto` and `TorchSampler` accepted, anything
  else refused).

Every field the verdict reads is typed as the source types it, with the source's validators
(the `dtype` check, the deprecated `mamba_state_cache_interval` migration,
`disable_periodic_mamba_snapshots_for_conversations`, the snapshot-offset checks, MTP's
`num_nextn_predict_layers` remap and `max_draft_len > 0`). Every other field of those classes is
known by name (an unknown key is refused, as `extra="forbid"` refuses it) and its value is left
to TensorRT-LLM: the verdict does not read it, and it is not judged here.

Invariants:
- `read_llm_args(mapping)` either returns the validated `LlmYaml` or raises
  `TrtllmAdapterError` with one line naming the first offending key and value and what pydantic
  said of it (TensorRT-LLM refuses the same value with the same pydantic message).
- pydantic is imported here only (`info --llm-config`); `import trtllm_mtp_carry` does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    PrivateAttr,
    StrictInt,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from .options import TrtllmAdapterError

SOURCE = "llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412"
"""Where every model below was read."""

KV_DTYPES = ("auto", "fp8", "fp8_ds_mla", "nvfp4")
"""`KvCacheConfig.validate_dtype`'s own names; it also takes the keys of `_str_to_torch_dtype_dict`."""

TORCH_DTYPE_NAMES = ("bfloat16", "float16", "float32", "int64", "int32", "int8", "bool", "fp8")
"""The keys of `_str_to_torch_dtype_dict` in `tensorrt_llm/_utils.py` @
000a01de66f0eab4ab05640711f0253f50f5209c, the only version of that file the index holds (a newer
tree may add names: the check then refuses a value TensorRT-LLM would take, never the reverse
for these)."""


class _Strict(BaseModel):
    """`StrictBaseModel` (`llmapi/utils.py`): unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")


def _known(base: type[BaseModel], name: str, names: tuple[str, ...]) -> type[BaseModel]:
    """`base` with the class's other field `names` accepted by name (any value: not judged here)."""
    fields: dict[str, Any] = {n: (Any, None) for n in names}
    model: type[BaseModel] = create_model(name, __base__=base, **fields)
    return model


# ---- kv_cache_config ------------------------------------------------------------------------

_SnapshotStart = Annotated[StrictInt, Field(gt=0)]
_SnapshotEnd = Annotated[StrictInt, Field(ge=0)]


class MambaStateConfig(_Strict):
    """`MambaStateConfig`: the four snapshot-placement fields, typed as the source types them."""

    periodic_snapshot_interval: NonNegativeInt = 0
    additional_snapshot_offsets_from_start: list[_SnapshotStart] = Field(default_factory=list)
    additional_snapshot_offsets_from_end: list[_SnapshotEnd] = Field(default_factory=list)
    enable_branch_snapshot: bool = False


class BlockReuseConfig(_Strict):
    """`BlockReuseConfig`: V2's reuse policy (the renamed `block_reuse_policy` key refused)."""

    policy: Literal["all_reusable", "per_request", "per_conversation"] = "all_reusable"
    max_num_turns: PositiveInt = 1

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "block_reuse_policy" in data:
            raise ValueError("'kv_cache_config.block_reuse_config.block_reuse_policy' was renamed to "
                             "'kv_cache_config.block_reuse_config.policy'")
        return data


class _KvCacheConfigRead(_Strict):
    """`KvCacheConfig`'s fields the verdict reads, and its validators over them."""

    enable_block_reuse: bool = True
    max_tokens: int | None = None
    free_gpu_memory_fraction: float | None = Field(default=0.9, ge=0, le=1)
    max_gpu_total_bytes: NonNegativeInt = 0
    dtype: str = "auto"
    mamba_state_cache_interval: NonNegativeInt | None = None
    mamba_state_config: MambaStateConfig = Field(default_factory=MambaStateConfig)
    use_kv_cache_manager_v2: bool | Literal["auto"] = "auto"
    block_reuse_config: BlockReuseConfig = Field(default_factory=BlockReuseConfig)
    _ignored_interval: int = PrivateAttr(default=0)  # what the conversations validator reset

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        value = value.lower()
        if value in KV_DTYPES or value in TORCH_DTYPE_NAMES:
            return value
        raise ValueError('kv_cache_config.dtype must be one of "auto", "fp8", "fp8_ds_mla", "nvfp4", '
                         "or valid torch.dtype string")

    @model_validator(mode="after")
    def _legacy_interval(self) -> _KvCacheConfigRead:
        # migrate_legacy_mamba_interval
        if self.mamba_state_cache_interval is None:
            return self
        if "periodic_snapshot_interval" in self.mamba_state_config.model_fields_set:
            raise ValueError("Cannot set both 'kv_cache_config.mamba_state_cache_interval' and "
                             "'kv_cache_config.mamba_state_config.periodic_snapshot_interval'.")
        self.mamba_state_config = self.mamba_state_config.model_copy(
            update={"periodic_snapshot_interval": self.mamba_state_cache_interval})
        return self

    @model_validator(mode="after")
    def _conversations(self) -> _KvCacheConfigRead:
        # disable_periodic_mamba_snapshots_for_conversations (the set value is kept in `ignored`)
        interval = self.mamba_state_config.periodic_snapshot_interval
        if self.block_reuse_config.policy == "per_conversation" and interval != 0:
            self.mamba_state_config = self.mamba_state_config.model_copy(
                update={"periodic_snapshot_interval": 0})
            self._ignored_interval = interval
        return self

    @model_validator(mode="after")
    def _offsets_need_v2(self) -> _KvCacheConfigRead:
        # validate_mamba_snapshot_offsets
        state = self.mamba_state_config
        offsets = bool(state.additional_snapshot_offsets_from_start or state.additional_snapshot_offsets_from_end)
        if offsets and self.use_kv_cache_manager_v2 is False:
            raise ValueError("kv_cache_config.mamba_state_config additional snapshot offsets require "
                             "kv_cache_config.use_kv_cache_manager_v2=True.")
        if state.enable_branch_snapshot and self.use_kv_cache_manager_v2 is False:
            raise ValueError("kv_cache_config.mamba_state_config.enable_branch_snapshot requires "
                             "kv_cache_config.use_kv_cache_manager_v2=True.")
        return self

    @property
    def ignored_interval(self) -> int:
        """The `periodic_snapshot_interval` the conversations validator reset to 0 (0: none)."""
        return self._ignored_interval


KvCacheConfig = _known(_KvCacheConfigRead, "KvCacheConfig", (
    "max_attention_window", "sink_token_length", "host_cache_size", "disk_cache_size", "disk_cache_path",
    "cross_kv_cache_fraction", "secondary_offload_min_priority", "event_buffer_max_size",
    "attention_dp_events_gather_period_ms", "kv_events_config", "enable_partial_reuse",
    "copy_on_partial_reuse", "use_uvm", "iteration_stats_interval", "mamba_ssm_cache_dtype",
    "mamba_ssm_stochastic_rounding", "mamba_ssm_philox_rounds", "tokens_per_block",
    "enable_swa_scratch_reuse", "kv_cache_event_hash_algo", "max_util_for_resume",
    "enable_kv_pool_rebalance", "kv_pool_rebalance_min_sampled_kv_caches",
    "kv_pool_rebalance_cooldown_secs", "kv_pool_rebalance_target_ratio_update_interval",
    "kv_pool_rebalance_ratio_threshold", "kv_pool_rebalance_moving_average_decay",
    "kv_pool_rebalance_check_interval", "disk_prefetch_num_reqs", "fp8_context_mla_kv_len_cap",
    "pool_ratio", "avg_seq_len"))
"""`KvCacheConfig` @ 0004396: the fields above typed, its 32 other fields by name."""


# ---- speculative_config ---------------------------------------------------------------------

_DECODING_BASE = ("max_total_draft_tokens", "max_concurrency", "draft_len_schedule", "load_format",
                  "acceptance_rate_window_size", "acceptance_rate_threshold", "use_rejection_sampling",
                  "allow_advanced_sampling", "advanced_sampling_mode", "enable_penalty")
"""`DecodingBaseConfig`'s fields besides `max_draft_len` and `speculative_model`."""


class _DecodingBase(_Strict):
    max_draft_len: NonNegativeInt | None = None
    speculative_model: Any = Field(default=None, validation_alias=AliasChoices(
        "speculative_model", "speculative_model_dir"))


class _MtpRead(_DecodingBase):
    """`MTPDecodingConfig`: `decoding_type: MTP`; `num_nextn_predict_layers` is deprecated and
    remapped to `max_draft_len` (`_remap_deprecated_num_nextn_predict_layers`); a set
    `max_draft_len` must be > 0 (`set_max_total_draft_tokens`)."""

    decoding_type: Literal["MTP"] = "MTP"

    @model_validator(mode="before")
    @classmethod
    def _remap(cls, data: Any) -> Any:
        if isinstance(data, dict) and "num_nextn_predict_layers" in data:
            data = dict(data)
            layers = data.pop("num_nextn_predict_layers")
            data.setdefault("max_draft_len", layers)
        return data

    @model_validator(mode="after")
    def _positive(self) -> _MtpRead:
        if self.max_draft_len is not None and self.max_draft_len <= 0:
            raise ValueError("max_draft_len must be > 0 for MTP")
        return self


_EAGLE = ("eagle_choices", "greedy_sampling", "posterior_threshold", "use_dynamic_tree", "dynamic_tree_max_topK",
          "num_eagle_layers", "max_non_leaves_per_layer", "eagle3_one_model", "eagle3_layers_to_capture",
          "eagle3_model_arch")


def _decoding(name: str, decoding_type: str, base: type[BaseModel], names: tuple[str, ...]) -> type[BaseModel]:
    body = create_model(f"_{name}", __base__=base, decoding_type=(Literal[decoding_type], decoding_type))
    return _known(body, name, _DECODING_BASE + names)


MTPDecodingConfig = _known(_MtpRead, "MTPDecodingConfig", _DECODING_BASE + (
    "use_relaxed_acceptance_for_thinking", "relaxed_topk", "relaxed_delta", "use_mtp_vanilla",
    "mtp_eagle_one_model", "use_dynamic_tree", "dynamic_tree_max_topK", "sa_config",
    "begin_thinking_phase_token", "end_thinking_phase_token"))
SpeculativeConfig = Annotated[Union[  # type: ignore[valid-type]  # noqa: UP007
    _decoding("DraftTargetDecodingConfig", "Draft_Target", _DecodingBase, ()),
    _decoding("Eagle3DecodingConfig", "Eagle3", _DecodingBase, _EAGLE + ("sa_config",)),
    _decoding("EagleDecodingConfig", "Eagle", _DecodingBase, _EAGLE),
    MTPDecodingConfig,
    _decoding("NGramDecodingConfig", "NGram", _DecodingBase,
              ("max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool")),
    _decoding("SADecodingConfig", "SA", _DecodingBase,
              ("max_matching_ngram_size", "enable_global_pool", "global_pool_size")),
    _decoding("UserProvidedDecodingConfig", "User_Provided", _DecodingBase, ("drafter", "resource_manager")),
    _decoding("SaveHiddenStatesDecodingConfig", "SaveState", _DecodingBase,
              ("output_directory", "write_interval", "file_prefix", "eagle3_layers_to_capture", "eagle_choices")),
    _decoding("PARDDecodingConfig", "PARD", _DecodingBase, ("mask_token_id", "sa_config")),
    _decoding("DFlashDecodingConfig", "DFlash", _DecodingBase,
              ("mask_token_id", "target_layer_ids", "attention_backend")),
    _decoding("DSparkDecodingConfig", "DSpark", _DecodingBase,
              ("mask_token_id", "target_layer_ids", "block_size", "markov_rank", "markov_head_type",
               "attention_backend")),
    _decoding("AutoDecodingConfig", "AUTO", _DecodingBase, ()),
], Field(discriminator="decoding_type")]
"""The `SpeculativeConfig` union @ 0004396, discriminated by `decoding_type`."""


# ---- cache_transceiver_config, sparse_attention_config, kv_cache_compression_config ----------

class CacheTransceiverConfig(_Strict):
    """`CacheTransceiverConfig` (every field typed): its presence is what the creator reads."""

    backend: Literal["DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI"] | None = None
    transceiver_runtime: Literal["CPP", "PYTHON", "auto"] | None = "auto"
    max_tokens_in_buffer: int | None = None
    kv_transfer_timeout_ms: PositiveInt | None = 60000
    kv_transfer_sender_future_timeout_ms: PositiveInt | None = 1000
    kv_transfer_poll_interval_ms: PositiveInt | None = 5000
    kv_cache_bounce_size_mb: NonNegativeInt = 0
    enable_pipelined_transfer: bool = False


def _tagged(name: str, algorithm: str, names: tuple[str, ...]) -> type[BaseModel]:
    body = create_model(f"_{name}", __base__=_Strict, algorithm=(Literal[algorithm], algorithm))
    return _known(body, name, names)


_DSA = ("seq_len_threshold", "index_n_heads", "index_head_dim", "index_topk", "indexer_max_chunk_size",
        "skip_indexer_for_short_seqs", "use_cute_dsl_topk", "use_cute_dsl_paged_mqa_logits", "q_split_threshold",
        "indexer_rope_interleave", "enable_heuristic_topk", "use_self_sampling_topk", "use_gvr_emission",
        "indexer_k_dtype", "index_share_for_mtp_iteration")
SparseAttentionConfig = Annotated[Union[  # type: ignore[valid-type]  # noqa: UP007
    _tagged("QSASparseAttentionConfig", "qsa", ("seq_len_threshold",)),
    _tagged("RocketSparseAttentionConfig", "rocket", ("seq_len_threshold", "window_size", "kernel_size", "topr",
                                                      "topk", "prompt_budget", "page_size", "kt_cache_dtype")),
    _tagged("DeepSeekSparseAttentionConfig", "dsa", _DSA),
    _tagged("DeepSeekV4SparseAttentionConfig", "deepseek_v4", _DSA + ("compress_ratios", "window_size")),
    _tagged("SkipSoftmaxAttentionConfig", "skip_softmax", ("threshold_scale_factor", "target_sparsity")),
    _tagged("MiniMaxM3SparseAttentionConfig", "minimax_m3", (
        "sparse_num_index_heads", "sparse_index_dim", "sparse_block_size", "sparse_topk_blocks",
        "sparse_init_blocks", "sparse_local_blocks", "sparse_score_type", "sparse_disable_index_value",
        "indexer_kv_dtype", "num_attention_heads", "num_key_value_heads", "implementation")),
], Field(discriminator="algorithm")]
"""The `SparseAttentionConfig` union @ 0004396, discriminated by `algorithm`."""

KvCacheCompressionConfig = Annotated[Union[  # type: ignore[valid-type]  # noqa: UP007
    _tagged("ColdPageQuantizationCompressionConfig", "quantization_for_cold_page",
            ("quant", "scale_checkpoint_path")),
    _tagged("TriAttentionKvCacheCompressionConfig", "triattention",
            ("eviction_mode", "normalize_scores", "budget", "beta", "calibration_path")),
], Field(discriminator="algorithm")]
"""`KvCacheCompressionConfigType` @ 0004396, discriminated by `algorithm`."""


# ---- the file -------------------------------------------------------------------------------

class _LlmArgsRead(BaseModel):
    """`TorchLlmArgs`' fields the verdict reads (`extra="forbid"`, as `BaseLlmArgs` sets it)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: Any = None  # required by LLM(...), given on the command line rather than in the file
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_attention_dp: bool = False
    dtype: str = "auto"
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)  # type: ignore[valid-type]
    speculative_config: SpeculativeConfig | None = None  # type: ignore[valid-type]
    cache_transceiver_config: CacheTransceiverConfig | None = None
    sparse_attention_config: SparseAttentionConfig | None = None  # type: ignore[valid-type]
    kv_cache_compression_config: KvCacheCompressionConfig | None = None  # type: ignore[valid-type]
    # the file-level keys `update_llm_args_with_extra_dict` maps besides the fields (values not read
    # here but `quant_config.kv_cache_quant_algo`, see `kv_formats.verdict_of_options`)
    quant_config: dict[str, Any] | None = None
    calib_config: dict[str, Any] | None = None
    hf_revision: Any = None
    sampler_type: Any = None

    @field_validator("sampler_type")
    @classmethod
    def _removed(cls, value: Any) -> Any:
        if value is not None and value not in ("auto", "TorchSampler"):
            raise ValueError(f"'sampler_type' was removed and {value!r} is no longer available; "
                             "TorchSampler is the only sampler")
        return value


LlmYaml = _known(_LlmArgsRead, "LlmYaml", (
    # BaseLlmArgs
    "tokenizer", "tokenizer_mode", "custom_tokenizer", "post_processor_hook", "skip_tokenizer_init",
    "trust_remote_code", "revision", "tokenizer_revision", "model_kwargs", "context_parallel_size",
    "gpus_per_node", "moe_cluster_parallel_size", "moe_tensor_parallel_size", "moe_expert_parallel_size",
    "enable_lm_head_tp_in_adp", "pp_partition", "cp_config", "load_format", "enable_lora", "lora_config",
    "enable_chunked_prefill", "guided_decoding_backend", "batched_logits_processor",
    "iter_stats_max_iterations", "request_stats_max_iterations", "peft_cache_config", "scheduler_config",
    "max_batch_size", "max_input_len", "max_seq_len", "max_beam_width", "max_num_tokens",
    "gather_generation_logits", "num_postprocess_workers", "postprocess_tokenizer_dir", "num_serve_frontends",
    "reasoning_parser", "decoding_config", "mpi_session", "otlp_traces_endpoint", "backend",
    "return_perf_metrics", "perf_metrics_output_dir", "perf_metrics_max_requests", "prometheus_metrics_config",
    "enable_energy_metrics", "orchestrator_type", "env_overrides", "telemetry_config",
    # TorchLlmArgs
    "generation_config", "garbage_collection_gen0_threshold", "cuda_graph_config", "encoder_cuda_graph_config",
    "enable_encoder_decoder_mixed_cuda_graph", "multimodal_config", "attention_dp_config",
    "disable_overlap_scheduler", "moe_config", "nvfp4_gemm_config", "dwdp_config", "encoder_max_batch_size",
    "encoder_max_num_tokens", "attn_backend", "enable_mla_skip_correction", "mla_skip_correction_threshold",
    "sampler_force_async_worker", "enable_in_graph_sampling", "enable_speculative_beam_history_d2h",
    "enable_early_first_token_response", "enable_low_latency_host_dispatch", "enable_iter_perf_stats",
    "enable_iter_req_stats", "print_iter_log", "batch_wait_timeout_ms", "batch_wait_timeout_iters",
    "batch_wait_max_tokens_ratio", "torch_compile_config", "prefill_cuda_graph_backend",
    "prefill_capture_num_tokens", "enable_autotuner", "use_fine_grained_sync", "enable_layerwise_nvtx_marker",
    "enable_min_latency", "stream_interval", "force_dynamic_quantization", "allreduce_strategy",
    "checkpoint_loader", "checkpoint_format", "checkpoint_io_policy", "mx_config", "gms_config",
    "kv_connector_config", "mm_encoder_only", "disable_mm_encoder", "encode_only", "ray_worker_extension_cls",
    "ray_placement_config", "ray_worker_nsight_options", "sleep_config", "reorder_policy_config",
    "enable_resource_governor", "use_cute_dsl_blockscaling_mm", "use_cute_dsl_blockscaling_bmm",
    "use_cute_dsl_bf16_bmm", "use_cute_dsl_bf16_gemm", "max_stats_len", "layer_wise_benchmarks_config"))
"""`TorchLlmArgs` @ 0004396 (with `BaseLlmArgs`): the fields above typed, every other field by name."""


def read_llm_args(mapping: Mapping[str, Any]) -> Any:
    """`mapping` (an `llm.yaml` without its `mtp_carry` section) validated as TensorRT-LLM's
    `LlmArgs` would validate it: an `LlmYaml`. `TrtllmAdapterError`, one line naming the first
    offending key (dotted) and value and pydantic's message, for a file TensorRT-LLM refuses."""
    try:
        return LlmYaml.model_validate(dict(mapping))
    except ValidationError as exc:
        raise TrtllmAdapterError(_one_line(exc, mapping)) from None


def _one_line(exc: ValidationError, mapping: Mapping[str, Any]) -> str:
    error = exc.errors(include_url=False)[0]
    said = "TensorRT-LLM's LlmArgs refuses it, llm_args.py @ 0004396"
    where = [str(part) for part in error["loc"]]
    # a union member's tag (e.g. 'MTP') is part of pydantic's location, not of the file's keys
    path = []
    node: Any = mapping
    for part in where:
        if isinstance(node, Mapping) and part in node:
            path.append(part)
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            path.append(f"[{part}]")
            node = node[int(part)]
    key = ".".join(path).replace(".[", "[") or "(the file)"
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key ({message}: {said})"
    value = error.get("input")
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):  # the discriminator's key
        tag = str(error.get("ctx", {}).get("discriminator", "")).strip("'")
        key, value = f"{key}.{tag}", value.get(tag) if isinstance(value, Mapping) else value
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{key}: {shown}: {message} ({said})"
