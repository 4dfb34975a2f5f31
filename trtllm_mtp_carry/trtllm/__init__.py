"""TEMPORARY placeholder (branch i18b): to be replaced by i18a's `trtllm_mtp_carry/trtllm/__init__.py`.

It only makes this folder a package so the TensorRT-LLM Triton model, its
repository writer and their tests import in this branch before the merge.
The adapter itself (`attach`, `detach`, `CarryOptions`, `parse_carry_options`,
`session_key_for`, `TrtllmAdapterError`) is issue 18's other half (i18a); the
modules here import it lazily, inside functions.
"""
