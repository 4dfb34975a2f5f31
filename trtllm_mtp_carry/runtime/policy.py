"""Drafter policies: what a warm turn does about the drafter's lost context.

- `carry`   adopt the previous turn's rows, build only the new span's (default);
- `rebuild` ignore the prefix cache: one target pass over the whole prompt from
            position 0, building every key's drafter row as it goes (full
            context at full cost, nothing computed twice);
- `blind`   TensorRT-LLM's behaviour for hybrid models in its releases (1.3.0rc29,
            1.4.0rc1) and on main-line (the draft pool is unpaired): no drafter rows
            over the reused prefix, rows for the new span the prefill computes
            (its context phase runs the MTP layer over the tokens it prefills);
- `paired`  a model of TensorRT-LLM's paired draft reuse, what PR #19303 (open) does
            for a plain hybrid with block reuse on (it pairs the separate MTP draft
            pool on `_supports_draft_reuse_match_backoff`; main-line does not pair
            hybrids: docs/TENSORRT-LLM.md, "TensorRT-LLM versions"), for the
            reference engine only (`engine/paired_drafts.py`): the drafter's
            blocks are published to a prefix tree of their own, and a warm turn
            resumes at min(target match, drafter match), rounded down to an SSM
            snapshot; the target recomputes what the drafter pool evicted;
- `off`     no speculative decoding at all.

Every policy but `off` builds every key's row on a cold turn (the prefill from
position 0 computes the whole prompt anyway); on a warm turn a refused carry
is `blind`.
All of them build rows per prefill chunk, so each is what it claims at any
concurrency; the generated tokens never depend on the policy.
"""

from __future__ import annotations

from enum import Enum


class DrafterPolicy(str, Enum):
    """How a turn prepares the drafter; compares equal to its string value."""

    CARRY = "carry"
    REBUILD = "rebuild"
    BLIND = "blind"
    PAIRED = "paired"
    OFF = "off"

    @classmethod
    def parse(cls, value: DrafterPolicy | str) -> DrafterPolicy:
        """The policy named by `value`, or a ValueError listing the valid names."""
        if isinstance(value, DrafterPolicy):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown drafter policy {value!r}; expected one of {names}") from None

    @property
    def drafts(self) -> bool:
        """Whether this policy runs speculative decoding."""
        return self is not DrafterPolicy.OFF


ALL_POLICIES: tuple[DrafterPolicy, ...] = tuple(DrafterPolicy)
