"""The carry inside TensorRT-LLM's PyTorch backend, installed where the executor is built.

What it is for: a user serving a hybrid MTP model (Qwen3-Next) on TensorRT-LLM
with block reuse gets a drafter that is blind over every reused prefix on a
build without paired draft reuse. The carry resource manager (`manager.py`)
restores it. Two ways in, both probing first (`probe.py`) and installing only on
an unpaired draft pool:

- in TensorRT-LLM's worker process, where the default `LLM(...)`, `trtllm-serve`
  and Dynamo build the executor: `TRTLLM_MTP_CARRY_WORKER` and `trtllm.worker`
  (a hook at `create_py_executor_instance`);
- in one process (`TLLM_WORKER_USE_SINGLE_PROCESS=1`, TP=1): `attach(llm)` reaches
  the in-process executor and appends the manager (`detach(llm)` removes it):

```python
import os
os.environ["TLLM_WORKER_USE_SINGLE_PROCESS"] = "1"  # before the first LLM
from tensorrt_llm import LLM
from trtllm_mtp_carry.trtllm import attach
llm = LLM(model=..., speculative_config=...,   # block reuse and a snapshot at each prompt's end:
          kv_cache_config={"enable_block_reuse": True,   # without them no prefix is ever reused
                           "mamba_state_config": {"additional_snapshot_offsets_from_end": [0]}})
carry = attach(llm, {"carry_slots": 16})
print(carry.topology, carry.armed, carry.reason)
```

The adapter imports `tensorrt_llm` only inside `attach` (`probe.reach_executor`)
and depends on no front end (the Triton model lives in `serve/trtllm/`);
without TensorRT-LLM, attach on a real LLM fails with one line naming the
`trtllm` extra. The CPU stand-in (`standin/`) follows
the executor's protocol so the same classes are tested without TensorRT-LLM.

Invariants:
- At most one attachment per LLM; `detach` removes the manager and drops every
  carried row. Attach before the first request.
- `pop_turn(RequestOutput.request_id)` says what the carry did for that request
  (each record is read once, and at most `manager.TURN_LOG` are kept);
  `forget_conversation(conversation_id)` drops an ended conversation's rows.
- Paired and folded topologies, a disabled carry, or block reuse off install
  nothing (`armed` is False and `reason` says why).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core import carry_eviction, carry_row_dtype, carry_slots
from ..core.settings import format_bytes
from ..service.stats import CarryStats
from .identity import session_key_for
from .options import (
    CarryOptions,
    TrtllmAdapterError,
    load_llm_options,
    parse_carry_options,
    split_carry_options,
)

__all__ = [
    "CARRY_MANAGER_KEY",
    "CarryAttachment",
    "CarryOptions",
    "TrtllmAdapterError",
    "attach",
    "detach",
    "load_llm_options",
    "parse_carry_options",
    "session_key_for",
    "split_carry_options",
]

CARRY_MANAGER_KEY = "MTP_CARRY"
"""The carry manager's key in `resource_managers` (string keys are what
`TorchLlmArgs.extra_resource_managers` installs too)."""



@dataclass
class CarryAttachment:
    """The carry attached to one LLM: topology, configured vs armed (with why), counters."""

    topology: str  # unpaired | paired | folded
    armed: bool
    reason: str
    options: CarryOptions
    version: str
    mtp_layer: int | None
    tokens_per_block: int | None
    manager: Any | None  # the installed CarryResourceManager (None: nothing installed)
    _resource_manager: Any = None

    @property
    def slots(self) -> int | None:
        """The carry store's slot cap: `mtp_carry.carry_slots`, else the process's `carry_slots()`
        (None: no cap)."""
        if self.options.carry_slots is not None:
            return self.options.carry_slots
        return carry_slots()

    def stats(self) -> CarryStats:
        """The carry's statistics (`service.CarryStats`: the fields every executor reports; zeros
        where nothing is installed)."""
        if self.manager is not None:
            stats: CarryStats = self.manager.stats()
            return stats
        return CarryStats.idle(armed=False, row_dtype=self.options.carry_row_dtype or carry_row_dtype(),
                               eviction_policy=carry_eviction(), carry_slots=self.slots,
                               carry_memory_bytes=self._device_bytes() or 0)

    def turn(self, request_id: int) -> dict[str, object] | None:
        """The turn record of executor request `request_id` (`LlmRequest.py_request_id`): R, the
        carry outcome, rows scattered and deposited (see `CarryManagerCore.turn`); None unarmed."""
        return None if self.manager is None else self.manager.turn(request_id)

    def pop_turn(self, client_id: int) -> dict[str, object] | None:
        """The turn record of the request `LLM.generate_async` returned as `RequestOutput` with
        `request_id == client_id` (the executor's `LlmRequest.py_client_id`), removed (each is
        read once; see `CarryManagerCore.pop_turn`); None unarmed, unknown or already read."""
        return None if self.manager is None else self.manager.pop_turn(client_id)

    def forget_conversation(self, conversation_id: str, lora_id: int | None = None) -> int:
        """The conversation ended: drop its carried rows under every salt (`session_end`
        evictions) and let its live requests deposit nothing; returns the rows dropped
        (0 unarmed, or when nothing was carried). ValueError/TypeError name a bad id."""
        if self.manager is None:
            from .identity import conversation_session

            conversation_session(conversation_id, lora_id)  # the same errors armed or not
            return 0
        return self.manager.forget_conversation(conversation_id, lora_id)

    def info(self) -> list[tuple[str, str, str]]:
        """`(name, value, note)` rows as `trtllm-mtp-carry info` prints them, configured beside armed."""
        yes = {True: "yes", False: "no"}
        where = "-" if self.mtp_layer is None else f"layer {self.mtp_layer}"
        return [
            ("TensorRT-LLM", self.version, ""),
            ("topology", self.topology, ""),
            ("carry configured", yes[self.options.enable], "mtp_carry.enable"),
            ("carry armed", yes[self.armed], self.reason),
            ("carry slots (carry_slots)", str(self.slots or "no cap"),
             "mtp_carry.carry_slots" if self.options.carry_slots else "carry_slots()"),
            ("carry memory (carry_memory)", _or_refused(self._device_bytes()),
             "mtp_carry.carry_memory" if self.options.carry_memory is not None else "carry_memory() or 1GiB"),
            ("MTP layer", where, f"tokens_per_block={self.tokens_per_block}"),
            ("carry reserved", self._reserved(),
             "bytes held at attach, after TensorRT-LLM sized its KV cache (docs/MEMORY.md)"),
        ]

    def _device_bytes(self) -> int | None:
        """`options.device_bytes()`, or None where it is refused (a fraction set by flag or env: the
        install stood aside saying so, and stats and info still answer)."""
        try:
            return self.options.device_bytes()
        except TrtllmAdapterError:
            return None

    def _reserved(self) -> str:
        reserved = None if self.manager is None else self.manager.reserved
        if reserved is None:
            return "0B device, 0B host"
        host = 0 if reserved.host is None else reserved.host.nbytes
        return f"{format_bytes(reserved.device.nbytes)} device, {format_bytes(host)} host"


def _or_refused(nbytes: int | None) -> str:
    return "refused (a fraction: give bytes)" if nbytes is None else format_bytes(nbytes)


_ATTACHED: weakref.WeakKeyDictionary[Any, CarryAttachment] = weakref.WeakKeyDictionary()
"""The attachment of each LLM (kept here, not on the LLM: the adapter adds no name to it)."""


def attach(llm: Any, options: CarryOptions | Mapping[str, Any] | None = None) -> CarryAttachment:
    """Probe `llm`'s in-process executor and install the carry where it can run.

    `options` is the `mtp_carry` section (a mapping, parsed with
    `parse_carry_options`) or `CarryOptions`. Raises `TrtllmAdapterError` (one
    line) for bad options, a second attach, or an executor the carry refuses
    (see `probe.probe_executor`). Returns the attachment; `armed` says whether
    the carry runs, `reason` why (or why not).
    """
    opts = options if isinstance(options, CarryOptions) else parse_carry_options(options)
    if _attached(llm) is not None:
        raise TrtllmAdapterError("the carry is already attached to this LLM (detach it first)")
    from .manager import carry_manager_class
    from .probe import probe_executor
    from .verdict import carry_options_verdict

    probe = probe_executor(llm)
    own = carry_options_verdict(opts)  # the carry's own options first, as the worker and info judge
    armed = own is None and probe.runnable
    reason = probe.reason if own is None else own.reason
    manager = None
    if armed:
        assert probe.mtp_layer is not None  # runnable implies a draft manager with its MTP layer
        base = _base_resource_manager(probe.draft)
        from ..dataplane.warm import warm_manager_kernels
        from .reservation import reserve_for

        # in-process, the executor (and its KV cache) exists already: the arena comes out of
        # the headroom TensorRT-LLM left, reserved now rather than one deposit at a time
        reserved = reserve_for(probe.draft, probe.mtp_layer, opts)
        manager = carry_manager_class(base)(probe.draft, probe.mtp_layer, opts, reserved=reserved)
        warm_manager_kernels(manager)  # no Triton compile inside a timed turn
        probe.resource_manager.resource_managers[CARRY_MANAGER_KEY] = manager  # after DRAFT_KV
    attachment = CarryAttachment(probe.topology, armed, reason, opts, probe.version,
                                 probe.mtp_layer, probe.tokens_per_block, manager,
                                 probe.resource_manager)
    _ATTACHED[llm] = attachment
    return attachment


def detach(llm: Any) -> None:
    """Remove the carry from `llm` and drop its carried rows (no-op if it was never attached)."""
    attachment = _attached(llm)
    if attachment is None:
        return
    if attachment.manager is not None:
        managers = attachment._resource_manager.resource_managers
        if managers.get(CARRY_MANAGER_KEY) is attachment.manager:
            del managers[CARRY_MANAGER_KEY]
        attachment.manager.shutdown()
    _ATTACHED.pop(llm, None)


def _attached(llm: Any) -> CarryAttachment | None:
    try:
        return _ATTACHED.get(llm)
    except TypeError:  # not weak-referenceable: never attached (attach refuses it first)
        return None


def _base_resource_manager(draft: Any) -> type:
    for cls in type(draft).__mro__:
        if cls.__name__ == "BaseResourceManager":  # resource_manager.py's protocol base
            return cls
    raise TrtllmAdapterError(
        f"the draft KV cache manager ({type(draft).__name__}) does not derive from "
        "BaseResourceManager: not a TensorRT-LLM resource manager")
