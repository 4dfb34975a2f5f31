"""Chat traces through the carry store: reading them (`reader`), replaying them (`replay`), and the
`trtllm-mtp-carry trace-replay` command (`cli`). Torch-free; numpy for the per-request arrays."""
