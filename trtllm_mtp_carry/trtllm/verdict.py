"""The one verdict on a TensorRT-LLM deployment: armed, or why the carry stands aside.

What it is for: `trtllm-mtp-carry info --llm-config` judges a deployment from its files before it
starts; the worker's probe (`probe.py`, on the live executor) judges it at start. Both resolve what
they see to the same facts and ask the checks below, in this order, so they give the same verdict
and the same reason:

1. the carry's own options: `mtp_carry.enable`, then its device memory (`carry_memory`: 0 bytes, or
   a pool fraction the carry inside TensorRT-LLM cannot size, stands aside);
2. speculative decoding: none (`speculative_config` unset), or a decoding type other than `MTP`;
3. the parallel mapping (`probe.parallel_refusal`: tensor and attention-data parallelism);
4. disaggregated serving (`cache_transceiver_config` set);
5. the KV format and cache manager (`kv_formats.kv_verdict`);
6. reuse: block reuse off, or a hybrid target without snapshot placement (`options.reuse_stand_aside`).

The live probe adds what only the running executor shows (the draft pool's pairing markers, the
names its build has); `info` says so below its verdict.

Why disaggregation stands aside: `py_executor_creator` turns the separate one-model draft pool off
when `cache_transceiver_config` is set (`spec_config._allow_separate_draft_kv_cache = False`: PR
#11689, "disabled for disaggregated mode (cache_transceiver_config is not None)", kept by #17341 and
#18872 for everything but MiniMax-M3's Eagle3 and standalone drafters), so the MTP layer's KV is
folded into the target pool; `scheduler_v2.py` @ 38198e34582cf777ecc72062f477987284ba9999 says it
too ("Cache-transceiver mode disables the separate one-model draft manager, so disagg generation
init has no paired-reuse path"). With no separate draft pool there is nothing for the carry to
restore into.

Invariant: every `Verdict.reason` is one sentence without file@commit references; those go in
`details`, which `info` prints on the lines below the reason and the worker logs after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MTP = "MTP"
"""The one decoding type whose drafter rows the carry restores (`MTPDecodingConfig.decoding_type`)."""

CREATOR_DISAGG = ("py_executor_creator sets spec_config._allow_separate_draft_kv_cache = False when "
                  "cache_transceiver_config is not None (PR #11689; #17341, #18872 keep it for MTP); "
                  "scheduler_v2.py @ 38198e34582cf777ecc72062f477987284ba9999: \"Cache-transceiver mode "
                  "disables the separate one-model draft manager\"")
"""Where the disaggregation rule was read."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """`armed` (the carry runs) and why: `reason`, one sentence; `details`, lines below it (what
    was read where, what to set)."""

    armed: bool
    reason: str
    details: tuple[str, ...] = ()


NOT_CONFIGURED = "not configured (mtp_carry.enable is false)"


def carry_memory_verdict(device_bytes: int | None, refusal: str | None = None) -> Verdict | None:
    """Why the carry's device memory cannot carry anything, or None: refused (`refusal`, a pool
    fraction given where bytes are needed), or 0 bytes (every deposit is refused `too_large`:
    nothing fits, and the host tier only takes what the device tier has room for)."""
    if device_bytes is None:
        return Verdict(False, refusal or "the carry's device memory is not set in bytes")
    if device_bytes == 0:
        return Verdict(False, "the carry's device memory is 0 bytes, so every deposit is refused and "
                       "nothing is carried", ("set mtp_carry.carry_memory (or --carry-memory, "
                                              "TRTLLM_MTP_CARRY_MEMORY) to bytes, e.g. 1GiB",))
    return None


def carry_options_verdict(options: Any) -> Verdict | None:
    """Why the carry's own options (a `CarryOptions`) keep it from running, or None: not enabled,
    or its device memory (`CarryOptions.device_bytes`, the rule both arenas follow) is refused or 0."""
    from .options import TrtllmAdapterError

    if not options.enable:
        return Verdict(False, NOT_CONFIGURED)
    try:
        device_bytes, refusal = options.device_bytes(), None
    except TrtllmAdapterError as exc:
        device_bytes, refusal = None, str(exc)
    return carry_memory_verdict(device_bytes, refusal)


def speculation_verdict(decoding_type: str | None) -> Verdict | None:
    """Why the carry has no MTP drafter to serve, or None: no speculative decoding
    (`decoding_type` None), or another decoding type."""
    if decoding_type is None:
        return Verdict(False, "no speculative decoding is configured (speculative_config is not set), so "
                       "there is no drafter whose rows could be carried", (
                           "set speculative_config: {decoding_type: MTP} for a model with an MTP layer "
                           "(one-model MTP keeps its layer's KV in a separate draft pool)",))
    if decoding_type != MTP:
        return Verdict(False, f"speculative_config.decoding_type is {decoding_type}, and the carry restores "
                       "a one-model MTP drafter's rows only", (
                           "other drafters' pools and layouts were not read (Eagle3 one-model gets a separate "
                           "draft pool of its own draft layers: should_use_separate_draft_kv_cache)",))
    return None


def disaggregation_verdict(disaggregated: bool) -> Verdict | None:
    """Why a disaggregated worker is not armed, or None (see the module doc)."""
    if disaggregated:
        return Verdict(False, "disaggregated serving (cache_transceiver_config is set) folds the MTP layer "
                       "into the target pool, so there is no separate draft pool to carry into",
                       (CREATOR_DISAGG,))
    return None


def first(*verdicts: Verdict | None) -> Verdict | None:
    """The first of `verdicts` that is not None (the checks in order), or None."""
    return next((v for v in verdicts if v is not None), None)
