"""The session benchmark (`trtllm-mtp-carry bench`): replay multi-turn sessions under
each drafter policy in one run and compare warm time to first token, drafter
preparation, and acceptance side by side (carry vs rebuild vs blind).
"""
