"""The reference engine: a small hybrid MTP model in plain torch (model, tokenizer,
corpus) with a prefix cache and greedy speculative decoding around it.

Import submodules by name (`trtllm_mtp_carry.engine.model`); this package
imports nothing itself so that its light modules stay light.
"""
