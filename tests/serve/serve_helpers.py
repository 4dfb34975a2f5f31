"""What the serve tests share: the served model's names and sizes."""

import trtllm_mtp_carry.core as core

MODEL = "mtp_carry"  # 2 instances, loaded at start
PROBE = "mtp_carry_probe"  # loaded only with bad parameters
MAX_TOKENS = 24  # the served default max_tokens
MARCONI = 48  # the served restore threshold (short test prompts still restore)
HAS_CARRY_SLOTS = hasattr(core, "set_carry_slots")  # several slots per instance (issue 9)
CARRY_SLOTS = 4 if HAS_CARRY_SLOTS else None  # every session of an instance keeps its rows
