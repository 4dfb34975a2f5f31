"""The stand-in's guard: package code may read only the TensorRT-LLM names the source has.

Not a TensorRT-LLM module: the stand-in's own rule. `TRTLLM_NAMES` is every
TensorRT-LLM name a stand-in class answers to package code, the rows of
docs/TRTLLM-CONFORMANCE.md (pinned equal by tests/trtllm/test_trtllm_conformance.py),
each row naming the file and commit it was read from.

Invariant: package code (any `trtllm_mtp_carry.*` module outside this stand-in
package) reading a name of a `Conformant` object that is not in
`TRTLLM_NAMES[cls.TRTLLM_CLASS]` gets AttributeError, as it would on TensorRT-LLM.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

STANDIN_PACKAGE = "trtllm_mtp_carry.trtllm.standin"
"""The stand-in's package: its own modules see its bookkeeping too."""

TRTLLM_NAMES: dict[str, frozenset[str]] = {
    # class (as docs/TRTLLM-CONFORMANCE.md names it) -> the TensorRT-LLM names the stand-in has
    "LLM": frozenset({"_executor", "generate_async", "args", "shutdown", "tokenizer"}),
    "GenerationExecutor": frozenset({"engine"}),
    "PyExecutor": frozenset({"resource_manager", "model_engine"}),
    "ResourceManager": frozenset({
        "resource_managers", "prepare_resources", "update_resources", "free_resources",
        "get_resource_manager"}),
    "ScheduledRequests": frozenset({"context_requests", "generation_requests", "all_requests"}),
    "KVCacheManagerV2": frozenset({
        "is_draft", "dtype", "mapping", "enable_block_reuse", "tokens_per_block", "layer_offsets",
        "enable_joint_kv_cache_reuse", "_can_publish_block_reuse",
        "_supports_draft_reuse_match_backoff", "_supports_reuse_match_backoff",
        "_supports_additional_snapshot_offsets", "kv_cache_config",
        "_fresh_page_fill", "_stream", "get_buffers", "impl",
        "get_batch_cache_indices", "prepare_resources", "update_resources", "free_resources",
        "add_dummy_requests", "shutdown", "get_max_resource_count",
        "get_needed_resource_to_completion"}),
    # a V2 manager's `impl` (kv_cache_manager_v2.py @ 00be09f7: `KVCacheManager as KVCacheManagerPy`)
    "KVCacheManagerPy": frozenset({"get_mem_pool_base_address", "get_page_stride"}),
    # a subclass answers its parents' names too (`Conformant`): these are what QSA's class adds
    # or reads differently (qsa/cache_manager.py, kv_cache_manager_v2.py @ 38198e34)
    "QSAMambaHybridCacheManagerV2": frozenset({
        "qsa_sparse_layer_ids", "qsa_position_layer_id", "qsa_index_dim", "qsa_index_kv_heads",
        "get_index_k_buffer", "get_qsa_position_buffer", "get_buffers", "get_batch_cache_indices"}),
    # DeepSeek-V4's manager (deepseek_v4/cache_manager.py @ 0b03b6af): what it adds or reads differently
    "DeepseekV4CacheManager": frozenset({"use_fp8_ds_mla", "get_buffers", "get_cache_indices"}),
    # the class newer trees build for it (modules/qwen4_exp/cache_manager.py @ 6ff2801f): the same names
    "Qwen4ExpHybridCacheManagerV2": frozenset({
        "qsa_sparse_layer_ids", "qsa_position_layer_id", "qsa_index_dim", "qsa_index_kv_heads",
        "get_index_k_buffer", "get_qsa_position_buffer", "get_buffers", "get_batch_cache_indices"}),
    "KvCacheConfig": frozenset({"enable_block_reuse", "mamba_state_config", "block_reuse_config"}),
    # `TorchLlmArgs.speculative_config` (llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412)
    "DecodingBaseConfig": frozenset({"decoding_type"}),
    # the executor's parallel mapping (mapping.py @ 05ebebb2) and communicator (communicator.py
    # @ a1cf28f9): what the worker install and the lockstep read
    "Mapping": frozenset({"tp_size", "tp_rank", "pp_size", "rank", "enable_attention_dp"}),
    "Distributed": frozenset({"tp_allgather"}),
    "KvCacheCreator": frozenset({"try_prepare_estimation", "_llm_args"}),
    "MambaStateConfig": frozenset({
        "periodic_snapshot_interval", "additional_snapshot_offsets_from_start",
        "additional_snapshot_offsets_from_end", "enable_branch_snapshot"}),
    "LlmRequest": frozenset({
        "py_request_id", "py_client_id", "prompt_len", "max_new_tokens", "state",
        "context_current_position", "context_chunk_size", "prepopulated_prompt_len",
        "get_tokens", "get_num_tokens", "py_conversation_params", "cache_salt", "cache_salt_id",
        "lora_task_id", "is_dummy_request", "is_context_init_state", "is_context_finished",
        "is_generation_in_progress_state", "is_generation_complete_state", "is_finished",
        "is_finished_due_to_length", "is_finished_due_to_cancellation", "is_last_context_chunk",
        "finish_by_reason"}),
}
"""Every TensorRT-LLM name a stand-in class answers to package code (the rows of
docs/TRTLLM-CONFORMANCE.md, pinned equal by tests/trtllm/test_trtllm_conformance.py)."""


@functools.cache
def _names(cls: type) -> frozenset[str]:
    """The names `cls` answers: its TensorRT-LLM class's and every Conformant parent's (a
    subclass inherits its parent's attributes in TensorRT-LLM too)."""
    return frozenset().union(*(TRTLLM_NAMES[c.__dict__["TRTLLM_CLASS"]] for c in cls.__mro__
                               if c.__dict__.get("TRTLLM_CLASS")))


class Conformant:
    """Base of the stand-in classes that play a TensorRT-LLM class (`TRTLLM_CLASS`).

    Package code (any `trtllm_mtp_carry.*` module outside the stand-in package) reading a
    name that is not in `TRTLLM_NAMES[TRTLLM_CLASS]` gets AttributeError, as it would on
    TensorRT-LLM: `getattr(obj, name, default)` gets the default, `hasattr` False. The
    stand-in's own code, tests and scripts see the stand-in's bookkeeping too.
    """

    TRTLLM_CLASS: str = ""

    def __getattribute__(self, name: str) -> Any:
        if name[:2] == "__" or name in _names(object.__getattribute__(self, "__class__")):
            return object.__getattribute__(self, name)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("trtllm_mtp_carry.") and not caller.startswith(STANDIN_PACKAGE):
            raise AttributeError(
                f"TensorRT-LLM's {type(self).TRTLLM_CLASS} has no {name!r} in "
                "docs/TRTLLM-CONFORMANCE.md: the stand-in refuses what TensorRT-LLM lacks")
        return object.__getattribute__(self, name)
